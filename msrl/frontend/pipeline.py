"""The front end in one place: a trainer's methods to the fragmented graph every runtime runs
(DESIGN.md "The flow of one job")::

    trace(reset, train_step) -> probe -> partition(policy) -> place_collectives -> serve_inference

Each stage after the partition is a pass ``FragmentGraph -> FragmentGraph``
(:mod:`msrl.frontend.collectives`, :mod:`msrl.frontend.serving`); the code generation of each
fragment's programs follows in :func:`msrl.run.job.compile_job`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from msrl.frontend.collectives import place_collectives
from msrl.frontend.partition import partition
from msrl.frontend.serving import serve_inference
from msrl.graph import Graph
from msrl.graph.fragmented import FragmentGraph
from msrl.policy import DistributionPolicy

__all__ = ["PASSES", "fragment_graph", "front_end"]

#: the passes run after the partition, in order
PASSES = (place_collectives, serve_inference)


def fragment_graph(graphs: dict[str, Graph], policy: DistributionPolicy) -> FragmentGraph:
    """:func:`msrl.frontend.partition.partition`, then every pass of :data:`PASSES`.

    Args:
        graphs: method -> traced (and probed, where the policy needs it) graph.
        policy: the distribution policy, overrides applied.

    Raises:
        PartitionError: what the policy (or central inference) cannot honour, naming the line.
    """
    fg = partition(graphs, policy)
    for run_pass in PASSES:
        fg = run_pass(fg)
    return fg


def front_end(spec: Any, probe: bool = True, max_message: int | None = None) -> tuple[dict[str, Graph], FragmentGraph]:
    """Trace -> probe -> partition -> passes for ``spec`` (a :class:`msrl.run.job.JobSpec`).

    Args:
        spec: the job.
        probe: annotate values by a probe run (needed when fragments have different replica
            counts, and for a replicated learner's collective points; see :mod:`msrl.frontend.probe`).
        max_message: the largest message between processes (bytes): a boundary value larger
            than that is refused here, from the probe's sizes (``None``: no limit, one process).

    Returns:
        the traced graphs per method and the fragmented graph (its ``generator_kinds`` the
        global generators the probe saw drawn from; ``None`` without a probe).

    Raises:
        TraceError, PartitionError, ProbeDiverged, ConfigError: as the stages raise them.
    """
    from msrl.frontend.tracer import TRACED_METHODS, trace

    graphs = {m: trace(spec.algorithm.trainer, m) for m in TRACED_METHODS}
    drawn = None
    if probe:
        from msrl.frontend.probe import probe as run_probe

        drawn = run_probe(graphs, spec)
    fg = dataclasses.replace(fragment_graph(graphs, spec.policy), generator_kinds=drawn)
    if probe and max_message is not None:
        from msrl.frontend.probe import check_message_sizes

        check_message_sizes(graphs, fg, spec.num_envs, max_message)
    return graphs, fg
