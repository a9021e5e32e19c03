"""CQL: Conservative Q-Learning (Kumar, Zhou, Tucker and Levine 2020, "Conservative Q-Learning for
Offline Reinforcement Learning", NeurIPS, Eq. 4, the CQL(H) variant, on SAC), offline, for Box
actions, as CORL's ``cql.py`` and d3rlpy's ``CQL`` write it.

SAC's updates on the dataset's transitions, with the critics pushed down on actions the dataset
does not hold: each critic's loss adds ``cql_alpha * (logsumexp_a Q(s, a) - Q(s, a_data))``, the
log-sum-exp estimated by importance sampling over ``n_actions`` uniformly random actions and
``n_actions`` of the current policy at ``s`` and at ``s'`` (Appendix F: each value less its
sampling log-density). The target ``r + gamma (1 - d) min_i Q'_i(s', a')``, ``a' ~ pi(s')`` (or
with ``deterministic_backup`` the policy's mean ``tanh(mu(s'))``, d3rlpy's), has no entropy term
(CORL's ``backup_entropy: false``); the policy and the temperature are SAC's.

Read top to bottom: hyperparameters, the actor (what evaluation acts with), the learner and the
trainer (each iteration one minibatch of the dataset, the critic step, the policy and temperature
steps, the target averaging, the policy to the actor). SAC's policy and Q-network are
:mod:`msrl.rl.continuous`'s. The dataset is the config's ``dataset:``; the budget
``train.total_gradient_steps``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict

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
from msrl.rl.continuous import QNetwork, SquashedGaussianPolicy, polyak_update_
from msrl.rl.datasets import DatasetBuffer

__all__ = ["CQLConfig", "CQLActor", "CQLLearner", "CQLTrainer", "ALGORITHM", "conservative_penalty"]


@dataclasses.dataclass
class CQLConfig:
    """CQL's hyperparameters (CORL's and d3rlpy's continuous-control defaults)."""

    critic_lr: PositiveFloat = 3e-4
    """Adam learning rate of the twin critics"""
    actor_lr: PositiveFloat = 1e-4
    """Adam learning rate of the policy"""
    temperature_lr: PositiveFloat = 1e-4
    """Adam learning rate of SAC's entropy temperature"""
    initial_temperature: PositiveFloat = 1.0
    """SAC's entropy temperature at the start (tuned towards an entropy of -action_dim)"""
    batch_size: PositiveInt = 256
    """transitions per gradient step (per learner replica under multi_learner)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: UnitInterval = 0.005
    """Polyak averaging rate of the target critics"""
    cql_alpha: NonNegativeFloat = 5.0
    """weight of the conservative penalty (0: SAC on the dataset)"""
    n_actions: PositiveInt = 10
    """actions sampled per state, each of the three kinds, for the log-sum-exp"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy and of the critics (ReLU)"""
    deterministic_backup: bool = False
    """the target's next action: the policy's mean ``tanh(mu(s'))`` (d3rlpy) instead of a sample (CORL)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


def build_policy(ctx: BuildContext) -> SquashedGaussianPolicy:
    """SAC's squashed Gaussian policy of ``ctx``'s spaces, initialised from ``ctx.seed`` alone
    (the global RNG untouched), on ``ctx.device``: the actor's and the learner's copies start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = SquashedGaussianPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes,
                                     algorithm="CQL")
    return net.to(ctx.device)


def conservative_penalty(q_data: torch.Tensor, q_sampled: torch.Tensor, log_density: torch.Tensor) -> torch.Tensor:
    """CQL(H)'s regulariser (Kumar et al. 2020, Eq. 4; the importance-sampled log-sum-exp of
    Appendix F): ``mean_s(logsumexp_k(Q(s, a_k) - log mu(a_k|s)) - Q(s, a_data))``.

    Args:
        q_data: ``Q(s, a_data)``, ``(B,)``.
        q_sampled: ``Q(s, a_k)`` of the sampled actions, ``(B, K)``.
        log_density: each sample's log-density under the distribution it was drawn from, ``(B, K)``.

    Returns:
        a 0-d tensor.
    """
    return (torch.logsumexp(q_sampled - log_density, dim=1) - q_data).mean()


class CQLActor(Actor):
    """Acts with the policy: ``tanh(mu(s))`` within the bounds (``deterministic``), else a
    sample, the noise from the actor's own generator (seeded ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N, *action_shape)`` float32 within the bounds for observations ``(N, *obs_shape)``."""
        action, _ = self.policy(obs, self.generator, deterministic=deterministic)
        return action.view(action.shape[0], *self.policy.action_shape)

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


