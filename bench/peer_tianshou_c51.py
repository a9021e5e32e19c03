"""A peer of msrl's C51: Tianshou's ``C51`` (tianshou 2.0) on CartPole-v1 with
``configs/c51_cartpole.yaml``'s settings (CleanRL's ``c51.py``'s).

Runs in an environment that has tianshou (see ``bench/peer_tianshou_pg.py``)::

    /tmp/ts/bin/python bench/peer_tianshou_c51.py --seed 1 --budget 500000 --eval-every 10000

Settings: one env; 101 atoms on [-100, 100]; a 120-84 ReLU network with a softmax over each
action's atoms; Adam 2.5e-4 with epsilon 0.01/128; a 10,000-transition replay; gamma 0.99; 10
env steps then one gradient step on a batch of 128 once 10,000 env steps are collected; the
target network copied every 500 env steps (every 50 gradient steps: Tianshou counts updates);
epsilon falling linearly from 1.0 to 0.05 over the first half of the budget; the first
10,000 actions uniformly random (CleanRL's schedule acts epsilon-greedily there with epsilon
near 1; both are near-uniform). The evaluation is ``bench/bench_offpolicy.py``'s: greedy in the
distributions' means, 20 episodes on envs seeded 10000..10019, its time out of the clock.
Prints one JSON object as ``bench/peer_tianshou_pg.py`` does.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium
import numpy as np
import torch
from tianshou.algorithm import C51
from tianshou.algorithm.modelfree.c51 import C51Policy
from tianshou.algorithm.optim import AdamOptimizerFactory
from tianshou.data import Collector, CollectStats, ReplayBuffer
from tianshou.env import DummyVectorEnv
from tianshou.utils.net.common import Net
from tianshou.utils.torch_utils import policy_within_training_step, torch_train_mode

EVAL_EPISODES, EVAL_SEED, THRESHOLD = 20, 10_000, 475.0


def evaluate(net: torch.nn.Module, support: torch.Tensor, env_id: str) -> float:
    """Greedy (argmax of each action's mean return) mean return over 20 episodes, envs seeded 10000..10019."""
    env = gymnasium.make_vec(env_id, num_envs=EVAL_EPISODES, vectorization_mode="sync",
                             vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP})
    obs, _ = env.reset(seed=EVAL_SEED)
    ret = np.zeros(EVAL_EPISODES)
    done = np.zeros(EVAL_EPISODES, dtype=bool)
    with torch.no_grad():
        while not done.all():
            probs, _ = net(torch.as_tensor(obs, dtype=torch.float32))
            obs, r, te, tr, _ = env.step((probs * support).sum(-1).argmax(-1).numpy())
            ret += np.where(done, 0.0, r)
            done |= te | tr
    env.close()
    return float(ret.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budget", type=int, default=500_000)
    p.add_argument("--eval-every", type=int, default=10_000)
    p.add_argument("--env-id", default="CartPole-v1")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    atoms, v_min, v_max, starts, train_frequency = 101, -100.0, 100.0, 10_000, 10
    envs = DummyVectorEnv([lambda: gymnasium.make(args.env_id)])
    envs.seed(args.seed)
    space = gymnasium.make(args.env_id)
    net = Net(state_shape=space.observation_space.shape, action_shape=int(space.action_space.n), hidden_sizes=[120, 84],
              softmax=True, num_atoms=atoms)
    policy = C51Policy(model=net, action_space=space.action_space, observation_space=space.observation_space,
                       num_atoms=atoms, v_min=v_min, v_max=v_max)
    algorithm = C51(policy=policy, optim=AdamOptimizerFactory(lr=2.5e-4, eps=0.01 / 128), gamma=0.99,
                    n_step_return_horizon=1, target_update_freq=500 // train_frequency)
    collector = Collector[CollectStats](algorithm, envs, ReplayBuffer(10_000), exploration_noise=True)
    collector.reset()
    support = torch.linspace(v_min, v_max, atoms)
    steps, eval_time, curve, hit = 0, 0.0, [], None
    t0 = time.perf_counter()
    with policy_within_training_step(policy), torch_train_mode(policy):
        collector.collect(n_step=starts, random=True)
    steps = starts
    while steps < args.budget:
        eps = max(0.05, 1.0 + (0.05 - 1.0) * steps / (0.5 * args.budget))
        policy.set_eps_training(eps)
        with policy_within_training_step(policy), torch_train_mode(policy):  # what Tianshou's trainer does
            steps += collector.collect(n_step=train_frequency).n_collected_steps
            algorithm.update(buffer=collector.buffer, sample_size=128)
        if steps // args.eval_every > len(curve):
            s = time.perf_counter()
            train_s = s - t0 - eval_time
            mean = evaluate(net, support, args.env_id)
            eval_time += time.perf_counter() - s
            curve.append((steps, train_s, mean))
            if mean >= THRESHOLD and hit is None:
                hit = (train_s, steps)
    train_time = time.perf_counter() - t0 - eval_time
    print(json.dumps({"time_to_threshold": hit[0] if hit else None, "steps_to_threshold": hit[1] if hit else None,
                      "sps": steps / train_time, "curve": curve, "final_eval": evaluate(net, support, args.env_id)}))


if __name__ == "__main__":
    main()
