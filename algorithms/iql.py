"""IQL: Implicit Q-Learning (Kostrikov, Nair and Levine 2022, "Offline Reinforcement Learning with
Implicit Q-Learning", ICLR, Algorithm 1), offline, for Box actions, as CORL's ``iql.py`` and
d3rlpy's ``IQL`` write it.

It never evaluates an action the dataset does not hold: a state value ``V(s)`` is fitted by
expectile regression to the target critics' ``min_i Q'_i(s, a)`` on the dataset's actions (Eq. 5),
the twin critics regress on ``r + gamma (1 - d) V(s')`` (Eq. 6), and the policy is extracted by
advantage-weighted regression, ``exp(beta (Q'(s, a) - V(s)))``, clipped, weighting the
log-likelihood of the dataset's action (Eq. 7). The target critics follow by Polyak averaging.

Read top to bottom: hyperparameters, the networks, the actor (what evaluation acts with), the
learner and the trainer (each iteration one minibatch of the dataset, the three updates, the
policy to the actor). The dataset is the config's ``dataset:``; the budget
``train.total_gradient_steps``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.continuous import QNetwork, box_space, polyak_update_, relu_mlp
from msrl.rl.datasets import DatasetBuffer

__all__ = ["IQLConfig", "GaussianPolicy", "IQLActor", "IQLLearner", "IQLTrainer", "ALGORITHM", "expectile_loss"]


@dataclasses.dataclass
class IQLConfig:
    """IQL's hyperparameters (the paper's MuJoCo settings, as CORL's and d3rlpy's defaults)."""

    learning_rate: PositiveFloat = 3e-4
    """Adam learning rate of the critics, the value network and the policy"""
    batch_size: PositiveInt = 256
    """transitions per gradient step (per learner replica under multi_learner)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: UnitInterval = 0.005
    """Polyak averaging rate of the target critics"""
    expectile: UnitInterval = 0.7
    """the value network's expectile (0.5: the mean, -> 1: the maximum over the dataset's actions)"""
    beta: PositiveFloat = 3.0
    """inverse temperature of the advantage weights exp(beta * A)"""
    max_weight: PositiveFloat = 100.0
    """the advantage weights are clipped to this"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of every network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """The asymmetric squared loss of expectile regression (Kostrikov et al. 2022, Eq. 5):
    ``mean(|tau - 1(u < 0)| u^2)`` over ``diff = u = Q(s, a) - V(s)``, ``(B,)`` float; a 0-d tensor."""
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return (weight * diff.pow(2)).mean()


class GaussianPolicy(nn.Module):
    """``pi(a|s) = N(tanh(f(s)) * scale + bias, exp(log_std))`` with a state-independent
    ``log_std`` clipped to [-5, 2] (CORL's IQL policy): observations ``(B, *obs_shape)`` float32;
    its mean is the greedy action, within the bounds.

    Raises:
        ValueError: a non-Box or unbounded space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...]) -> None:
        super().__init__()
        obs, act = box_space(observation_space, "observation", "IQL"), box_space(action_space, "action", "IQL")
        if not (np.all(np.isfinite(act.low)) and np.all(np.isfinite(act.high))):
            raise ValueError(f"IQL squashes its actions' means into the action space's bounds; {act} is unbounded")
        n_act = int(np.prod(act.shape))
        self.net = relu_mlp(int(np.prod(obs.shape)), hidden, n_act)
        self.log_std = nn.Parameter(torch.zeros(n_act))
        low = torch.as_tensor(act.low, dtype=torch.float32).flatten()
        high = torch.as_tensor(act.high, dtype=torch.float32).flatten()
        self.register_buffer("scale", (high - low) / 2.0)
        self.register_buffer("bias", (high + low) / 2.0)

    def forward(self, obs: torch.Tensor) -> torch.distributions.Normal:
        """The action distribution, a Normal over ``(B, n_act)``."""
        mean = torch.tanh(self.net(obs.flatten(1))) * self.scale + self.bias
        return torch.distributions.Normal(mean, self.log_std.clamp(-5.0, 2.0).exp().expand_as(mean), validate_args=False)


