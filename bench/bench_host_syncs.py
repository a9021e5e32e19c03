"""What one iteration of each ``gpu_only`` job dispatches, counted on any machine: aten ops per
iteration and per batched env step (about the kernels a GPU launches: the figure CUDA-graph
capture exists to collapse; views and allocations counted apart), the ops that would synchronise a GPU's host, and the iteration's
host reads (:class:`msrl.runtime.programs.host_syncs.HostSyncRecorder`; one ``train_step`` after a warm-up).

    python bench/bench_host_syncs.py                    # the shipped GPU configs' sizes
    python bench/bench_host_syncs.py --envs 4096        # another batch (ops do not grow with it)
    python bench/bench_host_syncs.py --json syncs.json

The ops of the ``single_learner_coarse`` learner fragment (the same update on the batch the
actors send) are counted the same way, in its replica's thread.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import torch

from msrl.config import build_job_spec, load_config
from msrl.run.job import Job
from msrl.runtime.programs.host_syncs import CPU_ONLY_READS, HostSyncRecorder, recording_program

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_READ = ("msrl/runtime/replica.py", "start_read_iteration")
JOBS = {
    "gpu_only CartPole (PPO)": ("configs/ppo_cartpole_gpu_only.yaml", ["env.id=msrl/CartPole-v1"], None),
    "gpu_only Pendulum (PPO)": ("configs/ppo_cartpole_gpu_only.yaml", ["env.id=msrl/Pendulum-v1"], None),
    "gpu_only Tag (MA-PPO)": ("configs/ma_ppo_tag.yaml", [], None),
    "coarse learner fragment (PPO CartPole)": ("configs/ppo_cartpole.yaml",
                                               ["distribution_policy.name=single_learner_coarse"], "learner"),
}


def measure(config: str, over: list[str], fragment: str | None) -> dict:
    """One warm-up ``train_step`` then one recorded: ops, syncs, reads, ops per batched step."""
    cfg = load_config(ROOT / config, over)
    job = Job(build_job_spec(cfg))
    try:
        job.reset()
        job.runtime.run("train_step")
        rec = HostSyncRecorder(allow=(*CPU_ONLY_READS, ONE_READ))
        if fragment is None:
            with rec:
                job.runtime.run("train_step")
        else:
            rep = job.replica(fragment, 0)
            program = rep.programs["train_step"]
            rep.programs["train_step"] = recording_program(program, rec)
            job.runtime.run("train_step")
            rep.programs["train_step"] = program
        steps = cfg.algorithm.hparams["num_steps"]
        return {"num_envs": cfg.env.num_envs, "num_steps": steps, "ops": rec.ops_total,
                "ops_per_step": round(rec.ops_total / steps, 1), "kernels": rec.compute_ops,
                "kernels_per_step": round(rec.compute_ops / steps, 1), "syncs": [str(s) for s in rec.syncs],
                "reads": len(rec.reads(ONE_READ)), "host_ops": sum(rec.host_ops.values()),
                "top": rec.ops.most_common(6)}
    finally:
        job.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, default=None, help="env.num_envs of every job (default: the config's)")
    p.add_argument("--json", type=pathlib.Path, default=None)
    args = p.parse_args()
    rows = {}
    for name, (config, over, fragment) in JOBS.items():
        rows[name] = measure(config, [*over, *([f"env.num_envs={args.envs}"] if args.envs else [])], fragment)
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| job | envs x steps | aten ops per iteration (per batched env step) | of them launching a kernel "
          "(per batched env step) | host syncs (besides the read) | host reads |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['num_envs']} x {r['num_steps']} | {r['ops']} ({r['ops_per_step']}) | "
              f"{r['kernels']} ({r['kernels_per_step']}) | {len(r['syncs'])} | {r['reads']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
