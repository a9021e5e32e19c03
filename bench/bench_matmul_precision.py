"""What ``train.float32_matmul_precision: medium`` gives on the CPU: float32 matrix products
computed in bfloat16 by oneDNN where the CPU has bfloat16 units (such as AMX).

``torch.set_float32_matmul_precision("medium")`` sets oneDNN's float32 matmul precision to
``bf16`` as well as CUDA's (torch 2.9 and later): Linear layers and matmuls, not convolutions,
then run on the CPU's bfloat16 units. This times, the two precisions alternating round by round
in one process (a busy machine slows both alike): a 1280 x 256 Linear over 4,096 rows (the
shape of DreamerV3 ``XS``'s heads over imagined states), and one DreamerV3 update (world model,
critic, actor) on a replayed batch of 16 x 64 CartPole steps, at the model size given.

    python bench/bench_matmul_precision.py
    python bench/bench_matmul_precision.py --model-size mini --updates 10
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Callable

import numpy as np
import torch
from tensordict import TensorDict

from msrl.algorithms import dreamerv3
from msrl.api import BuildContext
from msrl.envs import env_spec

PRECISIONS = ("highest", "medium")


def timed(fns: dict[str, Callable[[], object]], repeats: int, rounds: int) -> dict[str, float]:
    """Milliseconds of one call of each of ``fns`` (keyed by precision): the medians of
    ``rounds`` rounds of ``repeats`` calls, the precisions alternating round by round."""
    times: dict[str, list[float]] = {p: [] for p in fns}
    for _ in range(rounds):
        for p, fn in fns.items():
            torch.set_float32_matmul_precision(p)
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times[p].append((time.perf_counter() - t0) / repeats * 1e3)
    return {p: float(np.median(t)) for p, t in times.items()}


def dreamer_update(model_size: str, seed: int) -> Callable[[], object]:
    """One DreamerV3 update (``learn``) on a fixed random batch ``(16, 64)`` of CartPole steps."""
    hp = dreamerv3.DreamerV3Config(model_size=model_size)
    ctx = BuildContext(hp, env_spec("CartPole-v1", 1), 0, 1, 1, 1000, seed, torch.device("cpu"))
    learner = dreamerv3.DreamerV3Learner(ctx)
    g = torch.Generator().manual_seed(seed)
    B, T = hp.batch_size, hp.batch_length
    batch = TensorDict({"obs": torch.randn(B, T, 4, generator=g), "action": torch.randint(0, 2, (B, T), generator=g),
                        "reward": torch.ones(B, T), "is_first": torch.zeros(B, T, dtype=torch.bool),
                        "is_terminal": torch.zeros(B, T, dtype=torch.bool)}, batch_size=[B, T])
    return lambda: learner.learn(batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", default="XS", choices=list(dreamerv3.SIZES))
    p.add_argument("--updates", type=int, default=3, help="DreamerV3 updates a round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    before = torch.get_float32_matmul_precision()
    onednn = getattr(torch.backends.mkldnn.matmul, "fp32_precision", "(no per-backend API)")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, one thread; oneDNN bf16: "
          f"{torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
          f"oneDNN matmul precision now: {onednn}")
    try:
        x = torch.randn(4096, 1280, generator=torch.Generator().manual_seed(args.seed))
        linear = torch.nn.Linear(1280, 256)
        with torch.no_grad():
            ms = timed({q: (lambda: linear(x)) for q in PRECISIONS}, 20, args.rounds)
            torch.set_float32_matmul_precision("highest")
            exact = linear(x)
            torch.set_float32_matmul_precision("medium")
            err = float((linear(x) - exact).abs().max() / exact.abs().max())
        print(f"Linear 1280x256 over 4096 rows: highest {ms['highest']:.2f} ms, medium {ms['medium']:.2f} ms "
              f"({ms['highest'] / ms['medium']:.2f}x); largest difference {err:.1e} of the largest output")
        update = dreamer_update(args.model_size, args.seed)
        ms = timed({q: update for q in PRECISIONS}, args.updates, args.rounds)
        print(f"DreamerV3 {args.model_size} update (16 x 64 replayed steps, horizon 15): highest {ms['highest']:.0f} ms, "
              f"medium {ms['medium']:.0f} ms ({ms['highest'] / ms['medium']:.2f}x)")
    finally:
        torch.set_float32_matmul_precision(before)


if __name__ == "__main__":
    main()
