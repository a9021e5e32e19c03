"""The peer of ``bench_marl.py spread``: TorchRL's QMIX / VDN and MADDPG on the same MPE
simple_spread (mpe2, 3 agents, 25 steps, local_ratio 0.5) and the same budget.

TorchRL's ``sota-implementations/multiagent/qmix_vdn.py`` and ``maddpg_iddpg.py`` are written for
VMAS (60,000 frames a batch, 30M frames); this script builds their programs from the same TorchRL
pieces (``MultiAgentMLP``, ``QMixer`` / ``VDNMixer`` + ``QMixerLoss``, ``DDPGLoss`` with a
centralised ``MultiAgentMLP`` critic, ``SoftUpdate``, ``EGreedyModule``, ``AdditiveGaussianModule``,
``Collector``, ``TensorDictReplayBuffer``) on mpe2 through TorchRL's ``PettingZooWrapper``, with
the settings of msrl's configs where the two name the same thing (learning rate, discount, replay
size, batch, updates per env step, epsilon schedule, the target rate, hidden widths, grad clip),
so that the comparison is of implementations at one budget:

- QMIX / VDN (``configs/qmix_simple_spread.yaml``): a shared 2 x 64 ReLU MLP agent (TorchRL's is
  feed-forward, msrl's recurrent), team reward = the agents' rewards summed, the 25-step limit
  terminal (msrl's ``bootstrap_at_time_limit: false``), replay of 5,000 episodes' transitions,
  minibatches of 32 episodes' worth (800), 8 updates per 8 episodes after 3,200 steps, epsilon
  1 -> 0.05 over 50k steps, Polyak targets (TorchRL's way) at rate 0.005.
- MADDPG (``configs/maddpg_simple_spread.yaml``, continuous actions): an actor and a centralised
  critic per agent (no sharing), 2 x 64 ReLU, lr 0.01, gamma 0.95, tau 0.01, batch 1,024, replay
  1M, 2 updates per 200 env steps after 25,600, Gaussian acting noise 0.1 of the half-range.

Reported per algorithm and seed: the greedy evaluation (20 episodes, the team return: the agents'
rewards summed) every ``--eval-every`` env steps and at the end, env steps/s and training time. Run
in a venv with torch 2.13.0, ``torchrl==0.14.1``, ``pettingzoo``, ``mpe2`` (msrl is not needed)::

    python bench/peer_torchrl_marl.py --algos qmix vdn maddpg --seeds 1 --budget 300000 --json torchrl_marl.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import PettingZooWrapper
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import (
    AdditiveGaussianModule,
    EGreedyModule,
    ProbabilisticActor,
    QValueModule,
    SafeSequential,
    TanhDelta,
    ValueOperator,
)
from torchrl.modules.models.multiagent import MultiAgentMLP, QMixer, VDNMixer
from torchrl.objectives import DDPGLoss, SoftUpdate, ValueEstimators
from torchrl.objectives.multiagent.qmixer import QMixerLoss

N_AGENTS, MAX_CYCLES, FRAMES_PER_BATCH = 3, 25, 200  # msrl's configs: 8 envs x 25 steps an iteration


def make_env(seed: int, continuous: bool) -> PettingZooWrapper:
    """simple_spread_v3 as msrl's configs make it, the agents in one group ``agents``."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=N_AGENTS, local_ratio=0.5, max_cycles=MAX_CYCLES,
                                        continuous_actions=continuous)
    return PettingZooWrapper(env, group_map={"agents": [f"agent_{i}" for i in range(N_AGENTS)]},
                             categorical_actions=True, use_mask=False, seed=seed)


def evaluate(policy, seed: int, continuous: bool, episodes: int = 20) -> float:
    """Mean greedy team return (the agents' rewards summed over the episode) over ``episodes``."""
    env, returns = make_env(seed, continuous), []
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        for _ in range(episodes):
            td = env.rollout(MAX_CYCLES, policy=policy, break_when_any_done=True)
            returns.append(float(td["next", "agents", "reward"].sum()))
    env.close()
    return float(np.mean(returns))


