"""Deep Deterministic Policy Gradient (Lillicrap et al. 2016, "Continuous control with deep
reinforcement learning", arXiv:1509.02971, Algorithm 1), as CleanRL's
``ddpg_continuous_action.py`` writes it: one Q-network and a deterministic policy, each with a
Polyak-averaged target, Gaussian exploration noise (in place of the paper's Ornstein-Uhlenbeck
process, as CleanRL and Fujimoto et al. 2018 do).

Read top to bottom: hyperparameters, the learner (the Q-network, the policy, their targets, two
Adam optimisers) and the trainer: uniform random actions until ``learning_starts``, one critic
update per env step after it, and every ``policy_frequency`` critic updates one policy update and
the targets' averaging (CleanRL: 2; the paper and SB3: 1) -- all ``if``s on step counters. The
networks, the noisy actor and Polyak averaging are :mod:`msrl.rl.continuous`'s (shared with
TD3); the replay buffer is :class:`msrl.rl.buffers.ReplayBuffer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import gymnasium
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from msrl.api import (
    AlgorithmSpec,
    BuildContext,
    Fraction,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.buffers import ReplayBuffer
from msrl.rl.continuous import (
    DeterministicActor,
    QNetwork,
    build_deterministic_policy,
    polyak_update_,
)

__all__ = ["DDPGConfig", "DDPGActor", "DDPGLearner", "DDPGTrainer", "ALGORITHM"]


@dataclasses.dataclass
class DDPGConfig:
    """DDPG's hyperparameters (CleanRL's names and defaults)."""

    buffer_size: PositiveInt = 1_000_000
    """replay capacity in transitions"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: Fraction = 0.005
    """target networks' Polyak rate"""
    batch_size: PositiveInt = 256
    """transitions per gradient step"""
    learning_starts: NonNegativeInt = 25_000
    """env steps of uniform random actions before learning starts"""
    learning_rate: PositiveFloat = 3e-4
    """Adam learning rate of the policy and of the Q-networks"""
    exploration_noise: NonNegativeFloat = 0.1
    """std of the Gaussian acting noise, a fraction of the action range's half-width"""
    policy_frequency: PositiveInt = 2
    """critic updates between policy (and target) updates (CleanRL: 2; the paper: 1)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy and of each Q-network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class DDPGActor(DeterministicActor):
    """DDPG's acting: the deterministic policy plus Gaussian noise (:class:`msrl.rl.continuous.DeterministicActor`)."""

    algorithm = "DDPG"


class DDPGLearner(Learner):
    """Q-learning towards the target networks' value and the deterministic policy gradient
    through the Q-network (Lillicrap et al. 2016, Algorithm 1)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: DDPGConfig = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = build_deterministic_policy(ctx, "DDPG")
        self.policy_target = build_deterministic_policy(ctx, "DDPG")
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf = QNetwork(spec.observation_space, spec.action_space, hidden, "DDPG").to(dev)
        self.qf_target = QNetwork(spec.observation_space, spec.action_space, hidden, "DDPG").to(dev)
        self.qf_target.load_state_dict(self.qf.state_dict())
        self.q_parameters = list(self.qf.parameters())
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=self.hp.learning_rate)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.learning_rate)
        self.optimizer = self.q_optimizer

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One critic update (:meth:`update_critic`)."""
        return self.update_critic(batch)

    def update_critic(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """The Q-network towards ``y = r + gamma (1 - d) Q'(s', mu'(s'))`` (Algorithm 1).

        Args:
            batch: TensorDict ``(B,)`` with :attr:`ReplayBuffer.KEYS`.

        Returns:
            ``losses/qf_loss``, ``losses/qf_values`` (0-d tensors).
        """
        hp = self.hp
        with torch.no_grad():
            next_q = self.qf_target(batch["next_obs"], self.policy_target(batch["next_obs"]))
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_q
        q = self.qf(batch["obs"], batch["action"])
        qf_loss = F.mse_loss(q, target)
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)
        return {"losses/qf_loss": qf_loss.detach(), "losses/qf_values": q.detach().mean()}

    def update_actor(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """The policy up the gradient of ``Q(s, mu(s))`` (the deterministic policy gradient,
        Silver et al. 2014).

        Returns:
            ``losses/actor_loss`` (0-d tensor).
        """
        for p in self.q_parameters:  # the critics pass gradients to the action only
            p.requires_grad_(False)
        try:
            actor_loss = -self.qf(batch["obs"], self.policy(batch["obs"])).mean()
        finally:
            for p in self.q_parameters:
                p.requires_grad_(True)
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        return {"losses/actor_loss": actor_loss.detach()}

    def update_targets(self) -> None:
        """Every target towards its network: ``theta' <- tau theta + (1 - tau) theta'``."""
        polyak_update_(self.policy_target, self.policy, self.hp.tau)
        polyak_update_(self.qf_target, self.qf, self.hp.tau)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        """Every network and both optimisers."""
        nets = ("policy", "policy_target", "qf", "qf_target")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(q_optimizer=self.q_optimizer.state_dict(), policy_optimizer=self.policy_optimizer.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s networks and optimisers."""
        for n in ("policy", "policy_target", "qf", "qf_target"):
            getattr(self, n).load_state_dict(state[n])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])


class DDPGTrainer(Trainer):
    """DDPG's loop body: one env step (random actions before ``learning_starts``), then one
    critic update and, every ``policy_frequency`` of them, the policy and target updates."""

    def reset(self) -> None:
        """First observations, step counters, the learner's policy to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.num_updates = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One env step and, once learning has started, the updates; returns their metrics."""
        hp = self.hparams
        if self.global_step < hp.learning_starts:
            action = self.actor.random_action(self.obs)
        else:
            action = self.actor.act(self.obs)
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"], terminated=terminated)
        self.obs = next_obs
        self.global_step += self.num_envs
        metrics = {}
        if self.global_step > hp.learning_starts:
            batch = self.buffer.sample()
            metrics = self.learner.update_critic(batch)
            self.num_updates += 1
            if self.num_updates % hp.policy_frequency == 0:
                metrics = {**metrics, **self.learner.update_actor(batch)}
                self.learner.update_targets()
                self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="ddpg",
    hparams=DDPGConfig,
    trainer=DDPGTrainer,
    components={"actor": DDPGActor, "buffer": ReplayBuffer, "learner": DDPGLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: total_num_envs,
    action_spaces=(gymnasium.spaces.Box,),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
