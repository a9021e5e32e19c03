"""The boundary codec on the main job's values: a trajectory of one overlapped x2 actor (8 envs x
16 steps, a TensorDict of 8 tensors, 7.5 KB) and the PPO weights an actor reads (12 tensors,
37.7 KB), encoded and decoded as an asynchronous boundary moves them, microseconds of CPU per
call (one thread, warm caches: a floor; in a replica sharing a core each costs ~2-3x this).

    python bench/bench_codec.py
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def _values():
    from msrl.config import build_job_spec, load_config
    from msrl.job import Job

    job = Job(build_job_spec(load_config("configs/ppo_cartpole.yaml",
                                         ["distribution_policy.name=single", "env.num_envs=8"])), probe=False)
    t = job.trainers[("main", 0)]
    obs = t.env.reset(seed=1)
    for _ in range(t.hparams.num_steps):
        action, log_prob, value = t.actor.act(obs)
        next_obs, reward, terminated, truncated, info = t.env.step(action)
        t.buffer.insert(obs=obs, action=action, log_prob=log_prob, value=value, reward=reward,
                        terminated=terminated, truncated=truncated, next_obs=info["final_obs"])
        obs = next_obs
    out = {"trajectory": t.buffer.gather().clone(), "weights": t.learner.get_weights()}
    job.close()
    return out


def _us(f, n: int) -> float:
    for _ in range(100):
        f()
    c = time.thread_time()
    for _ in range(n):
        f()
    return 1e6 * (time.thread_time() - c) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    torch.set_num_threads(1)
    from msrl.runtime.codec import decode, encode

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| value | bytes | encode (us) | decode, viewed in the received buffer (us) | decode, copied (us) |")
    print("| --- | --- | --- | --- | --- |")
    for name, value in _values().items():
        message = encode(value)
        received = message.numpy().tobytes()
        print(f"| {name} | {message.numel()} | {_us(lambda: encode(value), args.calls):.1f} "
              f"| {_us(lambda: decode(bytearray(received), copy=False), args.calls):.1f} "
              f"| {_us(lambda: decode(message), args.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
