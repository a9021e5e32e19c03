"""IMPALA with a recurrent policy (Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL
with Importance Weighted Actor-Learner Architectures", Figure 3's agents with their LSTM; V-trace,
Eq. 1): the actors carry each env's LSTM state from step to step (zeroed where an episode ends),
each unroll keeps the state it started from, and the learner re-runs every env's unroll from it
(:mod:`msrl.rl.recurrent`) under its current policy before V-trace. Written for
``async_learner`` as IMPALA is; written against msrl's public API only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import torch
from tensordict import TensorDict

from msrl.advantages import vtrace
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
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES
from msrl.rl.recurrent import RecurrentActor, RecurrentRolloutBuffer, build_recurrent_actor_critic
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["IMPALALSTMConfig", "IMPALALSTMLearner", "IMPALALSTMTrainer", "ALGORITHM"]


@dataclasses.dataclass
class IMPALALSTMConfig:
    """IMPALA-LSTM's hyperparameters: IMPALA's (the paper's names where it has them) and the LSTM's."""

    num_steps: PositiveInt = 20
    """unroll length per env per iteration (T; the paper: 20)"""
    learning_rate: PositiveFloat = 1e-3
    """Adam learning rate at the start of training (the paper uses RMSProp)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training (the paper: polynomial decay)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    rho_bar: PositiveFloat = 1.0
    """V-trace's truncation of the importance weights rho_t (the value target's fixed point)"""
    c_bar: PositiveFloat = 1.0
    """V-trace's truncation of the trace coefficients c_t (the speed of convergence)"""
    vtrace_lambda: UnitInterval = 1.0
    """Section 4.2's lambda on the trace coefficients (1: Eq. 1)"""
    update_epochs: PositiveInt = 1
    """passes over each batch (the paper: 1; RLlib's ``num_epochs``), V-trace recomputed with the
    learner's current policy at every gradient step"""
    num_minibatches: PositiveInt = 1
    """gradient steps per pass, each on a slice of the envs' unrolls"""
    reward_scale: PositiveFloat = 1.0
    """rewards are multiplied by this before V-trace, so the critic learns returns of this scale
    (1: none; the reward scaling of Henderson et al. 2018, "Deep Reinforcement Learning that
    Matters", "Reward Scale"). An MLP critic trained by Adam for a few hundred steps cannot reach
    returns in the hundreds: CartPole's shipped config uses 0.1"""
    ent_coef: NonNegativeFloat = 0.01
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient (the paper's baseline cost)"""
    max_grad_norm: PositiveFloat = 40.0
    """global gradient-norm clip (the paper: 40)"""
    hidden_sizes: LayerSizes = (64,)
    """the MLP trunk's widths before the LSTM (vector observations)"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations: the Nature CNN (Mnih et al. 2015) or IMPALA's
    residual network (Espeholt et al. 2018, Figure 3)"""

    lstm_size: PositiveInt = 256
    """the LSTM's hidden units (the paper's Atari agent: 256)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class IMPALALSTMLearner(Learner):
    """V-trace actor-critic updates on ``(T, N)`` unrolls re-run through the LSTM from their
    initial states: each of the ``num_minibatches`` slices of the env axis re-runs its envs'
    whole unrolls, so a trace never crosses a slice (the loss as IMPALA's learner's)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: IMPALALSTMConfig = ctx.hparams
        self.net = build_recurrent_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5, fused=True)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    def learn(self, batch: TensorDict, initial_state: torch.Tensor) -> dict[str, Any]:
        """``update_epochs * num_minibatches`` gradient steps on one batch of unrolls.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`
                (``log_prob``: the behaviour policy's); initial_state: ``(N, 2, H)`` float32, the
                LSTM state the unrolls started from.

        Returns:
            IMPALA's learner's metrics (``losses/*`` of the last step, ``charts/learning_rate``).

        Raises:
            FloatingPointError: a loss is NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        T, N = batch.batch_size
        done = batch["terminated"] | batch["truncated"]
        stats: dict[str, Any] = {}
        slices = [envs for _ in range(hp.update_epochs)
                  for envs in torch.randperm(N, generator=self.generator, device=batch.device).chunk(min(hp.num_minibatches, N))]
        for envs in slices:
            mb, state, mb_done = batch[:, envs], initial_state[envs], done[:, envs]
            log_prob, entropy, value = net.evaluate_sequences(mb["obs"], state, mb_done, mb["action"])
            with torch.no_grad():
                next_values = net.next_values(mb["obs"], mb["next_obs"], state, mb_done)
            vs, pg_adv = vtrace(mb["log_prob"], log_prob.detach(), mb["reward"] * hp.reward_scale, value.detach(), next_values,
                                mb["terminated"], mb["truncated"], hp.gamma, hp.rho_bar, hp.c_bar, hp.vtrace_lambda)
            pg_loss = -(pg_adv * log_prob).mean()
            v_loss = 0.5 * ((vs - value) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss + hp.vf_coef * v_loss - hp.ent_coef * entropy_loss
            grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
            with torch.no_grad():
                ratio = (log_prob.detach() - mb["log_prob"]).exp()
            stats = {
                "losses/policy_loss": pg_loss.detach(),
                "losses/value_loss": v_loss.detach(),
                "losses/entropy": entropy_loss.detach(),
                "losses/grad_norm": grad_norm,
                "losses/rho_clipped": (ratio > hp.rho_bar).float().mean(),
                "losses/mean_ratio": ratio.mean(),
            }
        stats["charts/learning_rate"] = self.lr.clone()
        return stats

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The recurrent actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": int(self.iteration),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])


class IMPALALSTMTrainer(Trainer):
    """IMPALA-LSTM's loop body: an unroll of ``num_steps`` steps carrying the LSTM state, one
    learner update, weight sync (under ``async_learner`` the next unroll runs meanwhile)."""

    def reset(self) -> None:
        """First observations, the zero LSTM state, and the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.lstm_state = self.actor.initial_state(self.obs)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Unroll of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        self.buffer.begin(self.lstm_state)
        for _step in range(self.hparams.num_steps):
            action, log_prob, value, self.lstm_state = self.actor.act(self.obs, self.lstm_state)
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
            self.lstm_state = self.actor.end_episodes(self.lstm_state, terminated, truncated)
            self.obs = next_obs
        trajectory, initial_state = self.buffer.gather()
        metrics = self.learner.learn(trajectory, initial_state)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="impala_lstm",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=IMPALALSTMConfig,
    trainer=IMPALALSTMTrainer,
    components={"actor": RecurrentActor, "buffer": RecurrentRolloutBuffer, "learner": IMPALALSTMLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="corrected",  # V-trace (Espeholt et al. 2018, eq. 1)
)
