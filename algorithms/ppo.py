"""Proximal Policy Optimisation (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", arXiv:1707.06347), CleanRL-equivalent (vwxyzjn/cleanrl, ``ppo.py`` and
``ppo_continuous_action.py``), top to bottom: the hyperparameters, the network and the rollout
actor it acts with, the rollout buffer, the learner (GAE, clipped surrogate, value loss, entropy
bonus, epochs of shuffled minibatches, advantage normalisation, LR annealing, grad-norm
clipping, observation and reward normalisation), the loop body msrl traces, and the
algorithm's declaration. Written only against msrl's public API; the math it shares with other
algorithms (networks, sampling, buffers, schedules, losses) is :mod:`msrl.rl`.

Discrete action spaces use a Categorical policy; Box action spaces a diagonal Gaussian with a
state-independent log standard deviation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping

import torch
from tensordict import TensorDict

from msrl.advantages import gae
from msrl.api import (
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
from msrl.normalization import RewardScaler
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.losses import ppo_epochs, ppo_loss
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES, ActorCritic, build_actor_critic
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["PPOConfig", "PPOActor", "RolloutBuffer", "PPOLearner", "PPOTrainer", "ALGORITHM"]


@dataclasses.dataclass
class PPOConfig:
    """PPO's hyperparameters (CleanRL's names and defaults unless noted)."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 2.5e-4
    """Adam learning rate at the start of training"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 0.95
    """GAE lambda"""
    num_minibatches: PositiveInt = 4
    """minibatches per epoch (minibatch size = T * total envs / num_minibatches)"""
    update_epochs: PositiveInt = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: PositiveFloat = 0.2
    """surrogate clipping coefficient"""
    anneal_clip: bool = False
    """anneal the clipping coefficient linearly to 0 (rl-zoo's `lin_0.2`)"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values"""
    ent_coef: NonNegativeFloat = 0.01
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip"""
    target_kl: PositiveFloat | None = None
    """stop the epochs of an iteration early when the approximate KL exceeds this"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations: the Nature CNN (Mnih et al. 2015) or IMPALA's
    residual network (Espeholt et al. 2018, Figure 3)"""
    normalize_obs: bool = False
    """feed the networks observations normalized by their running mean and std (gymnasium's
    NormalizeObservation, as CleanRL's continuous-action PPO wraps its envs); the statistics
    live in the network and are updated by the learner after each update from the rollout's
    observations, so a rollout and the update on it see the same normalization"""
    obs_clip: PositiveFloat = 10.0
    """clip normalized observations to [-obs_clip, obs_clip] (CleanRL: 10)"""
    normalize_reward: bool = False
    """scale rewards by the running std of the discounted return (gymnasium's NormalizeReward,
    as CleanRL's continuous-action PPO), in the learner before GAE"""
    reward_clip: PositiveFloat = 10.0
    """clip scaled rewards to [-reward_clip, reward_clip] (CleanRL: 10)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


#: The rollout actor: samples from the :class:`~msrl.rl.networks.ActorCritic` (Categorical
#: logits or a diagonal Gaussian) with its own generator, recording ``log_prob`` and ``value``
#: for the update; its weights come from the learner after every update.
PPOActor = ActorCriticActor


class PPOLearner(Learner):
    """PPO's update on a ``(T, N)`` rollout (CleanRL ``ppo.py``, lines "bootstrap value" to
    "explained variance")."""

    #: the minibatch loss (:func:`msrl.rl.losses.ppo_loss`), an attribute so that
    #: ``compile: inductor`` can replace it by its compiled form (:meth:`compile_targets`)
    ppo_loss = staticmethod(ppo_loss)

    def compile_targets(self) -> tuple[str, ...]:
        """The network's evaluation of a minibatch and PPO's loss on it (their backward is
        compiled with them); the optimiser step stays as written."""
        return ("net.evaluate", "ppo_loss")

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: PPOConfig = ctx.hparams
        self.net: ActorCritic = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        # the learning rate and the iteration count live in tensors on the learner's device,
        # updated in place: a captured iteration (a CUDA graph) replays the schedule with them
        #: the optimiser's learning rate, a 0-d tensor (float64 on the CPU, float32 on a GPU,
        #: where the fused Adam kernel reads it)
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5, fused=True)
        steps_per_iteration = self.hp.num_steps * ctx.total_num_envs
        self.num_iterations = max(1, ctx.total_env_steps // steps_per_iteration)
        #: updates taken, a 0-d int64 tensor on the learner's device
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)
        self.replicas = ctx.num_replicas  # learners whose statistics reduce_statistics averages
        if self.hp.normalize_reward:
            self.reward_scaler = RewardScaler(self.hp.gamma, self.hp.reward_clip).to(ctx.device)

    def learn(self, batch: TensorDict) -> dict[str, float]:
        """Runs ``update_epochs`` epochs of shuffled minibatches on one rollout.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`.

        Returns:
            ``losses/value_loss``, ``losses/policy_loss``, ``losses/entropy``,
            ``losses/old_approx_kl``, ``losses/approx_kl`` (of the last minibatch, as CleanRL
            logs them), ``losses/clipfrac`` (mean over minibatches), ``losses/explained_variance``,
            ``losses/grad_norm``: 0-d tensors on the learner's device, so an update on a GPU
            copies nothing to the host (``target_kl`` early stopping is the exception: it reads
            the KL once per epoch); ``charts/learning_rate``: a 0-d tensor too.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        lr, clip = self.schedule()
        T, N = batch.batch_size
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].flatten(0, 1)).view(T, N)
        reward = self.scale_rewards(batch["reward"], batch["terminated"]) if hp.normalize_reward else batch["reward"]
        advantages, returns = gae(
            reward, batch["value"], next_values, batch["terminated"], batch["truncated"], hp.gamma, hp.gae_lambda
        )
        b_obs = batch["obs"].flatten(0, 1)
        b_actions = batch["action"].flatten(0, 1)
        metrics = self.update(
            lambda mb: net.evaluate(b_obs[mb], b_actions[mb]),
            batch["log_prob"].flatten(),
            batch["value"].flatten(),
            advantages.flatten(),
            returns.flatten(),
            lr,
            clip,
        )
        if hp.normalize_obs:  # after the update: the next rollout normalizes with these statistics
            net.obs_rms.update(net.observation_vector(b_obs), self.reduce_statistics, self.replicas)
        return metrics

    def scale_rewards(self, reward: torch.Tensor, terminated: torch.Tensor) -> torch.Tensor:
        """Rewards ``(T, N)`` divided by the running std of the discounted return and clipped to
        ``reward_clip`` (:class:`~msrl.normalization.RewardScaler`, gymnasium's ``NormalizeReward``),
        the statistics updated with this rollout's returns over every learner replica first."""
        return self.reward_scaler(reward, terminated, self.reduce_statistics, self.replicas)

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Sets this iteration's learning rate (:func:`anneal_learning_rate`) and returns it
        with the clip coefficient (annealed the same way when ``anneal_clip``): the learning
        rate :attr:`lr`, the clip coefficient a 0-d float64 tensor when annealed, else the float."""
        hp = self.hp
        frac = anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        return self.lr, (frac * hp.clip_coef if hp.anneal_clip else hp.clip_coef)

    def update(
        self,
        evaluate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        b_logprobs: torch.Tensor,
        b_values: torch.Tensor,
        b_advantages: torch.Tensor,
        b_returns: torch.Tensor,
        lr: torch.Tensor | float,
        clip: torch.Tensor | float,
    ) -> dict[str, Any]:
        """``update_epochs`` epochs of shuffled minibatches of the clipped PPO objective
        (Schulman et al. 2017, Eq. 7 and 9; :func:`msrl.rl.losses.ppo_epochs` over
        :func:`~msrl.rl.losses.ppo_loss`) on a flattened batch of ``B`` samples.

        Args:
            evaluate: minibatch indices ``(b,)`` -> ``(log_prob, entropy, value)``, each ``(b,)``,
                under the current network.
            b_logprobs, b_values, b_advantages, b_returns: ``(B,)`` float32 from the rollout.
            lr: the learning rate (reported); clip: the clipping coefficient (a 0-d tensor or
                a float).

        Returns:
            the metrics documented in :meth:`learn`.
        """
        hp = self.hp
        stats = ppo_epochs(evaluate, b_logprobs, b_values, b_advantages, b_returns, clip,
                           step=lambda loss: self.apply_gradients(loss, hp.max_grad_norm), generator=self.generator,
                           update_epochs=hp.update_epochs, num_minibatches=hp.num_minibatches, norm_adv=hp.norm_adv,
                           clip_vloss=hp.clip_vloss, ent_coef=hp.ent_coef, vf_coef=hp.vf_coef, target_kl=hp.target_kl,
                           loss=self.ppo_loss)
        stats["charts/learning_rate"] = lr.clone() if isinstance(lr, torch.Tensor) else lr
        return stats

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        state = {
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "iteration": int(self.iteration),
            "generator": self.generator.get_state(),
        }
        if self.hp.normalize_reward:
            state["return_rms"] = self.reward_scaler.return_rms.state_dict()
            state["discounted_return"] = self.reward_scaler.discounted_return
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])
        if self.hp.normalize_reward:
            self.reward_scaler.return_rms.load_state_dict(state["return_rms"])
            self.reward_scaler.discounted_return = state["discounted_return"]


class PPOTrainer(Trainer):
    """PPO's loop body: a rollout of ``num_steps`` steps, one learning update, weight sync."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(
                obs=self.obs,
                action=action,
                log_prob=log_prob,
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                next_obs=info["final_obs"],
            )
            self.obs = next_obs
        trajectory = self.buffer.gather()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="ppo",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=PPOConfig,
    trainer=PPOTrainer,
    components={"actor": PPOActor, "buffer": RolloutBuffer, "learner": PPOLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