def build_policy(ctx: BuildContext) -> GaussianPolicy:
    """The :class:`GaussianPolicy` of ``ctx``'s spaces, initialised from ``ctx.seed`` alone (the
    global RNG untouched), on ``ctx.device``: the actor's and the learner's copies start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = GaussianPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


class IQLActor(Actor):
    """Acts with the extracted policy: its mean (``deterministic``), else a sample clipped to the
    bounds from the actor's own generator (seeded ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        space = ctx.env_spec.action_space
        self.action_shape = tuple(space.shape)
        self.low = torch.as_tensor(space.low, dtype=torch.float32, device=ctx.device).flatten()
        self.high = torch.as_tensor(space.high, dtype=torch.float32, device=ctx.device).flatten()
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N, *action_shape)`` float32 within the bounds for observations ``(N, *obs_shape)``."""
        dist = self.policy(obs)
        if deterministic:
            action = dist.mean
        else:
            noise = torch.randn(dist.mean.shape, generator=self.generator, device=dist.mean.device)
            action = torch.maximum(torch.minimum(dist.mean + noise * dist.stddev, self.high), self.low)
        return action.view(action.shape[0], *self.action_shape)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies the learner's policy weights into the actor's (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.generator.set_state(state["generator"])


class IQLLearner(Learner):
    """The value network, the twin critics and the policy, each with its own Adam optimiser,
    updated in Algorithm 1's order on one minibatch, then the target critics averaged."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: IQLConfig = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf1 = QNetwork(spec.observation_space, spec.action_space, hidden, "IQL").to(dev)
            self.qf2 = QNetwork(spec.observation_space, spec.action_space, hidden, "IQL").to(dev)
            self.vf = relu_mlp(int(np.prod(spec.observation_space.shape)), hidden, 1).to(dev)
        self.qf1_target = QNetwork(spec.observation_space, spec.action_space, hidden, "IQL").to(dev)
        self.qf2_target = QNetwork(spec.observation_space, spec.action_space, hidden, "IQL").to(dev)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        lr = self.hp.learning_rate
        self.q_parameters = [*self.qf1.parameters(), *self.qf2.parameters()]
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=lr)
        self.v_optimizer = torch.optim.Adam(list(self.vf.parameters()), lr=lr)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=lr)
        self.parameters = [*self.q_parameters, *self.vf.parameters(), *self.policy.parameters()]
        self.optimizer = self.q_optimizer

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One IQL step on a minibatch (Algorithm 1).

        Args:
            batch: a TensorDict of batch size ``(B,)`` with ``obs``, ``next_obs`` ``(B, *obs_shape)``
                and ``action`` ``(B, *action_shape)`` float32, ``reward`` float32, ``terminated``
                bool (:class:`~msrl.rl.datasets.DatasetBuffer`).

        Returns:
            ``losses/value_loss``, ``losses/qf_loss``, ``losses/actor_loss``,
            ``losses/qf1_values`` and ``charts/advantage_weight`` (the weights' mean), 0-d tensors.

        Raises:
            FloatingPointError: a loss is NaN or infinite (that step is not taken).
        """
        hp = self.hp
        obs, action = batch["obs"], batch["action"]
        with torch.no_grad():
            target_q = torch.min(self.qf1_target(obs, action), self.qf2_target(obs, action))
        v = self.vf(obs.flatten(1)).squeeze(-1)
        advantage = target_q - v
        value_loss = expectile_loss(advantage, hp.expectile)
        self.apply_gradients(value_loss, optimizer=self.v_optimizer)
        with torch.no_grad():
            next_v = self.vf(batch["next_obs"].flatten(1)).squeeze(-1)
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_v
        q1, q2 = self.qf1(obs, action), self.qf2(obs, action)
        qf_loss = ((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()) / 2.0
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)
        weight = torch.exp(hp.beta * advantage.detach()).clamp(max=hp.max_weight)
        log_prob = self.policy(obs).log_prob(action.flatten(1)).sum(-1)
        actor_loss = -(weight * log_prob).mean()
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        with torch.no_grad():
            polyak_update_(self.qf1_target, self.qf1, hp.tau)
            polyak_update_(self.qf2_target, self.qf2, hp.tau)
        return {"losses/value_loss": value_loss.detach(), "losses/qf_loss": qf_loss.detach(),
                "losses/actor_loss": actor_loss.detach(), "losses/qf1_values": q1.detach().mean(),
                "charts/advantage_weight": weight.mean()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        nets = ("policy", "qf1", "qf2", "qf1_target", "qf2_target", "vf")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(q_optimizer=self.q_optimizer.state_dict(), v_optimizer=self.v_optimizer.state_dict(),
                     policy_optimizer=self.policy_optimizer.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in ("policy", "qf1", "qf2", "qf1_target", "qf2_target", "vf"):
            getattr(self, n).load_state_dict(state[n])
        for n in ("q_optimizer", "v_optimizer", "policy_optimizer"):
            getattr(self, n).load_state_dict(state[n])


class IQLTrainer(Trainer):
    """IQL's loop body: a minibatch from the dataset, one learner step, the policy to the actor."""

    def reset(self) -> None:
        """The learner's initial policy to the actor."""
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """One IQL step on a minibatch of the dataset; returns the learner's metrics."""
        batch = self.buffer.sample()
        metrics = self.learner.learn(batch)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="iql",
    observation_spaces=(gymnasium.spaces.Box,),
    action_spaces=(gymnasium.spaces.Box,),
    hparams=IQLConfig,
    trainer=IQLTrainer,
    components={"actor": IQLActor, "buffer": DatasetBuffer, "learner": IQLLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: 0,
    policy_lag="corrected",  # it learns from a fixed dataset, never from what its actors did
    offline=True,
)
