"""Deep Q-Network (Mnih et al. 2015, "Human-level control through deep reinforcement
learning", Nature 518:529-533), as CleanRL's ``dqn.py`` and Stable-Baselines3's ``DQN`` write
it, with options: double Q-learning (van Hasselt et al. 2016, "Deep Reinforcement Learning
with Double Q-learning", Eq. 4), a dueling network (Wang et al. 2016, "Dueling Network
Architectures for Deep Reinforcement Learning", Eq. 9), n-step returns, prioritized replay
(Schaul et al. 2016) and Ape-X's fixed per-env exploration (Horgan et al. 2018, "Distributed
Prioritized Experience Replay", Section 4): all four together, with the replay in a fragment
of its own, are Ape-X DQN (``configs/apex_dqn_cartpole.yaml``).

Read top to bottom: hyperparameters, the Q-network, the actor (epsilon-greedy), the learner
(TD target from a target network, Huber loss, gradient-norm clipping, Polyak/hard target
update), and the trainer whose ``train_step`` msrl traces; the replay buffer is
:class:`msrl.rl.buffers.ReplayBuffer`, shared with SAC. Its decisions -- the epsilon schedule,
when learning starts, when the target network is synced -- are ordinary ``if``s on step
counters: control values every fragment computes identically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    Fraction,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
    returns,
)
from msrl.rl.buffers import PrioritizedReplayBuffer, ReplayBuffer
from msrl.rl.distributions import epsilon_greedy

__all__ = ["DQNConfig", "QNetwork", "DQNActor", "ReplayBuffer", "DQNLearner", "DQNTrainer", "ALGORITHM"]


@dataclasses.dataclass
class DQNConfig:
    """DQN's hyperparameters (defaults: rl-zoo's CartPole-v1 DQN)."""

    learning_rate: PositiveFloat = 2.3e-3
    """Adam learning rate"""
    buffer_size: PositiveInt = 100_000
    """replay capacity in transitions (per buffer)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    tau: Fraction = 1.0
    """target update rate: 1.0 copies the Q-network, < 1 is Polyak averaging"""
    target_network_frequency: PositiveInt = 10
    """env steps (over every env of the job) between target updates"""
    batch_size: PositiveInt = 64
    """transitions per gradient step (per replay buffer)"""
    start_e: UnitInterval = 1.0
    """exploration epsilon at the start"""
    end_e: UnitInterval = 0.04
    """exploration epsilon at the end of the schedule"""
    exploration_fraction: Fraction = 0.16
    """fraction of the env-step budget over which epsilon falls linearly from start_e to end_e"""
    learning_starts: NonNegativeInt = 1000
    """env steps collected before the first gradient step"""
    train_frequency: PositiveInt = 256
    """vector-env steps collected per iteration (each steps every env once)"""
    gradient_steps: NonNegativeInt = 128
    """gradient steps per iteration once learning has started"""
    double_q: bool = False
    """choose the next action with the online network and value it with the target network"""
    dueling: bool = False
    """split the Q-network's last hidden layer into a state-value and an advantage stream,
    ``Q = V + A - mean_a A`` (Wang et al. 2016, Eq. 9)"""
    n_step: PositiveInt = 1
    """rewards summed into each stored transition before bootstrapping (n-step returns; Ape-X and Rainbow: 3)"""
    exploration: Literal["schedule", "apex"] = "schedule"
    """``schedule``: one epsilon for every env, falling from start_e to end_e; ``apex``: env ``i``
    of ``E`` (over every actor replica) keeps ``apex_epsilon ** (1 + apex_alpha * i / (E - 1))``
    for the whole run (Horgan et al. 2018, Section 4; ``start_e``/``end_e`` unused)"""
    apex_epsilon: UnitInterval = 0.4
    """Ape-X's base epsilon (the paper: 0.4)"""
    apex_alpha: PositiveFloat = 7.0
    """Ape-X's exponent spread (the paper: 7)"""
    prioritized_replay: bool = False
    """draw transitions in proportion to their last TD error (Schaul et al. 2016), with
    importance-sampling weights on the loss"""
    per_alpha: UnitInterval = 0.6
    """prioritization exponent alpha (0: uniform; the paper's proportional variant: 0.6)"""
    per_beta: UnitInterval = 0.4
    """importance-sampling exponent beta at the start, annealed linearly to 1 over the run (the paper: 0.4)"""
    per_eps: PositiveFloat = 1e-6
    """added to |TD error| so that no transition's priority is 0"""
    max_grad_norm: PositiveFloat = 10.0
    """global gradient-norm clip"""
    hidden_sizes: LayerSizes = (256, 256)
    """hidden layer widths of the Q-network (ReLU)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class QNetwork(nn.Module):
    """An MLP ``Q(s, .)``: observations ``(B, *obs_shape)`` -> action values ``(B, n)``.

    With ``dueling`` the last hidden layer is two streams, one to a state value ``V(s)`` and one
    to advantages ``A(s, .)``, combined as ``Q = V + A - mean_a A`` (Wang et al. 2016, Eq. 9);
    the earlier hidden layers are shared.

    Raises:
        ValueError: a non-Box observation space, a non-Discrete action space, or ``dueling``
            without a hidden layer.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...],
                 dueling: bool = False) -> None:
        super().__init__()
        if not isinstance(observation_space, gymnasium.spaces.Box) or not isinstance(action_space, gymnasium.spaces.Discrete):
            raise ValueError(f"DQN needs Box observations and Discrete actions, got {observation_space} / {action_space}")
        if dueling and not hidden:
            raise ValueError("algorithm.hparams.dueling needs at least one hidden layer (hidden_sizes is empty)")
        n_in, layers, n_out = int(np.prod(observation_space.shape)), [], int(action_space.n)
        for h in hidden[:-1] if dueling else hidden:
            layers += [nn.Linear(n_in, h), nn.ReLU()]
            n_in = h
        self.dueling = dueling
        if dueling:
            self.net = nn.Sequential(*layers)
            self.value = nn.Sequential(nn.Linear(n_in, hidden[-1]), nn.ReLU(), nn.Linear(hidden[-1], 1))
            self.advantage = nn.Sequential(nn.Linear(n_in, hidden[-1]), nn.ReLU(), nn.Linear(hidden[-1], n_out))
        else:
            layers.append(nn.Linear(n_in, n_out))
            self.net = nn.Sequential(*layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """``(B, *obs_shape)`` float32 -> ``(B, n)`` action values."""
        x = self.net(obs.flatten(1))
        if not self.dueling:
            return x
        a = self.advantage(x)
        return self.value(x) + a - a.mean(-1, keepdim=True)


def apex_epsilons(num_envs: int, epsilon: float = 0.4, alpha: float = 7.0) -> torch.Tensor:
    """Ape-X's fixed exploration rates: env ``i`` of ``num_envs`` explores with
    ``epsilon ** (1 + alpha * i / (num_envs - 1))`` (Horgan et al. 2018, Section 4; one env:
    ``epsilon``). Returns ``(num_envs,)`` float32, falling from ``epsilon`` to ``epsilon ** (1 + alpha)``.

    Raises:
        ValueError: ``num_envs < 1``.
    """
    if num_envs < 1:
        raise ValueError(f"apex_epsilons: num_envs must be >= 1, got {num_envs}")
    i = torch.arange(num_envs, dtype=torch.float64)
    return (epsilon ** (1.0 + alpha * i / max(num_envs - 1, 1))).to(torch.float32)


def _build_q(ctx: BuildContext) -> QNetwork:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = QNetwork(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes,
                       dueling=ctx.hparams.dueling)
    return net.to(ctx.device)


class DQNActor(Actor):
    """Epsilon-greedy actions from a copy of the Q-network; random draws from the actor's own
    ``torch.Generator`` (seeded by ``ctx.seed``). With ``exploration: apex`` each env keeps its
    own epsilon (:func:`apex_epsilons`), its index counted over every actor replica's envs."""

    def __init__(self, ctx: BuildContext) -> None:
        self.q = _build_q(ctx)
        self.weights = ModuleWeights(self.q)
        self.n_actions = int(ctx.env_spec.action_space.n)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)
        self.env_epsilons: torch.Tensor | None = None
        if ctx.hparams.exploration == "apex":
            # this replica acts for its share of the job's envs, in replica order
            n = ctx.total_num_envs // ctx.num_replicas
            every = apex_epsilons(ctx.total_num_envs, ctx.hparams.apex_epsilon, ctx.hparams.apex_alpha)
            self.env_epsilons = every[ctx.replica * n:(ctx.replica + 1) * n].to(ctx.device)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, epsilon: float = 0.0, deterministic: bool = False) -> torch.Tensor:
        """Chooses actions.

        Args:
            obs: ``(N, *obs_shape)`` float32.
            epsilon: probability of a uniformly random action per env, in ``[0, 1]`` (with
                ``exploration: apex`` the envs' own epsilons are used instead).
            deterministic: greedy actions (epsilon ignored).

        Returns:
            actions ``(N,)`` int64.

        Raises:
            ValueError: with ``exploration: apex``, ``N`` is not this actor's env count.
        """
        greedy = self.q(obs).argmax(-1)
        if deterministic:
            return greedy
        n = obs.shape[0]
        if self.env_epsilons is not None:
            if n != self.env_epsilons.shape[0]:
                raise ValueError(f"DQNActor.act: exploration 'apex' keeps one epsilon for each of this actor's "
                                 f"{self.env_epsilons.shape[0]} envs, got observations of {n}")
            epsilon = self.env_epsilons
        return epsilon_greedy(greedy, self.n_actions, epsilon, self.generator)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The Q-network's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the Q-network (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.generator.set_state(state["generator"])


