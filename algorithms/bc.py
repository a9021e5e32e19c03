"""BC: behavioural cloning (Pomerleau 1991, "Efficient Training of Artificial Neural Networks
for Autonomous Navigation"; the offline-RL baseline of Fu et al. 2020, D4RL, and of d3rlpy's
``BC``/``DiscreteBC``): a policy fitted to a dataset's actions by maximum likelihood, with no
env in its loop.

Read top to bottom: hyperparameters, the policy network, the actor (what evaluation acts
with), the learner and the trainer: each iteration one minibatch from the dataset
(:class:`msrl.rl.datasets.DatasetBuffer`, the ``buffer`` role), one Adam step, the weights to the
actor. For Discrete actions the loss is the cross-entropy of the dataset's action under the
policy's softmax; for Box actions the squared error of a deterministic tanh policy's action
(d3rlpy's deterministic ``BC``). The budget is ``train.total_gradient_steps``; the dataset is
the config's ``dataset:`` (a Minari dataset, ``msrl collect`` writes one).
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
)
from msrl.rl.continuous import DeterministicPolicy, relu_mlp
from msrl.rl.datasets import DatasetBuffer

__all__ = ["BCConfig", "BCPolicy", "BCActor", "BCLearner", "BCTrainer", "ALGORITHM"]


@dataclasses.dataclass
class BCConfig:
    """BC's hyperparameters (d3rlpy's ``DiscreteBC``/``BC`` defaults but the batch)."""

    learning_rate: PositiveFloat = 1e-3
    """Adam learning rate"""
    batch_size: PositiveInt = 256
    """transitions per gradient step (per learner replica under multi_learner)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class BCPolicy(nn.Module):
    """The cloned policy: for Discrete actions logits ``(B, n)`` from a ReLU MLP; for Box
    actions a :class:`~msrl.rl.continuous.DeterministicPolicy` (``tanh`` into the bounds).
    Observations ``(B, *obs_shape)`` float32.

    Raises:
        ValueError: a non-Box observation space, or an action space neither Discrete nor bounded Box.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.discrete = isinstance(action_space, gymnasium.spaces.Discrete)
        if self.discrete:
            if not isinstance(observation_space, gymnasium.spaces.Box):
                raise ValueError(f"BC needs Box observations, got {observation_space}")
            self.net = relu_mlp(int(np.prod(observation_space.shape)), hidden, int(action_space.n))
        else:
            self.net = DeterministicPolicy(observation_space, action_space, hidden, algorithm="BC")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, n)`` (Discrete) or actions ``(B, n_act)`` within the bounds (Box)."""
        return self.net(obs.flatten(1)) if self.discrete else self.net(obs)


def build_policy(ctx: BuildContext) -> BCPolicy:
    """The :class:`BCPolicy` of ``ctx``'s spaces, initialised from ``ctx.seed`` alone (the
    global RNG untouched), on ``ctx.device``: the actor's and the learner's copies start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = BCPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


class BCActor(Actor):
    """Acts with the cloned policy: the most likely action (Discrete; a sample from the softmax
    when not ``deterministic``, with the actor's own generator seeded ``ctx.seed``) or the
    deterministic policy's action (Box)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        self.action_shape = tuple(ctx.env_spec.action_space.shape or ())
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions for observations ``(N, *obs_shape)``: ``(N,)`` int64 or ``(N, *action_shape)`` float32."""
        out = self.policy(obs)
        if not self.policy.discrete:
            return out.view(out.shape[0], *self.action_shape)
        if deterministic:
            return out.argmax(-1)
        return torch.multinomial(torch.softmax(out, -1), 1, generator=self.generator).squeeze(-1)

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


class BCLearner(Learner):
    """One Adam step per minibatch on the negative log-likelihood of the dataset's actions::

        Discrete: loss = mean(-log softmax(f(s))[a])      (cross-entropy)
        Box:      loss = mean(||mu(s) - a||^2)             (a deterministic policy's MLE under a fixed Gaussian)
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: BCConfig = ctx.hparams
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        self.parameters = list(self.policy.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One update on a minibatch.

        Args:
            batch: a TensorDict of batch size ``(B,)`` with ``obs`` ``(B, *obs_shape)`` float32 and
                ``action`` ``(B,)`` int64 or ``(B, *action_shape)`` float32 (:class:`~msrl.rl.datasets.DatasetBuffer`).

        Returns:
            ``losses/bc_loss`` (a 0-d tensor); for Discrete actions also
            ``charts/accuracy``, the share of the batch's actions the policy ranks first.

        Raises:
            FloatingPointError: the loss is NaN or infinite (no step is taken).
        """
        out = self.policy(batch["obs"])
        if self.policy.discrete:
            loss = nn.functional.cross_entropy(out, batch["action"])
            extra = {"charts/accuracy": (out.detach().argmax(-1) == batch["action"]).float().mean()}
        else:
            loss = ((out - batch["action"].flatten(1)) ** 2).sum(-1).mean()
            extra = {}
        self.apply_gradients(loss, None)  # no clipping (d3rlpy's BC clips none)
        return {"losses/bc_loss": loss.detach(), **extra}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])


class BCTrainer(Trainer):
    """BC's loop body: a minibatch from the dataset, one learner update, the weights to the actor."""

    def reset(self) -> None:
        """The learner's initial weights to the actor."""
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """One gradient step on a minibatch of the dataset; returns the learner's metrics."""
        batch = self.buffer.sample()
        metrics = self.learner.learn(batch)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="bc",
    observation_spaces=(gymnasium.spaces.Box,),
    action_spaces=(gymnasium.spaces.Discrete, gymnasium.spaces.Box),
    hparams=BCConfig,
    trainer=BCTrainer,
    components={"actor": BCActor, "buffer": DatasetBuffer, "learner": BCLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: 0,
    policy_lag="corrected",  # it learns from a fixed dataset, never from what its actors did
    offline=True,
)