def train_loop(env, explore, greedy_policy, update, seed: int, budget: int, eval_every: int, continuous: bool) -> dict:
    """Collects ``FRAMES_PER_BATCH`` env steps at a time with ``explore`` and calls ``update(data,
    frames)``; evaluates ``greedy_policy`` every ``eval_every`` env steps and at the end."""
    collector = Collector(env, explore, frames_per_batch=FRAMES_PER_BATCH, total_frames=budget)
    frames, evals, train_time, next_eval = 0, [], 0.0, eval_every
    start = time.perf_counter()
    for data in collector:
        frames += data.numel()
        update(data, frames)
        collector.update_policy_weights_()
        if eval_every and frames >= next_eval and frames < budget:
            train_time += time.perf_counter() - start
            evals.append((frames, evaluate(greedy_policy, seed + 1000, continuous)))
            next_eval += eval_every
            start = time.perf_counter()
    train_time += time.perf_counter() - start
    collector.shutdown()
    final = evaluate(greedy_policy, seed + 1000, continuous)
    evals.append((frames, final))
    return {"evals": evals, "final_eval": final, "env_steps": frames, "time_s": train_time, "sps": frames / train_time}


def run_qmix(seed: int, budget: int, eval_every: int, mixer_type: str) -> dict:
    """TorchRL's QMIX / VDN program (``qmix_vdn.py``) at msrl's settings."""
    torch.manual_seed(seed)
    env = make_env(seed, continuous=False)
    obs_dim = env.observation_spec["agents", "observation"].shape[-1]
    n_actions = env.full_action_spec["agents", "action"].space.n
    net = MultiAgentMLP(n_agent_inputs=obs_dim, n_agent_outputs=n_actions, n_agents=N_AGENTS, centralised=False,
                        share_params=True, depth=2, num_cells=64, activation_class=nn.ReLU)
    module = TensorDictModule(net, in_keys=[("agents", "observation")], out_keys=[("agents", "action_value")])
    value_module = QValueModule(action_value_key=("agents", "action_value"),
                                out_keys=[env.action_key, ("agents", "action_value"), ("agents", "chosen_action_value")],
                                spec=env.full_action_spec_unbatched, action_space=None)
    qnet = SafeSequential(module, value_module)
    greedy = EGreedyModule(eps_init=1.0, eps_end=0.05, annealing_num_steps=50_000, action_key=env.action_key,
                           spec=env.full_action_spec_unbatched)
    explore = TensorDictSequential(qnet, greedy)
    if mixer_type == "qmix":
        mixer = TensorDictModule(QMixer(state_shape=(N_AGENTS, obs_dim), mixing_embed_dim=32, n_agents=N_AGENTS,
                                        device="cpu"),
                                 in_keys=[("agents", "chosen_action_value"), ("agents", "observation")],
                                 out_keys=["chosen_action_value"])
    else:
        mixer = TensorDictModule(VDNMixer(n_agents=N_AGENTS, device="cpu"),
                                 in_keys=[("agents", "chosen_action_value")], out_keys=["chosen_action_value"])
    loss = QMixerLoss(qnet, mixer, delay_value=True)
    loss.set_keys(action_value=("agents", "action_value"), local_value=("agents", "chosen_action_value"),
                  global_value="chosen_action_value", action=env.action_key)
    loss.make_value_estimator(ValueEstimators.TD0, gamma=0.99)
    target = SoftUpdate(loss, eps=1 - 0.005)
    optim = torch.optim.Adam(loss.parameters(), 5e-4)
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(5000 * MAX_CYCLES), batch_size=32 * MAX_CYCLES)

    def update(data, frames):
        # the team's reward; the time limit terminal (msrl's bootstrap_at_time_limit: false)
        data.set(("next", "reward"), data["next", "agents", "reward"].sum(-2))
        data.set(("next", "terminated"), data["next", "done"].clone())
        buffer.extend(data.reshape(-1))
        greedy.step(frames=data.numel())
        if frames >= 3200:
            for _ in range(8):
                out = loss(buffer.sample())
                out["loss"].backward()
                nn.utils.clip_grad_norm_(loss.parameters(), 10.0)
                optim.step()
                optim.zero_grad()
                target.step()

    return train_loop(env, explore, qnet, update, seed, budget, eval_every, continuous=False)


