"""Fakes for running a whole job inside a unit test (as Acme's ``testing/fakes.py``): a fake env
(a registered gymnasium id), a fake actor, buffer and learner, and a fake algorithm
(``ALGORITHM``: ``algorithm.name: fakes`` with this folder on ``sys.path``) whose
``train_step`` has the on-policy shape -- a rollout loop, one gradient step, the weights back.

Everything is tiny and exact: the actor is a threshold on one learned weight, the learner one
SGD step of a squared error, so a test can reason about every value and a job builds and runs in
well under a second per iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict

from msrl.api import Actor, AlgorithmSpec, Buffer, BuildContext, Learner, PositiveFloat, PositiveInt, Trainer

__all__ = ["ENV_ID", "CounterEnv", "FakeConfig", "FakeActor", "FakeBuffer", "FakeLearner", "FakeTrainer", "ALGORITHM"]

#: the fake env's gymnasium id
ENV_ID = "MsrlFakes/Counter-v0"


class CounterEnv(gymnasium.Env):
    """Observations of 3 uniform floats in [-1, 1]; reward 1 when the action (0 or 1) says
    whether the first is positive; episodes of ``length`` steps (then truncated)."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, length: int = 10) -> None:
        self.length, self.t, self.obs = length, 0, np.zeros(3, np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return self.obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float(int(action) == int(self.obs[0] > 0))
        self.t += 1
        self.obs = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        return self.obs, reward, False, self.t >= self.length, {}


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=CounterEnv)


@dataclasses.dataclass
class FakeConfig:
    """The fake algorithm's hyperparameters."""

    num_steps: PositiveInt = 4
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 0.1
    """SGD step size"""


class FakeActor(Actor):
    """Acts ``obs[:, 0] * w > 0`` with the learner's weight ``w`` (a 1-element tensor)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.w = torch.zeros(1)

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """``(N, 3)`` float32 observations -> ``(N,)`` int64 actions."""
        return (obs[:, 0] * self.w > 0).long()

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.clone()}

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.w = weights["w"].clone()

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = state["w"].clone()


class FakeBuffer(Buffer):
    """Holds one rollout; :meth:`gather` returns it as a ``(T, N)`` TensorDict and empties it."""

    def __init__(self, ctx: BuildContext) -> None:
        self.rows: list[dict[str, torch.Tensor]] = []

    def insert(self, obs: torch.Tensor, action: torch.Tensor, reward: torch.Tensor) -> None:
        self.rows.append({"obs": obs, "action": action, "reward": reward})

    def gather(self) -> TensorDict:
        """The rollout: ``obs`` ``(T, N, 3)``, ``action`` and ``reward`` ``(T, N)``."""
        out = TensorDict({k: torch.stack([r[k] for r in self.rows]) for k in ("obs", "action", "reward")},
                         batch_size=[len(self.rows), self.rows[0]["reward"].shape[0]])
        self.rows = []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rows": list(self.rows)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = list(state["rows"])


class FakeLearner(Learner):
    """One SGD step per rollout of ``(w * obs[..., 0] - (2 * reward - 1) * sign)^2``: ``w`` grows
    where acting on the first observation's sign was rewarded."""

    def __init__(self, ctx: BuildContext) -> None:
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.parameters = [self.w]  # what apply_gradients steps and all-reduces
        self.optimizer = torch.optim.SGD(self.parameters, lr=ctx.hparams.learning_rate)

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        x = batch["obs"][..., 0]
        chose = 2.0 * batch["action"].float() - 1.0
        target = (2.0 * batch["reward"] - 1.0) * chose
        loss = (self.w * x - target).square().mean()
        self.apply_gradients(loss)
        return {"losses/fake_loss": loss.detach(), "charts/w": self.w.detach()[0]}

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.detach().clone()}

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self.w.copy_(state["w"])
        self.optimizer.load_state_dict(state["optimizer"])


class FakeTrainer(Trainer):
    """The on-policy loop body: a rollout of ``num_steps`` steps, one learner step, weights back."""

    def reset(self) -> None:
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, torch.Tensor]:
        for _step in range(self.hparams.num_steps):
            action = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(self.obs, action, reward)
            self.obs = next_obs
        metrics = self.learner.learn(self.buffer.gather())
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="fakes",
    hparams=FakeConfig,
    trainer=FakeTrainer,
    components={"actor": FakeActor, "buffer": FakeBuffer, "learner": FakeLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    policy_lag="corrected",
)
