"""PPO with a recurrent policy (CleanRL's ``ppo_atari_lstm.py``; Schulman et al. 2017 with an
LSTM core as in Mnih et al. 2016 and Espeholt et al. 2018), for partially observed tasks: the
actor carries each env's LSTM state from step to step (zeroed where an episode starts), the
rollout keeps the state it started from, and the learner re-runs each env's whole rollout from
it, in minibatches of envs (whole sequences), for ``update_epochs`` epochs.

Values at the next observations (GAE's bootstraps, :func:`msrl.advantages.gae`) come from the
state after each step, without a reset: where an episode was truncated its final observation
continues it, as PPO's do. Written against msrl's public API; the recurrent network, actor and
buffer are :mod:`msrl.rl.recurrent`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

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
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.losses import ppo_epochs, ppo_loss
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES
from msrl.rl.recurrent import RecurrentActor, RecurrentRolloutBuffer, build_recurrent_actor_critic
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["PPOLSTMConfig", "PPOLSTMLearner", "PPOLSTMTrainer", "ALGORITHM"]


@dataclasses.dataclass
class PPOLSTMConfig:
    """PPO-LSTM's hyperparameters (CleanRL ``ppo_atari_lstm.py``'s names; PPO's defaults)."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T): each env's sequence"""
    learning_rate: PositiveFloat = 2.5e-4
    """Adam learning rate at the start of training"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 0.95
    """GAE lambda"""
    num_minibatches: PositiveInt = 4
    """minibatches per epoch, each a group of envs' whole sequences (at most one per env)"""
    update_epochs: PositiveInt = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: PositiveFloat = 0.1
    """surrogate clipping coefficient (CleanRL's Atari value)"""
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
    hidden_sizes: LayerSizes = (64,)
    """the MLP trunk's widths before the LSTM (vector observations)"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations"""
    lstm_size: PositiveInt = 128
    """the LSTM's hidden units"""
    burn_in: NonNegativeInt = 0
    """steps at the start of each env's sequence that the learner re-runs only to warm the LSTM
    state up, without a loss on them (R2D2's burn-in, Kapturowski et al. 2019, section 3: the
    stored initial state was made by the behaviour policy's older weights)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        if self.burn_in >= self.num_steps:
            raise ValueError(f"burn_in={self.burn_in} leaves no step of a num_steps={self.num_steps} sequence to learn "
                             "from; it must be below num_steps")


class PPOLSTMLearner(Learner):
    """PPO's clipped objective on a ``(T, N)`` rollout re-run through the LSTM: minibatches are
    groups of envs (``min(num_minibatches, N)`` per epoch), each env's ``T``
    steps re-run from the rollout's initial state (CleanRL ``ppo_atari_lstm.py``, "Optimizing the
    policy and value network")."""

    #: the minibatch loss (:func:`msrl.rl.losses.ppo_loss`), an attribute so that ``compile:
    #: inductor`` can replace it (:meth:`compile_targets`)
    ppo_loss = staticmethod(ppo_loss)

    def compile_targets(self) -> tuple[str, ...]:
        """PPO's loss (the sequences' re-run stays eager: a Python loop over ``T``)."""
        return ("ppo_loss",)

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: PPOLSTMConfig = ctx.hparams
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
        """Runs ``update_epochs`` epochs of env minibatches on one rollout.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with
                :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`; initial_state: ``(N, 2, H)``
                float32, the LSTM state the rollout started from.

        Returns:
            ``losses/*`` (:func:`~msrl.rl.losses.ppo_epochs`'s, of the last minibatch; clipfrac the
            mean) and ``charts/learning_rate``, 0-d tensors.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        T, N = batch.batch_size
        anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        obs, action = batch["obs"], batch["action"]
        done = batch["terminated"] | batch["truncated"]
        with torch.no_grad():
            next_values = net.next_values(obs, batch["next_obs"], initial_state, done)
        advantages, returns = gae(batch["reward"], batch["value"], next_values, batch["terminated"], batch["truncated"],
                                  hp.gamma, hp.gae_lambda)

        k = hp.burn_in  # the first k steps of every sequence only warm the state up

        def evaluate(envs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            log_prob, entropy, value = net.evaluate_sequences(obs[:, envs], initial_state[envs], done[:, envs],
                                                              action[:, envs])
            return log_prob.T[:, k:], entropy.T[:, k:], value.T[:, k:]  # rows are envs, as the rollout's below

        # rows = envs, each a sequence of T steps: the minibatches hold whole sequences
        stats = ppo_epochs(evaluate, batch["log_prob"].T[:, k:], batch["value"].T[:, k:], advantages.T[:, k:],
                           returns.T[:, k:], hp.clip_coef,
                           step=lambda loss: self.apply_gradients(loss, hp.max_grad_norm), generator=self.generator,
                           update_epochs=hp.update_epochs, num_minibatches=min(hp.num_minibatches, N), norm_adv=hp.norm_adv,
                           clip_vloss=hp.clip_vloss, ent_coef=hp.ent_coef, vf_coef=hp.vf_coef, target_kl=hp.target_kl,
                           loss=self.ppo_loss)
        stats["charts/learning_rate"] = self.lr.clone()
        return stats

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The recurrent actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                "iteration": int(self.iteration), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])


class PPOLSTMTrainer(Trainer):
    """PPO-LSTM's loop body: a rollout of ``num_steps`` steps carrying the LSTM state, one
    update, weight sync."""

    def reset(self) -> None:
        """First observations, the zero LSTM state, and the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.lstm_state = self.actor.initial_state(self.obs)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
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
    name="ppo_lstm",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=PPOLSTMConfig,
    trainer=PPOLSTMTrainer,
    components={"actor": RecurrentActor, "buffer": RecurrentRolloutBuffer, "learner": PPOLSTMLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="corrected",
)
