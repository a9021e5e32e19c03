"""Networks, samplers, buffers and the PPO update that several algorithms build on.

The algorithms in ``msrl.algorithms`` never import one another: what two of them share lives
here, written only against msrl's public API (``msrl.api``), so an algorithm written outside the
project can use it too.

- PPO's hyperparameters (:class:`PPOConfig`) and update (:class:`PPOLearner`: GAE, clipped
  surrogate, value loss, entropy bonus; Schulman et al. 2017, arXiv:1707.06347), used by PPO,
  MA-PPO and MAPPO;
- the actor-critic network (:class:`ActorCritic`, CleanRL's), its rollout actor
  (:class:`PPOActor`) and the on-policy :class:`RolloutBuffer`, used by PPO, A2C, IMPALA and the
  multi-agent variants;
- categorical sampling without a host sync (:func:`sample_categorical`) and its log-prob and
  entropy (:func:`categorical_log_prob_entropy`);
- the uniform :class:`ReplayBuffer` of DQN and SAC.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from msrl.advantages import gae
from msrl.api import (
    Actor,
    Buffer,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
    returns,
)
from msrl.normalization import RunningMeanStd

__all__ = ["PPOConfig", "mlp", "ActorCritic", "nature_cnn", "build_actor_critic", "categorical_log_prob_entropy",
           "sample_categorical", "PPOActor", "RolloutBuffer", "PPOLearner", "ReplayBuffer", "OnPolicyTrainer"]


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


def _layer(n_in: int, n_out: int, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def mlp(n_in: int, hidden: tuple[int, ...], n_out: int, out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [_layer(n_in, h), nn.Tanh()]
        n_in = h
    layers.append(_layer(n_in, n_out, std=out_std))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs with tanh activations and orthogonal init (CleanRL).

    Args:
        observation_space: a Box; observations are flattened to ``obs_dim``.
        action_space: Discrete (logits over ``n``) or Box (Gaussian mean over its flat size).
        hidden_sizes: widths of the hidden layers.
        obs_clip: normalize observations by running statistics (``obs_rms``, a
            :class:`~msrl.normalization.RunningMeanStd` in the state dict) and clip them to
            ``[-obs_clip, obs_clip]``; ``None``: observations as they come.

    Raises:
        ValueError: another kind of space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden_sizes: tuple[int, ...],
                 obs_clip: float | None = None) -> None:
        super().__init__()
        if not isinstance(observation_space, gymnasium.spaces.Box):
            raise ValueError(f"PPO needs a Box observation space, got {observation_space}")
        obs_dim = int(np.prod(observation_space.shape))
        self.discrete = isinstance(action_space, gymnasium.spaces.Discrete)
        if self.discrete:
            n_out = int(action_space.n)
        elif isinstance(action_space, gymnasium.spaces.Box):
            n_out = int(np.prod(action_space.shape))
            self.action_shape = tuple(action_space.shape)
            self.actor_logstd = nn.Parameter(torch.zeros(1, n_out))
        else:
            raise ValueError(f"PPO supports Discrete and Box action spaces, got {action_space}")
        self.obs_clip = obs_clip
        self.image = observation_space.dtype == np.uint8 and len(observation_space.shape) == 3
        if self.image:  # frames (C, H, W): the Nature CNN trunk shared by both heads (CleanRL ppo_atari.py)
            if obs_clip is not None:
                raise ValueError("normalize_obs is for vector observations; image observations are scaled by 1/255")
            self.trunk = nature_cnn(observation_space.shape[0], observation_space.shape[1:])
            self.critic = _layer(512, 1, std=1.0)
            self.actor = _layer(512, n_out, std=0.01)
            return
        self.critic = mlp(obs_dim, hidden_sizes, 1, out_std=1.0)
        self.actor = mlp(obs_dim, hidden_sizes, n_out, out_std=0.01)
        if obs_clip is not None:
            self.obs_rms = RunningMeanStd((obs_dim,))

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """The heads' input: observations ``(B, *obs_shape)`` flattened to ``(B, obs_dim)``
        (normalized when the net normalizes), or for frames the CNN trunk's ``(B, 512)``."""
        if self.image:
            return self.trunk(obs.float() / 255.0)
        x = obs.flatten(1)
        return x if self.obs_clip is None else self.obs_rms.normalize(x, self.obs_clip)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(s)`` for observations ``(B, *obs_shape)`` -> ``(B,)``."""
        return self.critic(self.features(obs)).squeeze(-1)

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        """The policy's action distribution for ``(B, *obs_shape)`` observations."""
        out = self.actor(self.features(obs))
        if self.discrete:
            return torch.distributions.Categorical(logits=out, validate_args=False)
        # validate_args=False: the default checks are data-dependent ifs, a host sync per call on a GPU
        return torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)`` of ``action`` under the current policy, each ``(B,)``."""
        x = self.features(obs)
        value = self.critic(x).squeeze(-1)
        out = self.actor(x)
        if self.discrete:
            log_prob, entropy = categorical_log_prob_entropy(out, action)
            return log_prob, entropy, value
        dist = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
        flat = action.flatten(1)
        return dist.log_prob(flat).sum(-1), dist.entropy().sum(-1), value


def nature_cnn(channels: int, hw: tuple[int, ...]) -> nn.Sequential:
    """The DQN paper's convolutional trunk (Mnih et al. 2015, Methods: 32 8x8 filters stride 4,
    64 4x4 stride 2, 64 3x3 stride 1, then 512 units, ReLU), orthogonally initialised as CleanRL's
    ``ppo_atari.py``: ``(B, channels, *hw)`` float in [0, 1] -> ``(B, 512)``."""
    conv = nn.Sequential(_layer_conv(channels, 32, 8, 4), nn.ReLU(), _layer_conv(32, 64, 4, 2), nn.ReLU(),
                         _layer_conv(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        n = conv(torch.zeros(1, channels, *hw)).shape[1]
    return nn.Sequential(*conv, _layer(n, 512), nn.ReLU())


def _layer_conv(c_in: int, c_out: int, kernel: int, stride: int) -> nn.Conv2d:
    layer = nn.Conv2d(c_in, c_out, kernel, stride)
    nn.init.orthogonal_(layer.weight, math.sqrt(2))
    nn.init.constant_(layer.bias, 0.0)
    return layer


def categorical_log_prob_entropy(logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``action`` and entropy of a Categorical over ``logits``.

    What ``torch.distributions.Categorical(logits=...)``'s ``log_prob``/``entropy`` compute (the
    entropy with log-probabilities clamped to the dtype's smallest finite value, so a zero
    probability adds 0, not NaN), without its argument validation and bookkeeping: forward and
    backward take 57 us instead of 147 us for 256 samples of 2 actions on one CPU thread, ~9%
    of a PPO gradient step on CartPole. Log-probabilities come from ``log_softmax``, as
    :meth:`PPOActor.act` computes them, so a rollout's and an update's agree bitwise.

    Args:
        logits: ``(B, n)`` float; action: ``(B,)`` int64 indices in ``[0, n)``.

    Returns:
        ``(log_prob, entropy)``, each ``(B,)``.
    """
    logp = torch.log_softmax(logits, dim=-1)
    log_prob = logp.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
    return log_prob, entropy


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of a Categorical over ``probs``: what ``torch.multinomial(probs, 1,
    generator=generator).squeeze(-1)`` returns, bitwise, with the same generator use.

    That is ATen's own single-sample path (``multinomial`` in ``aten/src/ATen/native/
    Distributions.cpp``: the exponential race ``argmax(p / q)``, ``q ~ Exp(1)``, equivalent to
    the Gumbel-max trick), without its argument checks -- two host syncs per call on a GPU and
    ~10 us of a ~100 us inference call on one CPU thread. ``probs`` come from a softmax here, so
    the checks (no NaN, no negative entries, rows summing to more than 0) hold by construction;
    a NaN loss is caught where the weights are updated (:meth:`msrl.api.Learner.apply_gradients`).

    Args:
        probs: ``(B, n)`` float, non-negative rows with positive sums (need not be normalised).
        generator: the RNG to draw from (default: torch's global one).

    Returns:
        ``(B,)`` int64 indices in ``[0, n)``.
    """
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(-1)


def learning_rate_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A learning rate as a 0-d tensor on ``device``, for an optimiser built with ``lr=`` it
    and a schedule that updates it in place (:func:`anneal_learning_rate`): a captured
    iteration (a CUDA graph, :mod:`msrl.runtime.capture`) replays the update. float64 on the CPU
    (fused Adam reads it as a double: the same steps as with the Python float), float32 on a
    GPU (where the fused Adam kernel reads it on the device)."""
    return torch.tensor(value, device=device, dtype=torch.float32 if device.type == "cuda" else torch.float64)


@torch.no_grad()
def anneal_learning_rate(lr: torch.Tensor, iteration: torch.Tensor, base: float, num_iterations: int,
                         anneal: bool) -> torch.Tensor:
    """CleanRL's linear annealing on the device, without a host read: ``frac = 1 - iteration /
    num_iterations``, ``lr <- frac * base`` (in place, when ``anneal``), ``iteration += 1``.

    Args:
        lr: the optimiser's 0-d learning-rate tensor (:func:`learning_rate_tensor`).
        iteration: a 0-d int64 tensor, updates taken so far.

    Returns:
        ``frac``, a 0-d float64 tensor: computed in float64, it equals the same schedule in
        Python floats, bitwise.
    """
    frac = 1.0 - iteration.to(torch.float64) / num_iterations
    if anneal:
        lr.copy_(frac * base)
    iteration += 1
    return frac


def load_learning_rate(optimizer: torch.optim.Optimizer, lr: torch.Tensor) -> None:
    """After ``optimizer.load_state_dict``: the saved learning rate (a float in checkpoints
    written before rates were tensors) copied into ``lr``, which the optimiser's groups hold
    again (the schedule and a captured iteration update that tensor in place)."""
    for group in optimizer.param_groups:
        lr.copy_(torch.as_tensor(group["lr"], dtype=lr.dtype))
        group["lr"] = lr


def build_actor_critic(ctx: BuildContext) -> ActorCritic:
    """An :class:`ActorCritic` for ``ctx``'s spaces and ``ctx.hparams.hidden_sizes``, initialised
    from ``ctx.seed`` (so an actor and a learner built from one seed start equal), on
    ``ctx.device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        hp = ctx.hparams  # PPO's, or another algorithm's (A2C) without normalization options
        net = ActorCritic(ctx.env_spec.observation_space, ctx.env_spec.action_space, hp.hidden_sizes,
                          hp.obs_clip if getattr(hp, "normalize_obs", False) else None)
    return net.to(ctx.device)


class PPOActor(Actor):
    """Samples actions from the current policy during rollouts.

    Sampling draws from the actor's own ``torch.Generator`` (seeded by ``ctx.seed``), so
    replicas running side by side stay reproducible.
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.net = self.build_net(ctx)
        self.weights = ModuleWeights(self.net)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """The policy network (an :class:`ActorCritic`); subclasses build others."""
        return build_actor_critic(ctx)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chooses actions.

        Args:
            obs: ``(N, *obs_shape)`` float32.
            deterministic: take the mode (argmax / mean) instead of sampling.

        Returns:
            ``(action, log_prob, value)``: action ``(N,)`` int64 (Discrete) or
            ``(N, *action_shape)`` float32 (Box, unclipped); log_prob and value ``(N,)`` float32.
        """
        net = self.net
        x = net.features(obs)
        out = net.actor(x)
        value = net.critic(x).squeeze(-1)
        if net.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            if deterministic:
                action = out.argmax(-1)
            else:
                action = sample_categorical(log_probs.exp(), self.generator)
            return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1), value
        std = net.actor_logstd.expand_as(out).exp()
        flat = out if deterministic else out + std * torch.randn(out.shape, generator=self.generator, device=out.device)
        log_prob = torch.distributions.Normal(out, std, validate_args=False).log_prob(flat).sum(-1)
        return flat.view(-1, *net.action_shape), log_prob, value

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the actor-critic (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.generator.set_state(state["generator"])


class RolloutBuffer(Buffer):
    """Preallocated ``(T, N, ...)`` storage for one rollout of ``T = num_steps`` steps.

    Keys: ``obs`` ``(T, N, *obs_shape)`` float32 (uint8 for uint8 frames), ``action`` ``(T, N, *action_shape)``,
    ``log_prob``, ``value``, ``reward`` ``(T, N)`` float32, ``terminated``, ``truncated``
    ``(T, N)`` bool, ``next_obs`` (the true next observation: the final one where an episode
    ended) ``(T, N, *obs_shape)`` float32.
    """

    KEYS = ("obs", "action", "log_prob", "value", "reward", "terminated", "truncated", "next_obs")
    #: per-step views of ``storage`` for :meth:`insert`, and the storage they view (rebuilt when
    #: a subclass or a checkpoint replaces it)
    _rows: list[dict[str, torch.Tensor]] = []
    _rows_of: TensorDict | None = None
    _key_groups: list[list[str]] = []

    def __init__(self, ctx: BuildContext) -> None:
        spec, T, N = ctx.env_spec, ctx.hparams.num_steps, ctx.env_spec.num_envs
        obs_shape = tuple(spec.observation_space.shape)
        discrete = isinstance(spec.action_space, gymnasium.spaces.Discrete)
        act_shape = () if discrete else tuple(spec.action_space.shape)
        f32, dev = torch.float32, ctx.device
        # uint8 frames stay bytes (a quarter of the memory); the network scales them
        obs_t = torch.uint8 if spec.observation_space.dtype == np.uint8 else f32
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, N, *obs_shape, dtype=obs_t, device=dev),
                "action": torch.zeros(T, N, *act_shape, dtype=torch.int64 if discrete else f32, device=dev),
                "log_prob": torch.zeros(T, N, dtype=f32, device=dev),
                "value": torch.zeros(T, N, dtype=f32, device=dev),
                "reward": torch.zeros(T, N, dtype=f32, device=dev),
                "terminated": torch.zeros(T, N, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, N, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, N, *obs_shape, dtype=obs_t, device=dev),
            },
            batch_size=[T, N],
            device=dev,
        )
        self.t = 0

    def insert(self, **step: torch.Tensor) -> None:
        """Stores step ``t`` (each tensor ``(N, ...)``, keys exactly :attr:`KEYS`).

        Raises:
            KeyError: missing or unknown keys.
            IndexError: the buffer already holds ``T`` steps.
        """
        name = type(self).__name__
        if set(step) != set(self.KEYS):
            raise KeyError(f"{name}.insert takes exactly {self.KEYS}, got {sorted(step)}")
        if self.t >= self.storage.batch_size[0]:
            raise IndexError(f"{name} is full ({self.t} steps); call gather() first")
        if self._rows_of is not self.storage:  # views of each step's row, made once (TensorDict indexing costs ~25 us)
            self._rows = [{k: v[t] for k, v in self.storage.items()} for t in range(self.storage.batch_size[0])]
            self._rows_of = self.storage
            groups: dict[torch.dtype, list[str]] = {}
            for k in self.KEYS:
                groups.setdefault(self.storage[k].dtype, []).append(k)
            self._key_groups = list(groups.values())
        row = self._rows[self.t]
        # one multi-tensor copy per dtype: on a GPU one kernel for each (float, int64, bool)
        # instead of one per key (torch's fused path needs one dtype per call)
        for keys in self._key_groups:
            torch._foreach_copy_([row[k] for k in keys], [step[k] for k in keys])
        self.t += 1

    def gather(self) -> TensorDict:
        """Returns the rollout, a TensorDict of batch size ``(T, N)``, and empties the buffer.

        The returned tensors are the buffer's storage: valid until the next :meth:`insert`.

        Raises:
            RuntimeError: fewer than ``T`` steps were inserted.
        """
        T = self.storage.batch_size[0]
        if self.t != T:
            raise RuntimeError(f"{type(self).__name__} holds {self.t} of {T} steps")
        self.t = 0
        return self.storage

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t = int(state["t"])


class PPOLearner(Learner):
    """PPO's update on a ``(T, N)`` rollout (CleanRL ``ppo.py``, lines "bootstrap value" to
    "explained variance")."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: PPOConfig = ctx.hparams
        self.net = self.build_net(ctx)
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
        self.replicas = ctx.num_replicas  # learners whose statistics gradient_hook averages
        if self.hp.normalize_reward:
            self.return_rms = RunningMeanStd(()).to(ctx.device)
            self.discounted_return: torch.Tensor | None = None  # (N,), per env, across iterations

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """The trained network (an :class:`ActorCritic`); subclasses build others."""
        return build_actor_critic(ctx)

    def learn(self, batch: TensorDict) -> dict[str, float]:
        """Runs ``update_epochs`` epochs of shuffled minibatches on one rollout.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`RolloutBuffer.KEYS`.

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
            net.obs_rms.update(b_obs.flatten(1), self.gradient_hook, self.replicas)
        return metrics

    @torch.no_grad()
    def scale_rewards(self, reward: torch.Tensor, terminated: torch.Tensor) -> torch.Tensor:
        """Rewards ``(T, N)`` divided by the running std of the discounted return and clipped to
        ``reward_clip`` (gymnasium's ``NormalizeReward``: ``G <- gamma (1 - terminated) G + r``
        per env, carried across iterations), the statistics updated with this rollout's ``T N``
        returns first."""
        T, N = reward.shape
        if self.discounted_return is None or self.discounted_return.shape[0] != N:
            self.discounted_return = torch.zeros(N, dtype=torch.float64, device=reward.device)
        g, returns = self.discounted_return, torch.empty(T, N, dtype=torch.float64, device=reward.device)
        for t in range(T):
            g = g * self.hp.gamma * (~terminated[t]).to(torch.float64) + reward[t].to(torch.float64)
            returns[t] = g
        self.discounted_return.copy_(g)  # in place: a captured iteration replays the update
        self.return_rms.update(returns.flatten(), self.gradient_hook, self.replicas)
        return self.return_rms.normalize(reward, self.hp.reward_clip, center=False)

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
        (Schulman et al. 2017, Eq. 7 and 9) on a flattened batch of ``B`` samples.

        Args:
            evaluate: minibatch indices ``(b,)`` -> ``(log_prob, entropy, value)``, each ``(b,)``
                (or ``(b, G)``), under the current networks.
            b_logprobs, b_values, b_advantages, b_returns: ``(B,)`` float32 from the rollout, or
                ``(B, G)``: minibatches then draw whole rows (MAPPO: env-steps, whose ``G``
                agents the centralised critic values together) and the losses average over
                their ``b G`` samples.
            lr: the learning rate (reported, as a 0-d tensor or a float); clip: the clipping
                coefficient (a 0-d tensor or a float).

        Returns:
            the metrics documented in :meth:`learn`.
        """
        hp = self.hp
        batch_size = b_logprobs.shape[0]
        minibatch_size = max(1, batch_size // hp.num_minibatches)

        device = b_logprobs.device
        clipfrac_sum = torch.zeros((), device=device)
        n_minibatches = 0
        stats: dict[str, Any] = {}
        for _epoch in range(hp.update_epochs):
            perm = torch.randperm(batch_size, generator=self.generator, device=device)
            for start in range(0, batch_size - minibatch_size + 1, minibatch_size):
                mb = perm[start : start + minibatch_size]
                newlogprob, entropy, newvalue = (x.flatten() for x in evaluate(mb))
                logratio = newlogprob - b_logprobs[mb].flatten()
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfrac_sum += ((ratio - 1.0).abs() > clip).float().mean()
                    n_minibatches += 1
                mb_adv = b_advantages[mb].flatten()
                if hp.norm_adv and mb_adv.numel() > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()
                mb_returns, mb_values = b_returns[mb].flatten(), b_values[mb].flatten()
                if hp.clip_vloss:
                    v_unclipped = (newvalue - mb_returns) ** 2
                    v_clipped = mb_values + torch.clamp(newvalue - mb_values, -clip, clip)
                    v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - mb_returns) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - hp.ent_coef * entropy_loss + v_loss * hp.vf_coef
                grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
                stats = {
                    "losses/value_loss": v_loss.detach(),
                    "losses/policy_loss": pg_loss.detach(),
                    "losses/entropy": entropy_loss.detach(),
                    "losses/old_approx_kl": old_approx_kl,
                    "losses/approx_kl": approx_kl,
                    "losses/grad_norm": grad_norm,
                }
            if hp.target_kl is not None and stats["losses/approx_kl"] > hp.target_kl:
                break
        y_pred, y_true = b_values, b_returns
        var_y = torch.var(y_true)
        stats["losses/explained_variance"] = torch.where(var_y == 0, float("nan"), 1 - torch.var(y_true - y_pred) / var_y)
        stats["losses/clipfrac"] = clipfrac_sum / max(n_minibatches, 1)
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
            state["return_rms"] = self.return_rms.state_dict()
            state["discounted_return"] = self.discounted_return
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])
        if self.hp.normalize_reward:
            self.return_rms.load_state_dict(state["return_rms"])
            self.discounted_return = state["discounted_return"]


