"""DreamerV3: a world model learned from replayed sequences, and an actor-critic trained on
rollouts imagined inside it (Hafner, Pasukonis, Ba and Lillicrap 2023, "Mastering Diverse
Domains through World Models", arXiv:2301.04104v1; equation numbers are that version's).

Read top to bottom: hyperparameters and the model sizes (RLlib's, whose ``XS`` is the CPU size);
symlog and two-hot (Eq. 9-10); the networks -- encoder, RSSM with discrete latents (Eq. 1),
decoder, reward, continue, actor, critic; the acting side, which carries each env's recurrent
state ``(h, z, previous action)`` from step to step as PPO-LSTM's actor carries its LSTM state;
the replay of sequences; the learner: the world model's loss (Eq. 2-5, free bits and KL
balancing), imagination of ``horizon`` steps from every replayed state, lambda-returns (Eq. 7),
the critic's two-hot loss with its slow-critic regulariser, the actor's REINFORCE loss with
percentile return normalisation and entropy (Eq. 11-12); and the trainer: ``steps_per_iteration``
env steps into the replay, then ``train_ratio`` replayed steps per env step of updates.

Where imagination runs is the learner, wherever a policy puts it: under ``async_learner`` the
actors keep collecting while the learner trains (RLlib's layout), under coarse they wait.

    msrl train configs/dreamerv3_cartpole.yaml
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn import functional as F

from msrl.advantages import lambda_returns
from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    Fraction,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
    returns,
)
from msrl.rl.buffers import SequenceReplay
from msrl.rl.distributional import symlog, two_hot_log_likelihood, two_hot_mean

__all__ = ["DreamerV3Config", "SIZES", "sample_categorical", "is_image", "WorldModel", "DreamerV3Actor",
           "DreamerV3Learner", "DreamerV3Trainer", "ALGORITHM"]

#: model sizes (RLlib's ``dreamerv3/utils``, the paper's S-XL and smaller ones for small tasks):
#: name -> (GRU units, dense units, dense layers, latents, classes per latent, CNN channel multiplier)
SIZES = {
    "nano": (16, 16, 1, 4, 4, 2), "micro": (32, 32, 1, 8, 8, 4), "mini": (64, 64, 1, 16, 16, 8),
    "XXS": (128, 128, 1, 32, 32, 16), "XS": (256, 256, 1, 32, 32, 24), "S": (512, 512, 2, 32, 32, 32),
    "M": (1024, 640, 3, 32, 32, 48), "L": (2048, 768, 4, 32, 32, 64), "XL": (4096, 1024, 5, 32, 32, 96),
}


@dataclasses.dataclass
class DreamerV3Config:
    """DreamerV3's hyperparameters (the paper's Table W.1 and RLlib's ``DreamerV3Config`` names
    and defaults)."""

    model_size: str = "XS"
    """the networks' size: one of nano, micro, mini, XXS, XS, S, M, L, XL (:data:`SIZES`)"""
    batch_size: PositiveInt = 16
    """replayed sequences per update (B)"""
    batch_length: PositiveInt = 64
    """steps per replayed sequence (T)"""
    horizon: PositiveInt = 15
    """imagined steps from each replayed state (H)"""
    train_ratio: PositiveInt = 1024
    """replayed steps (B x T per update) per env step"""
    steps_per_iteration: PositiveInt = 4
    """env steps per env per iteration, before that iteration's updates"""
    learning_starts: NonNegativeInt = 1024
    """env steps (over every env) before the first update"""
    buffer_size: PositiveInt = 1_000_000
    """replay rows kept (split evenly over the envs, the oldest overwritten)"""
    world_model_lr: PositiveFloat = 1e-4
    """Adam's learning rate for the world model"""
    actor_lr: PositiveFloat = 3e-5
    """Adam's learning rate for the actor"""
    critic_lr: PositiveFloat = 3e-5
    """Adam's learning rate for the critic"""
    adam_eps: PositiveFloat = 1e-8
    """Adam's epsilon"""
    world_model_grad_clip: PositiveFloat = 1000.0
    """global gradient-norm clip of the world model"""
    actor_grad_clip: PositiveFloat = 100.0
    """global gradient-norm clip of the actor"""
    critic_grad_clip: PositiveFloat = 100.0
    """global gradient-norm clip of the critic"""
    gamma: UnitInterval = 0.997
    """discount (the paper: 1 - 1/333)"""
    return_lambda: UnitInterval = 0.95
    """lambda of the lambda-returns (Eq. 7)"""
    entropy_scale: PositiveFloat = 3e-4
    """the actor's entropy coefficient eta (Eq. 11)"""
    return_norm_decay: UnitInterval = 0.99
    """EMA decay of the returns' 5th-95th percentile range (Eq. 12)"""
    slow_critic_decay: UnitInterval = 0.98
    """EMA decay of the slow critic, whose outputs regularise the critic"""
    unimix: Fraction = 0.01
    """the uniform share mixed into every categorical (latents and actor)"""
    free_nats: PositiveFloat = 1.0
    """free bits: each KL term is clipped below this many nats (Eq. 5)"""
    dyn_scale: PositiveFloat = 0.5
    """weight of the dynamics loss KL[sg(q) || p] (Eq. 5)"""
    rep_scale: PositiveFloat = 0.1
    """weight of the representation loss KL[q || sg(p)] (Eq. 5)"""
    num_bins: PositiveInt = 255
    """two-hot bins of the reward and critic heads, even in symlog space over [-20, 20]"""
    replay_value_scale: NonNegativeFloat = 0.0
    """weight of the replay value loss (DreamerV3's 2024 code, ``repval``: 0.3; 0: the paper's
    v1, the critic learns from imagination alone): the critic also learns, on the replayed states,
    lambda-returns along the real sequence that bootstrap from the imagined returns
    (:func:`replay_returns`), with the same slow-critic regulariser; the world model gets no
    gradient from it (the 2024 code's one optimiser does)"""

    def __post_init__(self) -> None:
        if self.model_size not in SIZES:
            raise ValueError(f"model_size: {self.model_size!r} is not one of {', '.join(SIZES)}")
        if self.num_bins < 2:
            raise ValueError(f"num_bins: {self.num_bins} bins cannot encode a value; use 2 or more (the paper: 255)")


