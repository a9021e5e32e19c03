"""The one interface every runtime implements: what the driver (:mod:`msrl.run.loop`,
:mod:`msrl.run.evaluation`, :mod:`msrl.run.checkpoints`) calls, and the record of one iteration it gets
back. The local runtime (:class:`msrl.run.job.Job`: replicas as threads of this process) and the Ray
runtime (:class:`msrl.cluster.ray_runtime.RayJob`: a process per replica) both implement
:class:`JobRuntime`; the driver never asks which one it has.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, TypedDict, runtime_checkable

__all__ = ["IterationRecord", "JobRuntime", "iteration_record"]


class IterationRecord(TypedDict, total=False):
    """One ``train_step`` iteration of a whole job, as :meth:`JobRuntime.run` returns it (a dict:
    ``record["output"]``).

    Keys every runtime fills:
        output: the learner's metrics, ``name -> float``.
        env_steps: the job's env steps after the iteration, over every env replica (int).
        episodes: the :class:`~msrl.api.EpisodeStats` finished in it, replica 0 first.
        time_s: the slowest replica's seconds for it.
        policy_lags: learner version minus acting version of what asynchronous boundaries
            delivered in it (empty without them).
        inference: central inference's ``batch_sizes`` and ``latencies_s`` in it, or ``None``.
        notices: (each replica's record) one-line notices of its programs in it (a captured
            program: captured, or why not; :meth:`~msrl.runtime.replica.Replica.pop_notices`),
            printed by the runtime in the driver's process.

    Keys of a runtime whose replicas are processes (Ray):
        comm_share, wait_share: the replicas' share of their busy time spent moving values, and
            waiting for a peer (0-1).
        refused: connections, frames and datagrams its servers refused, ``kind -> count``.
    """

    output: dict[str, float]
    env_steps: int
    episodes: Any
    time_s: float
    policy_lags: list[int]
    inference: Any
    notices: list[str]
    comm_share: float
    wait_share: float
    refused: dict[str, int]


def iteration_record(rows: Sequence[Mapping[str, Any]], output: dict[str, float] | None,
                     with_episodes: Sequence[bool] | None = None, processes: bool = False) -> IterationRecord:
    """The job's record of one iteration from its replicas' rows (each
    :meth:`~msrl.runtime.host.ReplicaHost.run` record), the one aggregation both runtimes use.

    Args:
        rows: one row per replica, in the order their episodes are listed.
        output: the output fragment's metrics as floats (``None``: it returned nothing).
        with_episodes: per row, whether its finished episodes count (the env's fragment);
            ``None``: every row's.
        processes: the replicas are processes (Ray): the record has their communication
            shares and what their servers refused too.

    Returns:
        the :class:`IterationRecord`: ``env_steps`` summed over the rows, episodes merged in
        row order, the slowest row's ``time_s``, every row's policy lags, the first central
        inference statistics; with ``processes`` also ``comm_share``, ``wait_share`` and
        ``refused``.
    """
    from msrl.api import EpisodeStats

    episodes = EpisodeStats([], [])
    for row, counts in zip(rows, with_episodes if with_episodes is not None else [True] * len(rows)):
        if counts:
            episodes.merge(row["episodes"])
    record: IterationRecord = {
        "output": output, "env_steps": sum(r["env_steps"] for r in rows), "episodes": episodes,
        "time_s": max(r["time_s"] for r in rows), "policy_lags": [lag for r in rows for lag in r["policy_lags"]],
        "inference": next((r["inference"] for r in rows if r.get("inference")), None)}
    if processes:
        busy = sum(r["time_s"] for r in rows)
        record["comm_share"] = sum(r["comm_s"] for r in rows) / busy if busy > 0 else 0.0
        record["wait_share"] = sum(r["wait_s"] for r in rows) / busy if busy > 0 else 0.0
        record["refused"] = {k: sum(r["refused"][k] for r in rows) for k in rows[0]["refused"]}
    return record


@runtime_checkable
class JobRuntime(Protocol):
    """A built job ready to run on some runtime.

    Attributes:
        spec: the :class:`~msrl.run.job.JobSpec`; ``fragment_graph``: its partition.
        iteration: ``train_step`` iterations finished; ``env_steps``: env steps taken so far.
        restarts_replicas: whether a replica's death is recovered by restarting the job from its
            last checkpoint (replicas in processes under a watchdog: a restart point is saved
            before the first iteration and ``faults/...`` columns are written).
        iterations_exact: whether, when an iteration raises in :meth:`run`, ``iteration`` counts
            the iterations of that call that finished (else only whole calls count).
    """

    spec: Any
    fragment_graph: Any
    iteration: int
    restarts_replicas: bool
    iterations_exact: bool

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, over every env replica."""

    def reset(self) -> None:
        """Runs every replica's ``reset`` program (initial state, initial weight sync)."""

    def run(self, n: int) -> list[IterationRecord]:
        """Runs ``n`` iterations, the replicas free between boundaries; one record each.

        Raises:
            FragmentError: a fragment raised; FloatingPointError: a ``*_loss`` metric is not
            finite; ReplicaDied: a replica's process died.
        """

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs: every replica's state and the iteration count."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into a job built from the same spec."""

    def eval_actor(self) -> Any:
        """An actor holding the current policy, for evaluation on this process's CPU."""

    def replica_table(self) -> list[dict[str, Any]]:
        """Where each replica runs: ``fragment``, ``replica``, ``roles``, ``pid``, ``node``, one row
        per replica (written as the run's ``replicas.json``); ``[]`` when the replicas are
        threads of this process."""

    def pop_episode_stats(self) -> Any:
        """Episodes finished on every env replica since the last call."""

    def close(self) -> None:
        """Stops the replicas and releases what the job holds."""
