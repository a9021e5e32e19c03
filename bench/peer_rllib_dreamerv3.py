"""RLlib's DreamerV3 (torch, new API stack) on a gymnasium env, for ``bench/bench_dreamerv3.py``:
started the way RLlib's docs start it (``DreamerV3Config().environment(...).training(...)``,
``build_algo()``, then ``train()`` in a loop) until ``--budget`` env steps; prints one JSON line:
the curve of (env steps, training seconds, mean return of the last 10 finished episodes), the env
steps and seconds at which that mean first reached ``--threshold``, env steps/s, the updates
(``num_grad_updates_lifetime``), updates/s and seconds an update after the first.

RLlib 2.60's DreamerV3 trains at least one batch of ``batch_size_B x batch_length_T`` (1,024)
replayed steps per env step whatever ``training_ratio`` is below that: its sampling loop stops on
a lifetime training ratio its metrics report as 0 (``actual_training_ratio``), so each
``train()`` samples one env step and then updates until that one step's ratio is met. Its
effective ratio is 1,024 (one update per env step); compare msrl at ``train_ratio: 1024`` or per
update.

The returns are the env's own: a wrapper appends each finished episode's (env step, return) to a
file this script reads after every ``train()``, and the mean of the last 10 is computed here as
msrl's bench computes it (RLlib's ``episode_return_mean``, asked for a 10-episode window with
``metrics_num_episodes_for_smoothing``, moved as the mean of one report's episodes here).

An ``ALE/...`` id is made with ``frameskip=1`` and wrapped as RLlib's Atari examples wrap it
(``wrap_atari_for_new_api_stack``: 64x64 grayscale, 4 frames a step with the max of the last two,
up to 30 no-ops, no frame stack) and the grayscale frame repeated into the three channels RLlib's
DreamerV3 encodes; the logged episode is the game's (env steps: agent steps).

RLlib pins its own gymnasium; run it from a venv with ``ray[rllib]`` (and ``ale-py`` for Atari)::

    python -m venv /tmp/rl && /tmp/rl/bin/pip install torch==2.13.0 "ray[rllib]==2.60.0" pillow \\
        ale-py==0.12.1 opencv-python-headless
    /tmp/rl/bin/python bench/peer_rllib_dreamerv3.py --env-id CartPole-v1 --model-size XS --training-ratio 1024 \\
        --budget 20000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import gymnasium as gym
import numpy as np


class EpisodeLog(gym.Wrapper):
    """Appends ``"<env steps of this env so far> <episode return>"`` to ``path`` as each
    episode ends (terminated or truncated)."""

    def __init__(self, env: gym.Env, path: str) -> None:
        super().__init__(env)
        self.path, self.steps, self.ret = path, 0, 0.0

    def reset(self, **kwargs):
        self.ret = 0.0
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        self.ret += float(reward)
        if terminated or truncated:
            with open(self.path, "a") as f:
                f.write(f"{self.steps} {self.ret}\n")
        return obs, reward, terminated, truncated, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--model-size", default="XS")
    p.add_argument("--training-ratio", type=int, default=1024)
    p.add_argument("--budget", type=int, default=20_000)
    p.add_argument("--threshold", type=float, default=450.0)
    p.add_argument("--seed", type=int, default=1)
    for k in ("world-model-lr", "actor-lr", "critic-lr"):
        p.add_argument(f"--{k}", type=float, default=None, help="replaces RLlib's default")
    args = p.parse_args()
    lrs = {k: getattr(args, k) for k in ("world_model_lr", "actor_lr", "critic_lr") if getattr(args, k) is not None}
    import torch

    torch.set_num_threads(1)
    import ray
    from ray import tune
    from ray.rllib.algorithms.dreamerv3.dreamerv3 import DreamerV3Config

    log = os.path.join(tempfile.mkdtemp(), "episodes.txt")
    open(log, "w").close()
    def make(_cfg):
        if args.env_id.startswith("ALE/"):
            import ale_py
            from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack

            gym.register_envs(ale_py)
            env = wrap_atari_for_new_api_stack(gym.make(args.env_id, frameskip=1), dim=64, framestack=None)
            # RLlib 2.60's DreamerV3 encodes only (64, 64, 3) frames (a (64, 64) one is refused, a (64, 64, 1)
            # one read as three channels): msrl's grayscale frame, repeated into three channels
            env = gym.wrappers.TransformObservation(env, lambda o: np.repeat(o, 3, -1),
                                                    gym.spaces.Box(-1.0, 1.0, (64, 64, 3), np.float32))
            return EpisodeLog(env, log)
        return EpisodeLog(gym.make(args.env_id), log)

    tune.register_env("logged", make)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = (DreamerV3Config().environment("logged").framework("torch")
              .training(model_size=args.model_size, training_ratio=args.training_ratio, **lrs)
              .debugging(seed=args.seed))
    algo = config.build_algo()
    curve, reached, train_s, steps, seen, updates, first, episodes, pending = [], None, 0.0, 0, 0, 0, None, [], ""
    reader = open(log)  # noqa: SIM115 - read incrementally for the whole run, closed after it
    while steps < args.budget:
        t0 = time.perf_counter()
        result = algo.train()
        train_s += time.perf_counter() - t0
        steps = int(result.get("num_env_steps_sampled_lifetime", 0) or result["env_runners"].get(
            "num_env_steps_sampled_lifetime", 0))
        updates = int(result.get("num_grad_updates_lifetime", 0))
        if first is None and updates:
            first = (updates, train_s)  # (the clock after the iteration of the first update)
        # (only what was written since the last read: the handle stays open at its position; a line
        # not yet ended waits in `pending`)
        *lines, pending = (pending + reader.read()).split("\n")
        episodes += [(int(a), float(b)) for a, b in (line.split() for line in lines)]
        for i in range(seen, len(episodes)):  # each episode's point: the mean of it and the 9 before
            last = [r for _, r in episodes[max(0, i - 9):i + 1]]
            curve.append((episodes[i][0], train_s, sum(last) / len(last)))
            if reached is None and len(last) == 10 and curve[-1][2] >= args.threshold:
                reached = (episodes[i][0], train_s)
        seen = len(episodes)
        print(f"peer: {steps} env steps, {updates} updates, {len(episodes)} episodes, {train_s:.0f} s", file=sys.stderr,
              flush=True)
    reader.close()
    algo.stop()
    ray.shutdown()
    print(json.dumps({"curve": curve, "steps_to_threshold": reached and reached[0],
                      "time_to_threshold": reached and reached[1], "sps": steps / train_s, "env_steps": steps,
                      "updates": updates, "updates_per_s": updates / train_s,
                      "s_per_update": (train_s - first[1]) / (updates - first[0]) if first and updates > first[0] else None}))


if __name__ == "__main__":
    main()
