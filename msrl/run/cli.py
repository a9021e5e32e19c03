"""The ``msrl`` command line.

::

    msrl train CONFIG [key.sub=value ...] [--resume RUN_DIR]
    msrl launch CONFIG [key.sub=value ...] --address http://HEAD:8265 [--working-dir DIR] [--no-wait]
    msrl eval RUN_DIR [--episodes N] [--seed S]
    msrl plot RUN_DIR [--out PNG]
    msrl graph CONFIG [key.sub=value ...] [-o PNG]

Errors in the input -- a config error, code the tracer cannot read (:class:`TraceError`), a
graph the policy cannot partition (:class:`PartitionError`, a declaration the probe
contradicts) -- print one line ``msrl: error: ...`` on stderr and exit with status 2, having
written nothing; a run stopped by an error (e.g. a NaN) exits with status 1 and keeps its last
checkpoint; a run whose Ray cluster (or whose training process itself) stopped under it exits
with status 3, in one line naming the last checkpoint and the ``--resume`` command.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import pathlib
import signal
import sys
from typing import Any, Callable, NoReturn, Sequence

from msrl.errors import MsrlError

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from msrl.config import ConfigError, load_config

    items = ([args.config] if args.config else []) + list(args.overrides)
    configs = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    if len(configs) > 1 or (configs and items[0] != configs[0]):
        raise ConfigError(f"msrl train takes one CONFIG before its key=value overrides, got {' '.join(items)}")
    if args.owned:  # the msrl command: its start-up shortcuts first (validating a config imports the algorithm)
        _own_process(configs[0] if configs else pathlib.Path(args.resume or ".") / "config.yaml", overrides)
    if args.resume:  # the run's saved config (or CONFIG), with budget-like overrides
        from msrl.run.rundir import resume_config

        cfg = resume_config(args.resume, overrides, configs[0] if configs else None)
    elif not configs:
        raise ConfigError("msrl train needs a CONFIG (a YAML file), or --resume RUN_DIR")
    else:
        cfg = load_config(configs[0], overrides)  # config errors before torch is imported

    if args.supervise:
        from msrl.config import resolve_runtime
        from msrl.policy import load_policy

        policy = load_policy(cfg.distribution_policy.name).with_overrides(cfg.distribution_policy.replicas,
                                                                          placement=cfg.distribution_policy.placement)
        if resolve_runtime(cfg.runtime, policy) == "ray":  # a Ray driver: watched by this process (msrl.run.supervisor)
            from msrl.run.supervisor import supervised

            return supervised(lambda: _classified(lambda: _train_run(cfg, args)))
    return _train_run(cfg, args)


def _own_process(config: str | pathlib.Path, overrides: Sequence[str]) -> None:
    """The ``msrl`` command's process is msrl's own: :func:`msrl.runtime.startup.own_process`, before
    the config is validated (validation imports the algorithm, and with it tensordict), unless
    the config (read, not yet validated) compiles a fragment. A config that cannot be read
    keeps plain torch; its error comes from the validation that follows."""
    from msrl.config import ConfigError, read_config
    from msrl.runtime.startup import config_compiles, own_process

    try:
        compiles = config_compiles(read_config(config, overrides))
    except ConfigError:
        return
    if compiles is not None:
        own_process(compiles=compiles)


def _format_return(value: float) -> str:
    """A return for a result line: one decimal from 100 up (``500.0``), four significant digits
    below (``0.9575``, ``54.55``, ``-3.142``), never rounded to another value's look (0.9575 is
    not ``1.0``)."""
    if abs(value) >= 100 or value == 0 or not math.isfinite(value):
        return f"{value:.1f}"
    text = f"{value:.4g}"
    return text if "." in text or "e" in text else text + ".0"


def _train_run(cfg: object, args: argparse.Namespace) -> int:
    from msrl.run.training import train

    result = train(cfg, resume=args.resume)
    evaluation = (f"evaluation: mean return {_format_return(result.eval_mean)} over {len(result.eval_returns)} episodes"
                  if result.eval_returns else "no evaluation (no gymnasium twin)")
    early = ""
    offline = cfg.train.total_gradient_steps is not None  # an offline algorithm's budget: gradient steps
    unit, done = ("gradient step", result.iterations) if offline else ("env step", result.env_steps)
    if result.steps_to_threshold is not None:  # the loop stopped at the threshold: said, with the budget it used
        early = (f"; stopped early: an evaluation reached train.stop_at_return={_format_return(cfg.train.stop_at_return)} "
                 f"at {unit} {result.steps_to_threshold} ({result.time_to_threshold_s:.1f} s), "
                 f"{done} of the budget's {cfg.train.budget} {unit}s used")
    steps = f"{result.iterations} gradient steps" if offline else f"{result.env_steps} env steps"
    if offline and result.env_steps:  # an offline-then-online algorithm's (AWAC's) online phase
        steps += f" ({result.env_steps} env steps online)"
    print(
        f"run {result.run_dir}: {result.iterations} iterations, {steps}, "
        f"{result.time_s:.1f} s training ({done / max(result.time_s, 1e-9):.0f} steps/s); {evaluation}{early}"
    )
    return 0


def _launch(args: argparse.Namespace) -> int:
    from msrl.cluster.launch import launch

    return launch(args.config, args.overrides, args.address, args.working_dir, wait=not args.no_wait)


def _eval(args: argparse.Namespace) -> int:
    from msrl.run.python_api import evaluate, load

    if args.owned:  # an evaluation compiles nothing
        from msrl.runtime.startup import own_process

        own_process()
    policy = load(args.run_dir)
    returns = evaluate(policy, args.episodes, args.seed)
    mean = sum(returns) / len(returns)
    print(json.dumps({"run_dir": str(args.run_dir), "episodes": len(returns), "mean_return": mean,
                      "min_return": min(returns), "max_return": max(returns)}))
    return 0


def _collect(args: argparse.Namespace) -> int:
    from msrl.run.collect import collect

    if args.owned:  # collecting compiles nothing
        from msrl.runtime.startup import own_process

        own_process()
    path = collect(args.runs, args.out, args.episodes, noise=args.noise, seed=args.seed, root=args.root)
    print(json.dumps({"dataset_id": args.out, "path": str(path), "episodes": args.episodes}))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from msrl.run.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _graph(args: argparse.Namespace) -> int:
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job
    from msrl.run.outcome import TrainingStopped
    from msrl.run.printer import draw_fragments, format_boundary_bytes, format_capture, format_compile, format_job
    from msrl.runtime.replica import FragmentError

    if args.owned:
        _own_process(args.config, args.overrides)
    cfg = load_config(args.config, args.overrides)
    population = cfg.population
    if population is not None:  # the members' job: member 0's config
        from msrl.run.population import member_configs

        member = member_configs(cfg, __import__("random").Random(cfg.seed))[0]
    job = Job(build_job_spec(member if population is not None else cfg))
    try:
        if population is not None:
            from msrl.run.population import describe

            sys.stdout.write(describe(cfg, job))
        sys.stdout.write(format_job(job))
        try:
            measured = job.measure_boundary_bytes()
        except (FragmentError, FloatingPointError) as e:  # the algorithm failed in its measured iteration: as msrl train says it
            raise TrainingStopped(f"the iteration msrl graph measures bytes on stopped: {e}", 1, 0, None) from e
        sys.stdout.write(format_boundary_bytes(job, measured))
        sys.stdout.write(format_capture(_measure_captures(job)))
        sys.stdout.write(format_compile({k: job.replica(*k).compile_status() for k in job.replicas}))
        out = draw_fragments(job, args.out or f"{cfg.name}_fdg.png")
        print(f"\npicture of the fragmented graph: {pathlib.Path(out).resolve()}")
    finally:
        job.close()
    return 0


def _measure_captures(job: Any) -> dict[tuple[str, int], str]:
    """Each replica's ``train_step`` capture (:meth:`~msrl.runtime.replica.Replica.capture_summary`)
    after running the iterations a capture takes (warm-up, probe, capture, one replay) where one
    may still be captured; only replicas whose program is under capture."""
    from msrl.runtime.programs.capture import WARMUP

    if any(job.replica(*k).capture_summary() == "graph" for k in job.replicas):
        job.run(WARMUP + 2)
    summaries = {k: job.replica(*k).capture_summary() for k in job.replicas}
    return {k: s for k, s in summaries.items() if s is not None}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line ``msrl: error: ...`` (exit status 2), like every
    other input error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"msrl: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``msrl``."""
    p = _Parser(prog="msrl", description="distributed RL on a fragmented dataflow graph")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a job from a YAML config")
    t.add_argument("config", nargs="?", help="the YAML config (optional with --resume: the run's own)")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides (with --resume: only budget-like keys)")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint (e.g. --resume runs/X train.total_env_steps=N)")
    t.set_defaults(fn=_train)
    la = sub.add_parser("launch", help="submit a training run to a Ray cluster as a Ray Job")
    la.add_argument("config")
    la.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    la.add_argument("--address", default=None,
                    help="the Ray dashboard's address, http://HEAD:8265 (default: $RAY_ADDRESS)")
    la.add_argument("--working-dir", default=".", help="uploaded as the job's working directory (default: .)")
    la.add_argument("--no-wait", action="store_true", help="submit and return; do not follow the job's log")
    la.set_defaults(fn=_launch)
    e = sub.add_parser("eval", help="evaluate a run's last checkpoint with deterministic actions")
    e.add_argument("run_dir", type=pathlib.Path)
    e.add_argument("--episodes", type=_positive_int, default=20, help="episodes to run (>= 1; default 20)")
    e.add_argument("--seed", type=int, default=None)
    e.set_defaults(fn=_eval)
    c = sub.add_parser("collect", help="write episodes of trained runs as a Minari dataset (offline RL)")
    c.add_argument("runs", nargs="+", type=pathlib.Path, metavar="RUN_DIR",
                   help="run directories (several: their episodes mixed, split evenly)")
    c.add_argument("-o", "--out", required=True, metavar="DATASET_ID",
                   help="Minari dataset id, (namespace/)(env_name/)name(-vN), e.g. msrl/cartpole/expert-v0")
    c.add_argument("--episodes", type=_positive_int, required=True, help="episodes to write (>= 1)")
    c.add_argument("--noise", type=float, default=0.0,
                   help="exploration noise in [0, 1]: epsilon (Discrete), Gaussian std over the half-range (Box); 0: greedy")
    c.add_argument("--seed", type=int, default=0, help="episode i is seeded SEED + i (default 0)")
    c.add_argument("--root", default=None, help="datasets root (default Minari's: $MINARI_DATASETS_PATH or ~/.minari/datasets)")
    c.set_defaults(fn=_collect)
    pl = sub.add_parser("plot", help="plot a run's learning curve as PNG")
    pl.add_argument("run_dir", type=pathlib.Path)
    pl.add_argument("--out", default=None)
    pl.set_defaults(fn=_plot)
    g = sub.add_parser("graph", help="print the FDG, fragments and generated programs; draw the fragmented graph")
    g.add_argument("config")
    g.add_argument("overrides", nargs="*")
    g.add_argument("-o", "--out", default=None, help="PNG path (default: <name>_fdg.png in the current directory)")
    g.set_defaults(fn=_graph)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``msrl``; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # --help and usage errors end here, before any heavy import
    if extra:  # key=value overrides after an option (msrl train --resume runs/X train.total_env_steps=N)
        if getattr(args, "overrides", None) is None or not all("=" in x and not x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    # the command line (argv None) watches a Ray run's driver from a parent process; a call
    # from Python (main([...]), the tests) runs in the caller's process
    args.supervise = argv is None
    args.owned = argv is None  # the command's process is msrl's own (msrl/runtime/startup.py); a caller's is not
    if argv is None:  # this process is msrl's own: no collector during start-up nor at exit (msrl/runtime/startup.py)
        from msrl.runtime.startup import defer_gc, freeze_before_exit

        defer_gc()
        # SIGINT is msrl's own in its process: a background job of a script (`msrl train ... &`,
        # nohup, a CI wrapper) starts with it ignored, and `kill -INT` would do nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop as Ctrl-C stops: checkpoint kept, resume line, status 130
            signal.signal(sig, _interrupt)
        try:
            return _classified(lambda: args.fn(args))
        finally:
            freeze_before_exit()
    return _classified(lambda: args.fn(args))


def _interrupt(signum: int, frame: object) -> NoReturn:
    """SIGTERM and SIGHUP to the ``msrl`` command: raised as the ``KeyboardInterrupt`` of a
    Ctrl-C (a run keeps its last checkpoint and says how to resume it; exit status 130)."""
    raise KeyboardInterrupt


#: errors of a path msrl may not write: read-only filesystem, permission denied, operation not permitted
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _classified(fn: Callable[[], int]) -> int:
    """``fn()``'s exit status, with msrl's errors turned into their one line and status: input
    errors 2 (a path msrl may not write too), a stopped run 1, a lost cluster 3, Ctrl-C 130; anything
    else is raised."""
    try:
        return fn()
    except KeyboardInterrupt as e:  # Ctrl-C: not a crash (msrl.run.outcome.TrainingInterrupted says where to resume)
        print(f"\nmsrl: {str(e) or 'interrupted'}", file=sys.stderr)  # a bare Ctrl-C (start-up) has no text
        return 130
    except FileNotFoundError as e:
        print(f"msrl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a place msrl must write to refuses it (a read-only filesystem, permissions)
        if e.errno not in _UNWRITABLE:
            raise
        where = f" {e.filename}" if e.filename else ""
        print(f"msrl: error: cannot write{where}: {e.strerror} (a run writes into its run directory: copy it where "
              "msrl may write, or give runs_dir=...; msrl plot and msrl graph take --out)", file=sys.stderr)
        return 2
    except MsrlError as e:  # each says how the command line ends on it (msrl.errors)
        if e.exit_status is None:
            raise
        if e.exit_status == 1:  # a stopped run: what stopped it, where, the checkpoint
            print("msrl: " + "; ".join(part.strip() for part in str(e).splitlines() if part.strip()), file=sys.stderr)
        else:  # bad input (2), a lost cluster (3)
            print(f"msrl: error: {' '.join(str(e).split(chr(10)))}", file=sys.stderr)
        return e.exit_status


if __name__ == "__main__":
    sys.exit(main())
