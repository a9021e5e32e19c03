"""How long building a job takes before its first iteration (trace, probe, partition, codegen,
replicas): ``msrl.run.job.Job(spec)`` timed, with the probe's runs timed apart.

    python bench/bench_job_build.py                       # the DQN and Ape-X configs, local runtime
    python bench/bench_job_build.py configs/ppo_cartpole.yaml --overrides runtime=local

Prints one JSON line per config: ``job_s`` (the whole ``Job()``) and ``probe_s`` (each probe
run, with its ``probe_num_envs``).
"""

from __future__ import annotations

import argparse
import json
import time

DEFAULT = [
    ("configs/dqn_cartpole.yaml", ["distribution_policy.name=single_learner_coarse", "runtime=local", "env.num_envs=2"]),
    ("configs/apex_dqn_cartpole.yaml", ["runtime=local"]),
]


def build(config: str, overrides: list[str]) -> dict:
    """Times ``Job(build_job_spec(load_config(config, overrides)))`` and its probe runs."""
    import msrl.frontend.probe as probe
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job

    runs: list[tuple[float, int]] = []
    original = probe._run

    def timed(graphs, spec, num_envs, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(graphs, spec, num_envs, *args, **kwargs)
        runs.append((time.perf_counter() - t0, num_envs))
        return out

    probe._run = timed
    try:
        spec = build_job_spec(load_config(config, overrides))
        t0 = time.perf_counter()
        job = Job(spec)
        elapsed = time.perf_counter() - t0
        job.close()
    finally:
        probe._run = original
    return {"config": config, "overrides": overrides, "job_s": round(elapsed, 2),
            "probe_s": [round(s, 2) for s, _ in runs], "probe_num_envs": [n for _, n in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*")
    p.add_argument("--overrides", nargs="*", default=[])
    args = p.parse_args()
    cases = [(c, args.overrides) for c in args.configs] or DEFAULT
    for config, overrides in cases:
        print(json.dumps(build(config, overrides)), flush=True)


if __name__ == "__main__":
    main()