class ReplayBuffer(Buffer):
    """A circular replay buffer of ``buffer_size`` transitions, preallocated on first insert.

    Keys: ``obs``/``next_obs`` ``(*obs_shape)`` float32, ``action`` ``(*action_shape)`` (int64
    for Discrete, float32 for Box), ``reward`` float32, ``terminated`` bool. It takes however
    many envs' rows each insert brings, so it serves one actor replica or, placed beside the
    learner, every replica's gathered transitions. Samples are drawn uniformly with the
    buffer's own generator (seeded ``ctx.seed + 2``).
    """

    KEYS = ("obs", "action", "reward", "next_obs", "terminated")

    def __init__(self, ctx: BuildContext) -> None:
        self.capacity, self.batch_size = ctx.hparams.buffer_size, ctx.hparams.batch_size
        self.device = ctx.device
        self.storage: TensorDict | None = None
        self.pos, self.size = 0, 0
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 2)

    def insert(self, **step: torch.Tensor) -> None:
        """Stores one step of ``N`` transitions (each tensor ``(N, ...)``, keys exactly
        :attr:`KEYS`), overwriting the oldest when full.

        Raises:
            KeyError: missing or unknown keys.
        """
        if set(step) != set(self.KEYS):
            raise KeyError(f"{type(self).__name__}.insert takes exactly {self.KEYS}, got {sorted(step)}")
        n = step["obs"].shape[0]
        if self.storage is None:
            self.storage = TensorDict(
                {k: torch.zeros(self.capacity, *v.shape[1:], dtype=v.dtype, device=self.device) for k, v in step.items()},
                batch_size=[self.capacity],
                device=self.device,
            )
        columns = self.storage.to_dict()  # the storage's own tensors (no copies)
        if self.pos + n <= self.capacity:  # one contiguous run of rows: slices, not an index tensor
            for k, v in step.items():
                columns[k][self.pos:self.pos + n] = v
        else:
            idx = (self.pos + torch.arange(n, device=self.device)) % self.capacity
            for k, v in step.items():
                columns[k][idx] = v
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    @returns("batch")
    def sample(self) -> TensorDict:
        """``batch_size`` transitions drawn uniformly with replacement: a TensorDict of batch
        size ``(batch_size,)``. Gathered from several replicas, the samples concatenate.

        Raises:
            RuntimeError: the buffer is empty.
        """
        return self._draw((self.batch_size,))

    @returns("batch", axis=1)
    def sample_many(self, num_batches: int) -> TensorDict:
        """``num_batches`` minibatches of ``batch_size`` transitions at once, each drawn as
        :meth:`sample` draws (uniformly, with replacement): a TensorDict of batch size
        ``(num_batches, batch_size)``, indexed with one gather instead of ``num_batches``.
        Gathered from several replicas, minibatch ``k`` concatenates every replica's ``k``-th.

        Raises:
            RuntimeError: the buffer is empty.
            ValueError: ``num_batches`` is not a positive int.
        """
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"{type(self).__name__}.sample_many: num_batches must be a positive int, got {num_batches!r}")
        return self._draw((num_batches, self.batch_size))

    def _draw(self, shape: tuple[int, ...]) -> TensorDict:
        if self.storage is None or self.size == 0:
            raise RuntimeError(f"{type(self).__name__} is empty; learning must start after some steps")
        idx = torch.randint(self.size, shape, generator=self.generator, device=self.device)
        return self.storage[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "pos": self.pos, "size": self.size, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.storage, self.pos, self.size = state["storage"], int(state["pos"]), int(state["size"])
        self.generator.set_state(state["generator"])


class OnPolicyTrainer(Trainer):
    """The on-policy loop body A2C, IMPALA and MAPPO share (as SB3's ``OnPolicyAlgorithm`` does
    for A2C and PPO; PPO's own file spells the same loop out): a rollout of ``num_steps`` steps,
    one learner update, weight sync."""

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
