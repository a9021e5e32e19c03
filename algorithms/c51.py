"""C51: categorical distributional DQN (Bellemare, Dabney and Munos 2017, "A Distributional
Perspective on Reinforcement Learning", arXiv:1707.06887, Algorithm 1), as CleanRL's ``c51.py``
writes it: the network outputs, for every action, a distribution over ``n_atoms`` fixed returns
between ``v_min`` and ``v_max``; the learner projects ``r + gamma Z'(s', a*)`` onto the support
and minimises the cross-entropy to it.

Read top to bottom: hyperparameters, the network, the epsilon-greedy actor (greedy in the
distributions' means), the learner and the trainer: ``train_frequency`` env steps per iteration
into a replay buffer, then, once ``learning_starts`` env steps are collected, a target sync when
due and one gradient step -- ``if``s on step counters. The projection is
:func:`msrl.rl.distributional.categorical_projection`; the replay
:class:`msrl.rl.buffers.ReplayBuffer`.
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
    Fraction,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.buffers import ReplayBuffer
from msrl.rl.distributional import categorical_projection, categorical_support
from msrl.rl.distributions import epsilon_greedy

__all__ = ["C51Config", "CategoricalQNetwork", "C51Actor", "C51Learner", "C51Trainer", "ALGORITHM"]


@dataclasses.dataclass
class C51Config:
    """C51's hyperparameters (CleanRL's ``c51.py`` names and defaults)."""

    learning_rate: PositiveFloat = 2.5e-4
    """Adam learning rate"""
    adam_eps: PositiveFloat = 0.01 / 128
    """Adam's epsilon (the paper and CleanRL: 0.01 / batch size)"""
    n_atoms: PositiveInt = 101
    """atoms of each action's return distribution"""
    v_min: float = -100.0
    """the support's lowest return"""
    v_max: float = 100.0
    """the support's highest return"""
    buffer_size: PositiveInt = 10_000
    """replay capacity in transitions"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    target_network_frequency: PositiveInt = 500
    """env steps (over every env of the job) between target-network copies"""
    batch_size: PositiveInt = 128
    """transitions per gradient step"""
    start_e: UnitInterval = 1.0
    """exploration epsilon at the start"""
    end_e: UnitInterval = 0.05
    """exploration epsilon at the end of the schedule"""
    exploration_fraction: Fraction = 0.5
    """fraction of the env-step budget over which epsilon falls linearly from start_e to end_e"""
    learning_starts: NonNegativeInt = 10_000
    """env steps collected before the first gradient step"""
    train_frequency: PositiveInt = 10
    """vector-env steps collected per iteration, each followed by one gradient step once learning has started"""
    hidden_sizes: LayerSizes = (120, 84)
    """hidden layer widths of the network (ReLU)"""
    double_q: bool = False
    """the next state's action picked by the online network and scored by the target (Double DQN's
    rule, van Hasselt et al. 2016, Eq. 4; Tianshou's C51 always does this); off: the target network
    alone picks and scores (the paper's Algorithm 1, CleanRL's ``c51.py``)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        if self.n_atoms < 2:
            raise ValueError(f"n_atoms must be at least 2, got {self.n_atoms}")
        if not self.v_min < self.v_max:
            raise ValueError(f"v_min must be below v_max, got v_min={self.v_min}, v_max={self.v_max}")


class CategoricalQNetwork(nn.Module):
    """Per action, a categorical distribution over the support: observations ``(B, *obs_shape)``
    float32 to probabilities ``(B, n_actions, n_atoms)`` (a softmax over atoms), and ``q`` their
    means ``(B, n_actions)``.

    Raises:
        ValueError: a non-Box observation space or a non-Discrete action space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...],
                 support: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(observation_space, gymnasium.spaces.Box) or not isinstance(action_space, gymnasium.spaces.Discrete):
            raise ValueError(f"C51 needs Box observations and Discrete actions, got {observation_space} / {action_space}")
        self.n_actions, self.n_atoms = int(action_space.n), int(support.shape[0])
        n_in, layers = int(np.prod(observation_space.shape)), []
        for h in hidden:
            layers += [nn.Linear(n_in, h), nn.ReLU()]
            n_in = h
        layers.append(nn.Linear(n_in, self.n_actions * self.n_atoms))
        self.net = nn.Sequential(*layers)
        self.register_buffer("support", support.clone())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """``(B, n_actions, n_atoms)`` probabilities."""
        return torch.softmax(self.net(obs.flatten(1)).view(-1, self.n_actions, self.n_atoms), dim=-1)

    def q(self, obs: torch.Tensor) -> torch.Tensor:
        """The distributions' means, ``(B, n_actions)``: ``Q(s, a) = sum_i z_i p_i(s, a)``."""
        return (self(obs) * self.support).sum(-1)


