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

from msrl.backend import Backend
from msrl.fragments.torch_graph import LOWERING as TORCH_GRAPH

__all__ = ["BACKEND"]

BACKEND = Backend(
    name="cpu_process_group",
    lowering=TORCH_GRAPH.__class__(backend="cpu_process_group", rules=TORCH_GRAPH.rules),
    devices=("cpu",),
    env_engine="process",
)