class DQNLearner(Learner):
    """TD learning of ``Q`` against a target network (Mnih et al. 2015, Algorithm 1), one-step
    or on the replay's n-step transitions, with the Huber loss and gradient-norm clipping SB3 uses."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: DQNConfig = ctx.hparams
        self.q = _build_q(ctx)
        self.weights = ModuleWeights(self.q)
        self.target = _build_q(ctx)
        self.target.load_state_dict(self.q.state_dict())
        self.parameters = list(self.q.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate, fused=True)
        # prioritized replay's beta schedule: the run's gradient steps, taken and in all
        iterations = ctx.total_env_steps // (self.hp.train_frequency * ctx.total_num_envs)
        learning = max(0, ctx.total_env_steps - self.hp.learning_starts) / max(ctx.total_env_steps, 1)
        self.gradient_steps_total = max(1, int(iterations * learning) * self.hp.gradient_steps)
        self.gradient_steps_taken = 0

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """Gradient steps on replay minibatches: one for a batch of size ``(B,)``, ``K`` in
        turn for ``(K, B)`` (:meth:`ReplayBuffer.sample_many`).

        ``y = r + gamma * (1 - terminated) * Q_target(s', argmax_a Q(s', a))`` with double Q,
        ``max_a Q_target(s', a)`` without (an n-step transition's ``r`` is its discounted reward
        sum and it bootstraps with its ``discount``, ``gamma^m``, instead of ``gamma``); loss ``Huber(Q(s, a), y)``. The target network does
        not change within a call, so without double Q the ``K`` minibatches' targets are
        computed in one forward pass before the first step (the values SB3 computes step by
        step); with double Q each step's targets use the online network as it is then.

        Args:
            batch: TensorDict of batch size ``(B,)`` or ``(K, B)`` with :attr:`ReplayBuffer.KEYS`.

        Returns:
            ``losses/td_loss`` and ``losses/q_values`` (mean ``Q(s, a)``), means over the
            ``K`` steps, 0-d tensors.
        """
        return self._steps(batch, prioritized=False)[0]

    @returns("replicated", "batch", axis=1)
    def learn_prioritized(self, batch: TensorDict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """:meth:`learn` on prioritized samples (:class:`~msrl.rl.buffers.PrioritizedReplayBuffer`):
        each sample's Huber loss weighted by ``w_i = (N P(i))^-beta / max_j w_j`` over its
        minibatch (Schaul et al. 2016, Algorithm 1, line 10), ``beta`` annealed linearly from
        ``per_beta`` to 1 over the run's gradient steps; returns the metrics and each sample's TD
        error ``y - Q(s, a)`` before its step (the new priorities).

        Args:
            batch: TensorDict of batch size ``(B,)`` or ``(K, B)`` with the replay keys and ``scale``.

        Returns:
            ``(metrics, td_error)``: as :meth:`learn`, plus ``charts/per_beta``; ``td_error`` float32
            of the batch's shape (declared a ``batch`` along its last axis: scattered back to the
            shards that drew the samples in the order they were gathered).
        """
        return self._steps(batch, prioritized=True)

    def _steps(self, batch: TensorDict, prioritized: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The gradient steps of :meth:`learn` (``prioritized``: of :meth:`learn_prioritized`,
        the loss weighted and the TD errors returned; else ``None`` for them)."""
        hp = self.hp
        batches = batch.unsqueeze(0) if batch.batch_dims == 1 else batch
        targets = None if hp.double_q else self._targets(batches)
        td_loss = torch.zeros((), device=batches.device)
        q_values = torch.zeros((), device=batches.device)
        obs, actions = batches["obs"], batches["action"].long().unsqueeze(-1)
        errors, beta = [], None
        for k in range(batches.shape[0]):
            target = self._targets(batches[k]) if targets is None else targets[k]
            q_sa = self.q(obs[k]).gather(-1, actions[k]).squeeze(-1)
            if prioritized:
                beta = min(1.0, hp.per_beta + (1.0 - hp.per_beta) * self.gradient_steps_taken / self.gradient_steps_total)
                self.gradient_steps_taken += 1
                weights = batches["scale"][k].pow(-beta)
                loss = (weights / weights.max() * F.smooth_l1_loss(q_sa, target, reduction="none")).mean()
                errors.append((target - q_sa).detach())
            else:
                loss = F.smooth_l1_loss(q_sa, target)
            self.apply_gradients(loss, hp.max_grad_norm)
            td_loss += loss.detach()
            q_values += q_sa.detach().mean()
        k = batches.shape[0]
        metrics = {"losses/td_loss": td_loss / k, "losses/q_values": q_values / k}
        if not prioritized:
            return metrics, None
        return {**metrics, "charts/per_beta": beta}, torch.stack(errors).view(batch.batch_size)

    @torch.no_grad()
    def _targets(self, batch: TensorDict) -> torch.Tensor:
        """TD targets of a batch of any batch size ``S``: a float32 tensor of shape ``S``."""
        next_q = self.target(batch["next_obs"].flatten(0, batch.batch_dims - 1)).unflatten(0, batch.batch_size)
        if self.hp.double_q:
            next_a = self.q(batch["next_obs"]).argmax(-1, keepdim=True)
            next_v = next_q.gather(-1, next_a).squeeze(-1)
        else:
            next_v = next_q.max(-1).values
        # an n-step transition bootstraps with its own gamma^m (msrl.rl.buffers.ReplayBuffer)
        discount = batch["discount"] if "discount" in batch.keys() else self.hp.gamma
        return batch["reward"] + discount * next_v * (1.0 - batch["terminated"].float())

    @torch.no_grad()
    def update_target(self) -> None:
        """``target <- tau * Q + (1 - tau) * target`` (a copy when ``tau = 1``)."""
        for t, p in zip(self.target.parameters(), self.q.parameters()):
            t.lerp_(p, self.hp.tau)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The Q-network's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.state_dict(), "target": self.target.state_dict(), "optimizer": self.optimizer.state_dict(),
                "gradient_steps_taken": self.gradient_steps_taken}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gradient_steps_taken = int(state.get("gradient_steps_taken", 0))