def _build_network(ctx: BuildContext) -> CategoricalQNetwork:
    hp: C51Config = ctx.hparams
    support = categorical_support(hp.v_min, hp.v_max, hp.n_atoms)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = CategoricalQNetwork(ctx.env_spec.observation_space, ctx.env_spec.action_space, hp.hidden_sizes, support)
    return net.to(ctx.device)


class C51Actor(Actor):
    """Epsilon-greedy in the distributions' means; random draws from the actor's own
    ``torch.Generator`` (seeded by ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.net = _build_network(ctx)
        self.weights = ModuleWeights(self.net)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, epsilon: float = 0.0, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N,)`` int64 for observations ``(N, *obs_shape)`` float32: a uniformly random
        action with probability ``epsilon`` (in ``[0, 1]``) per env, else the greedy one;
        ``deterministic``: greedy (epsilon ignored)."""
        greedy = self.net.q(obs).argmax(-1)
        if deterministic:
            return greedy
        return epsilon_greedy(greedy, self.net.n_actions, epsilon, self.generator)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the network (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        """The network and the exploration generator's state."""
        return {"net": self.net.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s network and generator."""
        self.net.load_state_dict(state["net"])
        self.generator.set_state(state["generator"])


class C51Learner(Learner):
    """The cross-entropy between ``Z(s, a)`` and the projected target distribution of
    ``r + gamma Z_target(s', a*)``, ``a* = argmax_a Q_target(s', a)`` (Algorithm 1); with
    ``double_q``, ``a* = argmax_a Q(s', a)`` of the online network (van Hasselt et al. 2016, Eq. 4)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: C51Config = ctx.hparams
        self.net = _build_network(ctx)
        self.target = _build_network(ctx)
        self.target.load_state_dict(self.net.state_dict())
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate, eps=self.hp.adam_eps)

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One gradient step on a replay minibatch.

        Args:
            batch: TensorDict ``(B,)`` with :attr:`ReplayBuffer.KEYS`.

        Returns:
            ``losses/loss`` (the cross-entropy) and ``losses/q_values`` (mean ``Q(s, a)``), 0-d tensors.
        """
        with torch.no_grad():
            next_pmfs = self.target(batch["next_obs"])
            picker = self.net(batch["next_obs"]) if self.hp.double_q else next_pmfs
            next_a = (picker * self.target.support).sum(-1).argmax(-1)
            next_pmf = next_pmfs[torch.arange(next_pmfs.shape[0], device=next_pmfs.device), next_a]
            discount = batch["discount"] if "discount" in batch.keys() else self.hp.gamma
            target = categorical_projection(next_pmf, batch["reward"], 1.0 - batch["terminated"].float(), discount,
                                            self.target.support)
        pmfs = self.net(batch["obs"])
        pmf = pmfs[torch.arange(pmfs.shape[0], device=pmfs.device), batch["action"].long()]
        loss = -(target * pmf.clamp(1e-5, 1.0 - 1e-5).log()).sum(-1).mean()
        self.apply_gradients(loss)
        q_values = (pmf.detach() * self.net.support).sum(-1).mean()
        return {"losses/loss": loss.detach(), "losses/q_values": q_values}

    @torch.no_grad()
    def update_target(self) -> None:
        """Copies the network into the target network."""
        self.target.load_state_dict(self.net.state_dict())

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        """The network, its target and the optimiser."""
        return {"net": self.net.state_dict(), "target": self.target.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s networks and optimiser."""
        self.net.load_state_dict(state["net"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])


class C51Trainer(Trainer):
    """C51's loop body: ``train_frequency`` epsilon-greedy steps into the replay buffer, then, once
    ``learning_starts`` env steps are collected, a target copy when due and one gradient step."""

    def reset(self) -> None:
        """First observations, step counters, the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.target_synced_at = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the update's metrics and the exploration epsilon."""
        hp = self.hparams
        for _step in range(hp.train_frequency):
            decay = (hp.start_e - hp.end_e) * self.global_step / (hp.exploration_fraction * self.total_env_steps)
            epsilon = max(hp.end_e, hp.start_e - decay)
            action = self.actor.act(self.obs, epsilon)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"],
                               terminated=terminated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step > hp.learning_starts:
            if self.global_step - self.target_synced_at >= hp.target_network_frequency:
                self.learner.update_target()
                self.target_synced_at = self.global_step
            metrics = self.learner.learn(self.buffer.sample())
            self.actor.set_weights(self.learner.get_weights())
        return {**metrics, "charts/epsilon": epsilon}


ALGORITHM = AlgorithmSpec(
    name="c51",
    hparams=C51Config,
    trainer=C51Trainer,
    components={"actor": C51Actor, "buffer": ReplayBuffer, "learner": C51Learner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.train_frequency * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
