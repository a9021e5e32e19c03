"""A run's metrics: ``metrics.csv`` and TensorBoard events, one row per iteration.

Columns: ``iteration``, ``env_steps``, ``time_s`` (training wall time, s), ``charts/SPS`` (env
steps/s), ``charts/episodic_return`` and ``charts/episodic_length`` (means over the episodes
finished in the iteration, and any extra episode statistics the env reports), the learner's
``losses/...``; under Ray ``charts/comm_share``/``wait_share``, ``faults/...`` and
``security/refused_connections``/``_frames``/``_datagrams`` (what the replicas' boundary servers
and shared-memory groups refused since they started: strangers, wrong tokens, bad frames); with
asynchronous boundaries ``async/policy_lag_mean``/``_max``; under central inference
``inference/...``; ``eval/mean_return`` on evaluation iterations.
"""

from __future__ import annotations

import csv
import math
import pathlib
import time
from typing import Any, Mapping

from msrl.runtime.inference import inference_metrics

__all__ = ["MetricsWriter", "iteration_row", "use_native_crc32c"]


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data`` (TensorFlow's ``crc32c::Mask``: the checksum
    rotated right by 15 bits plus 0xa282ead8, modulo 2**32), computed by ``google-crc32c``'s C
    library."""
    import google_crc32c

    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def use_native_crc32c() -> bool:
    """Makes TensorBoard's event writer checksum its records with ``google-crc32c``'s C
    implementation instead of TensorBoard's pure-Python one (without TensorFlow installed,
    ``tensorboard.summary.writer.record_writer`` uses a byte-at-a-time Python loop, a large part
    of writing a long run's events; figures: ``bench/results/startup.md``, "Figures behind the code").
    The bytes written are the same (checked against TensorBoard's own function on first use).

    Returns:
        whether the C checksum is in use (``False``: ``google-crc32c`` is not installed or
        runs without its C extension, or this TensorBoard writes records differently; its own
        writer is then left as it is).
    """
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", "c") != "c":  # its own pure-Python fallback: no faster
        return False
    current = getattr(record_writer, "masked_crc32c", None)
    if current is _masked_crc32c:
        return True
    if current is None or any(current(b) != _masked_crc32c(b) for b in (b"", b"msrl", bytes(range(256)) * 3)):
        return False
    record_writer.masked_crc32c = _masked_crc32c
    return True


def iteration_row(rec: Mapping[str, Any], iteration: int, time_s: float, steps_per_iteration: int, offline: bool,
                  faults: Mapping[str, int] | None, lost_episodes: int | None) -> dict[str, Any]:
    """The ``metrics.csv`` row of one iteration's runtime record (see
    :meth:`msrl.run.job.Job.run`).

    Args:
        rec: the record; ``iteration``: its number (from 1); ``time_s``: training time at its end.
        steps_per_iteration: env steps of one iteration (for ``charts/SPS``).
        offline: an offline algorithm's row: a ``gradient_steps`` column (one per iteration) and
            ``charts/gradient_steps_per_s`` instead of ``charts/SPS``.
        faults: the run's fault counters (Ray runs), written as ``faults/...``; ``None``: none.
        lost_episodes: the run's ``faults/lost_episodes`` so far (a local run on env worker
            processes), or ``None``: not written.
    """
    stats = rec["episodes"]
    mean = (lambda xs: sum(xs) / len(xs) if xs else float("nan"))  # noqa: E731
    lags = rec.get("policy_lags")
    return {
        "iteration": iteration,
        "env_steps": rec["env_steps"],
        **({"gradient_steps": iteration} if offline else {}),
        "time_s": round(time_s, 6),  # to the microsecond: a captured GPU iteration is ~1.4 ms
        ("charts/gradient_steps_per_s" if offline else "charts/SPS"): round(steps_per_iteration / max(rec["time_s"], 1e-9), 1),
        "charts/episodic_return": mean(stats.returns),
        "charts/episodic_length": mean(stats.lengths),
        **{f"charts/{k}": sum(v) / len(v) for k, v in stats.extra.items() if v},
        **(rec["output"] or {}),
        **({f"faults/{k}": v for k, v in faults.items()} if faults is not None else {}),
        **({"faults/lost_episodes": lost_episodes} if lost_episodes is not None else {}),
        **({"charts/comm_share": round(rec["comm_share"], 4), "charts/wait_share": round(rec["wait_share"], 4)}
           if "comm_share" in rec else {}),
        **({"async/policy_lag_mean": sum(lags) / len(lags), "async/policy_lag_max": max(lags)} if lags else {}),
        **{f"security/refused_{k}": v for k, v in (rec.get("refused") or {}).items()},
        **inference_metrics(rec.get("inference")),
    }


class MetricsWriter:
    """CSV + TensorBoard writer; on resume, rows past the checkpoint are dropped.

    TensorBoard events are written in batches, every :attr:`TB_EVERY_S` seconds of
    :meth:`flush` calls and at :meth:`close`, each batch drained before training goes on.
    Handed over one row per iteration, TensorBoard's writer thread (event serialisation and a
    pure-Python CRC per record) competed with the training thread for the GIL and slowed small
    jobs measurably (``bench/results/startup.md``, "Figures behind the code")."""

    TB_EVERY_S = 5.0
    #: events TensorBoard's writer thread may hold queued: a batch is handed over without the
    #: training thread waiting on the writer thread after every 10 events (torch's default)
    TB_QUEUE = 10_000

    def __init__(self, run_dir: pathlib.Path, resume_iteration: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        use_native_crc32c()

        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if resume_iteration is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["iteration"]) <= resume_iteration]
        self.columns: list[str] = list(self.rows[0].keys()) if self.rows else []
        self._csv: Any = None
        self._writer: Any = None
        self._rewrite()
        purge = resume_iteration + 1 if resume_iteration is not None else None
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge, max_queue=self.TB_QUEUE)
        self._tb_next = len(self.rows)  # rows before it are in TensorBoard already
        self._tb_written_at = time.perf_counter()

    def _rewrite(self) -> None:
        if not self.columns:
            return
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)

    def log(self, row: dict[str, Any]) -> None:
        """Appends ``row`` to metrics.csv (buffered until :meth:`flush`) and its finite numbers
        to TensorBoard as one event at step ``row["env_steps"]`` (written by a later
        :meth:`flush` or :meth:`close`)."""
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new:
            self._close_csv()
            self.columns += new
            self._rewrite()
        else:
            if self._csv is None:
                self._csv = open(self.path, "a", newline="")
                self._writer = csv.DictWriter(self._csv, fieldnames=self.columns)
            self._writer.writerow(row)

    def _write_tb(self) -> None:
        """Writes the rows logged since the last batch to TensorBoard, one Summary per row holding
        every finite scalar (what ``add_scalar`` writes one value at a time), and waits until
        they are out."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self.tb._get_file_writer()
        for row in self.rows[self._tb_next:]:
            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
                      if k not in ("iteration", "env_steps", "gradient_steps") and isinstance(v, (int, float))
                      and math.isfinite(v)]
            writer.add_summary(Summary(value=values), int(row.get("gradient_steps", row["env_steps"])))
        self._tb_next = len(self.rows)
        self.tb.flush()
        self._tb_written_at = time.perf_counter()

    def flush(self) -> None:
        """Writes the buffered rows to metrics.csv, and to TensorBoard when the last batch is
        :attr:`TB_EVERY_S` seconds old."""
        if self._csv is not None:
            self._csv.flush()
        if len(self.rows) > self._tb_next and time.perf_counter() - self._tb_written_at >= self.TB_EVERY_S:
            self._write_tb()

    def _close_csv(self) -> None:
        if self._csv is not None:
            self._csv.close()
            self._csv = None

    def close(self) -> None:
        """Writes what is buffered and closes both files."""
        self._close_csv()
        if len(self.rows) > self._tb_next:
            self._write_tb()
        self.tb.close()