class CQLLearner(Learner):
    """The twin critics with the conservative penalty, SAC's policy and temperature, each with
    its own Adam optimiser, then the target critics averaged."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: CQLConfig = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf1 = QNetwork(spec.observation_space, spec.action_space, hidden, "CQL").to(dev)
            self.qf2 = QNetwork(spec.observation_space, spec.action_space, hidden, "CQL").to(dev)
        self.qf1_target = QNetwork(spec.observation_space, spec.action_space, hidden, "CQL").to(dev)
        self.qf2_target = QNetwork(spec.observation_space, spec.action_space, hidden, "CQL").to(dev)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_parameters = [*self.qf1.parameters(), *self.qf2.parameters()]
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=self.hp.critic_lr)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.actor_lr)
        self.log_alpha = torch.full((1,), math.log(self.hp.initial_temperature), device=dev, requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=self.hp.temperature_lr)
        self.parameters = [*self.q_parameters, *self.policy.parameters()]
        self.optimizer = self.q_optimizer
        self.target_entropy = -float(np.prod(spec.action_space.shape))
        space = spec.action_space
        self.low = torch.as_tensor(space.low, dtype=torch.float32, device=dev).flatten()
        self.high = torch.as_tensor(space.high, dtype=torch.float32, device=dev).flatten()
        #: log-density of the uniform proposal over the action box
        self.uniform_log_density = -float(torch.log(self.high - self.low).sum())
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(ctx.seed + 3)

    def _q_both(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both critics on ``K`` actions per state: obs ``(B, *obs_shape)``, actions ``(B, K, n_act)``
        -> two ``(B, K)``."""
        B, K = actions.shape[:2]
        rep = obs.flatten(1).repeat_interleave(K, dim=0)
        flat = actions.reshape(B * K, -1)
        return self.qf1(rep, flat).view(B, K), self.qf2(rep, flat).view(B, K)

    def _policy_samples(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``n_actions`` actions of the current policy per state and their log-probabilities,
        ``(B, K, n_act)`` and ``(B, K)``, without gradient."""
        with torch.no_grad():  # one pass over the B states, K samples each
            return self.policy(obs, self.generator, n_samples=self.hp.n_actions)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One CQL step on a minibatch.

        Args:
            batch: a TensorDict of batch size ``(B,)`` with ``obs``, ``next_obs`` ``(B, *obs_shape)``
                and ``action`` ``(B, *action_shape)`` float32, ``reward`` float32, ``terminated``
                bool (:class:`~msrl.rl.datasets.DatasetBuffer`).

        Returns:
            ``losses/qf_loss``, ``losses/cql_penalty``, ``losses/actor_loss``, ``losses/alpha``,
            ``losses/alpha_loss`` and ``losses/qf1_values``, 0-d tensors.

        Raises:
            FloatingPointError: a loss is NaN or infinite (that step is not taken).
        """
        hp = self.hp
        obs, action, next_obs = batch["obs"], batch["action"].flatten(1), batch["next_obs"]
        B, K, n_act = obs.shape[0], hp.n_actions, action.shape[1]
        with torch.no_grad():
            next_a, _ = self.policy(next_obs, self.generator, deterministic=hp.deterministic_backup)
            next_q = torch.min(self.qf1_target(next_obs, next_a), self.qf2_target(next_obs, next_a))
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_q
        q1, q2 = self.qf1(obs, action), self.qf2(obs, action)
        td_loss = (q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()
        uniform = self.low + (self.high - self.low) * torch.rand((B, K, n_act), generator=self.generator, device=obs.device)
        here, here_logp = self._policy_samples(obs)
        there, there_logp = self._policy_samples(next_obs)
        sampled = torch.cat([uniform, here, there], dim=1)
        log_density = torch.cat([torch.full((B, K), self.uniform_log_density, device=obs.device), here_logp, there_logp], 1)
        s1, s2 = self._q_both(obs, sampled)
        penalty = conservative_penalty(q1, s1, log_density) + conservative_penalty(q2, s2, log_density)
        qf_loss = td_loss + hp.cql_alpha * penalty
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)

        alpha = self.log_alpha.detach().exp()
        a, logp = self.policy(obs, self.generator)
        for p in self.q_parameters:  # the critics pass gradients to the action only
            p.requires_grad_(False)
        try:
            q = torch.min(self.qf1(obs, a), self.qf2(obs, a))
        finally:
            for p in self.q_parameters:
                p.requires_grad_(True)
        actor_loss = (alpha * logp - q).mean()
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        alpha_loss = (-self.log_alpha.exp() * (logp.detach() + self.target_entropy)).mean()
        self.apply_gradients(alpha_loss, optimizer=self.alpha_optimizer)
        with torch.no_grad():
            polyak_update_(self.qf1_target, self.qf1, hp.tau)
            polyak_update_(self.qf2_target, self.qf2, hp.tau)
        return {"losses/qf_loss": qf_loss.detach(), "losses/cql_penalty": penalty.detach(),
                "losses/actor_loss": actor_loss.detach(), "losses/alpha": alpha.squeeze(0),
                "losses/alpha_loss": alpha_loss.detach(), "losses/qf1_values": q1.detach().mean()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        nets = ("policy", "qf1", "qf2", "qf1_target", "qf2_target")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(q_optimizer=self.q_optimizer.state_dict(), policy_optimizer=self.policy_optimizer.state_dict(),
                     alpha_optimizer=self.alpha_optimizer.state_dict(), log_alpha=self.log_alpha.detach().clone(),
                     generator=self.generator.get_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in ("policy", "qf1", "qf2", "qf1_target", "qf2_target"):
            getattr(self, n).load_state_dict(state[n])
        for n in ("q_optimizer", "policy_optimizer", "alpha_optimizer"):
            getattr(self, n).load_state_dict(state[n])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.generator.set_state(state["generator"])


class CQLTrainer(Trainer):
    """CQL's loop body: a minibatch from the dataset, one learner step, the policy to the actor."""

    def reset(self) -> None:
        """The learner's initial policy to the actor."""
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """One CQL step on a minibatch of the dataset; returns the learner's metrics."""
        batch = self.buffer.sample()
        metrics = self.learner.learn(batch)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="cql",
    observation_spaces=(gymnasium.spaces.Box,),
    action_spaces=(gymnasium.spaces.Box,),
    hparams=CQLConfig,
    trainer=CQLTrainer,
    components={"actor": CQLActor, "buffer": DatasetBuffer, "learner": CQLLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: 0,
    policy_lag="corrected",  # it learns from a fixed dataset, never from what its actors did
    offline=True,
)
