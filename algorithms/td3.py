"""Twin Delayed DDPG (Fujimoto, van Hoof and Meger 2018, "Addressing Function Approximation Error
in Actor-Critic Methods", arXiv:1802.09477: clipped double Q-learning, Eq. 10; delayed policy
updates, Section 5.2; target policy smoothing, Eq. 14-15), as CleanRL's
``td3_continuous_action.py`` writes it.

Read top to bottom: hyperparameters, the learner (twin Q-networks and their targets, a
deterministic policy and its target, two Adam optimisers) and the trainer: uniform random actions
until ``learning_starts``, one critic update per env step after it, and every
``policy_frequency`` critic updates one policy update and the Polyak averaging of every target --
all ``if``s on step counters. The networks, the noisy actor, Polyak averaging and the target
smoothing are :mod:`msrl.rl.continuous`'s (shared with DDPG); the replay buffer is
:class:`msrl.rl.buffers.ReplayBuffer`.
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
    smoothed_target_action,
)

__all__ = ["TD3Config", "TD3Actor", "TD3Learner", "TD3Trainer", "ALGORITHM"]


@dataclasses.dataclass
class TD3Config:
    """TD3's hyperparameters (CleanRL's names and defaults)."""

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
    policy_noise: NonNegativeFloat = 0.2
    """std of the target policy smoothing noise, a fraction of the half-width (Eq. 14)"""
    noise_clip: NonNegativeFloat = 0.5
    """the smoothing noise's clip, a fraction of the half-width (Eq. 15)"""
    policy_frequency: PositiveInt = 2
    """critic updates between policy (and target) updates: the delay (Section 5.2)"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the policy and of each Q-network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class TD3Actor(DeterministicActor):
    """TD3's acting: the deterministic policy plus Gaussian noise (:class:`msrl.rl.continuous.DeterministicActor`)."""

    algorithm = "TD3"


class TD3Learner(Learner):
    """Clipped double Q-learning with target policy smoothing, and the deterministic policy
    gradient through the first Q-network (Fujimoto et al. 2018, Algorithm 1)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: TD3Config = ctx.hparams
        spec, hidden, dev = ctx.env_spec, ctx.hparams.hidden_sizes, ctx.device
        self.policy = build_deterministic_policy(ctx, "TD3")
        self.policy_target = build_deterministic_policy(ctx, "TD3")
        self.weights = ModuleWeights(self.policy)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed + 1)
            self.qf1 = QNetwork(spec.observation_space, spec.action_space, hidden, "TD3").to(dev)
            self.qf2 = QNetwork(spec.observation_space, spec.action_space, hidden, "TD3").to(dev)
        self.qf1_target = QNetwork(spec.observation_space, spec.action_space, hidden, "TD3").to(dev)
        self.qf2_target = QNetwork(spec.observation_space, spec.action_space, hidden, "TD3").to(dev)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_parameters = [*self.qf1.parameters(), *self.qf2.parameters()]
        self.q_optimizer = torch.optim.Adam(self.q_parameters, lr=self.hp.learning_rate)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.learning_rate)
        self.optimizer = self.q_optimizer
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(ctx.seed + 3)

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One critic update (:meth:`update_critic`)."""
        return self.update_critic(batch)

    def update_critic(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """Both Q-networks towards ``y = r + gamma (1 - d) min_i Q'_i(s', a~)`` with the smoothed
        target action ``a~`` (Eq. 10 and 15).

        Args:
            batch: TensorDict ``(B,)`` with :attr:`ReplayBuffer.KEYS`.

        Returns:
            ``losses/qf_loss``, ``losses/qf1_values`` (0-d tensors).
        """
        hp = self.hp
        with torch.no_grad():
            next_a = smoothed_target_action(self.policy_target, batch["next_obs"], hp.policy_noise, hp.noise_clip,
                                            self.generator)
            next_q = torch.min(self.qf1_target(batch["next_obs"], next_a), self.qf2_target(batch["next_obs"], next_a))
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float()) * next_q
        q1 = self.qf1(batch["obs"], batch["action"])
        q2 = self.qf2(batch["obs"], batch["action"])
        qf_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
        self.apply_gradients(qf_loss, optimizer=self.q_optimizer)
        return {"losses/qf_loss": qf_loss.detach(), "losses/qf1_values": q1.detach().mean()}

    def update_actor(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """The policy up the gradient of ``Q_1(s, mu(s))`` (the deterministic policy gradient,
        Silver et al. 2014; TD3's Algorithm 1 uses the first critic).

        Returns:
            ``losses/actor_loss`` (0-d tensor).
        """
        for p in self.q_parameters:  # the critics pass gradients to the action only
            p.requires_grad_(False)
        try:
            actor_loss = -self.qf1(batch["obs"], self.policy(batch["obs"])).mean()
        finally:
            for p in self.q_parameters:
                p.requires_grad_(True)
        self.apply_gradients(actor_loss, optimizer=self.policy_optimizer)
        return {"losses/actor_loss": actor_loss.detach()}

    def update_targets(self) -> None:
        """Every target towards its network: ``theta' <- tau theta + (1 - tau) theta'``."""
        polyak_update_(self.policy_target, self.policy, self.hp.tau)
        polyak_update_(self.qf1_target, self.qf1, self.hp.tau)
        polyak_update_(self.qf2_target, self.qf2, self.hp.tau)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (what the actor needs; detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        """Every network, both optimisers and the smoothing noise's generator."""
        nets = ("policy", "policy_target", "qf1", "qf2", "qf1_target", "qf2_target")
        state: dict[str, Any] = {n: getattr(self, n).state_dict() for n in nets}
        state.update(q_optimizer=self.q_optimizer.state_dict(), policy_optimizer=self.policy_optimizer.state_dict(),
                     generator=self.generator.get_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s networks, optimisers and generator."""
        for n in ("policy", "policy_target", "qf1", "qf2", "qf1_target", "qf2_target"):
            getattr(self, n).load_state_dict(state[n])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        self.policy_optimizer.load_state_dict(state["policy_optimizer"])
        self.generator.set_state(state["generator"])


class TD3Trainer(Trainer):
    """TD3's loop body: one env step (random actions before ``learning_starts``), then one
    critic update and, every ``policy_frequency`` of them, the delayed policy and target updates."""

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
    name="td3",
    hparams=TD3Config,
    trainer=TD3Trainer,
    components={"actor": TD3Actor, "buffer": ReplayBuffer, "learner": TD3Learner},
    env_steps_per_iteration=lambda hp, total_num_envs: total_num_envs,
    action_spaces=(gymnasium.spaces.Box,),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
