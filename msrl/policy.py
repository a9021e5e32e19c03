"""Distribution policies: which fragment each node belongs to, by role (DESIGN.md §3).

A policy is declared in one file of ``distribution_policies/`` as a module-level ``POLICY``.
It names its fragments, the roles each holds, default replicas, backend, device and
resources, and which boundaries are asynchronous. The partitioner (:mod:`msrl.partition`)
does the rest generically.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from msrl import registry
from msrl.api import ROLES
from msrl.graph import Node, NodeKind

__all__ = ["ONE_LEARNER", "FragmentSpec", "DistributionPolicy", "UnknownPolicyError", "load_policy", "available_policies"]


#: Why a policy runs a single learner (its ``max_role_replicas`` note).
ONE_LEARNER = "a single learner: several learners without gradient all-reduce would train diverging copies"


class UnknownPolicyError(ValueError):
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
    """

    name: str
    roles: tuple[str, ...]
    replicas: int = 1
    backend: str = "torch_graph"
    device: str = "cpu"
    resources: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"CPU": 1.0})


@dataclasses.dataclass(frozen=True)
class DistributionPolicy:
    """A named split of the component roles into fragments.

    Attributes:
        name: the YAML value ``distribution_policy.name``.
        description: one line shown by ``msrl graph``.
        fragments: the fragments, each role in exactly one.
        async_boundaries: ``(src fragment, dst fragment)`` pairs whose boundaries are queues
            (``put``/``get``) instead of synchronous collectives.
        max_role_replicas: role -> the most replicas the policy can run of it, with why
            (``{"learner": (1, "one learner: several would train diverging copies")}``); a
            config asking for more is an error, never a silent change of meaning.

    Raises:
        ValueError: a role in no fragment or in two, an unknown role, replicas < 1, a fragment
            without roles.
    """

    name: str
    description: str
    fragments: tuple[FragmentSpec, ...]
    async_boundaries: frozenset[tuple[str, str]] = frozenset()
    max_role_replicas: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)

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

    def with_overrides(
        self,
        replicas: Mapping[str, int] | None = None,
        backends: Mapping[str, str] | None = None,
        devices: Mapping[str, str] | None = None,
        placement: Mapping[str, str] | None = None,
    ) -> "DistributionPolicy":
        """A copy with per-fragment replicas, backends or devices replaced, and roles moved.

        Args:
            replicas, backends, devices: fragment -> value.
            placement: role -> the fragment that runs it instead of the policy's default (e.g.
                ``{"buffer": "learner"}``: a replay buffer beside the learner, as in Ape-X).

        Raises:
            KeyError: an override names a fragment or role the policy lacks (listing those it
                has).
            ValueError: a move leaves a fragment without roles.
        """
        names = [f.name for f in self.fragments]
        for table in (replicas, backends, devices, {v: k for k, v in (placement or {}).items()}):
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
            )
            for f in self.fragments
        )
        return dataclasses.replace(self, fragments=frags)

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
