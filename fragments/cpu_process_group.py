"""``cpu_process_group``: a CPU fragment whose replicas step their envs in a group of worker
processes sharing memory (DESIGN.md §4: "replicated over N OS processes, each running the program
on its share of environments").

The program is lowered exactly as by ``torch_graph`` (eager torch on the CPU); what differs is
where the fragment's envs live: each replica of the fragment holding the ``env`` role steps its
share of the envs in ``env.num_workers`` worker processes of the env engine
(:class:`~msrl.envs.engine.ProcessEnv`: observations, actions and rewards in shared memory, one
wake-up per worker per step), whatever ``env.engine`` says, under ``runtime: local`` (replicas
as threads) and on Ray (replicas as actors) alike. Chosen in YAML:
``distribution_policy.backends.actor: cpu_process_group``. A fragment without the env, a native
batched env, or another ``env.engine`` than ``sync``/``process`` is a config error.
"""

from __future__ import annotations

from typing import Any

from msrl.errors import ConfigError
from msrl.fragments.torch_graph import LOWERING as TORCH_GRAPH
from msrl.runtime.programs.backends import Backend

__all__ = ["BACKEND", "ProcessGroupBackend"]

#: the env engine this backend steps its fragment's envs on
ENGINE = "process"


class ProcessGroupBackend(Backend):
    """``torch_graph``'s lowering; the fragment's envs on the ``process`` engine."""

    def env_engine(self, requested: str) -> str:
        """Always the ``process`` engine (what ``env.engine: process`` selects for every fragment)."""
        return ENGINE

    def check(self, fragment: Any, policy: Any, env_id: str, env_engine: str) -> None:
        """The fragment must hold the env, a gymnasium one, on ``env.engine`` ``sync`` or ``process``.

        Raises:
            ConfigError: naming ``distribution_policy.backends.<fragment>`` and what is valid.
        """
        from msrl.envs.factory import is_native

        key = f"distribution_policy.backends.{fragment.name}={self.name}"
        if "env" not in fragment.roles:
            raise ConfigError(f"{key} steps a fragment's envs in a group of worker processes, but fragment "
                              f"{fragment.name} holds no env (roles: {', '.join(fragment.roles)}); valid: the fragment "
                              f"holding the env, {policy.fragment_of_role('env')}")
        if is_native(env_id):
            raise ConfigError(f"{key} steps gymnasium envs in worker processes; env.id={env_id!r} is a native "
                              "batched env, stepped in the replica's own process: use torch_graph")
        from msrl.envs.engines import engine

        if engine(env_engine).in_worker_processes != ENGINE:
            raise ConfigError(f"{key} steps its envs on the {ENGINE} engine; env.engine="
                              f"{env_engine} asks for another: leave env.engine at sync, or use torch_graph")


BACKEND = ProcessGroupBackend(
    name="cpu_process_group",
    lowering=TORCH_GRAPH.__class__(backend="cpu_process_group", rules=TORCH_GRAPH.rules),
    devices=("cpu",),
)
