"""Where the first iterations of a captured GPU job spend their time: the warm-up (eager), the
probe (eager, under the host-sync recorder) and the capture, against what torch alone pays for
the same first-time work.

The README's GPU job (``configs/ppo_cartpole_gpu_only.yaml``) trains 300k env steps in ~1,170
iterations; on an H200 its steady iteration is ~1.4 ms, but its first three took 587, 391 and
214 ms (``bench/time_breakdown.py``): a third of the run. This runs the job for a few
iterations and reports, for each of the first chunks (one iteration each), its wall time and:

* the warm-up and probe iterations under ``torch.profiler`` (CPU and CUDA activities): the ops
  and CUDA runtime calls with the most self time (a kernel's first launch loads its module,
  ``cublasCreate`` on the first product, ``cudaMalloc`` and ``cudaHostAlloc`` on first use);
* the capture iteration under ``cProfile`` (torch's profiler cannot run during a capture): the
  functions with the most own time;

and, with ``--floor``, in a fresh process with torch alone (no msrl), the same network's first
forward, backward and fused-Adam step on the GPU, and a CUDA graph of a forward-backward-step
iteration captured and instantiated: what any torch program pays before its steady state.

    python bench/bench_first_iterations.py            # on a machine with a CUDA GPU
    python bench/bench_first_iterations.py --floor
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def job_first_iterations(chunks: int = 4) -> None:
    """Runs the GPU job for a few iterations, profiling the first ``chunks`` chunks."""
    import torch

    import msrl
    import msrl.run.loop as loop

    real_chunk = loop.TrainingLoop._chunk
    seen = [0]
    cuda = torch.cuda.is_available()  # (on a CPU: the same job, eager, for checking this script)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def chunk(self, n):
        k = seen[0]
        seen[0] += 1
        if k >= chunks:
            return real_chunk(self, n)
        sync()
        t0 = time.perf_counter()
        if k < 2:  # warm-up and probe: eager
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] * cuda)]) as prof:
                out = real_chunk(self, n)
                sync()
            wall = time.perf_counter() - t0
            print(f"\n=== chunk {k + 1} ({n} iteration(s)): {wall * 1e3:.1f} ms under torch.profiler")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        else:  # the capture (and the first replays): cProfile
            pr = cProfile.Profile()
            pr.enable()
            out = real_chunk(self, n)
            sync()
            pr.disable()
            wall = time.perf_counter() - t0
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(f"\n=== chunk {k + 1} ({n} iteration(s)): {wall * 1e3:.1f} ms under cProfile")
            print(s.getvalue())
        return out

    # the capture's stages, timed apart (each after the GPU is drained)
    from msrl.runtime.programs import replay

    stages: list[tuple[str, float]] = []
    real_graph = torch.cuda.CUDAGraph

    def timed(name, fn):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync()
                stages.append((name, time.perf_counter() - t0))
        return run

    real_init, real_capture = replay.CudaGraph.__init__, replay.CudaGraph.capture
    replay.CudaGraph.__init__ = timed("_CudaGraph(): torch.cuda.CUDAGraph() and the generators registered", real_init)
    replay.CudaGraph.capture = timed("_CudaGraph.capture: record, instantiate, the first replay", real_capture)
    if cuda:
        torch.cuda.CUDAGraph = timed("torch.cuda.CUDAGraph() alone", real_graph)
    loop.TrainingLoop._chunk = chunk
    try:
        with tempfile.TemporaryDirectory() as runs:
            msrl.train(ROOT / "configs/ppo_cartpole_gpu_only.yaml", runs_dir=runs, train__progress=False,
                       train__total_env_steps=256 * 40, train__eval_every=0, train__checkpoint_every=10**9,
                       **{"eval.episodes": 1})
    finally:
        loop.TrainingLoop._chunk = real_chunk
        replay.CudaGraph.__init__, replay.CudaGraph.capture = real_init, real_capture
        torch.cuda.CUDAGraph = real_graph
    print("\n=== the capture's stages (ms)")
    for name, dt in stages:
        print(f"{name:70s} {dt * 1e3:8.1f}")


_FLOOR = r"""
import time, torch
t = [time.perf_counter()]
def mark(what):
    torch.cuda.synchronize(); now = time.perf_counter(); print(f"{what:58s} {1e3 * (now - t[0]):8.1f} ms"); t[0] = now
x = torch.zeros(16, 4, device="cuda"); mark("CUDA context, first tensor")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # torch.cuda.graphs' recipe: every eager iteration before a capture on a side stream
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 3)).cuda(); mark("the network (4-64-64-3) on the GPU")
    y = net(x); mark("first forward (cuBLAS set-up)")
    y.square().mean().backward(); mark("first backward")
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(2.5e-3, device="cuda"), fused=True, capturable=True)
    mark("torch.optim.Adam(fused=True) (imports torch._dynamo)")
    opt.step(); mark("first fused Adam step (its state made)")
    for _ in range(3):
        opt.zero_grad(set_to_none=False); net(x).square().mean().backward(); opt.step()
    mark("three more eager iterations")
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph(); mark("torch.cuda.CUDAGraph()")
with torch.cuda.graph(g, capture_error_mode="thread_local"):
    for _ in range(16):  # about the size of the job's iteration (16 steps' forwards, an update)
        net(x)
    opt.zero_grad(set_to_none=False); net(x).square().mean().backward(); opt.step()
mark("capture and instantiate (16 forwards + an update)")
g.replay(); mark("first replay")
t0 = time.perf_counter()
for _ in range(100):
    g.replay()
torch.cuda.synchronize(); print(f"{'steady replay':58s} {1e3 * (time.perf_counter() - t0) / 100:8.3f} ms")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--floor", action="store_true", help="also torch alone's first-time costs, in a fresh process")
    p.add_argument("--chunks", type=int, default=4)
    args = p.parse_args()
    if args.floor:
        print("=== torch alone, a fresh process")
        subprocess.run([sys.executable, "-c", _FLOOR], check=False)
    job_first_iterations(args.chunks)


if __name__ == "__main__":
    main()
