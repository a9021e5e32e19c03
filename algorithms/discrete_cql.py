"""Discrete CQL: Conservative Q-Learning for Discrete actions (Kumar, Zhou, Tucker and Levine
2020, "Conservative Q-Learning for Offline Reinforcement Learning", NeurIPS, Eq. 4, the CQL(H)
variant on a Q-network), offline, as d3rlpy's ``DiscreteCQL`` writes it: double DQN's target
from a target network, plus ``alpha * (logsumexp_a Q(s, a) - Q(s, a_data))``.

With Discrete actions the log-sum-exp over actions is exact (no sampling, as the paper's Atari
experiments, Section 6.2). The penalty pushes down the values of every action and pushes up
the one the dataset took: the learned Q-values are low where the dataset has no evidence, so
the greedy policy keeps to what the dataset did where it cannot tell better.

Read top to bottom: hyperparameters, the actor (greedy: it acts in evaluation only), the
learner (the double-DQN target, Huber TD loss, the conservative penalty, one Adam step, the
target network copied every ``target_update_interval`` gradient steps) and the trainer (each
iteration one minibatch of the dataset, one step, the weights to the actor). The dataset is the
config's ``dataset:``; the budget ``train.total_gradient_steps``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.continuous import relu_mlp
from msrl.rl.datasets import DatasetBuffer

__all__ = ["DiscreteCQLConfig", "DiscreteCQLActor", "DiscreteCQLLearner", "DiscreteCQLTrainer", "ALGORITHM",
           "discrete_conservative_penalty"]


@dataclasses.dataclass
class DiscreteCQLConfig:
    """Discrete CQL's hyperparameters (d3rlpy's ``DiscreteCQL`` but the learning rate, the batch
    and the target interval, which are d3rlpy's Atari settings; these suit a small MLP)."""

    learning_rate: PositiveFloat = 1e-3
    """Adam learning rate"""
    batch_size: PositiveInt = 256
    """transitions per gradient step (per learner replica under multi_learner)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    target_update_interval: PositiveInt = 500
    """gradient steps between copies of the Q-network into the target network"""
    alpha: NonNegativeFloat = 1.0
    """weight of the conservative penalty (0: double DQN on the dataset)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the Q-network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


def build_q_network(ctx: BuildContext) -> nn.Sequential:
    """The Q-network ``(B, *obs_shape) -> (B, n_actions)``, a ReLU MLP of ``ctx``'s spaces,
    initialised from ``ctx.seed`` alone (the global RNG untouched), on ``ctx.device``: the actor's
    and the learner's copies start equal."""
    spec = ctx.env_spec
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = relu_mlp(int(np.prod(spec.observation_space.shape)), ctx.hparams.hidden_sizes, int(spec.action_space.n))
    return net.to(ctx.device)


def discrete_conservative_penalty(q_all: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """CQL(H)'s regulariser for Discrete actions (Kumar et al. 2020, Eq. 4, the log-sum-exp over
    the action set exact): ``mean_s(logsumexp_a Q(s, a) - Q(s, a_data))``.

    Args:
        q_all: every action's value, ``(B, n_actions)`` float.
        action: the dataset's actions, ``(B,)`` int64.

    Returns:
        a 0-d tensor, >= 0 (a log-sum-exp is at least the largest term).
    """
    q_data = q_all.gather(1, action.long().unsqueeze(1)).squeeze(1)
    return (torch.logsumexp(q_all, dim=1) - q_data).mean()


class DiscreteCQLActor(Actor):
    """Acts greedily on the Q-network, ``deterministic`` or not: an offline algorithm's actor acts
    in evaluation only (``msrl collect`` adds its own exploration noise)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.q_network = build_q_network(ctx)
        self.weights = ModuleWeights(self.q_network)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N,)`` int64 for observations ``(N, *obs_shape)`` float32."""
        return self.q_network(obs.flatten(1)).argmax(-1)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The Q-network's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies the learner's Q-network weights into the actor's (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"q_network": self.q_network.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q_network.load_state_dict(state["q_network"])


class DiscreteCQLLearner(Learner):
    """Double DQN's Huber TD loss plus ``alpha`` times the conservative penalty, one Adam step,
    the target network copied every ``target_update_interval`` gradient steps (counted here)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: DiscreteCQLConfig = ctx.hparams
        self.q_network = build_q_network(ctx)
        self.target_network = build_q_network(ctx)
        self.weights = ModuleWeights(self.q_network)
        self.parameters = list(self.q_network.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate)
        self.gradient_steps = 0

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One discrete CQL step on a minibatch.

        Args:
            batch: a TensorDict of batch size ``(B,)`` with ``obs``, ``next_obs`` ``(B, *obs_shape)``
                float32, ``action`` ``(B,)`` int64, ``reward`` float32 and ``terminated`` bool
                (:class:`~msrl.rl.datasets.DatasetBuffer`).

        Returns:
            ``losses/td_loss``, ``losses/cql_penalty``, ``losses/loss`` and ``losses/q_values``
            (the dataset actions' mean value), 0-d tensors.

        Raises:
            FloatingPointError: the loss is NaN or infinite (that step is not taken).
        """
        hp = self.hp
        obs, next_obs, action = batch["obs"].flatten(1), batch["next_obs"].flatten(1), batch["action"].long()
        with torch.no_grad():  # double DQN (van Hasselt et al. 2016, Eq. 4): choose online, value target
            next_action = self.q_network(next_obs).argmax(1, keepdim=True)
            next_q = self.target_network(next_obs).gather(1, next_action).squeeze(1)
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_q
        q_all = self.q_network(obs)
        q_data = q_all.gather(1, action.unsqueeze(1)).squeeze(1)
        td_loss = F.smooth_l1_loss(q_data, target)
        penalty = discrete_conservative_penalty(q_all, action)
        loss = td_loss + hp.alpha * penalty
        self.apply_gradients(loss, None)  # no clipping (d3rlpy's DiscreteCQL clips none)
        self.gradient_steps += 1
        if self.gradient_steps % hp.target_update_interval == 0:
            self.target_network.load_state_dict(self.q_network.state_dict())
        return {"losses/td_loss": td_loss.detach(), "losses/cql_penalty": penalty.detach(),
                "losses/loss": loss.detach(), "losses/q_values": q_data.detach().mean()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The Q-network's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"q_network": self.q_network.state_dict(), "target_network": self.target_network.state_dict(),
                "optimizer": self.optimizer.state_dict(), "gradient_steps": self.gradient_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q_network.load_state_dict(state["q_network"])
        self.target_network.load_state_dict(state["target_network"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gradient_steps = int(state["gradient_steps"])


class DiscreteCQLTrainer(Trainer):
    """Discrete CQL's loop body: a minibatch from the dataset, one learner step, the Q-network
    to the actor."""

    def reset(self) -> None:
        """The learner's initial Q-network to the actor."""
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """One discrete CQL step on a minibatch of the dataset; returns the learner's metrics."""
        batch = self.buffer.sample()
        metrics = self.learner.learn(batch)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="discrete_cql",
    observation_spaces=(gymnasium.spaces.Box,),
    action_spaces=(gymnasium.spaces.Discrete,),
    hparams=DiscreteCQLConfig,
    trainer=DiscreteCQLTrainer,
    components={"actor": DiscreteCQLActor, "buffer": DatasetBuffer, "learner": DiscreteCQLLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: 0,
    policy_lag="corrected",  # it learns from a fixed dataset, never from what its actors did
    offline=True,
)
