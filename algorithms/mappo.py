"""MAPPO: multi-agent PPO with decentralised actors and a centralised critic (Yu et al. 2022,
"The Surprising Effectiveness of PPO in Cooperative Multi-Agent Games", arXiv:2103.01955).

Every agent acts with one shared actor from its own observation and its agent index (one-hot,
as the paper's implementation appends the agent id); one shared critic values agent ``i`` from
the *global* state -- all agents' observations of the env concatenated -- and ``i``'s index
(the paper's agent-specific global state, section 4.1). Training is centralised, execution
decentralised: acting needs only the actor. The update is PPO's
(:meth:`msrl.components.PPOLearner.update`: clipped surrogate, clipped value loss, entropy
bonus, epochs of shuffled minibatches) over all agent-steps, with GAE per agent.

Envs: ``(E, A, D)`` observations, per-agent rewards ``(E, A)``, one ``terminated``/``truncated``
per env (a PettingZoo parallel env such as MPE's ``simple_spread``, msrl's native Tag). Actions
per agent: ``Discrete`` (``(E, A)``) or ``MultiDiscrete`` (``(E, A, k)``, independent
Categoricals whose log-probabilities add).

    msrl train configs/mappo_simple_spread.yaml
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from msrl.advantages import gae
from msrl.api import AlgorithmSpec, BuildContext, NonNegativeFloat, PositiveFloat
from msrl.components import (
    OnPolicyTrainer,
    PPOActor,
    PPOConfig,
    PPOLearner,
    RolloutBuffer,
    categorical_log_prob_entropy,
    mlp,
    sample_categorical,
)

__all__ = ["MAPPOConfig", "MAPPONet", "MAPPOActor", "MAPPOBuffer", "MAPPOLearner", "MAPPOTrainer", "ALGORITHM"]


@dataclasses.dataclass
class MAPPOConfig(PPOConfig):
    """PPO's hyperparameters (:class:`msrl.components.PPOConfig`), with the MAPPO paper's
    MPE learning rate (7e-4) and entropy coefficient (0.01) as defaults."""

    learning_rate: PositiveFloat = 7e-4
    ent_coef: NonNegativeFloat = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.normalize_obs or self.normalize_reward:
            raise ValueError("normalize_obs and normalize_reward are PPO's single-agent options; mappo does not "
                             "normalize (leave them false)")


def _nvec(space: gymnasium.Space) -> list[int]:
    if isinstance(space, gymnasium.spaces.Discrete):
        return [int(space.n)]
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        return [int(n) for n in space.nvec]
    raise ValueError(f"MAPPO needs Discrete or MultiDiscrete agent actions, got {space}")


class MAPPONet(nn.Module):
    """The shared actor ``pi(a | o_i, i)`` and the centralised critic ``V(o_1..o_A, i)``.

    Args:
        observation_space: one agent's Box ``(D,)``; action_space: one agent's Discrete or
        MultiDiscrete; num_agents: ``A``; hidden_sizes: widths of the hidden layers.

    Raises:
        ValueError: other action spaces.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, num_agents: int,
                 hidden_sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.nvec, self.num_agents = _nvec(action_space), num_agents
        self.discrete = isinstance(action_space, gymnasium.spaces.Discrete)
        d = int(np.prod(observation_space.shape))
        self.actor = mlp(d + num_agents, hidden_sizes, sum(self.nvec), out_std=0.01)
        self.critic = mlp(num_agents * d + num_agents, hidden_sizes, 1, out_std=1.0)
        self.register_buffer("agent_id", torch.eye(num_agents), persistent=False)

    def _ids(self, obs: torch.Tensor) -> torch.Tensor:
        """One-hot agent indices ``(E, A, A)`` for observations ``(E, A, D)``."""
        return self.agent_id.expand(obs.shape[0], -1, -1)

    def logits(self, obs: torch.Tensor) -> list[torch.Tensor]:
        """Per action component, logits ``(E, A, n_k)`` of observations ``(E, A, D)``."""
        x = torch.cat([obs.flatten(2), self._ids(obs)], dim=-1)
        return list(torch.split(self.actor(x), self.nvec, dim=-1))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(global state, i)`` ``(E, A)`` of observations ``(E, A, D)``."""
        E, A = obs.shape[:2]
        state = obs.flatten(1).unsqueeze(1).expand(E, A, -1)  # every agent sees the env's global state
        return self.critic(torch.cat([state, self._ids(obs)], dim=-1)).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)``, each ``(E, A)``, of actions ``(E, A, k)``."""
        log_prob = torch.zeros(obs.shape[:2], device=obs.device)
        entropy = torch.zeros(obs.shape[:2], device=obs.device)
        for k, lg in enumerate(self.logits(obs)):
            lp, ent = categorical_log_prob_entropy(lg.flatten(0, 1), action[..., k].flatten())
            log_prob = log_prob + lp.view(obs.shape[:2])
            entropy = entropy + ent.view(obs.shape[:2])
        return log_prob, entropy, self.value(obs)


