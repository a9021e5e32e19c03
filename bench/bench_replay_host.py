"""The host's work per replayed iteration: what msrl does around a CUDA-graph replay, with the
replay itself removed, measured on any machine.

On a GPU a captured iteration is one graph launch; everything else the host does per iteration
(the runtime's call into the program, reading the iteration's results back, the loop's metrics
row) runs while the GPU works, and once it takes longer than the GPU's kernels the GPU waits
for the host. This runs the README's GPU job captured on the CPU (``devices.main=cpu``,
``capture.main=graph``: a host tape, on any machine) with the tape's and the read pack's replays made no-ops, so what is timed is msrl's
host work only, per iteration, in microseconds:

* ``job.run``: the runtime's iterations (the program call, starting and finishing each read);
* ``loop``: the training loop's work besides (metrics rows, CSV);
* ``total``: both (the host's time per replayed iteration).

    python bench/bench_replay_host.py --iterations 2000 --repeats 3

Compare with the GPU's time per iteration (``bench/bench_capture.py``'s captured ms/iteration
and GPU busy): the host must stay below it for the GPU never to wait.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import tempfile
import time

import msrl
import msrl.run.loop as loop
from msrl.runtime.programs import capture, replay

ROOT = pathlib.Path(__file__).resolve().parents[1]


def measure(iterations: int) -> dict:
    """One captured run of ``iterations`` iterations with the replays made no-ops: microseconds
    per iteration of ``job.run`` and of the whole chunk, over the chunks after the capture."""
    chunks: list[tuple[int, float, float]] = []  # (iterations, job.run s, chunk s)
    real_chunk = loop.TrainingLoop._chunk

    def chunk(self, n):
        run = self.job.run
        spent = [0.0]

        def timed(k):
            t0 = time.perf_counter()
            try:
                return run(k)
            finally:
                spent[0] += time.perf_counter() - t0

        self.job.run = timed
        start, t0 = self.job.iteration, time.perf_counter()
        try:
            return real_chunk(self, n)
        finally:
            self.job.run = run
            if start > capture.WARMUP + 2:  # replays only
                chunks.append((n, spent[0], time.perf_counter() - t0))

    real_replay = replay.Tape.replay
    loop.TrainingLoop._chunk, replay.Tape.replay = chunk, lambda self: None
    try:
        with tempfile.TemporaryDirectory() as runs:
            msrl.train(ROOT / "configs/ppo_cartpole_gpu_only.yaml", runs_dir=runs, train__progress=False,
                       train__total_env_steps=256 * iterations, train__eval_every=0, train__checkpoint_every=10**9,
                       **{"distribution_policy.capture.main": "graph", "distribution_policy.devices.main": "cpu",
                          "eval.episodes": 1})
    finally:
        loop.TrainingLoop._chunk, replay.Tape.replay = real_chunk, real_replay
    n = sum(c[0] for c in chunks)
    run_us, total_us = 1e6 * sum(c[1] for c in chunks) / n, 1e6 * sum(c[2] for c in chunks) / n
    return {"iterations": n, "job_run_us": run_us, "loop_us": total_us - run_us, "total_us": total_us}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = [measure(args.iterations) for _ in range(args.repeats)]
    print(f"# {platform.processor() or platform.machine()}, {args.repeats} runs of {args.iterations} iterations "
          f"(median; us per replayed iteration, the replay itself excluded)")
    for key in ("job_run_us", "loop_us", "total_us"):
        print(f"{key[:-3]:8s} {statistics.median(r[key] for r in rows):8.1f} us")


if __name__ == "__main__":
    main()