def replay_buffer(ctx: BuildContext) -> ReplayBuffer:
    """The replay: prioritized (:class:`~msrl.rl.buffers.PrioritizedReplayBuffer`) when
    ``prioritized_replay``, else uniform."""
    return PrioritizedReplayBuffer(ctx) if ctx.hparams.prioritized_replay else ReplayBuffer(ctx)


class DQNTrainer(Trainer):
    """DQN's loop body: ``train_frequency`` epsilon-greedy steps into the replay buffer, then,
    once ``learning_starts`` env steps are collected, a target sync when due and
    ``gradient_steps`` updates."""

    def reset(self) -> None:
        """First observations, step counters, the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.target_synced_at = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the updates' mean metrics and the exploration epsilon."""
        hp = self.hparams
        for _step in range(hp.train_frequency):
            decay = (hp.start_e - hp.end_e) * self.global_step / (hp.exploration_fraction * self.total_env_steps)
            epsilon = max(hp.end_e, hp.start_e - decay)
            action = self.actor.act(self.obs, epsilon)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            # truncated: an n-step replay must see where episodes end (a one-step one ignores it)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"],
                               terminated=terminated, truncated=truncated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step >= hp.learning_starts:
            if self.global_step - self.target_synced_at >= hp.target_network_frequency:
                self.learner.update_target()
                self.target_synced_at = self.global_step
            if hp.gradient_steps > 0 and hp.prioritized_replay:
                # the iteration's minibatches drawn by priority; their TD errors go back to the
                # replay (to the shard that drew each, wherever the replay sits)
                batch = self.buffer.sample_many(hp.gradient_steps)
                metrics, td_error = self.learner.learn_prioritized(batch)
                self.buffer.update_priorities(batch["index"], td_error)
            elif hp.gradient_steps > 0:
                # the iteration's minibatches at once: one replay gather, one target-network pass
                metrics = self.learner.learn(self.buffer.sample_many(hp.gradient_steps))
            self.actor.set_weights(self.learner.get_weights())
        if hp.exploration == "schedule":  # (apex: each env keeps its own, DQNActor.env_epsilons)
            metrics = {**metrics, "charts/epsilon": epsilon}
        return metrics


ALGORITHM = AlgorithmSpec(
    name="dqn",
    hparams=DQNConfig,
    trainer=DQNTrainer,
    components={"actor": DQNActor, "buffer": replay_buffer, "learner": DQNLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.train_frequency * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
