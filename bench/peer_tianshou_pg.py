"""The peer of msrl's PG: Tianshou's ``Reinforce`` (tianshou 2.0, the library MindSpore
Reinforcement's PG descends from) on CartPole-v1, on msrl's budget and settings.

Runs in an environment that has tianshou (it pins its own numpy/pandas range, so keep it out of
msrl's)::

    python -m venv /tmp/ts && /tmp/ts/bin/pip install torch==2.13.0 tianshou==2.0.1 gymnasium==1.4.0
    /tmp/ts/bin/python bench/peer_tianshou_pg.py --seed 1 --budget 500000 --eval-every 20000

Settings as ``configs/pg_cartpole.yaml``: 8 envs, 4,000 env steps collected per update (the
collector's ``n_step``; Tianshou closes the episodes a collection cuts with its running mean of
the returns), one Adam step of learning rate 5e-3 on all of them, gamma 0.99, the actor a 64x64
tanh MLP. Tianshou's REINFORCE has no learned baseline: it standardizes the returns by their
running mean and deviation (``return_standardization``), which is its baseline. The evaluation is
``bench/bench_offpolicy.py``'s: greedy, 20 episodes on envs seeded 10000..10019; its time is left
out of the clock. Prints one JSON object: ``time_to_threshold``, ``steps_to_threshold`` (the first
evaluation at or above 475), ``sps``, ``curve`` ``[(env_steps, train_s, mean_return)]`` and
``final_eval``.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium
import numpy as np
import torch
from tianshou.algorithm import Reinforce
from tianshou.algorithm.modelfree.reinforce import DiscreteActorPolicy
from tianshou.algorithm.optim import AdamOptimizerFactory
from tianshou.data import Collector, CollectStats, VectorReplayBuffer
from tianshou.env import DummyVectorEnv
from tianshou.utils.net.common import Net
from tianshou.utils.torch_utils import policy_within_training_step, torch_train_mode

EVAL_EPISODES, EVAL_SEED, THRESHOLD = 20, 10_000, 475.0


def evaluate(net: torch.nn.Module, env_id: str) -> float:
    """Greedy (argmax of the logits) mean return over 20 episodes, envs seeded 10000..10019."""
    env = gymnasium.make_vec(env_id, num_envs=EVAL_EPISODES, vectorization_mode="sync",
                             vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP})
    obs, _ = env.reset(seed=EVAL_SEED)
    ret = np.zeros(EVAL_EPISODES)
    done = np.zeros(EVAL_EPISODES, dtype=bool)
    with torch.no_grad():
        while not done.all():
            logits, _ = net(torch.as_tensor(obs, dtype=torch.float32))
            obs, r, te, tr, _ = env.step(logits.argmax(-1).numpy())
            ret += np.where(done, 0.0, r)
            done |= te | tr
    env.close()
    return float(ret.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--budget", type=int, default=500_000)
    p.add_argument("--eval-every", type=int, default=20_000)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--steps-per-update", type=int, default=4_000)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--gamma", type=float, default=0.99)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    envs = DummyVectorEnv([lambda: gymnasium.make(args.env_id) for _ in range(args.num_envs)])
    envs.seed(args.seed)
    space = gymnasium.make(args.env_id)
    net = Net(state_shape=space.observation_space.shape, action_shape=int(space.action_space.n),
              hidden_sizes=[64, 64], activation=torch.nn.Tanh)
    policy = DiscreteActorPolicy(actor=net, action_space=space.action_space, observation_space=space.observation_space)
    algorithm = Reinforce(policy=policy, gamma=args.gamma, return_standardization=True,
                          optim=AdamOptimizerFactory(lr=args.lr))
    collector = Collector[CollectStats](algorithm, envs, VectorReplayBuffer(args.steps_per_update * 2, args.num_envs))
    collector.reset()
    steps, eval_time, curve, hit = 0, 0.0, [], None
    t0 = time.perf_counter()
    while steps < args.budget:
        with policy_within_training_step(policy), torch_train_mode(policy):  # what Tianshou's trainer does
            stats = collector.collect(n_step=args.steps_per_update)
            steps += stats.n_collected_steps
            algorithm.update(buffer=collector.buffer, batch_size=None, repeat=1)
        collector.reset_buffer(keep_statistics=True)
        if steps // args.eval_every > len(curve):
            s = time.perf_counter()
            train_s = s - t0 - eval_time
            mean = evaluate(net, args.env_id)
            eval_time += time.perf_counter() - s
            curve.append((steps, train_s, mean))
            if mean >= THRESHOLD and hit is None:
                hit = (curve[-1][1], steps)
    train_time = time.perf_counter() - t0 - eval_time
    print(json.dumps({"time_to_threshold": hit[0] if hit else None, "steps_to_threshold": hit[1] if hit else None,
                      "sps": steps / train_time, "curve": curve, "final_eval": evaluate(net, args.env_id)}))


if __name__ == "__main__":
    main()
