"""Does ``torch.compile`` speed up the ``torch_graph`` backend's hot paths on this machine?

Measures, for the main job's PPO (CartPole-v1, 16 envs, T=32, MLPs 64x64), eager vs
``torch.compile``-d actor/critic MLPs:

* ``actor.act`` on a ``(16, 4)`` batch (one rollout step's inference), microseconds per call;
* ``learner.learn`` on one ``(32, 16)`` rollout (4 epochs x 2 minibatches), ms per call;
* the one-off compile time.

    python bench/bench_torch_compile.py
"""

from __future__ import annotations

import argparse
import time

import torch

from msrl.algorithms.ppo import ALGORITHM, PPOConfig
from msrl.policy import load_policy
from msrl.run.job import JobSpec, build_trainers


def timed(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="default", help="torch.compile mode")
    args = p.parse_args()
    torch.set_num_threads(1)
    hp = PPOConfig(num_steps=32, update_epochs=4, num_minibatches=2, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8)
    spec = JobSpec(ALGORITHM, hp, "CartPole-v1", 16, load_policy("single"), seed=1, total_env_steps=300_000)
    results = {}
    for variant in ("eager", "compiled"):
        trainer = build_trainers(spec)[("main", 0)]
        trainer.reset()
        trainer.train_step()  # fills the buffer with a real rollout
        batch = trainer.buffer.storage.clone()
        compile_s = 0.0
        if variant == "compiled":
            t = time.perf_counter()
            for net in (trainer.actor.net, trainer.learner.net):
                net.actor = torch.compile(net.actor, mode=args.mode, dynamic=False)
                net.critic = torch.compile(net.critic, mode=args.mode, dynamic=False)
            trainer.actor.act(trainer.obs)
            trainer.learner.learn(batch)
            compile_s = time.perf_counter() - t
        act_us = timed(lambda t=trainer: t.actor.act(t.obs), 2000) * 1e6
        learn_ms = timed(lambda t=trainer, b=batch: t.learner.learn(b), 50) * 1e3
        results[variant] = (act_us, learn_ms, compile_s)
    e, c = results["eager"], results["compiled"]
    print(f"torch {torch.__version__}, 1 thread, compile mode {args.mode!r}")
    print("| variant | actor.act (us/call) | learner.learn (ms/call) | compile time (s) |")
    print("| --- | --- | --- | --- |")
    print(f"| eager | {e[0]:.1f} | {e[1]:.2f} | - |")
    print(f"| torch.compile | {c[0]:.1f} | {c[1]:.2f} | {c[2]:.1f} |")
    print(f"| compiled / eager | {c[0] / e[0]:.2f}x | {c[1] / e[1]:.2f}x | |")


if __name__ == "__main__":
    main()
