"""Memory footprint of a run on Ray: PSS (proportional set size: shared pages split between the
processes that map them, so the rows add up to what the run costs the machine) of every replica
process, and of the whole run (the driver, Ray's daemons it started, every replica).

Rows (the main job's PPO config, after ``--iterations`` iterations, each row its own driver
process so that nothing of one row's Ray outlives into the next):

* ``single`` under ``runtime: local``: one process, the floor;
* ``coarse x2`` on Ray: two actor replicas and a learner;
* ``multi_learner x2`` on Ray;
* the floors of a replica process: a Ray actor that imports torch and steps nothing (what any
  torch replica costs), and one that builds an Adam optimizer and steps it once (what a learner
  costs: ``torch.optim`` imports TorchDynamo, ~80 MB, in every process that makes an optimizer).

Also per replica: the modules it imported that a replica does not need (plotting, TensorBoard,
pydantic, the tracer), read from its ``sys.modules``.

    python bench/bench_footprint.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from procs import descendants  # noqa: E402 - the tests' process-tree reader

ROWS = {
    "single (local)": ["distribution_policy.name=single", "runtime=local"],
    "coarse x2": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"],
    "multi_learner x2": ["distribution_policy.name=multi_learner", "distribution_policy.replicas.main=2"],
}

HEAVY = ("matplotlib", "torch.utils.tensorboard", "tensorboard", "pydantic", "msrl.frontend.tracer", "msrl.config", "tqdm",
         "torch._dynamo", "sympy", "grpc")


def pss_kb(pid: int) -> int:
    """PSS of process ``pid`` in KiB (``/proc/<pid>/smaps_rollup``; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _child(overrides: list[str], iterations: int) -> None:
    """One row, in its own process: builds the job as ``msrl train`` does, runs it, measures."""
    import torch

    from msrl.config import build_job_spec, load_config
    from msrl.run.driver import make_job

    torch.set_num_threads(1)
    cfg = load_config("configs/ppo_cartpole.yaml", overrides)
    job = make_job(build_job_spec(cfg), cfg)
    try:
        job.reset()
        job.run(iterations)
        pids = job.pids() if hasattr(job, "pids") else []
        modules: list[list[str]] = []
        if pids:
            import ray

            def loaded() -> list[str]:
                return sorted(m for m in HEAVY if m in sys.modules)

            modules = [ray.get(a.__ray_call__.remote(lambda self: loaded())) for a in job.actors]
        replicas = {p: pss_kb(p) for p in pids}
        tree = descendants(os.getpid()) | set(pids)
        total = pss_kb(os.getpid()) + sum(pss_kb(p) for p in tree)
        print("RESULT", json.dumps({"replicas_kb": list(replicas.values()), "total_kb": total,
                                    "processes": len(tree) + 1, "modules": modules}))
    finally:
        job.close()


def _floor() -> None:
    """Two idle Ray actors: one with torch imported, one that stepped an Adam optimizer."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Bare:
        def __init__(self, adam: bool) -> None:
            import torch

            torch.set_num_threads(1)
            if adam:
                m = torch.nn.Linear(4, 2)
                opt = torch.optim.Adam(m.parameters())
                m(torch.zeros(1, 4)).sum().backward()
                opt.step()

        def pid(self) -> int:
            return os.getpid()

    actors = [Bare.remote(False), Bare.remote(True)]
    pids = ray.get([a.pid.remote() for a in actors])
    print("RESULT", json.dumps({"replicas_kb": [pss_kb(p) for p in pids], "total_kb": 0, "processes": 0,
                                "modules": []}))
    ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        if args.child == ["floor"]:
            _floor()
        else:
            _child(args.child, args.iterations)
        return
    print(f"machine: {platform.machine()}, python {platform.python_version()}, {os.cpu_count()} CPUs")
    print("| row | processes | run PSS (MB) | vs single | replica PSS (MB) | heavy modules in a replica |")
    print("| --- | --- | --- | --- | --- | --- |")
    floor = None
    for name, over in ROWS.items():
        out = subprocess.run([sys.executable, __file__, "--iterations", str(args.iterations), "--child", *over],
                             capture_output=True, text=True, check=True)
        r = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])
        total = r["total_kb"] / 1024
        floor = floor or total
        reps = ", ".join(f"{kb / 1024:.0f}" for kb in r["replicas_kb"]) or "-"
        mods = ", ".join(sorted({m for ms in r["modules"] for m in ms})) or "-"
        print(f"| {name} | {r['processes']} | {total:.0f} | {total / floor:.2f}x | {reps} | {mods} |")
    out = subprocess.run([sys.executable, __file__, "--child", "floor"], capture_output=True, text=True, check=True)
    r = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])
    bare, adam = (kb / 1024 for kb in r["replicas_kb"])
    print(f"| floor: Ray actor, import torch | - | - | - | {bare:.0f} | - |")
    print(f"| floor: Ray actor, torch + one Adam step | - | - | - | {adam:.0f} | torch._dynamo (torch.optim) |")


if __name__ == "__main__":
    main()