def _mlp(n_in: int, units: int, layers: int) -> nn.Sequential:
    """DreamerV3's dense block: ``layers`` x (Linear without bias, LayerNorm, SiLU)."""
    out: list[nn.Module] = []
    for _ in range(layers):
        out += [nn.Linear(n_in, units, bias=False), nn.LayerNorm(units), nn.SiLU()]
        n_in = units
    return nn.Sequential(*out)


def _head(n_in: int, units: int, layers: int, n_out: int, zero: bool = False) -> nn.Sequential:
    """A dense block and a linear output (zero-initialised for the two-hot reward and critic
    heads, the paper's choice: they predict 0 at first)."""
    net = _mlp(n_in, units, layers)
    out = nn.Linear(units, n_out)
    if zero:
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
    return nn.Sequential(*net, out)


def _unimix_probs(logits: torch.Tensor, unimix: float) -> torch.Tensor:
    return (1 - unimix) * torch.softmax(logits, -1) + unimix / logits.shape[-1]


def sample_categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs`` ``(..., K)`` by the inverse CDF of one uniform per row:
    ``(...)`` int64 (one uniform a row, where ``torch.multinomial`` draws ``K`` exponentials)."""
    u = torch.rand(*probs.shape[:-1], 1, generator=generator, device=probs.device, dtype=probs.dtype)
    return (probs.cumsum(-1) < u).sum(-1).clamp(max=probs.shape[-1] - 1)


class _ChannelNorm(nn.Module):
    """LayerNorm over the channels of ``(B, C, H, W)`` maps (DreamerV3's CNN normalisation)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def is_image(shape: tuple[int, ...]) -> bool:
    """Whether observations of ``shape`` are frames ``(C, H, W)`` the CNN takes: square, a side
    that 16 divides (four stride-2 stages)."""
    return len(shape) == 3 and shape[1] == shape[2] and shape[1] % 16 == 0


class WorldModel(nn.Module):
    """Encoder, RSSM (Eq. 1), decoder, reward and continue heads, and the actor and critic on
    the model state ``s = (h, z)``: ``h`` ``(B, G)`` the GRU's deterministic state, ``z`` ``(B, L*C)``
    ``L`` one-hot latents of ``C`` classes.

    Vector observations go through an MLP on their symlog, and the decoder predicts that symlog;
    frames ``(C, H, W)`` uint8 (:func:`is_image`) through DreamerV3's CNN -- four stride-2 4x4
    convolutions of ``m, 2m, 4m, 8m`` channels (``m`` the size's multiplier), each normalised
    over channels with SiLU -- on ``frame / 255 - 0.5``, which the transposed CNN decodes.

    Args:
        obs_shape: one observation's shape; num_actions: ``A``; hp: :class:`DreamerV3Config`.
    """

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, hp: DreamerV3Config) -> None:
        super().__init__()
        g, units, layers, latents, classes, mult = SIZES[hp.model_size]
        self.gru_units, self.latents, self.classes, self.num_actions = g, latents, classes, num_actions
        self.unimix, self.obs_shape, self.image = hp.unimix, tuple(obs_shape), is_image(tuple(obs_shape))
        z, feat = latents * classes, g + latents * classes
        if self.image:
            c, side = obs_shape[0], obs_shape[1] // 16
            convs: list[nn.Module] = []
            chans = [c, mult, 2 * mult, 4 * mult, 8 * mult]
            for a, b in zip(chans[:-1], chans[1:]):
                convs += [nn.Conv2d(a, b, 4, 2, 1, bias=False), _ChannelNorm(b), nn.SiLU()]
            self.encoder = nn.Sequential(*convs, nn.Flatten())
            embed = 8 * mult * side * side
            deconvs: list[nn.Module] = [nn.Linear(feat, embed), nn.Unflatten(1, (8 * mult, side, side))]
            for a, b in zip(chans[:0:-1], chans[-2:0:-1]):
                deconvs += [nn.ConvTranspose2d(a, b, 4, 2, 1, bias=False), _ChannelNorm(b), nn.SiLU()]
            deconvs.append(nn.ConvTranspose2d(mult, c, 4, 2, 1))
            self.decoder = nn.Sequential(*deconvs)
        else:
            obs_dim = int(np.prod(obs_shape))
            self.encoder = _mlp(obs_dim, units, layers)
            embed = units
            self.decoder = _head(feat, units, layers, obs_dim)
        self.img_in = _mlp(z + num_actions, units, 1)
        self.gru = nn.GRUCell(units, g)
        self.prior = _head(g, units, layers, z)
        self.posterior = _head(g + embed, units, layers, z)
        self.reward = _head(feat, units, layers, hp.num_bins, zero=True)
        self.cont = _head(feat, units, layers, 1)
        self.actor = _head(feat, units, layers, num_actions)
        self.critic = _head(feat, units, layers, hp.num_bins, zero=True)
        self.register_buffer("bins", torch.linspace(-20.0, 20.0, hp.num_bins))

    def _target(self, obs: torch.Tensor) -> torch.Tensor:
        """What the encoder reads and the decoder predicts: ``frame / 255 - 0.5`` ``(B, C, H, W)``,
        or the vector's symlog ``(B, D)``, of observations ``(B, *obs_shape)``."""
        if self.image:
            return obs.float() / 255.0 - 0.5
        return symlog(obs.flatten(1).float())

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(B, E)`` of observations ``(B, *obs_shape)``."""
        return self.encoder(self._target(obs))

    def decoder_loss(self, feat: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        """The decoder's squared error summed over an observation's entries (pixels), ``(B,)``:
        model states ``(B, G + L*C)``, observations ``(B, *obs_shape)`` (Eq. 5's prediction term)."""
        return ((self.decoder(feat) - self._target(obs)) ** 2).flatten(1).sum(-1)

    @property
    def state_size(self) -> int:
        """``G + L*C``: the model state's width."""
        return self.gru_units + self.latents * self.classes

    def sample_latent(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One-hot latents ``(B, L*C)`` drawn from ``logits`` ``(B, L*C)`` (unimix), with
        straight-through gradients (the probabilities' gradient passes the one-hot sample)."""
        probs = _unimix_probs(logits.view(-1, self.latents, self.classes), self.unimix)
        onehot = F.one_hot(sample_categorical(probs, generator), self.classes).to(probs.dtype)
        return (onehot + probs - probs.detach()).flatten(1)

    def observe(self, h: torch.Tensor, z: torch.Tensor, prev_action: torch.Tensor, embed: torch.Tensor,
                is_first: torch.Tensor, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One posterior step: the carried ``(h, z, previous action one-hot (B, A))`` zeroed where
        ``is_first`` ``(B,)``, then ``h_t = GRU(h, [z, a])``, the posterior's logits (from
        ``embed`` ``(B, units)``) and ``z_t`` drawn from them. The prior's logits at ``h_t`` are
        ``self.prior(h_t)``: the learner takes them for a whole sequence at once, the actor none.

        Returns:
            ``(h_t, z_t, posterior_logits)``.
        """
        keep = (~is_first).to(h.dtype)[:, None]
        h, z, prev_action = h * keep, z * keep, prev_action * keep
        h = self.gru(self.img_in(torch.cat([z, prev_action], -1)), h)
        post_logits = self.posterior(torch.cat([h, embed], -1))
        return h, self.sample_latent(post_logits, generator), post_logits

    def imagine(self, h: torch.Tensor, z: torch.Tensor, action: torch.Tensor, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One prior step: ``h' = GRU(h, [z, a])``, ``z'`` drawn from the prior; action one-hot ``(B, A)``."""
        h = self.gru(self.img_in(torch.cat([z, action], -1)), h)
        return h, self.sample_latent(self.prior(h), generator)

    def policy(self, feat: torch.Tensor) -> torch.Tensor:
        """The actor's action probabilities ``(..., A)`` (unimix) at model states ``(..., G + L*C)``."""
        return _unimix_probs(self.actor(feat), self.unimix)


def _build_model(ctx: BuildContext) -> WorldModel:
    spec = ctx.env_spec
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        model = WorldModel(tuple(spec.observation_space.shape), int(spec.action_space.n), ctx.hparams)
    return model.to(ctx.device)


class DreamerV3Actor(Actor):
    """The acting side: encodes each observation, advances the env's model state with the
    posterior, and samples the actor's action; the recurrent state ``(N, G + L*C + A)`` (``h``,
    ``z``, the previous action one-hot) is a value of the trainer, carried as PPO-LSTM's
    actor carries its LSTM state. Draws from its own generator (seeded ``ctx.seed``)."""

    #: evaluation and :class:`msrl.run.python_api.TrainedPolicy` carry the state between steps
    recurrent = True

    def __init__(self, ctx: BuildContext) -> None:
        self.model = _build_model(ctx)
        self.weights = ModuleWeights(self.model)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def initial_state(self, obs: torch.Tensor) -> torch.Tensor:
        """Zeros ``(N, G + L*C + A)`` float32 for the envs whose first observations are ``obs``."""
        m = self.model
        return torch.zeros(obs.shape[0], m.state_size + m.num_actions, device=obs.device)

    @torch.no_grad()
    def end_episodes(self, state: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """``state`` with the rows of envs whose episode ended zeroed (their next observation
        starts one)."""
        return state * (~(terminated | truncated)).to(state.dtype)[:, None]

    @torch.no_grad()
    def act(self, obs: torch.Tensor, state: torch.Tensor, deterministic: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions ``(N,)`` int64 at observations ``(N, *obs_shape)`` and the next state
        ``(N, G + L*C + A)``; ``deterministic``: the most probable action."""
        m = self.model
        g, zs = m.gru_units, m.latents * m.classes
        h, z, prev = state[:, :g], state[:, g:g + zs], state[:, g + zs:]
        embed = m.encode(obs)
        # (an episode's first step arrives with a zero state: what the replayed is_first resets to)
        no_reset = torch.zeros(obs.shape[0], dtype=torch.bool, device=obs.device)
        h, z, _ = m.observe(h, z, prev, embed, no_reset, self.generator)
        probs = m.policy(torch.cat([h, z], -1))
        if deterministic:
            action = probs.argmax(-1)
        else:
            action = sample_categorical(probs, self.generator)
        return action, torch.cat([h, z, F.one_hot(action, m.num_actions).to(h.dtype)], -1)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the model (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.generator.set_state(state["generator"])


def replay_returns(reward: torch.Tensor, is_terminal: torch.Tensor, is_first: torch.Tensor, boot: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The replay value loss's targets (DreamerV3's 2024 code, ``repl_loss``): lambda-returns
    along replayed sequences of real rewards that bootstrap, step by step, from ``boot``, the
    imagined lambda-return from each replayed state; the return stops where an episode ends inside
    the window (the row before an ``is_first``) and is cut off at a terminal row.

    Args:
        reward, is_terminal, is_first: ``(B, T)`` float32 / bool rows of :class:`SequenceReplay`
            (the reward and flags on arriving at each row).
        boot: ``(B, T)`` float32: the imagined lambda-return from each row's state.

    Returns:
        ``(targets (B, T - 1), weight (B, T - 1))``: the returns of rows ``0..T-2`` and 0 at an
        episode's last row (its successor in the window is the next episode's first).
    """
    last = torch.cat([is_first[:, 1:], torch.zeros_like(is_first[:, :1])], 1).to(reward.dtype)
    live = (~is_terminal[:, 1:]).to(reward.dtype)
    ret = lambda_returns(reward[:, 1:].T, boot.T, live.T, gamma, lam * (1 - last[:, 1:].T))
    return ret.T, 1 - last[:, :-1]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor, latents: int, classes: int, unimix: float) -> torch.Tensor:
    """``KL[p || q]`` of the unimix categoricals, summed over the latents: ``(..., L*C) -> (...)``."""
    p = _unimix_probs(p_logits.unflatten(-1, (latents, classes)), unimix)
    q = _unimix_probs(q_logits.unflatten(-1, (latents, classes)), unimix)
    return (p * (p.log() - q.log())).sum((-2, -1))


class DreamerV3Learner(Learner):
    """The world model's update on replayed sequences, then the actor's and the critic's on
    rollouts imagined from every replayed state; three Adam optimisers, each clipped."""

    def __init__(self, ctx: BuildContext) -> None:
        from msrl.errors import ConfigError

        hp = self.hp = ctx.hparams
        replayed = hp.steps_per_iteration * ctx.total_num_envs * hp.train_ratio
        if replayed < hp.batch_size * hp.batch_length:
            raise ConfigError(
                f"algorithm.hparams: steps_per_iteration x env.num_envs x train_ratio = {replayed} replayed steps an "
                f"iteration is less than one update's batch_size x batch_length = {hp.batch_size * hp.batch_length}; "
                "raise steps_per_iteration or train_ratio")
        self.model = _build_model(ctx)
        self.weights = ModuleWeights(self.model)
        m = self.model
        world = [p for name, p in m.named_parameters() if not name.startswith(("actor.", "critic."))]
        kw = dict(eps=hp.adam_eps)
        self.world_optimizer = torch.optim.Adam(world, lr=hp.world_model_lr, **kw)
        self.actor_optimizer = torch.optim.Adam(m.actor.parameters(), lr=hp.actor_lr, **kw)
        self.critic_optimizer = torch.optim.Adam(m.critic.parameters(), lr=hp.critic_lr, **kw)
        self.optimizer = self.world_optimizer
        self.parameters = world
        self.slow_critic = copy.deepcopy(m.critic).requires_grad_(False)
        self.return_scale = torch.zeros((), device=ctx.device)
        self.updates = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    @returns("replicated")  # (declared: a run whose learning branch the probe never reaches still partitions)
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict (detached tensors)."""
        return self.weights.get()

    def describe(self) -> str:
        """``msrl graph``'s note: the world model and the imagination in this fragment."""
        hp, m = self.hp, self.model
        params = sum(p.numel() for p in m.parameters())
        return (f"world model ({hp.model_size}: GRU {m.gru_units}, {m.latents}x{m.classes} latents; {params:,} parameters "
                f"with the actor and critic) trained on {hp.batch_size}x{hp.batch_length} replayed steps an update, then "
                f"{hp.horizon} steps imagined here from each of those {hp.batch_size * hp.batch_length} states for the "
                "actor and the critic")

    def world_model_loss(self, batch: TensorDict) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Eq. 2-5 over a ``(B, T)`` batch: the decoder's symlog squared error, the reward's
        two-hot cross-entropy, the continue flag's binary cross-entropy, and ``dyn_scale *
        max(free, KL[sg(q) || p]) + rep_scale * max(free, KL[q || sg(p)])``.

        Returns:
            ``(loss, its terms, the posterior model states (B, T, G + L*C))``.
        """
        hp, m = self.hp, self.model
        obs, action, first = batch["obs"], batch["action"], batch["is_first"]
        B, T = action.shape
        embed = m.encode(obs.flatten(0, 1)).unflatten(0, (B, T))
        h = torch.zeros(B, m.gru_units, device=obs.device)
        z = torch.zeros(B, m.latents * m.classes, device=obs.device)
        hs, zs, posts = [], [], []
        for t in range(T):
            prev = F.one_hot(action[:, t], m.num_actions).to(h.dtype)
            h, z, post = m.observe(h, z, prev, embed[:, t], first[:, t], self.generator)
            hs.append(h)
            zs.append(z)
            posts.append(post)
        h_seq = torch.stack(hs, 1)
        feat = torch.cat([h_seq, torch.stack(zs, 1)], -1)
        prior, post = m.prior(h_seq), torch.stack(posts, 1)  # (the prior of all T steps in one batch)
        decoder = m.decoder_loss(feat.flatten(0, 1), obs.flatten(0, 1)).mean()
        reward = -two_hot_log_likelihood(torch.log_softmax(m.reward(feat), -1), symlog(batch["reward"]), m.bins).mean()
        cont = F.binary_cross_entropy_with_logits(m.cont(feat).squeeze(-1), (~batch["is_terminal"]).float())
        L, C = m.latents, m.classes
        dyn = _kl(post.detach(), prior, L, C, hp.unimix).clamp(min=hp.free_nats).mean()
        rep = _kl(post, prior.detach(), L, C, hp.unimix).clamp(min=hp.free_nats).mean()
        loss = decoder + reward + cont + hp.dyn_scale * dyn + hp.rep_scale * rep
        terms = {"losses/decoder": decoder, "losses/reward": reward, "losses/continue": cont, "losses/dyn_kl": dyn,
                 "losses/rep_kl": rep}
        return loss, terms, feat

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One update of the world model, then of the critic and the actor on imagined rollouts.

        Args:
            batch: TensorDict ``(B, T)`` with :attr:`SequenceReplay.KEYS`.

        Returns:
            ``losses/{world_model,decoder,reward,continue,dyn_kl,rep_kl,actor,critic}`` (and
            ``losses/replay_value`` where ``replay_value_scale > 0``),
            ``charts/{entropy,return_scale,imagined_return}``: 0-d tensors.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, m = self.hp, self.model
        loss, metrics, feat = self.world_model_loss(batch)
        self.apply_gradients(loss, hp.world_model_grad_clip, optimizer=self.world_optimizer)
        metrics["losses/world_model"] = loss
        # imagination from every replayed state, the world model fixed
        with torch.no_grad():
            g = m.gru_units
            start = feat.detach().flatten(0, 1)
            h, z = start[:, :g], start[:, g:]
            states, actions = [start], []
            for _ in range(hp.horizon):
                action = sample_categorical(m.policy(states[-1]), self.generator)
                h, z = m.imagine(h, z, F.one_hot(action, m.num_actions).to(h.dtype), self.generator)
                states.append(torch.cat([h, z], -1))
                actions.append(action)
            states_t, actions_t = torch.stack(states), torch.stack(actions)  # (H + 1, BT, F), (H, BT)
            reward = two_hot_mean(m.reward(states_t[1:]), m.bins)
            cont = (m.cont(states_t[1:]).squeeze(-1) > 0).to(reward.dtype)
            first_cont = (~batch["is_terminal"]).flatten().to(reward.dtype)
        # the critic's one forward: its values for the returns, its logits for its loss
        critic_logits = m.critic(states_t)
        with torch.no_grad():
            value = two_hot_mean(critic_logits.detach(), m.bins)
            ret = lambda_returns(reward, value, cont, hp.gamma, hp.return_lambda)
            weight = torch.cumprod(hp.gamma * torch.cat([first_cont[None], cont[:-1]]), 0) / hp.gamma
            lo, hi = torch.quantile(ret.flatten(), torch.tensor([0.05, 0.95], device=ret.device))
            spread = (hi - lo).reshape(1)
            self.reduce_statistics([spread])  # (a replicated learner's replicas keep one scale)
            self.return_scale.mul_(hp.return_norm_decay).add_((1 - hp.return_norm_decay) * spread[0])
            advantage = (ret - value[:-1]) / self.return_scale.clamp(min=1.0)
            slow = two_hot_mean(self.slow_critic(states_t[:-1]), m.bins)
        # the critic: two-hot on the lambda-returns, regularised toward the slow critic's outputs
        log_v = torch.log_softmax(critic_logits[:-1], -1)
        critic_loss = -(weight * (two_hot_log_likelihood(log_v, symlog(ret), m.bins)
                                  + two_hot_log_likelihood(log_v, symlog(slow), m.bins))).mean()
        if hp.replay_value_scale > 0:  # ... and on the replayed states' real returns (2024 code)
            B, T = batch["reward"].shape
            target, rweight = replay_returns(batch["reward"], batch["is_terminal"], batch["is_first"],
                                             ret[0].reshape(B, T), hp.gamma, hp.return_lambda)
            states = feat.detach()[:, :-1]
            with torch.no_grad():
                slow_replay = two_hot_mean(self.slow_critic(states), m.bins)
            log_r = torch.log_softmax(m.critic(states), -1)
            replay_loss = -(rweight * (two_hot_log_likelihood(log_r, symlog(target), m.bins)
                                       + two_hot_log_likelihood(log_r, symlog(slow_replay), m.bins))).mean()
            metrics["losses/replay_value"] = replay_loss
            critic_loss = critic_loss + hp.replay_value_scale * replay_loss
        self.apply_gradients(critic_loss, hp.critic_grad_clip, optimizer=self.critic_optimizer)
        # the actor: REINFORCE on the normalised advantages, with entropy (Eq. 11)
        probs = m.policy(states_t[:-1])
        log_prob = probs.log().gather(-1, actions_t[..., None]).squeeze(-1)
        entropy = -(probs * probs.log()).sum(-1)
        actor_loss = -(weight * (log_prob * advantage + hp.entropy_scale * entropy)).mean()
        self.apply_gradients(actor_loss, hp.actor_grad_clip, optimizer=self.actor_optimizer)
        with torch.no_grad():
            for slow_p, p in zip(self.slow_critic.parameters(), m.critic.parameters()):
                slow_p.lerp_(p, 1 - hp.slow_critic_decay)
        self.updates += 1
        metrics.update({"losses/actor": actor_loss.detach(), "losses/critic": critic_loss.detach(),
                        "charts/entropy": entropy.mean().detach(), "charts/return_scale": self.return_scale.clone(),
                        "charts/imagined_return": ret.mean()})
        return {k: v.detach() for k, v in metrics.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "slow_critic": self.slow_critic.state_dict(),
                "world_optimizer": self.world_optimizer.state_dict(), "actor_optimizer": self.actor_optimizer.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(), "return_scale": self.return_scale.clone(),
                "updates": self.updates.clone(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.slow_critic.load_state_dict(state["slow_critic"])
        for name in ("world_optimizer", "actor_optimizer", "critic_optimizer"):
            getattr(self, name).load_state_dict(state[name])
        self.return_scale.copy_(state["return_scale"])
        self.updates.copy_(state["updates"])
        self.generator.set_state(state["generator"])


class DreamerV3Trainer(Trainer):
    """The loop body: ``steps_per_iteration`` env steps of every env into the replay (the
    actor's recurrent state carried across them), then, once ``learning_starts`` env steps were
    taken, ``train_ratio`` replayed steps per env step of updates and the new weights to the actor."""

    def reset(self) -> None:
        """First observations (the replay's first rows), zero states, step counter, weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.state = self.actor.initial_state(self.obs)
        self.buffer.start(self.obs)
        self.global_step = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the last update's metrics (empty before learning starts)."""
        hp = self.hparams
        for _step in range(hp.steps_per_iteration):
            action, self.state = self.actor.act(self.obs, self.state)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(action=action, reward=reward, terminated=terminated, truncated=truncated,
                               final_obs=info["final_obs"], next_obs=next_obs)
            self.state = self.actor.end_episodes(self.state, terminated, truncated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step >= hp.learning_starts:
            updates = hp.steps_per_iteration * self.num_envs * hp.train_ratio // (hp.batch_size * hp.batch_length)
            for _update in range(updates):
                metrics = self.learner.learn(self.buffer.sample())
            self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="dreamerv3",
    hparams=DreamerV3Config,
    trainer=DreamerV3Trainer,
    components={"actor": DreamerV3Actor, "buffer": SequenceReplay, "learner": DreamerV3Learner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.steps_per_iteration * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    policy_lag="corrected",  # learns from a replay; the actor-critic from its own imagination
)