def run_maddpg(seed: int, budget: int, eval_every: int) -> dict:
    """TorchRL's MADDPG program (``maddpg_iddpg.py``, ``centralised_critic: True``) at msrl's settings."""
    torch.manual_seed(seed)
    env = make_env(seed, continuous=True)
    obs_dim = env.observation_spec["agents", "observation"].shape[-1]
    spec = env.full_action_spec_unbatched["agents", "action"]
    act_dim = spec.shape[-1]
    actor_net = MultiAgentMLP(n_agent_inputs=obs_dim, n_agent_outputs=act_dim, n_agents=N_AGENTS, centralised=False,
                              share_params=False, depth=2, num_cells=64, activation_class=nn.ReLU)
    policy = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=[("agents", "observation")], out_keys=[("agents", "param")]),
        spec=env.full_action_spec_unbatched, in_keys=[("agents", "param")], out_keys=[env.action_key],
        distribution_class=TanhDelta, distribution_kwargs={"low": spec.space.low, "high": spec.space.high},
        return_log_prob=False)
    half_range = float((spec.space.high - spec.space.low).max()) / 2
    noise = AdditiveGaussianModule(spec=env.full_action_spec_unbatched, sigma_init=0.1 * half_range,
                                   sigma_end=0.1 * half_range, action_key=env.action_key)
    explore = TensorDictSequential(policy, noise)
    critic_net = MultiAgentMLP(n_agent_inputs=obs_dim + act_dim, n_agent_outputs=1, n_agents=N_AGENTS,
                               centralised=True, share_params=False, depth=2, num_cells=64, activation_class=nn.ReLU)
    critic = ValueOperator(critic_net, in_keys=[("agents", "observation"), env.action_key],
                           out_keys=[("agents", "state_action_value")])
    loss = DDPGLoss(actor_network=policy, value_network=critic, delay_value=True)
    loss.set_keys(state_action_value=("agents", "state_action_value"), reward=("agents", "reward"),
                  done=("agents", "done"), terminated=("agents", "terminated"))
    loss.make_value_estimator(ValueEstimators.TD0, gamma=0.95)
    target = SoftUpdate(loss, eps=1 - 0.01)
    optim = torch.optim.Adam(loss.parameters(), 0.01)
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000_000), batch_size=1024)

    def update(data, frames):
        buffer.extend(data.reshape(-1))
        if frames >= 25_600:
            for _ in range(2):
                out = loss(buffer.sample())
                (out["loss_actor"] + out["loss_value"]).backward()
                nn.utils.clip_grad_norm_(loss.parameters(), 0.5)
                optim.step()
                optim.zero_grad()
                target.step()

    return train_loop(env, explore, policy, update, seed, budget, eval_every, continuous=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", nargs="+", default=["qmix", "vdn", "maddpg"], choices=["qmix", "vdn", "maddpg"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--eval-every", type=int, default=100_000)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    import torchrl

    results = []
    for algo in args.algos:
        for seed in args.seeds:
            r = (run_maddpg(seed, args.budget, args.eval_every) if algo == "maddpg"
                 else run_qmix(seed, args.budget, args.eval_every, algo))
            r.update(algo=algo, seed=seed)
            results.append(r)
            print(f"torchrl {algo} seed {seed}: final greedy team return {r['final_eval']:.1f}, evals "
                  f"{[round(v, 1) for _, v in r['evals']]}, {r['sps']:.0f} env steps/s, {r['time_s']:.0f} s", flush=True)
    out = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                      f"torchrl {torchrl.__version__}", "budget": args.budget, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
