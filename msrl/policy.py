"""Distribution policies: which fragment each node belongs to, by role (DESIGN.md §3).

A policy is declared in one file of ``distribution_policies/`` as a module-level ``POLICY``.
It names its fragments, the roles each holds, default replicas, backend, device and
resources, and which boundaries are asynchronous. The partitioner (:mod:`msrl.frontend.partition`)
does the rest generically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from msrl import registry
from msrl.api import ROLES
from msrl.errors import InputError
from msrl.graph import Node, NodeKind

__all__ = ["ONE_LEARNER", "BOUNDARY_CHANNELS", "SLOT_CHANNELS", "FragmentSpec", "BoundaryClass", "InferenceSpec", "DistributionPolicy",
           "UnknownPolicyError", "load_policy", "available_policies"]

#: How a boundary moves values (DESIGN.md §3, "Boundary kinds"):
#:
#: * ``sync``: a synchronous collective (send/recv, gather, scatter, broadcast): both sides meet
#:   it in every iteration.
#: * ``fifo``: a bounded queue per (producer, consumer) pair: a producer's ``put`` waits only while
#:   ``queue_capacity`` of its items are not yet taken (back-pressure); the consumer's ``get``
#:   takes each producer's oldest item (waiting while there is none).
#: * ``latest``: a latest-value slot: a producer publishes a versioned value and never waits; a
#:   consumer reads the newest one published, waiting only before the first publication, and
#:   knows its version.
#: * ``fresh``: a latest-value slot whose consumer waits for a version newer than the one it last
#:   read: each read is a new publication, as a synchronous broadcast's is. With ``trajectories:
#:   fifo`` it runs coarse in lockstep over streams -- the values of synchronous coarse, bit for
#:   bit -- and its actors can be replaced alone (``cluster.on_replica_loss``).
BOUNDARY_CHANNELS = ("sync", "fifo", "latest", "fresh")
#: the channels that are versioned slots (a ``put`` publishes, a ``get`` reads the newest)
SLOT_CHANNELS = ("latest", "fresh")
#: values of ``distribution_policy.capture.<fragment>`` (:mod:`msrl.runtime.programs.capture`)
CAPTURE_MODES = ("graph", "eager")
#: values of ``distribution_policy.compile.<fragment>`` (:mod:`msrl.runtime.programs.compiled`)
COMPILE_MODES = ("off", "inductor")


#: The fragment ``distribution_policy.placement.buffer: replay`` creates: the replay in a fragment
#: of its own (Ape-X's replay shards, Horgan et al. 2018), replicated by ``replicas.replay``.
REPLAY_FRAGMENT = "replay"

#: Why a policy runs a single learner (its ``max_role_replicas`` note).
ONE_LEARNER = "a single learner: several learners without gradient all-reduce would train diverging copies"


class UnknownPolicyError(InputError, ValueError):
    """A policy name with no file in ``distribution_policies/``."""


@dataclasses.dataclass(frozen=True)
class FragmentSpec:
    """One fragment of a policy.

    Attributes:
        name: fragment name (``"actor"``, ``"learner"``, ``"main"``).
        roles: the component roles whose calls this fragment runs.
        replicas: how many copies run side by side (each with its own share of envs).
        backend: the fragment backend in ``fragments/`` (``"torch_graph"``).
        device: torch device of the fragment's tensors (``"cpu"``, ``"cuda:0"``, or ``"auto"``:
            the first GPU when there is one, else the CPU).
        resources: per-replica resources for a Ray placement-group bundle (``{"CPU": 1}``).
        capture: whether its iteration is captured once and replayed (``"graph"``: a CUDA
            graph on a GPU, a host tape on the CPU; :mod:`msrl.runtime.programs.capture`) or run op by
            op (``"eager"``); ``None``: ``graph`` on a CUDA device, else ``eager``.
        compile: whether its components' compile targets run compiled by ``torch.compile``
            (``"inductor"``; :mod:`msrl.runtime.programs.compiled`) or as written (``"off"``, and ``None``).
    """

    name: str
    roles: tuple[str, ...]
    replicas: int = 1
    backend: str = "torch_graph"
    device: str = "cpu"
    resources: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"CPU": 1.0})
    capture: str | None = None
    compile: str | None = None


@dataclasses.dataclass(frozen=True)
class BoundaryClass:
    """A named class of boundaries a policy lets the YAML give a kind
    (``distribution_policy.boundaries.<name>: fifo``).

    Attributes:
        name: the YAML key (``"trajectories"``, ``"weights"``).
        src, dst: every ``train_step`` value crossing from fragment ``src`` to fragment ``dst``
            belongs to the class (``reset``'s boundaries, the job's initial synchronisation, are
            always synchronous).
        channel: the default channel, one of :data:`BOUNDARY_CHANNELS` (``sync``, ``fifo``,
            ``latest``).
        description: what crosses (shown by ``msrl graph`` and in config errors).
        data: whether every value that crosses must arrive (trajectories, observations): such
            a class cannot be a ``latest`` slot, which keeps only the newest value and would
            drop the rest (the config refuses it); ``False`` for state where the newest
            supersedes the older (weights).
    """

    name: str
    src: str
    dst: str
    channel: str = "sync"
    description: str = ""
    data: bool = True


@dataclasses.dataclass(frozen=True)
class InferenceSpec:
    """Central inference with dynamic batching (SEED RL, Espeholt et al. 2020, section 3): the
    ``server`` fragment (one replica) serves the ``clients`` fragment's replicas, each over its
    own ``fifo`` queues, and answers their ``role`` calls (``actor.act``) in batches.

    The server runs the part of its ``train_step`` that talks to the clients (up to and with the
    loop that steps the envs) once per client replica, side by side, each on that client's rows
    and its own shard of the buffer; the ``role`` calls of those runs are queued and run
    together: a batch closes when ``max_batch`` client requests wait (or every client still
    inside the loop waits), or when the oldest has waited ``timeout_ms``. ``max_batch`` = every
    client with no deadline runs exactly what one lockstep collective runs.

    Attributes:
        server, clients: fragment names (the central replica's and the env replicas').
        role: the role whose calls are batched.
        enabled: whether the YAML turned central inference on
            (``distribution_policy.inference``); off, the boundaries are the policy's classes.
        max_batch: client requests per batch, 1..client replicas (``None``: every client).
        timeout_ms: the longest a request waits for its batch to fill (``None``: no deadline).
    """

    server: str
    clients: str
    role: str = "actor"
    enabled: bool = False
    max_batch: int | None = None
    timeout_ms: float | None = None

    def batch_size(self, clients: int) -> int:
        """The batch size for ``clients`` client replicas (``max_batch``, or all of them)."""
        return clients if self.max_batch is None else min(self.max_batch, clients)


@dataclasses.dataclass(frozen=True)
class DistributionPolicy:
    """A named split of the component roles into fragments.

    Attributes:
        name: the YAML value ``distribution_policy.name``.
        description: one line shown by ``msrl graph``.
        fragments: the fragments, each role in exactly one.
        boundaries: the classes of boundaries and their kinds (:class:`BoundaryClass`); a
            boundary in no class is synchronous.
        queue_capacity: items a producer may have in a ``fifo`` boundary's queue (per producer
            and consumer) before its ``put`` waits.
        max_role_replicas: role -> the most replicas the policy can run of it, with why
            (``{"learner": (1, "one learner: several would train diverging copies")}``); a
            config asking for more is an error, never a silent change of meaning.
        inference: central inference the policy offers (:class:`InferenceSpec`), or ``None``.

    Raises:
        ValueError: a role in no fragment or in two, an unknown role, replicas < 1, a fragment
            without roles.
    """

    name: str
    description: str
    fragments: tuple[FragmentSpec, ...]
    boundaries: tuple[BoundaryClass, ...] = ()
    queue_capacity: int = 1
    max_role_replicas: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    inference: InferenceSpec | None = None

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for f in self.fragments:
            if f.replicas < 1:
                raise ValueError(f"policy {self.name}: fragment {f.name} has replicas={f.replicas}; must be >= 1")
            if not f.roles:
                raise ValueError(f"policy {self.name}: fragment {f.name} holds no role")
            for r in f.roles:
                if r not in ROLES:
                    raise ValueError(f"policy {self.name}: unknown role {r!r}; roles are {ROLES}")
                if r in seen:
                    raise ValueError(f"policy {self.name}: role {r!r} is in fragments {seen[r]} and {f.name}")
                seen[r] = f.name
        missing = [r for r in ROLES if r not in seen]
        if missing:
            raise ValueError(f"policy {self.name}: roles {missing} are in no fragment")
        names = [f.name for f in self.fragments]
        for bc in self.boundaries:
            if bc.src not in names or bc.dst not in names or bc.src == bc.dst:
                raise ValueError(f"policy {self.name}: boundary class {bc.name} joins {bc.src} -> {bc.dst}; "
                                 f"it must join two of the fragments {names}")
            if bc.channel not in BOUNDARY_CHANNELS:
                raise ValueError(f"policy {self.name}: boundary class {bc.name} has kind {bc.channel!r}; "
                                 f"kinds: {', '.join(BOUNDARY_CHANNELS)}")
        if self.queue_capacity < 1:
            raise ValueError(f"policy {self.name}: queue_capacity={self.queue_capacity}; must be >= 1")
        inf = self.inference
        if inf is not None:
            if inf.server not in names or inf.clients not in names or inf.server == inf.clients:
                raise ValueError(f"policy {self.name}: inference joins {inf.clients} -> {inf.server}; "
                                 f"it must join two of the fragments {names}")
            if inf.max_batch is not None and inf.max_batch < 1:
                raise ValueError(f"policy {self.name}: inference max_batch={inf.max_batch}; must be >= 1")
            if inf.timeout_ms is not None and not inf.timeout_ms >= 0:
                raise ValueError(f"policy {self.name}: inference timeout_ms={inf.timeout_ms}; must be >= 0")

    @property
    def serving(self) -> InferenceSpec | None:
        """The central inference this job runs (:class:`InferenceSpec` turned on), or ``None``."""
        return self.inference if self.inference is not None and self.inference.enabled else None

    def boundary_channel(self, method: str, src: str, dst: str) -> tuple[str, str | None]:
        """The channel of a ``method`` boundary from fragment ``src`` to ``dst``, and the name of
        the class that sets it (``("sync", None)`` when no class does; ``reset`` is always
        synchronous; under central inference, the boundaries between its server and clients
        are ``fifo`` queues, one per client)."""
        if method != "reset":
            inf = self.serving
            if inf is not None and {src, dst} == {inf.server, inf.clients}:
                cls = next((bc.name for bc in self.boundaries if (bc.src, bc.dst) == (src, dst)), None)
                return "fifo", cls
            for bc in self.boundaries:
                if (bc.src, bc.dst) == (src, dst):
                    return bc.channel, bc.name
        return "sync", None

    @property
    def asynchronous(self) -> bool:
        """Whether any boundary class is asynchronous (``fifo`` or ``latest``), or central
        inference is on (its boundaries are ``fifo`` queues)."""
        return any(bc.channel != "sync" for bc in self.boundaries) or self.serving is not None

    def fragment(self, name: str) -> FragmentSpec:
        """The fragment called ``name``.

        Raises:
            KeyError: naming the fragments that exist.
        """
        for f in self.fragments:
            if f.name == name:
                return f
        raise KeyError(f"policy {self.name} has no fragment {name!r}; fragments: {[f.name for f in self.fragments]}")

    def fragment_of_role(self, role: str) -> str:
        """The name of the fragment that runs ``role``'s calls."""
        for f in self.fragments:
            if role in f.roles:
                return f.name
        raise KeyError(role)

    def assign(self, node: Node) -> str:
        """The fragment of a ``call`` node (by its role).

        Raises:
            ValueError: ``node`` is not a call node.
        """
        if node.kind is not NodeKind.CALL:
            raise ValueError(f"assign() places call nodes; got {node.kind}")
        return self.fragment_of_role(node.role)

    def configured(
        self,
        *,
        replicas: Mapping[str, int] | None = None,
        backends: Mapping[str, str] | None = None,
        devices: Mapping[str, str] | None = None,
        placement: Mapping[str, str] | None = None,
        boundaries: Mapping[str, str] | None = None,
        queue_capacity: int | None = None,
        inference: Mapping[str, Any] | None = None,
        capture: Mapping[str, str] | None = None,
        compile: Mapping[str, str] | None = None,
    ) -> "DistributionPolicy":
        """:meth:`with_overrides` of the YAML's ``distribution_policy.*`` keys (each by its name;
        ``None``: not set), each checked by the policy that owns the rule first (the config
        delegates here).

        Raises:
            ConfigError: naming the key and what is valid (an unknown fragment, role or boundary
                class; a replica count below 1; a boundary kind this class cannot take; central
                inference on a policy without it, or a batch larger than its clients).
        """
        from msrl.errors import ConfigError

        replicas, backends, devices = replicas or {}, backends or {}, devices or {}
        placement, boundaries = placement or {}, boundaries or {}
        if placement.get("buffer") == REPLAY_FRAGMENT and REPLAY_FRAGMENT not in [f.name for f in self.fragments]:
            rest = {role: frag for role, frag in placement.items() if role != "buffer"}
            return self.with_overrides(placement={"buffer": REPLAY_FRAGMENT}).configured(
                replicas=replicas, backends=backends, devices=devices, placement=rest, boundaries=boundaries,
                queue_capacity=queue_capacity, inference=inference, capture=capture, compile=compile)
        for frag, mode in (capture or {}).items():
            if mode not in CAPTURE_MODES:
                raise ConfigError(f"distribution_policy.capture.{frag}={mode}: unknown capture mode; modes: "
                                  f"{', '.join(CAPTURE_MODES)} (default: graph on a CUDA device, eager on the CPU)")
        for frag, mode in (compile or {}).items():
            if mode not in COMPILE_MODES:
                raise ConfigError(f"distribution_policy.compile.{frag}={mode}: unknown compile mode; modes: "
                                  f"{', '.join(COMPILE_MODES)} (default: off)")
        for key, table in (("replicas", replicas), ("backends", backends), ("devices", devices), ("capture", capture or {}),
                           ("compile", compile or {})):
            names = [f.name for f in self.fragments]
            for frag in table:
                if frag not in names:
                    raise ConfigError(
                        f"distribution_policy.{key}.{frag}: policy {self.name} has no fragment {frag!r}; fragments: {', '.join(names)}"
                        + (f" (distribution_policy.placement.buffer={REPLAY_FRAGMENT} gives the buffer a fragment of its own)"
                           if frag == REPLAY_FRAGMENT else "")
                    )
        for frag, n in replicas.items():
            if n < 1:
                raise ConfigError(f"distribution_policy.replicas.{frag}: must be >= 1, got {n}")
        for role, frag in placement.items():
            names = [f.name for f in self.fragments]
            if role not in ROLES:
                raise ConfigError(f"distribution_policy.placement.{role}: unknown role {role!r}; roles: {', '.join(ROLES)}")
            if frag not in names:
                raise ConfigError(
                    f"distribution_policy.placement.{role}={frag}: policy {self.name} has no fragment {frag!r}; "
                    f"fragments: {', '.join(names)}"
                    + (f" (or {REPLAY_FRAGMENT}: the buffer in a fragment of its own)" if role == "buffer" else "")
                )
        for key, mode in boundaries.items():
            classes = {bc.name: bc for bc in self.boundaries}
            if key not in classes:
                have = ", ".join(f"{n} ({bc.src} -> {bc.dst})" for n, bc in classes.items())
                raise ConfigError(
                    f"distribution_policy.boundaries.{key}: policy {self.name} has no boundary class {key!r}; "
                    + (f"classes: {have}" if have else "its boundaries are all synchronous")
                )
            if mode not in BOUNDARY_CHANNELS:
                raise ConfigError(f"distribution_policy.boundaries.{key}={mode}: unknown boundary kind; "
                                  f"kinds: {', '.join(BOUNDARY_CHANNELS)}")
            if mode in SLOT_CHANNELS and classes[key].data:
                raise ConfigError(f"distribution_policy.boundaries.{key}={mode}: a latest-value slot keeps only the newest "
                                  f"value, and every value of {key} ({classes[key].description}) must arrive: all but the "
                                  "newest would be dropped; valid: sync or fifo (a bounded queue)")
        if inference is not None:
            inf = self.inference
            if inf is None:
                raise ConfigError(f"distribution_policy.inference: policy {self.name} has no central inference; "
                                  "single_learner_fine has (env replicas served by one central actor)")
            clients = replicas.get(inf.clients, self.fragment(inf.clients).replicas)
            if inference.get("max_batch") is not None and inference["max_batch"] > clients:
                raise ConfigError(f"distribution_policy.inference.max_batch={inference['max_batch']}: a batch holds the "
                                  f"requests of at most the {clients} {inf.clients} replicas "
                                  f"(distribution_policy.replicas.{inf.clients}); valid: 1..{clients}")
            for key, mode in boundaries.items():
                bc = next(b for b in self.boundaries if b.name == key)
                if {bc.src, bc.dst} == {inf.server, inf.clients} and mode != "fifo":
                    raise ConfigError(f"distribution_policy.boundaries.{key}={mode}: under distribution_policy.inference "
                                      f"the boundaries between {inf.clients} and {inf.server} are fifo queues, one per "
                                      f"{inf.clients} replica; drop the setting or distribution_policy.inference")
        try:
            return self.with_overrides(replicas, backends, devices, placement, boundaries, queue_capacity, inference,
                                       capture, compile)
        except ValueError as e:
            raise ConfigError(f"distribution_policy.placement: {e}") from None

    def with_overrides(
        self,
        replicas: Mapping[str, int] | None = None,
        backends: Mapping[str, str] | None = None,
        devices: Mapping[str, str] | None = None,
        placement: Mapping[str, str] | None = None,
        boundaries: Mapping[str, str] | None = None,
        queue_capacity: int | None = None,
        inference: Mapping[str, float | None] | None = None,
        capture: Mapping[str, str] | None = None,
        compile: Mapping[str, str] | None = None,
    ) -> "DistributionPolicy":
        """A copy with per-fragment replicas, backends, devices, capture or compile modes
        replaced, roles moved and boundary kinds changed.

        Args:
            replicas, backends, devices, capture, compile: fragment -> value.
            placement: role -> the fragment that runs it instead of the policy's default (e.g.
                ``{"buffer": "learner"}``: a replay buffer beside the learner; ``{"buffer":
                "replay"}``: the replay in a fragment of its own, :data:`REPLAY_FRAGMENT`, after
                the fragment that held it, replicated by ``replicas["replay"]``, as Ape-X's
                replay shards).
            boundaries: boundary class -> kind (one of :data:`BOUNDARY_CHANNELS`).
            queue_capacity: a ``fifo`` boundary's items per producer and consumer.
            inference: turns central inference on with these :class:`InferenceSpec` fields
                (``{"max_batch": 1, "timeout_ms": 2.0}``; ``{}``: on, with the defaults).

        Raises:
            KeyError: an override names a fragment, role or boundary class the policy lacks
                (listing those it has).
            ValueError: a move leaves a fragment without roles; an unknown boundary kind; a
                queue capacity below 1; central inference asked of a policy without it.
        """
        if (placement or {}).get("buffer") == REPLAY_FRAGMENT and REPLAY_FRAGMENT not in [f.name for f in self.fragments]:
            return self._with_replay_fragment().with_overrides(replicas, backends, devices, placement, boundaries,
                                                               queue_capacity, inference, capture, compile)
        classes = {bc.name: bc for bc in self.boundaries}
        for key, mode in (boundaries or {}).items():
            if key not in classes:
                have = ", ".join(f"{n} ({bc.src} -> {bc.dst})" for n, bc in classes.items()) or "none"
                raise KeyError(f"policy {self.name} has no boundary class {key!r}; classes: {have}")
            if mode not in BOUNDARY_CHANNELS:
                raise ValueError(f"boundary class {key}: unknown kind {mode!r}; kinds: {', '.join(BOUNDARY_CHANNELS)}")
        names = [f.name for f in self.fragments]
        for table in (replicas, backends, devices, capture, compile, {v: k for k, v in (placement or {}).items()}):
            for key in table or {}:
                if key not in names:
                    raise KeyError(f"policy {self.name} has no fragment {key!r}; fragments: {names}")
        for role in placement or {}:
            if role not in ROLES:
                raise KeyError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        moved = dict(placement or {})

        def roles(f: FragmentSpec) -> tuple[str, ...]:
            return tuple(r for r in ROLES if moved.get(r, f.name if r in f.roles else None) == f.name)

        for f in self.fragments:
            if not roles(f):
                raise ValueError(
                    f"placement {moved} leaves fragment {f.name} of policy {self.name} without roles "
                    f"(it held {', '.join(f.roles)})"
                )
        frags = tuple(
            dataclasses.replace(
                f,
                roles=roles(f),
                replicas=(replicas or {}).get(f.name, f.replicas),
                backend=(backends or {}).get(f.name, f.backend),
                device=(devices or {}).get(f.name, f.device),
                capture=(capture or {}).get(f.name, f.capture),
                compile=(compile or {}).get(f.name, f.compile),
            )
            for f in self.fragments
        )
        new_classes = tuple(dataclasses.replace(bc, channel=(boundaries or {}).get(bc.name, bc.channel)) for bc in self.boundaries)
        serving = self.inference
        if inference is not None:
            if serving is None:
                raise ValueError(f"policy {self.name} has no central inference; policies with it: single_learner_fine")
            unknown = set(inference) - {"max_batch", "timeout_ms"}
            if unknown:
                raise KeyError(f"central inference has no setting {sorted(unknown)[0]!r}; settings: max_batch, timeout_ms")
            serving = dataclasses.replace(serving, enabled=True, **inference)  # type: ignore[arg-type]
        return dataclasses.replace(self, fragments=frags, boundaries=new_classes, inference=serving,
                                   queue_capacity=self.queue_capacity if queue_capacity is None else queue_capacity)

    def _with_replay_fragment(self) -> "DistributionPolicy":
        """A copy with a ``replay`` fragment (:data:`REPLAY_FRAGMENT`) right after the fragment
        that held the buffer, on its backend and device, one replica, holding the buffer.

        Raises:
            ValueError: no fragment holds the buffer role, or it holds nothing else.
        """
        frags = list(self.fragments)
        at = next((i for i, f in enumerate(frags) if "buffer" in f.roles), None)
        if at is None:
            raise ValueError(f"policy {self.name} has no fragment holding the buffer to move into {REPLAY_FRAGMENT!r}")
        src = frags[at]
        rest = tuple(r for r in src.roles if r != "buffer")
        if not rest:
            raise ValueError(f"fragment {src.name} of policy {self.name} holds only the buffer: it is the replay already")
        frags[at] = dataclasses.replace(src, roles=rest)
        frags.insert(at + 1, FragmentSpec(REPLAY_FRAGMENT, roles=("buffer",), replicas=1, backend=src.backend, device=src.device))
        return dataclasses.replace(self, fragments=tuple(frags))

    def replica_problems(self) -> list[tuple[str, str]]:
        """``(fragment, why)`` for each fragment whose replica count this policy cannot run
        (empty when it can run them all)."""
        out = []
        for role, (most, why) in self.max_role_replicas.items():
            frag = self.fragment(self.fragment_of_role(role))
            if frag.replicas > most:
                out.append((frag.name, f"policy {self.name} runs at most {most} replica(s) of fragment {frag.name}, "
                                       f"which holds role {role}: {why}"))
        return out


def available_policies() -> list[str]:
    """Names of the policies in ``distribution_policies/``."""
    return registry.names("msrl.distribution_policies")


def load_policy(name: str) -> DistributionPolicy:
    """The ``POLICY`` of ``distribution_policies/<name>.py``.

    Raises:
        UnknownPolicyError: no such policy; the message lists those that exist.
    """
    return registry.load("msrl.distribution_policies", name, "POLICY", UnknownPolicyError, "distribution policy")
