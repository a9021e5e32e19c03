"""The ``msrl`` command line.

::

    msrl train CONFIG [key.sub=value ...] [--resume RUN_DIR]
    msrl launch CONFIG [key.sub=value ...] --address http://HEAD:8265 [--working-dir DIR] [--no-wait]
    msrl eval RUN_DIR [--episodes N] [--seed S]
    msrl plot RUN_DIR [--out PNG]
    msrl graph CONFIG [key.sub=value ...] [--out PNG]

Errors in the input -- a config error, code the tracer cannot read (:class:`TraceError`), a
graph the policy cannot partition (:class:`PartitionError`, a declaration the probe
contradicts) -- print one line ``msrl: error: ...`` on stderr and exit with status 2, having
written nothing; a run stopped by an error (e.g. a NaN) exits with status 1 and keeps its last
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from msrl.config import load_config
    from msrl.run import train

    cfg = load_config(args.config, args.overrides)
    result = train(cfg, resume=args.resume)
    evaluation = (f"evaluation: mean return {result.eval_mean:.1f} over {len(result.eval_returns)} episodes"
                  if result.eval_returns else "no evaluation (no gymnasium twin)")
    print(
        f"run {result.run_dir}: {result.iterations} iterations, {result.env_steps} env steps, "
        f"{result.time_s:.1f} s training ({result.env_steps / max(result.time_s, 1e-9):.0f} steps/s); {evaluation}"
    )
    return 0


def _launch(args: argparse.Namespace) -> int:
    from msrl.launch import launch

    return launch(args.config, args.overrides, args.address, args.working_dir, wait=not args.no_wait)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from msrl.api import BuildContext
    from msrl.config import build_job_spec
    from msrl.envs import env_spec
    from msrl.evaluate import evaluate
    from msrl.run import evaluation_env, latest_checkpoint, load_run_config

    cfg = load_run_config(args.run_dir)
    spec = build_job_spec(cfg)
    try:
        ckpt = torch.load(latest_checkpoint(args.run_dir), weights_only=False)
    except FileNotFoundError as e:
        from msrl.config import ConfigError

        raise ConfigError(str(e)) from None
    ctx = BuildContext(spec.hparams, env_spec(spec.env_id, args.episodes, spec.env_kwargs), 0, 1,
                       spec.num_envs, spec.total_env_steps, spec.seed, torch.device("cpu"))
    actor = spec.algorithm.components["actor"](ctx)
    actor.set_weights(ckpt["actor_weights"])
    env_id, kwargs = evaluation_env(cfg)
    if env_id is None:
        from msrl.config import ConfigError

        raise ConfigError(f"{spec.env_id} has no gymnasium twin to evaluate on; its run's metrics.csv holds the training returns")
    returns = evaluate(actor, env_id, args.episodes, args.seed if args.seed is not None else cfg.eval.seed, kwargs)
    mean = sum(returns) / len(returns)
    print(json.dumps({"run_dir": str(args.run_dir), "episodes": len(returns), "mean_return": mean,
                      "min_return": min(returns), "max_return": max(returns)}))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from msrl.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _graph(args: argparse.Namespace) -> int:
    from msrl.config import build_job_spec, load_config
    from msrl.job import Job
    from msrl.printer import draw_fragments, format_job

    cfg = load_config(args.config, args.overrides)
    job = Job(build_job_spec(cfg))
    try:
        sys.stdout.write(format_job(job))
        out = draw_fragments(job, args.out or f"{cfg.name}_fdg.png")
        print(f"\npicture of the fragmented graph: {out}")
    finally:
        job.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``msrl``."""
    p = argparse.ArgumentParser(prog="msrl", description="distributed RL on a fragmented dataflow graph")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a job from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
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
    e.add_argument("--episodes", type=int, default=20)
    e.add_argument("--seed", type=int, default=None)
    e.set_defaults(fn=_eval)
    pl = sub.add_parser("plot", help="plot a run's learning curve as PNG")
    pl.add_argument("run_dir", type=pathlib.Path)
    pl.add_argument("--out", default=None)
    pl.set_defaults(fn=_plot)
    g = sub.add_parser("graph", help="print the FDG, fragments and generated programs; draw the fragmented graph")
    g.add_argument("config")
    g.add_argument("overrides", nargs="*")
    g.add_argument("--out", default=None, help="PNG path (default <name>_fdg.png)")
    g.set_defaults(fn=_graph)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``msrl``; returns the exit status."""
    from msrl.config import ConfigError
    from msrl.partition import PartitionError
    from msrl.run import TrainingStopped
    from msrl.tracer import TraceError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, TraceError, PartitionError) as e:
        one_line = " ".join(str(e).split("\n"))
        print(f"msrl: error: {one_line}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"msrl: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"msrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
