"""What denormal floats cost a CPU forward, and what ``train.flush_denormal`` gives back.

Weight decay takes the weights of units that no longer get a gradient toward 0, and after tens
of thousands of updates some land below float32's smallest normal value (1.2e-38): x86 CPUs
compute on such denormals through a slow path. An AlphaZero Connect Four run with a 64-filter,
3-block tower had 2,428 of its 226,967 weights there at 61k self-play positions, and its
self-play had fallen from 50 to 14 positions/s. This times the network's forward on a batch of
64 positions with its weights as they are, then with a fraction of each convolution's weights
set to denormals (or a run's own weights, ``--weights``), under IEEE arithmetic and inside
:func:`msrl.runtime.host.flushed_denormals` (what every fragment runs in by default).

    python bench/bench_denormals.py
    python bench/bench_denormals.py --weights runs/X/checkpoints/weights/61440.pt --channels 64 --blocks 3
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from msrl.algorithms.alphazero import AlphaZeroConfig, policy_value_net
from msrl.envs.openspiel_env import observe
from msrl.runtime.host import flushed_denormals


def positions(n: int, seed: int) -> torch.Tensor:
    """``n`` Connect Four positions of random play, as the network reads them ``(n, 133)``."""
    import pyspiel

    game, rng, out = pyspiel.load_game("connect_four"), np.random.default_rng(seed), []
    while len(out) < n:
        state = game.new_initial_state()
        for _ in range(rng.integers(0, 30)):
            if state.is_terminal():
                break
            state.apply_action(int(rng.choice(state.legal_actions())))
        if not state.is_terminal():
            out.append(observe(state, 7))
    return torch.from_numpy(np.stack(out))


def forward_ms(net: torch.nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Milliseconds of one forward under IEEE arithmetic and flushed: the medians of 7 rounds of
    ``repeats`` each, the two modes alternating round by round (a busy machine slows both alike)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        for _ in range(7):
            for flush in (False, True):
                with flushed_denormals(flush):
                    net(x)
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        net(x)
                    times[flush].append((time.perf_counter() - t0) / repeats * 1e3)
    return float(np.median(times[False])), float(np.median(times[True]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--fraction", type=float, nargs="+", default=[0.0, 0.001, 0.01, 0.03],
                   help="fractions of each convolution's weights set to denormals (1e-40)")
    p.add_argument("--weights", default=None, help="a policy weights file a run kept (instead of --fraction)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}; "
          f"{args.channels} filters x {args.blocks} residual blocks, batch 64, one thread")
    hp = AlphaZeroConfig(network="resnet", channels=args.channels, residual_blocks=args.blocks)
    x = positions(64, seed=0)
    print("| weights | denormal weights | IEEE (ms) | flushed (ms) | IEEE / flushed |")
    print("| --- | --- | --- | --- | --- |")
    cases: list[tuple[str, float | None]] = [(args.weights, None)] if args.weights else \
        [(f"fresh, {f:.1%} of conv weights denormal", f) for f in args.fraction]
    for name, fraction in cases:
        torch.manual_seed(0)
        net = policy_value_net(hp, "openspiel/connect_four")
        if fraction is None:
            kept = torch.load(name, weights_only=False)  # train.keep_weights: {actor_weights, env_steps}
            net.load_state_dict(kept.get("actor_weights", kept))
        else:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for m in net.modules():
                    if isinstance(m, torch.nn.Conv2d):
                        m.weight[torch.rand(m.weight.shape, generator=g) < fraction] = 1e-40
        count = sum(int(((w != 0) & (w.abs() < torch.finfo(w.dtype).tiny)).sum()) for w in net.state_dict().values())
        ieee, flushed = forward_ms(net, x, args.repeats)
        print(f"| {name} | {count} | {ieee:.2f} | {flushed:.2f} | {ieee / flushed:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
