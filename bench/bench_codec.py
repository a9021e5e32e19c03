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
    from bench_overlap_floor import _rollout, _trainer

    job, t = _trainer(8)
    batch, _ = _rollout(t, t.env.reset(seed=1))
    out = {"trajectory": batch.clone(), "weights": t.learner.get_weights()}
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
    from msrl.runtime.transports.codec import decode, encode

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| value | bytes | encode (us) | decode, viewed in the received buffer (us) | decode, copied (us) |")
    print("| --- | --- | --- | --- | --- |")
    for name, value in _values().items():
        message = encode(value)
        received = message.numpy().tobytes()
        enc = _us(lambda v=value: encode(v), args.calls)
        viewed = _us(lambda r=received: decode(bytearray(r), copy=False), args.calls)
        copied = _us(lambda m=message: decode(m), args.calls)
        print(f"| {name} | {message.numel()} | {enc:.1f} | {viewed:.1f} | {copied:.1f} |", flush=True)


if __name__ == "__main__":
    main()
