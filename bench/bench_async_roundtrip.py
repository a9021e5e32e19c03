"""The per-op cost of central inference's asynchronous path, in one thread (no waiting): an env
replica's ``put`` of its observations, the server's ``take_from``, its ``put_to`` of the actions
and the env replica's ``get`` -- one round trip of one ``(8, 4)`` float32 tensor and one ``(8,)``
int64 tensor through the local runtime's endpoints, transport and mailboxes. Best of 5 x 20,000.

    python bench/bench_async_roundtrip.py
"""

from __future__ import annotations

import pathlib
import time

import torch

from msrl.config import build_job_spec, load_config
from msrl.run.driver import make_job

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    cfg = load_config(ROOT / "configs/ppo_cartpole.yaml", [
        "distribution_policy.name=single_learner_fine", "distribution_policy.replicas.env=2", "runtime=local",
        "distribution_policy.inference.max_batch=2", "train.progress=false"])
    job = make_job(build_job_spec(cfg), cfg)
    try:
        rt = job.runtime
        env = rt._hub("train_step").endpoint("env", 0, rt.asynchronous[("env", 0)], None)
        server = rt.asynchronous[("learner", 0)]
        obs_b = next(b for b in job.fragment_graph.boundaries if b.channel == "fifo" and b.src == "env")
        act_b = next(b for b in job.fragment_graph.boundaries if b.channel == "fifo" and b.src == "learner")
        obs, act = torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)

        def once() -> None:
            env.put(obs_b.name, obs)
            server.take_from(obs_b.name, 0)
            server.put_to(act_b.name, 0, act)
            env.get(act_b.name)

        for _ in range(2000):
            once()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(20_000):
                once()
            best = min(best, (time.perf_counter() - t) / 20_000 * 1e6)
        print(f"{best:.2f} us per round trip (put, take_from, put_to, get)")
    finally:
        job.close()


if __name__ == "__main__":
    main()
