"""A test algorithm that draws only from the global generators, as CleanRL-style code does:
its networks are built with ``nn.Linear``'s default initialisation (torch's global generator),
its actor samples with ``torch.multinomial`` and explores with ``random.random()`` (Python's)
and ``np.random.randint`` (NumPy's), and its learner trains on a ``torch.randperm`` half of
each rollout. Nothing is seeded here: msrl seeds each replica's global generators.

The loop body is A2C's (:class:`msrl.algorithms.a2c.A2CTrainer`)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from msrl.algorithms.a2c import A2CConfig, A2CTrainer
from msrl.algorithms.ppo import RolloutBuffer
from msrl.api import Actor, AlgorithmSpec, BuildContext, Learner, ModuleWeights


@dataclasses.dataclass
class GlobalConfig(A2CConfig):
    """A2C's hyperparameters and the exploration rate."""

    epsilon: float = 0.2
    """probability of a uniformly random action per step (the whole batch)"""


class Net(nn.Module):
    """Policy logits and value from one MLP trunk, default (global-generator) initialisation."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        n_in = int(np.prod(ctx.env_spec.observation_space.shape))
        self.n = int(ctx.env_spec.action_space.n)
        self.trunk = nn.Sequential(nn.Linear(n_in, ctx.hparams.hidden_sizes[0]), nn.Tanh())
        self.pi = nn.Linear(ctx.hparams.hidden_sizes[0], self.n)
        self.v = nn.Linear(ctx.hparams.hidden_sizes[0], 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.trunk(obs.flatten(1))
        return torch.log_softmax(self.pi(x), -1), self.v(x).squeeze(-1)


class GlobalActor(Actor):
    def __init__(self, ctx: BuildContext) -> None:
        self.hp = ctx.hparams
        self.net = Net(ctx)
        self.weights = ModuleWeights(self.net)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False):
        log_probs, value = self.net(obs)
        if deterministic:
            action = log_probs.argmax(-1)
        elif random.random() < self.hp.epsilon:
            action = torch.from_numpy(np.random.randint(self.net.n, size=obs.shape[0])).long()
        else:
            action = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1), value

    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])


class GlobalLearner(Learner):
    def __init__(self, ctx: BuildContext) -> None:
        self.hp = ctx.hparams
        self.net = Net(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate)

    def learn(self, batch: Any) -> dict[str, Any]:
        T, N = batch.batch_size
        rows = torch.randperm(T * N)[: max(1, T * N // 2)]
        flat = batch.flatten(0, 1)[rows]
        returns = flat["reward"] + self.hp.gamma * flat["value"] * (~flat["terminated"]).float()
        log_probs, value = self.net(flat["obs"])
        adv = returns - flat["value"]
        pg = -(adv * log_probs.gather(-1, flat["action"].unsqueeze(-1)).squeeze(-1)).mean()
        v_loss = ((returns - value) ** 2).mean()
        grad_norm = self.apply_gradients(pg + 0.5 * v_loss, self.hp.max_grad_norm)
        return {"losses/policy_loss": pg.detach(), "losses/value_loss": v_loss.detach(), "losses/grad_norm": grad_norm}

    def get_weights(self) -> dict[str, torch.Tensor]:
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])


class GlobalTrainer(A2CTrainer):
    """A2C's loop body."""


ALGORITHM = AlgorithmSpec(
    name="global_rng",
    hparams=GlobalConfig,
    trainer=GlobalTrainer,
    components={"actor": GlobalActor, "buffer": RolloutBuffer, "learner": GlobalLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
)
