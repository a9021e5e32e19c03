"""The Ray runtime: every fragment replica a Ray actor in its own process, boundaries over
``torch.distributed`` (Gloo) with the codec, one placement-group bundle per replica.

Driver side (:class:`RayJob`): traces, probes and partitions the job once, reserves a placement
group (one bundle ``{"CPU": c}`` per replica, ``c`` the fragment's ``cluster.cpus_per_replica``;
PACK or SPREAD), starts one :class:`ReplicaActor` per
replica in its bundle, and sets up one Gloo process group across them (its rendezvous in Ray's
key-value store under the job's secret, :mod:`msrl.cluster.rendezvous`). Each actor builds its own :class:`~msrl.runtime.replica.Replica` --
components, envs, RNG -- from the job spec and its (fragment, replica index), with torch's and
OpenMP's thread counts set from its bundle's CPUs. From then on the driver only makes Ray calls:
``run(method, n)`` runs ``n`` iterations inside every replica, each waiting only at its boundaries,
and returns per-iteration records (the output fragment's metrics as floats, env steps, finished
episodes, the iteration's time); state dicts and evaluation weights come back the same way.
Per-iteration data between replicas never goes through Ray.

A replica that raises stops the job: the driver kills every actor (waking peers blocked at a
boundary) and re-raises the replica's :class:`~msrl.runtime.replica.FragmentError`.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

import cloudpickle
import torch

from msrl.api import EpisodeStats
from msrl.cluster.actor_manager import ReplicaGroup
from msrl.cluster.bootstrap import cluster_stopped, init_ray, live_nodes, quiet_ray_notes
from msrl.cluster.options import RayOptions
from msrl.cluster.placement import (
    CAPACITY_SETTLE_S,
    PRODUCER_NICE,
    bundles_text,
    bundles_total,
    capacity_note,
    lacking_capacity,
    producer_only_fragments,
    producers_to_lower,
    resources_text,
)
from msrl.cluster.replacement import CAPACITY_NOTE_S, Replacements
from msrl.cluster.replica_actor import ReplicaActor, uds_prefix
from msrl.errors import PlacementError
from msrl.runtime.elastic import replaced_fragments
from msrl.runtime.interface import iteration_record
from msrl.runtime.replica import ReplicaDied, check_losses, print_notices, replica_states
from msrl.runtime.transports.codec import MAX_MESSAGE as CODEC_MAX_MESSAGE

__all__ = ["RayJob"]





def _line_up(records: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any] | None]:
    """A replica's records of a chunk of ``n`` iterations lined up with the chunk's: a
    replacement that ran its last iterations only is ``None`` before them; a replica that ran more
    (it also did an absent replica's share) has its extra records folded into its last (env steps
    and counters as of the end; episodes, lags and seconds summed)."""
    records = list(records)
    if len(records) <= n:
        return [None] * (n - len(records)) + records
    head, rest = records[:n - 1], records[n - 1:]
    last = dict(rest[-1])
    episodes = EpisodeStats([], [])
    for r in rest:
        episodes.merge(r["episodes"])
    last["episodes"] = episodes
    last["policy_lags"] = [lag for r in rest for lag in r["policy_lags"]]
    for k in ("time_s", "comm_s", "wait_s"):
        last[k] = sum(r[k] for r in rest)
    last["output"] = next((r["output"] for r in rest if r["output"] is not None), None)
    return head + [last]


class RayJob:
    """A job whose fragment replicas are Ray actors (see the module docstring): a
    :class:`~msrl.runtime.interface.JobRuntime`, as :class:`msrl.run.job.Job` is (what
    :func:`msrl.run.training.train` uses).

    Args:
        compiled: the job, compiled once by the driver (:func:`msrl.run.job.compile_job`;
            :meth:`compile` does both).
        options: how it is placed and connected (:class:`~msrl.cluster.options.RayOptions`, the
            ``cluster.*`` keys; default: its defaults).
        algorithm_ref: ``algorithm.name`` of the config when the algorithm is loaded from a file
            or module (so each process can import it); ``None`` for built-ins.

    Raises:
        ValueError: a per-fragment ``cpus_per_replica``/``gpus_per_replica`` naming a fragment
        the policy lacks; :class:`PlacementError` when the cluster cannot hold
        the bundles, or a fragment on a CUDA device would get no GPU (``gpus_per_replica`` 0 for it);
        :class:`ReplicaDied` when a replica cannot start.

    A replica that dies (or hangs) while the job runs is a :class:`ReplicaDied`
    (:class:`~msrl.cluster.watchdog.ReplicaHung`) from the call that met it, after every
    replica is killed; its ``env_steps`` is the job's env steps when it happened, from the
    replicas' last heartbeats.
    """

    #: a replica's death restarts the job from its last checkpoint (processes under a watchdog)
    restarts_replicas = True
    #: a failed :meth:`run` leaves ``iteration`` where the call began
    iterations_exact = False

    def __init__(self, compiled: Any, options: RayOptions | None = None, algorithm_ref: str | None = None) -> None:
        import secrets

        import ray

        o = self.options = options or RayOptions()
        spec = compiled.spec
        names = [f.name for f in spec.policy.fragments]
        cpus, gpus = o.bundles(names)
        cuda = sorted({f.name for f in spec.policy.fragments if torch.device(f.device).type == "cuda" and gpus[f.name] <= 0})
        if cuda:
            given = "=0" if not isinstance(o.gpus_per_replica, Mapping) else f" gives them none ({o.gpus_per_replica})"
            raise PlacementError(
                f"fragment(s) {', '.join(cuda)} hold CUDA tensors but cluster.gpus_per_replica{given}: a replica "
                "process sees no GPU without one in its bundle; set cluster.gpus_per_replica (e.g. 1, or "
                f"{{{cuda[0]}: 1}} for those fragments alone) or the fragments' device to cpu"
            )
        self.iteration = 0
        self._env_steps = 0
        #: (fragment, replica) -> that replica's env steps after the last finished chunk
        self.replica_steps: dict[tuple[str, int], int] = {}
        self.job_id = secrets.token_hex(8)
        self._stats = EpisodeStats([], [])
        self._eval_actor: Any = None
        self.spec = spec
        self.graphs, self.fragment_graph = compiled.graphs, compiled.fragment_graph
        max_message = o.max_message or CODEC_MAX_MESSAGE
        #: the fragments whose lost replicas are replaced alone (cluster.on_replica_loss)
        self.elastic = replaced_fragments(o.on_replica_loss, self.fragment_graph)
        #: the job's iteration when its replica processes started (a replacement's consumer
        #: counts the items it received from then on)
        self.start_iteration = 0
        self.faults: dict[str, int] = {}
        self.rejoin_args: tuple = ()
        #: lost elastic replicas replaced alone (reads this job through its JobView attributes)
        self.replacements = Replacements(self, o.replacement_timeout_s)
        self.keys = [(f.name, r) for f in spec.policy.fragments for r in range(f.replicas)]
        #: the one owner of the replica actors and their health
        self.replicas = ReplicaGroup(self.keys, {f.name: f.roles for f in spec.policy.fragments}, self._count_lost)
        self.replicas.absent = self.replacements.absent  # the same dict: the group's probes skip them
        #: each replica's placement-group bundle, in the order of ``keys``
        self.bundles = [{"CPU": cpus[f], **({"GPU": gpus[f]} if gpus[f] else {})} for f, _ in self.keys]
        need = sum(b["CPU"] for b in self.bundles)
        self._started_ray = not ray.is_initialized()
        quiet_ray_notes()  # (a Ray this process started before, too: the bench, a notebook's)
        if self._started_ray:
            # on this machine: declare at least the CPUs the bundles ask for (one thread each
            # when they outnumber the cores; they then share cores, never spin on them)
            init_ray(o.address, max(os.cpu_count() or 1, math.ceil(need)), o.connect_timeout_s, o.on_ray_started)
        try:
            threads = {f: max(1, int(math.floor(c))) for f, c in cpus.items()}
            self.placement_group = self._place(self.bundles, o.strategy, o.placement_timeout_s, o.capacity_timeout_s)
            spec_bytes, fg_bytes = cloudpickle.dumps(spec), cloudpickle.dumps(self.fragment_graph)
            compiles = any((f.compile or "off") != "off" for f in spec.policy.fragments)  # plain torch in replicas

            def options(key: tuple[str, int]) -> dict[str, Any]:
                n = str(threads[key[0]])
                # one thread: a threaded actor (max_concurrency > 1) runs methods off the main thread
                # and cost coarse PPO ~7% of its env steps/s here (GIL hand-offs)
                return {"num_cpus": cpus[key[0]], "num_gpus": gpus[key[0]], "max_concurrency": 1,
                        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}}}

            self.replicas.start(ReplicaActor, self.placement_group, options,
                                lambda key: (algorithm_ref, spec_bytes, fg_bytes, *key, threads[key[0]], self.job_id,
                                             compiles))
            ranks = {k: i for i, k in enumerate(self.keys)}
            peers = dict(zip(self.keys, self.replicas.call("info")))
            self.replicas.locate(peers, ray.get_runtime_context().get_node_id())
            lower = self._to_lower(self.keys, peers, o.learner_priority)
            self.replicas.call_each("lower_priority", [(PRODUCER_NICE,)] * len(lower), lower)
            servers: dict[tuple[str, int], str] = {}
            # the job's secret: the rendezvous' key prefix, every boundary stream's token, the
            # shared-memory sockets' names; handed to the replicas through Ray only
            token = secrets.token_urlsafe(32)
            self._token = token
            if any(b.asynchronous for b in self.fragment_graph.boundaries):
                addresses = self.replicas.call("start_boundary_server", token, o.timeout_s, o.tls, max_message, None, peers,
                                               o.boundary_transport)
                servers = {k: addr for k, addr in zip(self.keys, addresses) if addr is not None}
            if len(self.keys) > 1:
                self.replicas.call_each("init_process_group", [(ranks[k], ranks, o.timeout_s, peers, o.intra_node, servers, token,
                                                                o.tls, max_message, sorted(self.elastic), o.sync_transport)
                                                               for k in self.keys])
            self.rejoin_args = (servers, token, o.tls, max_message, o.timeout_s, o.boundary_transport, o.learner_priority)
            self._has_env = [k[0] == spec.policy.fragment_of_role("env") for k in self.keys]
            self.replicas.watch(self.job_id, o.replica_timeout_s)
        except BaseException as e:
            # a failed start stops what it started: its replicas (killed already where a replica
            # died) and the Ray it started; whether the cluster itself had stopped is asked first
            if isinstance(e, ReplicaDied):
                e.cluster_stopped = cluster_stopped()  # type: ignore[attr-defined]
            self.kill()
            if self._started_ray and ray.is_initialized():
                ray.shutdown()
            raise

    def _place(self, bundles: Sequence[dict[str, float]], strategy: str, placement_timeout_s: float,
               capacity_timeout_s: float | None) -> Any:
        """Reserves and returns the placement group of ``bundles`` (one per replica, in the order
        of ``keys``; see ``capacity_timeout_s`` in the class docstring for how long it waits).

        Raises:
            PlacementError: the cluster lacks the resources (first start), or the group was not
                placed in time (the message names the free resources and the key that bounds the wait).
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        n = len(bundles)
        if capacity_timeout_s is None:
            for res, need in bundles_total(bundles).items():
                have = ray.cluster_resources().get(res, 0)
                if need > have:
                    key = {"CPU": "cpus_per_replica", "GPU": "gpus_per_replica"}[res]
                    per = {f"{b.get(res, 0):g}" for b in bundles}
                    each = f"x cluster.{key}={per.pop()}" if len(per) == 1 else f"({bundles_text(self.keys, bundles)}, cluster.{key})"
                    raise PlacementError(f"{n} replicas {each} need {need:g} {res}s; the Ray cluster has {have:g}")
        deadline = placement_timeout_s if capacity_timeout_s is None else capacity_timeout_s
        group = placement_group([dict(b) for b in bundles], strategy=strategy)
        t0 = time.monotonic()
        try:
            if capacity_timeout_s is None or capacity_timeout_s <= CAPACITY_NOTE_S:
                ray.get(group.ready(), timeout=deadline)
            else:
                ready = group.ready()
                try:
                    ray.get(ready, timeout=CAPACITY_NOTE_S)
                except ray.exceptions.GetTimeoutError:
                    # Ray marks a lost node dead only once its health checks fail (~15-30 s after):
                    # until the live nodes are too small, or CAPACITY_SETTLE_S, the note would
                    # count the lost node as live; placed before then, there is nothing to say
                    while not lacking_capacity(bundles) and time.monotonic() - t0 < min(CAPACITY_SETTLE_S, deadline):
                        try:
                            ray.get(ready, timeout=1.0)
                            return group
                        except ray.exceptions.GetTimeoutError:
                            pass
                    print(capacity_note(self.keys, bundles, strategy, capacity_timeout_s), file=sys.stderr, flush=True)
                    ray.get(ready, timeout=max(0.1, deadline - (time.monotonic() - t0)))
                    print(f"msrl: the cluster holds the job's {n} replicas again after {time.monotonic() - t0:.1f} s "
                          "of waiting; starting them", file=sys.stderr, flush=True)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            key = ("cluster.capacity_timeout_s" if capacity_timeout_s is not None else "the placement timeout")
            raise PlacementError(
                f"the placement group of {bundles_text(self.keys, bundles)} ({strategy}) was not placed within {deadline:g} s "
                f"({key}); the cluster's free resources: {resources_text(ray.available_resources())}"
            ) from None
        return group

    # -- running ----------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The replica actors, in replica order (see :class:`~msrl.cluster.actor_manager.ReplicaGroup`)."""
        return self.replicas.actors

    @property
    def watchdog(self) -> Any:
        """The replicas' heartbeat :class:`~msrl.cluster.watchdog.Watchdog` (``None`` before they start)."""
        return self.replicas.watchdog

    def _count_lost(self, cause: ReplicaDied) -> None:
        """Sets ``cause.env_steps``: the job's env steps when the replica was lost (the running
        chunk's included, from the replicas' last heartbeats), read while the others live."""
        if self.watchdog is None:
            return
        from msrl.cluster.watchdog import PERIOD_S

        time.sleep(1.5 * PERIOD_S)  # the live replicas, stuck at a boundary, report their final counts
        beats = self.watchdog.env_steps()
        reached = {k: max(self.replica_steps.get(k, 0), beats.get(k, 0))
                   for k, env in zip(self.keys, self._has_env) if env}
        dead = (cause.fragment, cause.replica)
        if dead in reached:  # its own last heartbeat may be up to a period old: as far as its peers got
            ahead = [reached[k] - self.replica_steps.get(k, 0) for k in reached if k != dead]
            reached[dead] = max(reached[dead], self.replica_steps.get(dead, 0) + max(ahead, default=0))
        cause.env_steps = max(self._env_steps, sum(reached.values()))

    def run(self, n: int, method: str = "train_step") -> list[dict[str, Any]]:
        """Runs ``n`` iterations in every replica, each replica free between its boundaries;
        returns one record per iteration: ``output`` (metrics as floats), ``env_steps`` (the
        job's total after it), ``episodes`` (the :class:`EpisodeStats` finished in it, replica 0
        first), ``time_s`` (the slowest replica's iteration time), ``policy_lags`` (learner version
        minus acting version of what asynchronous boundaries delivered), ``comm_share`` (the replicas'
        time moving values -- encoding, sending, receiving, decoding, all-reduce -- over their
        iteration time, summed over replicas) and ``wait_share`` (likewise, time blocked until a
        peer reached its side of a boundary). Episodes are also kept for :meth:`pop_episode_stats`.

        Raises:
            FragmentError: a replica raised (the job is stopped).
            ReplicaDied: a replica's process died.
            FloatingPointError: a ``*_loss`` metric is not finite.
        """
        if method == "train_step":
            end = self.iteration - self.start_iteration + n  # the consumers' iterations at the chunk's end
            if self.replacements.absent:
                self.replacements.settle_absent(end - n)
            per_replica = self._call_all("run", (method, n), end, lambda key, owed: ("run", method, owed),
                                         counts=self.replacements.chunk_counts(n) if self.replacements.absent else None)
        else:
            per_replica = self.replicas.call("run", method, n, skip=self.replacements.absent)
        per_replica = [recs or [] for recs in per_replica]  # an absent replica ran nothing
        for recs in per_replica:  # the replicas' notices (a capture, or why not), printed here
            print_notices(recs)
        # a replacement ran the chunk's last iterations only: its rows line up with theirs; a
        # replica that also did an absent one's share ran more: its last row holds the rest
        per_replica = [_line_up(recs, n) for recs in per_replica]
        faults, self.faults = self.faults, {}
        records = []
        for i in range(n):
            rows = [recs[i] if recs[i] is not None else self._idle_row(k) for k, recs in zip(self.keys, per_replica)]
            out = next((r["output"] for r in rows if r["output"] is not None), None)
            record = iteration_record(rows, out, self._has_env, processes=True)
            self._stats.merge(record["episodes"])
            if method == "train_step":
                self.iteration += 1
            self._env_steps = record["env_steps"]
            self.replica_steps = {k: r["env_steps"] for k, r in zip(self.keys, rows)}
            check_losses(out, self.iteration)
            records.append({**record, "faults": faults if i == 0 else {}})
        return records

    def _idle_row(self, key: tuple[str, int]) -> dict[str, Any]:
        """The record of an iteration replica ``key`` did not run in this chunk (a replacement
        started after it): nothing finished, its env steps where the replacement started."""
        return {"output": None, "env_steps": self.replica_steps.get(key, 0), "episodes": EpisodeStats([], []),
                "policy_lags": [], "inference": None, "time_s": 0.0, "comm_s": 0.0, "wait_s": 0.0,
                "refused": {"connections": 0, "frames": 0, "datagrams": 0}}

    def _call_all(self, method: str, args: Sequence[Any] = (), end: int | None = None,
                  again: Any = None, counts: Mapping[tuple[str, int], int] | None = None) -> list[Any]:
        """``method(*args)`` on every replica, their results in replica order; a replica of an
        elastic fragment lost meanwhile is replaced alone (:meth:`_replace`) and ``again(key,
        owed)`` -- a method and its arguments (default: the same call) -- is what its replacement
        runs instead. ``end``: the consumers' iterations when the call ends (default: now,
        between chunks). ``counts``: for a chunk, the iterations each replica runs (``again(key,
        count)``; 0: none, an absent replica). An absent replica is not called: its result is
        ``None``."""
        if not self.elastic:
            return self.replicas.call(method, *args)
        end = self.iteration - self.start_iteration if end is None else end
        again = again or (lambda key, owed: (method, *args))
        replace = lambda cause: self.replacements.replace(cause, end, again, [] if counts is not None else None)  # noqa: E731
        if counts is None:
            return self.replicas.call(method, *args, replace=replace, skip=self.replacements.absent)
        return self.replicas.wait(lambda: [self.replicas.submit(k, *again(k, counts[k])) if counts[k] > 0 else None
                                           for k in self.keys], replace=replace)

    def _to_lower(self, keys: Sequence[tuple[str, int]], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                  priority: str) -> list[tuple[str, int]]:
        """The replicas among ``keys`` whose priority ``cluster.learner_priority`` = ``priority``
        lowers (:func:`producers_to_lower`; ``peers``: every replica's ``info()``), by
        :data:`PRODUCER_NICE` (``ReplicaActor.lower_priority``)."""
        return producers_to_lower(keys, peers, producer_only_fragments(self.fragment_graph), priority)

    def lower_replacement(self, key: tuple[str, int], peers: Mapping[tuple[str, int], Mapping[str, Any]],
                           priority: str) -> None:
        """Lowers replacement ``key``'s priority where :meth:`_to_lower` says so.

        Raises:
            ray.exceptions.RayActorError: the replacement died meanwhile.
        """
        import ray

        if self._to_lower([key], peers, priority):
            ray.get(self.replicas.submit(key, "lower_priority", PRODUCER_NICE))

    def bundle_unplaced(self, key: tuple[str, int]) -> bool:
        """Whether replica ``key``'s placement-group bundle has no live node now (its node lost,
        not yet placed again); ``False`` when Ray does not say."""
        from ray.util.placement_group import placement_group_table

        try:
            table = placement_group_table(self.placement_group)
            node = table.get("bundles_to_node_id", {}).get(self.keys.index(key))
            live = {n.get("NodeID") for n in live_nodes()}
            return table.get("state") != "CREATED" or node is None or node not in live
        except Exception:  # noqa: BLE001 - only for the message
            return False

    def reset(self) -> None:
        """Runs every replica's ``reset`` program."""
        self.run(1, "reset")

    def train_step(self) -> dict[str, float] | None:
        """One iteration on every replica; the learner's metrics."""
        return self.run(1)[0]["output"]

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, over every env replica."""
        return self._env_steps

    def pop_episode_stats(self) -> EpisodeStats:
        """Episodes finished since the last call, replica 0 first within each iteration."""
        out, self._stats = self._stats, EpisodeStats([], [])
        return out

    def weights(self, role: str, replica: int = 0) -> dict[str, torch.Tensor]:
        """``get_weights()`` of replica ``replica`` of the fragment holding ``role``. Of an elastic
        fragment, a replica lost meanwhile is replaced alone (or left absent for want of room) as
        in a chunk, and while the asked one is absent the next live replica answers."""
        frag = self.spec.policy.fragment(self.spec.policy.fragment_of_role(role))
        if frag.name not in self.elastic:
            return self.replicas.call_one((frag.name, replica), "weights", role)
        end = self.iteration - self.start_iteration
        for _ in range(frag.replicas + 1):
            live = [r for r in range(frag.replicas) if (frag.name, r) not in self.replacements.absent]
            if not live:
                break
            r = min((r for r in live if r >= replica), default=live[0])
            i = self.keys.index((frag.name, r))
            got = self.replicas.wait(
                lambda i=i: [self.replicas.submit(k, "weights", role) if j == i else None for j, k in enumerate(self.keys)],
                replace=lambda cause: self.replacements.replace(cause, end, lambda key, owed: ("weights", role)))[i]
            if got is not None:
                return got
        raise ReplicaDied(f"no replica of fragment {frag.name} is left to give the {role}'s weights", frag.name, replica,
                          tuple(frag.roles))

    def eval_actor(self) -> Any:
        """An actor built on the driver (CPU) holding the job's current policy weights."""
        if self._eval_actor is None:
            from msrl.runtime.replica import build_standalone_actor

            self._eval_actor, _ = build_standalone_actor(self.spec)
        self._eval_actor.set_weights(self.weights("actor"))
        return self._eval_actor

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every replica's state (from its process) and the iteration count."""
        states = self._call_all("state_dict")
        return {"iteration": self.iteration, "env_steps": self._env_steps,
                "replicas": {f"{f}/{r}": s for (f, r), s in zip(self.keys, states)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into every replica.

        Raises:
            KeyError: the checkpoint's replicas differ from this job's.
        """
        self.replicas.call_each("load_state_dict", [(s,) for s in replica_states(state, self.keys)])
        self.iteration = int(state["iteration"])
        self.start_iteration = self.iteration
        self._env_steps = int(state.get("env_steps", 0))
        self.replica_steps = {}  # each replica's count: from its first chunk on

    def kill(self) -> None:
        """Kills every replica process and frees the placement group (no process left behind)."""
        from ray.util.placement_group import remove_placement_group

        self.replicas.kill()
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - none placed yet, or already removed
            pass
        # the socket directories of this node's replicas (a killed one's are still there)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), uds_prefix(self.job_id) + "*")):
            shutil.rmtree(d, ignore_errors=True)

    def comm_stats(self) -> list[dict[str, Any]]:
        """Every replica's :meth:`ReplicaActor.comm_stats`, in replica order (``{}`` for an
        absent one: lost, not yet replaced for want of room)."""
        return [s or {} for s in self._call_all("comm_stats")]

    def pids(self) -> list[int]:
        """The replicas' process ids, in replica order (an absent replica's: its lost process's)."""
        return [p if p is not None else self.replicas.peers.get(k, {}).get("pid") for k, p in
                zip(self.keys, self._call_all("pid"))]

    def replica_table(self) -> list[dict[str, Any]]:
        """One row per replica: ``fragment``, ``replica``, ``roles``, ``pid`` and ``node`` (IP);
        an absent replica (lost, not yet replaced for want of room) has its lost process's, and
        ``absent: true``."""
        info = self._call_all("info")
        return [{"fragment": f, "replica": r, "roles": list(self.spec.policy.fragment(f).roles),
                 **(i if i is not None else {**self.replicas.peers.get((f, r), {}), "absent": True})}
                for (f, r), i in zip(self.keys, info)]

    def close(self) -> None:
        """Closes every replica (envs, process group), ends their processes, and stops Ray
        when this job started it. With the cluster itself gone (:func:`cluster_stopped`) nothing
        is asked of it: the replicas are killed and Ray shut down at once, where each call to a
        stopped GCS would wait out its own timeout."""
        import ray

        stopped = cluster_stopped() is not None
        if not stopped:
            self.replicas.close(timeout_s=30.0, skip=self.replacements.absent)
        self.kill()
        if self.watchdog is not None and ray.is_initialized() and not stopped:
            from msrl.cluster.rendezvous import RayStore

            self.watchdog.clear()
            RayStore(self._token, 0.0).clear()  # the rendezvous' keys
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

