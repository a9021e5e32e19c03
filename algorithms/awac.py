"""AWAC: Advantage-Weighted Actor-Critic (Nair, Gupta, Dalal and Levine 2020, "AWAC:
Accelerating Online Reinforcement Learning with Offline Datasets", arXiv:2006.09359, Algorithm 1
and Eq. 13), offline then online, as CORL's ``finetune/awac.py`` trains it: first
``offline_steps`` gradient steps on a dataset alone, then each iteration one step of every env
with the policy's sampled actions, added to the same replay buffer, and one gradient step.

The critics learn by TD, ``r + gamma (1 - d) min_i Q'_i(s', a')``, ``a' ~ pi(s')`` (no entropy
term); the policy by weighted maximum likelihood of the buffer's actions, each weighted by
``exp(A(s, a) / lambda)`` clipped at ``exp_adv_max``, ``A(s, a) = min_i Q_i(s, a) - min_i Q_i(s, a_pi)``
with ``a_pi ~ pi(s)`` (Eq. 13, the partition function left out as the paper's implementation
does). The policy never leaves the buffer's support by much: it clones the better actions, and
online it keeps improving from what it does itself.

Read top to bottom: hyperparameters, the Gaussian policy, the actor (a sample online, the mean
for evaluation), the learner and the trainer (its ``if`` on the iteration count is the phase:
both phases are one traced program). The dataset is the config's ``dataset:`` and the first
rows of the replay buffer (:class:`msrl.rl.datasets.DatasetReplayBuffer`); the budget is
``train.total_gradient_steps``, one per iteration over both phases (the online phase's env
steps are ``(total_gradient_steps - offline_steps) * env.num_envs``).
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
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.continuous import QNetwork, box_space, polyak_update_, relu_mlp
from msrl.rl.datasets import DatasetReplayBuffer

__all__ = ["AWACConfig", "AWACPolicy", "AWACActor", "AWACLearner", "AWACTrainer", "ALGORITHM", "advantage_weights"]


@dataclasses.dataclass
class AWACConfig:
    """AWAC's hyperparameters (CORL's ``finetune/awac.py`` defaults but the phases' lengths)."""

    learning_rate: PositiveFloat = 3e-4
    """Adam learning rate of the policy and of the twin critics"""
    batch_size: PositiveInt = 256
    """transitions per gradient step (per learner replica under multi_learner)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: UnitInterval = 0.005
    """Polyak averaging rate of the target critics"""
    awac_lambda: PositiveFloat = 1.0
    """temperature lambda of the advantage weights exp(A / lambda) (Eq. 13)"""
    exp_adv_max: PositiveFloat = 100.0
    """the largest advantage weight (CORL's clip)"""
    offline_steps: NonNegativeInt = 5000
    """gradient steps on the dataset alone before the env is stepped (0: online from the first iteration)"""
    buffer_size: PositiveInt = 100_000
    """online transitions the replay buffer holds beside the dataset's (per buffer)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy and of the critics (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


#: bounds of the policy's log standard deviation, in units of the action's half-range (d3rlpy's AWAC)
LOG_STD_MIN, LOG_STD_MAX = -6.0, 0.0


class AWACPolicy(nn.Module):
    """A Gaussian policy over a bounded Box: the mean ``c + h * tanh(f(s))`` (``c``, ``h`` the
    bounds' centre and half-range), a state-independent standard deviation
    ``h * exp(clamp(log_std, LOG_STD_MIN, LOG_STD_MAX))`` (d3rlpy's ``AWAC``; CORL's has the
    same parameter). Observations ``(B, *obs_shape)`` float32.

    Raises:
        ValueError: a non-Box space, or an action space with infinite bounds.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...]) -> None:
        super().__init__()
        obs, act = box_space(observation_space, "observation", "AWAC"), box_space(action_space, "action", "AWAC")
        if not (np.isfinite(act.low).all() and np.isfinite(act.high).all()):
            raise ValueError(f"AWAC needs a bounded action space, got {act}")
        n_act = int(np.prod(act.shape))
        self.mu = relu_mlp(int(np.prod(obs.shape)), hidden, n_act)
        self.log_std = nn.Parameter(torch.zeros(n_act))
        low, high = (torch.as_tensor(b, dtype=torch.float32).flatten() for b in (act.low, act.high))
        self.register_buffer("low", low)
        self.register_buffer("high", high)
        self.action_shape = tuple(act.shape)

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Normal:
        """The policy at ``obs``: a diagonal Normal with ``(B, n_act)`` mean and standard deviation."""
        centre, half = (self.high + self.low) / 2, (self.high - self.low) / 2
        mean = centre + half * torch.tanh(self.mu(obs.flatten(1)))
        std = half * self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).exp()
        return torch.distributions.Normal(mean, std.expand_as(mean))

    def sample(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Actions ``(B, n_act)`` drawn with ``generator`` (no gradient) and clipped into the bounds."""
        d = self.distribution(obs)
        noise = torch.randn(d.mean.shape, generator=generator, device=d.mean.device)
        return torch.maximum(torch.minimum(d.mean + d.stddev * noise, self.high), self.low).detach()

    def log_prob(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``log pi(a|s)`` of actions ``(B, n_act)``, summed over the action's dimensions: ``(B,)``."""
        return self.distribution(obs).log_prob(action.flatten(1)).sum(-1)


def build_policy(ctx: BuildContext) -> AWACPolicy:
    """The :class:`AWACPolicy` of ``ctx``'s spaces, initialised from ``ctx.seed`` alone (the
    global RNG untouched), on ``ctx.device``: the actor's and the learner's copies start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = AWACPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


def advantage_weights(q_data: torch.Tensor, v: torch.Tensor, awac_lambda: float, exp_adv_max: float) -> torch.Tensor:
    """AWAC's weights of the buffer's actions (Nair et al. 2020, Eq. 13, without the partition
    function): ``min(exp((Q(s, a) - V(s)) / lambda), exp_adv_max)``.

    Args:
        q_data: ``Q(s, a)`` of the buffer's actions, ``(B,)``.
        v: the policy's value ``V(s)`` estimated as ``Q(s, a_pi)``, ``(B,)``.
        awac_lambda: the temperature, > 0.
        exp_adv_max: the largest weight, > 0.

    Returns:
        ``(B,)`` weights in ``(0, exp_adv_max]``, without gradient.
    """
    return torch.exp((q_data - v).detach() / awac_lambda).clamp(max=exp_adv_max)


class AWACActor(Actor):
    """Acts with the policy: its mean (``deterministic``: evaluation) or a sample clipped into the
    bounds (the online phase), the noise from the actor's own generator (seeded ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N, *action_shape)`` float32 within the bounds for observations ``(N, *obs_shape)``."""
        action = self.policy.distribution(obs).mean if deterministic else self.policy.sample(obs, self.generator)
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


class AWACLearner(Learner):
    """The twin critics' TD step, then the policy's advantage-weighted likelihood step (each its
    own Adam optimiser), then the target critics averaged."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: AWACConfig = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = build_policy(ctx)
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf1 = QNetwork(spec.observation_space, spec.action_space, hidden, "AWAC").to(dev)
            self.qf2 = QNetwork(spec.observation_space, spec.action_space, hidden, "AWAC").to(dev)
        self.qf1_target = QNetwork(spec.observation_space, spec.action_space, hidden, "AWAC").to(dev)
        self.qf2_target = QNetwork(spec.observation_space, spec.action_space, hidden, "AWAC").to(dev)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_parameters = [*self.qf1.parameters(), *self.qf2.parameters()]
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=self.hp.learning_rate)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.learning_rate)
        self.parameters = [*self.q_parameters, *self.policy.parameters()]
        self.optimizer = self.q_optimizer
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(ctx.seed + 3)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One AWAC step on a minibatch.

        Args:
            batch: a TensorDict of batch size ``(B,)`` with ``obs``, ``next_obs`` ``(B, *obs_shape)``
                and ``action`` ``(B, *action_shape)`` float32, ``reward`` float32 and ``terminated``
                bool (:class:`~msrl.rl.datasets.DatasetReplayBuffer`).

        Returns:
            ``losses/qf_loss``, ``losses/actor_loss``, ``losses/qf1_values`` and
            ``charts/advantage_weight`` (the batch's mean weight), 0-d tensors.

        Raises:
            FloatingPointError: a loss is NaN or infinite (that step is not taken).
        """
        hp = self.hp
        obs, action, next_obs = batch["obs"], batch["action"].flatten(1), batch["next_obs"]
        with torch.no_grad():
            next_a = self.policy.sample(next_obs, self.generator)
            next_q = torch.min(self.qf1_target(next_obs, next_a), self.qf2_target(next_obs, next_a))
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_q
        q1, q2 = self.qf1(obs, action), self.qf2(obs, action)
        qf_loss = (q1 - target).pow(2).mean() + (q2 - target).pow(2).mean()
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)

        with torch.no_grad():
            a_pi = self.policy.sample(obs, self.generator)
            v = torch.min(self.qf1(obs, a_pi), self.qf2(obs, a_pi))
            q_data = torch.min(self.qf1(obs, action), self.qf2(obs, action))
        weights = advantage_weights(q_data, v, hp.awac_lambda, hp.exp_adv_max)
        actor_loss = -(self.policy.log_prob(obs, action) * weights).mean()
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        with torch.no_grad():
            polyak_update_(self.qf1_target, self.qf1, hp.tau)
            polyak_update_(self.qf2_target, self.qf2, hp.tau)
        return {"losses/qf_loss": qf_loss.detach(), "losses/actor_loss": actor_loss.detach(),
                "losses/qf1_values": q1.detach().mean(), "charts/advantage_weight": weights.mean()}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        nets = ("policy", "qf1", "qf2", "qf1_target", "qf2_target")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(q_optimizer=self.q_optimizer.state_dict(), policy_optimizer=self.policy_optimizer.state_dict(),
                     generator=self.generator.get_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for n in ("policy", "qf1", "qf2", "qf1_target", "qf2_target"):
            getattr(self, n).load_state_dict(state[n])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])
        self.generator.set_state(state["generator"])


class AWACTrainer(Trainer):
    """AWAC's loop body: past ``offline_steps`` iterations one step of every env with sampled
    actions into the replay buffer; every iteration one learner step on a minibatch of it and the
    policy to the actor."""

    def reset(self) -> None:
        """First observations, the iteration count, the learner's policy to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.iteration = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration (the online phase's env step when it has begun, then one gradient step);
        returns the learner's metrics."""
        if self.iteration >= self.hparams.offline_steps:
            action = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
            self.obs = next_obs
        self.iteration += 1
        batch = self.buffer.sample()
        metrics = self.learner.learn(batch)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="awac",
    observation_spaces=(gymnasium.spaces.Box,),
    action_spaces=(gymnasium.spaces.Box,),
    hparams=AWACConfig,
    trainer=AWACTrainer,
    components={"actor": AWACActor, "buffer": DatasetReplayBuffer, "learner": AWACLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: 0,  # the offline phase's; the online phase's steps are counted
    policy_lag="corrected",  # off-policy: learns from a replay buffer
    offline=True,
)