def _build_net(ctx: BuildContext) -> MAPPONet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = MAPPONet(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.env_spec.num_agents,
                       ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


class MAPPOActor(PPOActor):
    """Acts for every agent of every env from the shared actor; samples from its own generator
    (weights and state handling as :class:`msrl.components.PPOActor`)."""

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """A :class:`MAPPONet`."""
        return _build_net(ctx)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chooses actions.

        Args:
            obs: ``(E, A, D)`` float32; deterministic: argmax instead of sampling.

        Returns:
            ``(action, log_prob, value)``: action ``(E, A)`` int64 (Discrete) or ``(E, A, k)``
            (MultiDiscrete); log_prob and value ``(E, A)`` float32.
        """
        net = self.net
        actions, log_prob = [], torch.zeros(obs.shape[:2], device=obs.device)
        for lg in net.logits(obs):
            lp = torch.log_softmax(lg, dim=-1)
            if deterministic:
                a = lg.argmax(-1)
            else:
                a = sample_categorical(lp.exp().flatten(0, 1), self.generator).view(obs.shape[:2])
            actions.append(a)
            log_prob = log_prob + lp.gather(-1, a.unsqueeze(-1)).squeeze(-1)
        action = actions[0] if net.discrete else torch.stack(actions, dim=-1)
        return action, log_prob, net.value(obs)


class MAPPOBuffer(RolloutBuffer):
    """Preallocated ``(T, E, ...)`` storage: ``obs``/``next_obs`` ``(T, E, A, D)``, ``action``
    ``(T, E, A)`` or ``(T, E, A, k)`` int64, ``log_prob``, ``value``, ``reward`` ``(T, E, A)``,
    ``terminated``/``truncated`` ``(T, E)`` bool (insert, gather and checkpoints as
    :class:`msrl.components.RolloutBuffer`)."""

    def __init__(self, ctx: BuildContext) -> None:
        spec, T = ctx.env_spec, ctx.hparams.num_steps
        E, A, D = spec.num_envs, spec.num_agents, int(np.prod(spec.observation_space.shape))
        nvec = _nvec(spec.action_space)
        act_shape = (A,) if isinstance(spec.action_space, gymnasium.spaces.Discrete) else (A, len(nvec))
        f32, dev = torch.float32, ctx.device
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
                "action": torch.zeros(T, E, *act_shape, dtype=torch.int64, device=dev),
                "log_prob": torch.zeros(T, E, A, dtype=f32, device=dev),
                "value": torch.zeros(T, E, A, dtype=f32, device=dev),
                "reward": torch.zeros(T, E, A, dtype=f32, device=dev),
                "terminated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
            },
            batch_size=[T, E],
            device=dev,
        )
        self.t = 0


class MAPPOLearner(PPOLearner):
    """PPO's update over every agent-step of a ``(T, E, A)`` rollout, values from the
    centralised critic."""

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """A :class:`MAPPONet`."""
        return _build_net(ctx)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One PPO update (see :meth:`msrl.components.PPOLearner.learn` for the metrics).

        Args:
            batch: TensorDict of batch size ``(T, E)`` with :attr:`MAPPOBuffer.KEYS`.
        """
        hp, net = self.hp, self.net
        lr, clip = self.schedule()
        T, E, A, D = batch["obs"].shape
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].reshape(T * E, A, D)).view(T, E * A)
        term = batch["terminated"][:, :, None].expand(T, E, A).reshape(T, E * A)
        trunc = batch["truncated"][:, :, None].expand(T, E, A).reshape(T, E * A)
        advantages, returns = gae(batch["reward"].reshape(T, E * A), batch["value"].reshape(T, E * A), next_values,
                                  term, trunc, hp.gamma, hp.gae_lambda)
        # minibatches of whole env-steps: the critic needs every agent's observation of the env
        b_obs = batch["obs"].reshape(T * E, A, D)
        b_actions = batch["action"].reshape(T * E, A, -1)
        shape = (T * E, A)
        b_logprobs, b_values = batch["log_prob"].reshape(shape), batch["value"].reshape(shape)
        b_advantages, b_returns = advantages.reshape(shape), returns.reshape(shape)

        return self.update(lambda mb: net.evaluate(b_obs[mb], b_actions[mb]), b_logprobs, b_values, b_advantages,
                           b_returns, lr, clip)


class MAPPOTrainer(OnPolicyTrainer):
    """MAPPO's loop body is the on-policy one (:class:`msrl.components.OnPolicyTrainer`): a
    rollout of every agent of every env for ``num_steps`` steps, one learner update, weight sync."""


ALGORITHM = AlgorithmSpec(
    name="mappo",
    hparams=MAPPOConfig,
    trainer=MAPPOTrainer,
    components={"actor": MAPPOActor, "buffer": MAPPOBuffer, "learner": MAPPOLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete),
    num_agents=(2, None),
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
