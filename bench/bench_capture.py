"""A ``gpu_only`` iteration eager, captured (``distribution_policy.capture.main``) and compiled
(``distribution_policy.compile.main: inductor``, alone and inside the capture), one run.

For each job and batch size: milliseconds per ``train_step`` (the iteration's program and the
read of its results, the loop's work less evaluation and checkpoints) and env steps per second,
eager and captured, after the capture's warm-up; on a CUDA device also, from ``torch.profiler``
over one iteration, the kernels launched (CUDA runtime launches and graph launches) and the GPU
busy time (the sum of device kernel and copy durations, in ms and as a share of the unprofiled
iteration's time: the profiler slows the host, so its own wall clock would understate the share),
and the kernels the GPU ran (device kernel events, those inside a replayed CUDA graph included).

Modes: ``eager`` (op by op), ``graph`` (captured), ``compiled`` (compiled targets inside the
capture), ``compiled_eager`` (compiled targets, not captured).

    python bench/bench_capture.py                         # CartPole at 16 and 4096 envs
    python bench/bench_capture.py --jobs all --json capture.json
    python bench/bench_capture.py --jobs tag110_tf32 --envs 100 --modes graph   # TF32 products
    python bench/bench_capture.py --envs 16 --modes eager,graph,compiled,compiled_eager

On the CPU the capture is the host tape, a check rather than a speed-up (its replay re-dispatches
every op from Python): the figures there say what the check costs, not what a GPU gains.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import torch

from msrl.config import build_job_spec, load_config
from msrl.run.job import Job
from msrl.runtime.programs import capture
from msrl.runtime.programs.compiled import compiled_program_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAG_RULES = dict(grid_length=20.0, episode_length=500, max_acceleration=0.1, min_acceleration=-0.1, max_turn=2.356,
                 min_turn=-2.356, num_acceleration_levels=20, num_turn_levels=20, use_full_observation=False,
                 num_other_agents_observed=10, tagging_distance=0.02, tag_reward_for_tagger=10.0,
                 tag_penalty_for_runner=-10.0)  # bench/bench_tag.py's YAML
JOBS = {
    "cartpole": ("configs/ppo_cartpole_gpu_only.yaml", ["env.id=msrl/CartPole-v1"]),
    "pendulum": ("configs/ppo_cartpole_gpu_only.yaml", ["env.id=msrl/Pendulum-v1"]),
    "tag": ("configs/ma_ppo_tag.yaml", []),
    # the shape of issue 33's end-to-end Tag figure against WarpDrive (43.3k env steps/s on an
    # H200, eager): 110 agents a game (10 taggers, 100 runners), [256, 256] networks, one update
    # (one gradient step) per 25,000 env steps (with --envs 100: 100 games x 250 steps)
    # WarpDrive's tag_continuous.yaml rules (bench/bench_tag.py's): each agent observes its 10
    # nearest, 20 x 20 action levels, 500-step games
    "tag110": ("configs/ma_ppo_tag.yaml", ["env.kwargs.num_taggers=10", "env.kwargs.num_runners=100",
                                           "algorithm.hparams.num_steps=250", "algorithm.hparams.hidden_sizes=[256,256]",
                                           # one gradient step per batch, as WarpDrive's A2C trainer takes
                                           "algorithm.hparams.update_epochs=1", "algorithm.hparams.num_minibatches=1",
                                           "env.kwargs.observe_self=false",
                                           *[f"env.kwargs.{k}={str(v).lower() if isinstance(v, bool) else v}"
                                             for k, v in TAG_RULES.items()]]),
}
# the same with float32 matrix products on TensorFloat32 tensor cores (the user's opt-in
# train.float32_matmul_precision=high; WarpDrive's trainer runs them in float32)
JOBS["tag110_tf32"] = (JOBS["tag110"][0], [*JOBS["tag110"][1], "train.float32_matmul_precision=high"])


#: mode -> (capture, compile) of the fragment
MODES = {"eager": ("eager", "off"), "graph": ("graph", "off"), "compiled": ("graph", "inductor"),
         "compiled_eager": ("eager", "inductor")}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_iteration(job: Job) -> dict:
    """Kernels launched and GPU busy time of one ``train_step`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        job.runtime.run("train_step")
        _sync()
        wall = time.perf_counter() - t0
    launches = graph_launches = kernels = 0
    busy_us = 0.0
    for e in prof.events():
        name = e.name
        if name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
        elif name == "cudaGraphLaunch":
            graph_launches += 1
        if e.device_type.name == "CUDA":
            busy_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
            kernels += "Memcpy" not in name and "Memset" not in name
    copies = sum(1 for e in prof.events() if "Memcpy" in e.name and ("DtoH" in e.name or "HtoD" in e.name))
    avg = prof.key_averages()
    table = (avg.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
             + avg.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))
    return {"wall_ms": round(wall * 1e3, 3), "kernel_launches": launches, "graph_launches": graph_launches,
            "device_kernels": kernels,
            "gpu_busy_ms": round(busy_us / 1e3, 3), "gpu_busy_pct": round(100 * busy_us / 1e6 / wall, 1),
            "host_device_copies": copies, "profile": table}


def measure(config: str, over: list[str], mode: str, iterations: int) -> dict:
    """``iterations`` timed ``train_step``s of ``config`` with ``over`` in ``mode`` (a key of
    :data:`MODES`), after the warm-up, probe and capture iterations.

    Returns:
        ``mode``, ``status`` (the program's capture status), ``num_envs``, ``ms_per_iteration``
        (ms), ``env_steps_per_s``; on CUDA also :func:`profile_iteration`'s figures.
    """
    cap, comp = MODES[mode]
    cfg = load_config(ROOT / config, [*over, f"distribution_policy.capture.main={cap}",
                                      f"distribution_policy.compile.main={comp}"])
    job = Job(build_job_spec(cfg))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(cfg.train.float32_matmul_precision)  # as msrl train sets it
    try:
        job.reset()
        for _ in range(capture.WARMUP + 2):  # warm-up, probe, capture (eager: the same iterations)
            job.runtime.run("train_step")
        rep = job.replica("main", 0)
        fn = rep.programs["train_step"].fn
        status = fn.status if isinstance(fn, capture.CapturedProgram) else "eager"
        cp = compiled_program_of(fn)
        if cp is not None:
            status += "; " + ", ".join(cp.status(rep.trainer))
        _sync()
        t0 = time.perf_counter()
        job.runtime.run("train_step", iterations)  # one call, as the training loop runs a chunk
        _sync()
        per = (time.perf_counter() - t0) / iterations
        steps = cfg.algorithm.hparams["num_steps"] * cfg.env.num_envs
        row = {"mode": mode, "status": status, "num_envs": cfg.env.num_envs, "ms_per_iteration": round(per * 1e3, 3),
               "env_steps_per_s": round(steps / per)}
        if torch.cuda.is_available():
            row.update(profile_iteration(job))
            # the profiler slows the host (the wall it measures is longer than an iteration's):
            # the GPU's kernel time against the unprofiled iteration is the busy fraction
            row["gpu_busy_pct_of_iteration"] = round(100 * row["gpu_busy_ms"] / (per * 1e3), 1)
        return row
    finally:
        torch.set_float32_matmul_precision(precision)
        job.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="cartpole", help=f"comma-separated of {', '.join(JOBS)}, or all")
    p.add_argument("--envs", default="16,4096", help="batch sizes (env.num_envs), comma-separated")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--modes", default="eager,graph",
                   help=f"modes to time, comma-separated ({', '.join(MODES)})")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--profiles", help="on CUDA, write each row's torch.profiler table (top 25 ops by host time) here")
    args = p.parse_args()
    names = list(JOBS) if args.jobs == "all" else args.jobs.split(",")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'host'})"
    print(f"# {device}, torch {torch.__version__}")
    print("| job | envs | mode | ms / iteration | env steps/s | launches | kernels run | GPU busy | status |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in names:
        config, over = JOBS[name]
        for n in [int(x) for x in args.envs.split(",")]:
            for mode in args.modes.split(","):
                row = measure(config, [*over, f"env.num_envs={n}"], mode, args.iterations)
                row["job"] = name
                rows.append(row)
                profile = row.pop("profile", None)
                if args.profiles and profile is not None:
                    with open(args.profiles, "a") as f:
                        f.write(f"## {name}, {n} envs, {mode} ({row['status']})\n{profile}\n")
                launches = f"{row['kernel_launches']} + {row['graph_launches']} graph" if "kernel_launches" in row else "-"
                busy = f"{row['gpu_busy_ms']} ms: {row['gpu_busy_pct_of_iteration']}%" if "gpu_busy_ms" in row else "-"
                print(f"| {name} | {n} | {mode} | {row['ms_per_iteration']} | {row['env_steps_per_s']} | {launches} | "
                      f"{row.get('device_kernels', '-')} | {busy} | {row['status'][:200]} |", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
