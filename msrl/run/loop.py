"""The training loop of one attempt at a run: chunks of iterations in which the replicas run free,
each ending at the next checkpoint, evaluation or the end of the budget; a row of metrics per
iteration; the final evaluation, ``eval.json`` and the learning curve (see :mod:`msrl.run.training`)."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

from msrl.config import RunConfig
from msrl.envs.engines import engine
from msrl.run.checkpoints import CHECKPOINT, CheckpointError, Progress, read_checkpoint, save_checkpoint
from msrl.run.evaluation import evaluate_job
from msrl.run.job import JobSpec
from msrl.run.metrics import MetricsWriter, iteration_row
from msrl.run.outcome import ReplicaLost, TrainingInterrupted, TrainingStopped, TrainResult
from msrl.run.rundir import RunLock, atomic_write_text, new_run_dir, write_config
from msrl.run.supervisor import report
from msrl.runtime.interface import JobRuntime
from msrl.runtime.replica import FragmentError, ReplicaDied
from msrl.runtime.startup import resume_gc

__all__ = ["TrainingLoop"]


class TrainingLoop:
    """One attempt at training a built job: chunks of iterations until the budget (or the
    return threshold) is reached, then the final evaluation (see the module docstring).

    Args:
        cfg, spec: the run's config and job spec; job: the built job, a
            :class:`~msrl.runtime.interface.JobRuntime` (the loop never asks which runtime).
        resume: the run directory being resumed (``None``: a new run, whose directory is made
            here); state: the checkpoint it resumes from.
        locks: the run directory's lock is appended (released by the caller).
    """

    #: replicas run free for about this long between the driver's looks (s)
    CHUNK_S = 0.5
    #: and under an asynchronous policy for at least this many iterations: a chunk's end drains
    #: the pipeline (the actors wait while the learner takes their last rollouts), so a chunk of
    #: one slow iteration (IMPALA on Pong, ~1 s) ran actors and learner one after the other
    #: (bench/results/pong.md, "Pong against CleanRL+EnvPool")
    ASYNC_MIN_ITERATIONS = 8

    def __init__(self, cfg: RunConfig, spec: JobSpec, job: JobRuntime, resume: Any, state: Any, locks: list[RunLock],
                 faults: dict[str, int] | None = None, reuse: pathlib.Path | None = None) -> None:
        self.cfg, self.spec, self.job = cfg, spec, job
        self.metrics: MetricsWriter | None = None
        self._saving = False  # a checkpoint is being written
        # the budget's unit: env steps, or an offline algorithm's gradient steps (one per iteration)
        self.steps_per_iteration = spec.steps_per_iteration
        if resume is None:
            if reuse is None:
                self.run_dir = new_run_dir(cfg)
            else:  # an earlier attempt made it and died before its first checkpoint
                self.run_dir = reuse
            locks.append(RunLock(self.run_dir))  # (a new name: nobody else can hold it yet, but a --resume soon can)
            write_config(self.run_dir, cfg)
            self.progress, self.ckpt_steps = Progress(), None
            for k, v in (faults or {}).items():
                self.progress.faults[k] = self.progress.faults.get(k, 0) + v
            if reuse is None:
                clash = pathlib.Path(cfg.runs_dir) / cfg.name
                print(f"msrl: run directory {self.run_dir}" + (f" ({clash} exists)" if self.run_dir != clash else ""),
                      file=sys.stderr)
        else:
            self.run_dir = pathlib.Path(resume)
            self.progress, self.ckpt_steps = Progress.from_state(state), int(state["env_steps"])
        report(run_dir=str(self.run_dir))  # to the process watching a Ray run's driver, if any
        try:  # a replica that dies here (the job's start) is restarted as one that dies in a chunk
            if resume is None:
                job.reset()
            else:
                job.load_state_dict(state["job"])
                print(f"msrl: resuming {self.run_dir} at "
                      + (f"gradient step {job.iteration}" if spec.offline else f"env step {job.env_steps}"), file=sys.stderr)
            self.metrics = MetricsWriter(self.run_dir, job.iteration if resume is not None else None)
            self._write_replica_table()
            if resume is None and job.restarts_replicas:
                self.checkpoint()  # a restart point before the first chunk
        except ReplicaDied as e:
            if self.metrics is not None:
                self.metrics.close()
            raise ReplicaLost(self.run_dir, -1, e) from e
        self._last_eval: float | None = None  # the last periodic evaluation's mean return (an offline run's bar shows it)
        self.bar = self._progress_bar() if cfg.train.progress else None

    def _progress_bar(self) -> Any:
        from tqdm import tqdm

        # one speed: training env steps per second of training time (evaluations excluded), the
        # figure the final summary reports; tqdm's own rate only feeds the time-remaining estimate
        return tqdm(total=self.spec.num_iterations * self.steps_per_iteration, initial=self._steps(), unit="step", dynamic_ncols=True,
                    desc="training", bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                                "[{elapsed}<{remaining}{postfix}]")

    def _steps(self) -> int:
        """The job's progress in the budget's unit: its env steps, or an offline algorithm's
        gradient steps (its iterations)."""
        return self.job.iteration if self.spec.offline else self.job.env_steps

    def checkpoint(self) -> None:
        """Saves the job and the progress as the run's latest checkpoint."""
        self._saving = True  # a Ctrl-C until ckpt_steps is set reads the steps from the file
        save_checkpoint(self.run_dir, self.job, self.progress, self._steps() if self.cfg.train.keep_weights else None)
        self.ckpt_steps = self.job.env_steps  # once the file is in place
        self._saving = False

    def run(self) -> TrainResult:
        """Trains to the end of the budget (or the threshold), then evaluates and reports."""
        resume_gc()  # start-up is over: the collector back on for the loop (msrl/runtime/startup.py)
        try:
            iter_s = None
            while self.job.iteration < self.spec.num_iterations:
                iter_s = self._chunk(self._chunk_size(iter_s))
                if self.progress.threshold[0] is not None:
                    break
        except ReplicaDied as e:  # at a checkpoint's or an evaluation's call into the replicas
            raise ReplicaLost(self.run_dir, _reached(e, self.job.env_steps), e) from e
        except KeyboardInterrupt:
            raise self._interrupted() from None
        finally:
            if self.bar is not None:
                self.bar.close()
            self.metrics.close()
        try:
            return self._finish()
        except KeyboardInterrupt:  # during the final evaluation: the training is in the checkpoint
            raise self._interrupted() from None

    def _interrupted(self) -> TrainingInterrupted:
        """The :class:`TrainingInterrupted` of a Ctrl-C now: where the last checkpoint is."""
        kept = self.run_dir / CHECKPOINT if (self.run_dir / CHECKPOINT).is_file() else None
        steps = self.ckpt_steps
        if kept is not None and self._saving:  # interrupted mid-save: latest.pt is the old file or the new, whole
            try:
                steps = int(read_checkpoint(kept)["env_steps"])
            except CheckpointError:  # (atomic_save never leaves it damaged): the steps last known
                pass
        if steps is None:
            kept = None
        return TrainingInterrupted(self.run_dir, self.job.env_steps, kept, steps if kept else None)

    def _chunk_size(self, iter_s: float | None) -> int:
        """Iterations until the next event (a checkpoint, an evaluation, the end), at most
        :attr:`CHUNK_S` seconds of them (one while the iteration time is unknown), and under an
        asynchronous policy at least :attr:`ASYNC_MIN_ITERATIONS` (where no event comes first)."""
        cfg, it, done_eval = self.cfg, self.job.iteration, self.progress.done_eval
        n = min(self.spec.num_iterations - it, cfg.train.checkpoint_every - it % cfg.train.checkpoint_every)
        if cfg.train.eval_every:
            n = min(n, max(1, -(-((done_eval + 1) * cfg.train.eval_every - self._steps()) // self.steps_per_iteration)))
        if iter_s is None:
            return 1
        free = int(self.CHUNK_S / max(iter_s, 1e-6))
        if self.spec.policy.asynchronous:
            free = max(free, self.ASYNC_MIN_ITERATIONS)
        return max(1, min(n, free))

    def _chunk(self, n: int) -> float:
        """Runs ``n`` iterations, logs them (evaluating at the last when one is due) and
        checkpoints when due; returns the time per iteration."""
        job, p, it = self.job, self.progress, self.job.iteration
        t0, steps_before = time.perf_counter(), job.env_steps
        try:
            records = job.run(n)
        except ReplicaDied as e:
            raise ReplicaLost(self.run_dir, _reached(e, job.env_steps), e) from e
        except (FragmentError, FloatingPointError) as e:
            raise self._stopped(e, it, n, steps_before) from e
        chunk_dt = time.perf_counter() - t0
        for rec in records:
            p.recent.extend(rec["episodes"].returns)
        if self.bar is not None:
            # the speed and return so far set before the update draws: every frame after the
            # first shows them, whether or not this update redraws (tqdm's mininterval)
            self._postfix(self._steps() / max(p.time_s + chunk_dt, 1e-9))
            self.bar.update(self.steps_per_iteration * n)  # before an evaluation, so "evaluating" shows the steps it evaluates at
        eval_dt = 0.0
        for i, rec in enumerate(records):
            p.faults["lost_episodes"] += rec["episodes"].lost
            for k, v in rec.get("faults", {}).items():  # replicas replaced alone in the chunk
                p.faults[k] = p.faults.get(k, 0) + v
            if rec.get("faults", {}).get("replaced_replicas"):
                self._write_replica_table()  # the replacements' pids
            row = iteration_row(rec, it + i + 1, p.time_s + chunk_dt * (i + 1) / n, self.steps_per_iteration,
                                self.spec.offline,
                                p.faults if job.restarts_replicas else None,
                                p.faults["lost_episodes"] if engine(self.cfg.env.engine).loses_episodes and not job.restarts_replicas
                                else None)
            if i == n - 1:
                eval_dt = self._evaluate_if_due(row, t0)
            self.metrics.log(row)
        self.metrics.flush()
        p.time_s += time.perf_counter() - t0 - eval_dt  # training time: the whole chunk, evaluation excluded
        if self.bar is not None:
            self._postfix(self._steps() / max(p.time_s, 1e-9))  # the next update() draws it
        if (job.iteration % self.cfg.train.checkpoint_every == 0 or p.threshold[0] is not None
                or job.iteration == self.spec.num_iterations):
            ckpt_t0 = time.perf_counter()
            self.checkpoint()
            p.time_s += time.perf_counter() - ckpt_t0
        return chunk_dt / n

    def _write_replica_table(self) -> None:
        """Writes ``replicas.json``: where each replica runs (pids, nodes), for operators (Ray runs)."""
        table = self.job.replica_table()
        if table:
            atomic_write_text(self.run_dir / "replicas.json", json.dumps(table, indent=1))

    def _postfix(self, steps_per_s: float) -> None:
        """Sets the bar's one speed (training steps, env or gradient, per second of training
        time) and the mean return of the recent episodes -- an offline algorithm's, which has no
        episodes of its own, the last evaluation's (``eval``) -- without drawing."""
        if self.spec.offline:
            shown = {"eval": f"{self._last_eval:.1f}"} if self._last_eval is not None else {}
            self.bar.set_postfix({"steps/s": f"{steps_per_s:.0f}", **shown}, refresh=False)
            return
        recent = self.progress.recent
        ret = sum(recent) / len(recent) if recent else float("nan")
        self.bar.set_postfix({"steps/s": f"{steps_per_s:.0f}", "return": f"{ret:.1f}"}, refresh=False)

    def _evaluate_if_due(self, row: dict[str, Any], chunk_t0: float) -> float:
        """Evaluates when the steps (env or gradient) passed the next ``train.eval_every`` mark, writing
        ``eval/mean_return`` into ``row`` and the threshold when first reached; returns the
        evaluation's seconds."""
        cfg, p, job = self.cfg, self.progress, self.job
        if not cfg.train.eval_every or self._steps() // cfg.train.eval_every <= p.done_eval:
            return 0.0
        p.done_eval = self._steps() // cfg.train.eval_every
        t0 = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str("evaluating", refresh=True)
        returns = evaluate_job(job, cfg)
        if self.bar is not None:
            self.bar.set_description_str("training", refresh=False)
        mean = sum(returns) / len(returns)
        self._last_eval = mean
        row["eval/mean_return"] = mean
        if cfg.train.stop_at_return is not None and mean >= cfg.train.stop_at_return and p.threshold[0] is None:
            p.threshold = (p.time_s + (t0 - chunk_t0), self._steps())
        return time.perf_counter() - t0

    def _stopped(self, e: BaseException, it: int, n: int, steps_before: int) -> TrainingStopped:
        """The error that stops the run after a fragment raised in iterations ``it+1..it+n``."""
        ckpt = self.run_dir / CHECKPOINT
        good = ckpt if ckpt.is_file() else None
        if self.job.iterations_exact or n == 1:  # the job counts the iterations of the chunk that finished
            steps_before += (self.job.iteration - it) * self.steps_per_iteration
            where, failed = f"at iteration {self.job.iteration + 1} (after env step {steps_before})", self.job.iteration + 1
        else:
            where, failed = f"in iterations {it + 1}-{it + n} (after env step {steps_before})", it + 1
        return TrainingStopped(f"training stopped {where}: {e}\nlast good checkpoint: {good or 'none'}", failed,
                               steps_before, good)

    def _finish(self) -> TrainResult:
        """The final evaluation and ``eval.json``; closes the job and starts drawing the learning curve."""
        job, p = self.job, self.progress
        try:
            returns = evaluate_job(job, self.cfg)
        except ReplicaDied as e:
            raise ReplicaLost(self.run_dir, _reached(e, job.env_steps), e) from e
        result = TrainResult(self.run_dir, job.iteration, job.env_steps, p.time_s, returns, *p.threshold)
        (self.run_dir / "eval.json").write_text(json.dumps({
            "episodes": len(returns), "mean_return": result.eval_mean if returns else None, "returns": returns,
            "env_steps": job.env_steps, **({"gradient_steps": job.iteration} if self.spec.offline else {}),
            "iterations": job.iteration, "time_s": p.time_s,
            "time_to_threshold_s": p.threshold[0], "steps_to_threshold": p.threshold[1]}, indent=2))
        job.close()
        from msrl.run.plot import plot_in_background

        plot_in_background(self.run_dir)  # the result line does not wait for matplotlib
        return result


def _reached(e: ReplicaDied, env_steps: int) -> int:
    """The env steps the job reached when a replica died: the replicas' own count when the
    runtime knows it (the running chunk's steps), else the driver's ``env_steps``."""
    return e.env_steps if e.env_steps is not None else env_steps
