"""``cpu_process_group``: a CPU fragment replicated over N OS processes, each running the
fragment's program on its share of the envs (DESIGN.md §4).

The program is lowered exactly as by ``torch_graph`` (eager torch on the CPU); what differs is
where replicas live: each is a Ray actor in its own process with its own torch/OpenMP threads,
and the fragment's boundaries and all-reduces go over a Gloo process group
(:mod:`msrl.runtime.dist`). Choosing it for a fragment (``distribution_policy.backends.actor:
cpu_process_group``) therefore needs ``runtime: ray``; under ``runtime: local`` it is a config
error rather than a silent fallback to threads.
"""

from __future__ import annotations

from msrl.backend import Backend
from msrl.fragments.torch_graph import LOWERING as TORCH_GRAPH

__all__ = ["BACKEND"]

BACKEND = Backend(
    name="cpu_process_group",
    lowering=TORCH_GRAPH.__class__(backend="cpu_process_group", rules=TORCH_GRAPH.rules),
    devices=("cpu",),
    processes=True,
)
