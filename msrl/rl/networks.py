"""Networks the algorithms build on: CleanRL's orthogonally initialised layers and tanh MLPs,
the separate-MLP actor-critic (with the Nature CNN or the IMPALA ResNet trunk for frames), built
from a seed; the policy-value network of board games (AlphaZero's) over an MLP or a residual
tower.

Shared math and plumbing only (:mod:`msrl.rl`): no algorithm's learner lives here.
"""

from __future__ import annotations

import math
from typing import Sequence

import gymnasium
import numpy as np
import torch
from torch import nn

from msrl.api import BuildContext
from msrl.envs.dict_obs import DictLayout, is_image_space
from msrl.normalization import RunningMeanStd
from msrl.rl.distributions import categorical_log_prob_entropy, multi_categorical_log_prob_entropy

__all__ = ["layer", "mlp", "scale_frames", "nature_cnn", "impala_cnn", "CNNS", "ActorCritic", "build_actor_critic", "ACTION_SPACES",
           "OBSERVATION_SPACES", "DictEncoder", "action_outputs", "residual_tower", "PolicyValueNet", "ILLEGAL_LOGIT"]

#: the logit of an illegal move (its probability underflows to exactly 0)
ILLEGAL_LOGIT = -1e9

#: the action spaces :class:`ActorCritic` takes (an algorithm acting with it declares them:
#: ``AlgorithmSpec(action_spaces=ACTION_SPACES)``)
ACTION_SPACES = (gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete, gymnasium.spaces.Box)

#: the observation spaces :class:`ActorCritic` takes: Box (vectors, uint8 frames) and Dict
#: (packed by the engines, :mod:`msrl.envs.dict_obs`; an encoder per key, :class:`DictEncoder`)
OBSERVATION_SPACES = (gymnasium.spaces.Box, gymnasium.spaces.Dict)


def scale_frames(obs: torch.Tensor) -> torch.Tensor:
    """A CNN trunk's input from uint8 frames ``(B, C, H, W)``: float32 in [0, 1] (``/ 255``, as
    CleanRL's agents), laid out channels-last on the CPU.

    The layout changes no value a convolution sees, only the order oneDNN reads them in: its
    channels-last kernels run the Nature CNN's PPO update (256 frames, forward and backward) in
    about 0.75x the time of the default layout on a 2-core CPU (bench/results/pong.md, "Pong against
    CleanRL+EnvPool"). The results are those of another summation order (not bitwise the
    default layout's), the same on every execution path of a run. On a GPU the layout stays as
    it is (cuDNN's fp32 kernels gain nothing measured from it).
    """
    if obs.device.type == "cpu":  # the uint8 frames laid out first: a quarter of the bytes moved
        return obs.contiguous(memory_format=torch.channels_last).float().div_(255.0)
    return obs.float() / 255.0


def layer(n_in: int, n_out: int, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """A linear layer ``(B, n_in) -> (B, n_out)`` with orthogonal weights of gain ``std`` and a
    constant bias (CleanRL's ``layer_init``; Saxe et al. 2014 for orthogonal initialisation)."""
    linear = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(linear.weight, std)
    nn.init.constant_(linear.bias, bias)
    return linear


def mlp(n_in: int, hidden: tuple[int, ...], n_out: int, out_std: float) -> nn.Sequential:
    """A tanh MLP ``(B, n_in) -> (B, n_out)``: hidden layers of widths ``hidden`` (orthogonal
    init, gain sqrt(2)) and an output layer of gain ``out_std`` (CleanRL: 0.01 for policy
    logits, 1.0 for values)."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [layer(n_in, h), nn.Tanh()]
        n_in = h
    layers.append(layer(n_in, n_out, std=out_std))
    return nn.Sequential(*layers)


def action_outputs(net: nn.Module, action_space: gymnasium.Space) -> int:
    """Sets up ``net``'s policy head for ``action_space`` and returns its output width: sets
    ``net.discrete`` (Discrete: logits over ``n``), ``net.nvec`` (MultiDiscrete ``[n_1, ..., n_k]``:
    independent Categoricals, ``sum(n_j)`` logits; else ``None``), and for Box ``net.action_shape``
    and ``net.actor_logstd`` (a state-independent log std, ``(1, flat size)``, zeros).

    Raises:
        ValueError: another action space, or a MultiDiscrete of more than one axis.
    """
    net.discrete = isinstance(action_space, gymnasium.spaces.Discrete)
    net.nvec = None
    if net.discrete:
        return int(action_space.n)
    if isinstance(action_space, gymnasium.spaces.MultiDiscrete):
        if len(action_space.nvec.shape) != 1:
            raise ValueError(f"a MultiDiscrete action space of one axis [n_1, ..., n_k] is supported, got nvec of "
                             f"shape {action_space.nvec.shape} (flatten it in the env)")
        net.nvec = tuple(int(n) for n in action_space.nvec)
        return sum(net.nvec)
    if isinstance(action_space, gymnasium.spaces.Box):
        n_out = int(np.prod(action_space.shape))
        net.action_shape = tuple(action_space.shape)
        net.actor_logstd = nn.Parameter(torch.zeros(1, n_out))
        return n_out
    raise ValueError(f"the actor-critic supports Discrete, MultiDiscrete and Box action spaces, got {action_space}")


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs with tanh activations and orthogonal init (CleanRL).

    Args:
        observation_space: a Box (observations are flattened to ``obs_dim``; uint8 frames
            ``(C, H, W)`` go through the ``cnn`` trunk) or a Dict, whose observations come packed
            (:mod:`msrl.envs.dict_obs`): with image keys, a :class:`DictEncoder` trunk (a CNN per
            image, the other keys through an MLP of ``hidden_sizes``) shared by linear heads;
            without, the keys' flat vector (discrete keys one-hot) into the separate MLPs.
        action_space: Discrete (logits over ``n``), MultiDiscrete ``[n_1, ..., n_k]`` (independent
            Categoricals, logits over each ``n_j``: ``sum(n_j)`` outputs, as CleanRL's
            ``ppo_multidiscrete.py`` and the MuJoCo-free ``gym-microrts`` agents) or Box (Gaussian
            mean over its flat size).
        hidden_sizes: widths of the hidden layers.
        obs_clip: normalize observations by running statistics (``obs_rms``, a
            :class:`~msrl.normalization.RunningMeanStd` in the state dict) and clip them to
            ``[-obs_clip, obs_clip]``; ``None``: observations as they come.
        cnn: the trunk of uint8 frame observations ``(C, H, W)`` (:data:`CNNS`): ``"nature"``
            (:func:`nature_cnn`, 512 features) or ``"impala"`` (:func:`impala_cnn`, 256).

    Raises:
        ValueError: another kind of space, an unknown ``cnn``, or ``"impala"`` for observations
            that are not frames.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden_sizes: tuple[int, ...],
                 obs_clip: float | None = None, cnn: str = "nature") -> None:
        super().__init__()
        if not isinstance(observation_space, OBSERVATION_SPACES):
            raise ValueError(f"the actor-critic needs a Box or Dict observation space, got {observation_space}")
        n_out = action_outputs(self, action_space)
        self.obs_clip = obs_clip
        if cnn not in CNNS:
            raise ValueError(f"cnn must be one of {', '.join(CNNS)}, got {cnn!r}")
        self.image = is_image_space(observation_space)
        self.encoder: DictEncoder | None = None
        packed = isinstance(observation_space, gymnasium.spaces.Dict)
        images = packed and any(f.image for f in DictLayout(observation_space).fields)
        if self.image or images:  # a CNN trunk shared by both heads (CleanRL ppo_atari.py, ppo_procgen.py)
            if obs_clip is not None:
                raise ValueError("normalize_obs is for vector observations; image observations are scaled by 1/255")
            if self.image:  # frames (C, H, W)
                self.trunk, width = CNNS[cnn](observation_space.shape[0], observation_space.shape[1:])
            else:  # each image key through its CNN, the other keys through one MLP (SB3's CombinedExtractor)
                self.trunk = self.encoder = DictEncoder(observation_space, hidden_sizes, cnn)
                width = self.encoder.width
            self.critic = layer(width, 1, std=1.0)
            self.actor = layer(width, n_out, std=0.01)
            return
        if cnn != "nature":
            raise ValueError(f"cnn={cnn!r} is a trunk for uint8 frame observations (C, H, W); these are "
                             f"{observation_space}")
        if packed:  # vectors only: the keys' flat vector, then the separate MLPs as for a Box
            self.encoder = DictEncoder(observation_space, None)
            obs_dim = self.encoder.width
        else:
            obs_dim = int(np.prod(observation_space.shape))
        self.critic = mlp(obs_dim, hidden_sizes, 1, out_std=1.0)
        self.actor = mlp(obs_dim, hidden_sizes, n_out, out_std=0.01)
        if obs_clip is not None:
            self.obs_rms = RunningMeanStd((obs_dim,))

    def observation_vector(self, obs: torch.Tensor) -> torch.Tensor:
        """A vector net's input before normalization: observations ``(B, *obs_shape)`` flattened
        to ``(B, obs_dim)`` float (a packed Dict's keys restored, discrete keys one-hot); what
        ``obs_rms`` keeps statistics of."""
        return obs.flatten(1) if self.encoder is None else self.encoder(obs)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """The heads' input: observations ``(B, *obs_shape)`` flattened to ``(B, obs_dim)``
        (normalized when the net normalizes), or for frames (and Dicts with images) the trunk's
        ``(B, width)``."""
        if self.image:
            return self.trunk(scale_frames(obs))
        if self.encoder is not None and self.encoder.images:
            return self.trunk(obs)
        x = self.observation_vector(obs)
        return x if self.obs_clip is None else self.obs_rms.normalize(x, self.obs_clip)

    def head(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's output and the critic's value for observations ``(B, *obs_shape)``:
        ``(out, value)``, out ``(B, n)`` float32 (logits for a Discrete action space, the
        Gaussian's mean for a Box, flattened) and value ``(B,)`` float32."""
        x = self.features(obs)
        return self.actor(x), self.critic(x).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(s)`` for observations ``(B, *obs_shape)`` -> ``(B,)``."""
        return self.critic(self.features(obs)).squeeze(-1)

    def distribution(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        """The policy's action distribution for ``(B, *obs_shape)`` observations."""
        out = self.actor(self.features(obs))
        if self.nvec is not None:
            raise ValueError("a MultiDiscrete policy is independent Categoricals, not one torch Distribution: "
                             "use evaluate() for log-probabilities and entropies")
        if self.discrete:
            return torch.distributions.Categorical(logits=out, validate_args=False)
        # validate_args=False: the default checks are data-dependent ifs, a host sync per call on a GPU
        return torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)`` of ``action`` under the current policy, each ``(B,)``
        (``action``: ``(B,)`` int64 Discrete, ``(B, k)`` int64 MultiDiscrete -- the components'
        log-probabilities and entropies summed, as independent Categoricals -- or ``(B,
        *action_shape)`` float32 Box)."""
        x = self.features(obs)
        value = self.critic(x).squeeze(-1)
        out = self.actor(x)
        if self.discrete:
            log_prob, entropy = categorical_log_prob_entropy(out, action)
            return log_prob, entropy, value
        if self.nvec is not None:
            log_prob, entropy = multi_categorical_log_prob_entropy(out, self.nvec, action)
            return log_prob, entropy, value
        dist = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
        flat = action.flatten(1)
        return dist.log_prob(flat).sum(-1), dist.entropy().sum(-1), value


class DictEncoder(nn.Module):
    """An encoder per key of a packed ``Dict`` observation (:class:`~msrl.envs.dict_obs.DictLayout`),
    concatenated: ``(B, R)`` packed rows -> ``(B, width)`` float32.

    Image keys (uint8 ``(C, H, W)``) go through their own ``cnn`` trunk (scaled by 1/255,
    :func:`scale_frames`); the other keys are flattened in key order (Discrete and
    MultiDiscrete keys one-hot, as ``gymnasium.spaces.flatten``; uint8 vectors as their values)
    into one vector, which goes through a tanh MLP of ``vector_hidden`` (orthogonal init) when
    given (``None``: the vector as it is). Images first, then the vector, as Stable-Baselines3's
    ``CombinedExtractor`` concatenates them.

    Args:
        space: the ``Dict`` observation space.
        vector_hidden: the MLP widths of the non-image keys, or ``None``.
        cnn: the image keys' trunk (:data:`CNNS`).

    Attributes:
        layout: the packing; images: whether any key is an image; width: the output width.

    Raises:
        ValueError: a space :class:`~msrl.envs.dict_obs.DictLayout` refuses, or an unknown ``cnn``.
    """

    def __init__(self, space: gymnasium.spaces.Dict, vector_hidden: tuple[int, ...] | None,
                 cnn: str = "nature") -> None:
        super().__init__()
        if cnn not in CNNS:
            raise ValueError(f"cnn must be one of {', '.join(CNNS)}, got {cnn!r}")
        self.layout = DictLayout(space)
        self._image_keys = [f.key for f in self.layout.fields if f.image]
        self._vector_fields = [f for f in self.layout.fields if not f.image]
        trunks, width = [], 0
        for f in self.layout.fields:
            if f.image:
                trunk, w = CNNS[cnn](f.shape[0], f.shape[1:])
                trunks.append(trunk)
                width += w
        self.cnns = nn.ModuleList(trunks)  # in _image_keys' order (a key may hold a '.': no ModuleDict)
        self.images = bool(trunks)
        flat = sum(f.flat_width for f in self._vector_fields)
        self.vector: nn.Module | None = None
        if self._vector_fields and vector_hidden:
            layers: list[nn.Module] = []
            n_in = flat
            for h in vector_hidden:
                layers += [layer(n_in, h), nn.Tanh()]
                n_in = h
            self.vector, flat = nn.Sequential(*layers), n_in
        self.width = width + (flat if self._vector_fields else 0)

    def vector_input(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The non-image keys of restored observations (:meth:`DictLayout.unpack`) as one
        ``(B, V)`` float32 vector (discrete keys one-hot)."""
        cols = []
        for f in self._vector_fields:
            x = parts[f.key]
            if f.kind == "discrete":
                cols.append(nn.functional.one_hot(x.long(), int(f.space.n)).float())
            elif f.kind == "multi_discrete":
                cols += [nn.functional.one_hot(x[:, j].long(), int(n)).float() for j, n in enumerate(f.space.nvec)]
            else:
                cols.append(x.flatten(1).float())
        return torch.cat(cols, dim=1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        parts = self.layout.unpack(obs)
        out = [cnn(scale_frames(parts[k])) for k, cnn in zip(self._image_keys, self.cnns)]
        if self._vector_fields:
            v = self.vector_input(parts)
            out.append(v if self.vector is None else self.vector(v))
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def impala_cnn(channels: int, hw: tuple[int, ...], depths: tuple[int, ...] = (16, 32, 32),
               out: int = 256) -> tuple[nn.Sequential, int]:
    """IMPALA's deep residual trunk (Espeholt et al. 2018, Figure 3 "large architecture", as
    CleanRL's ``ppo_procgen.py``): per depth ``d`` a 3x3 convolution to ``d`` channels, a 3x3 max
    pool of stride 2, and two residual blocks (ReLU, 3x3 conv, ReLU, 3x3 conv, plus the input);
    then ReLU, flatten, a linear layer to ``out`` units and ReLU: ``(B, channels, *hw)`` float in
    [0, 1] -> ``(B, out)``. Returns the trunk and ``out``."""
    stacks: list[nn.Module] = []
    c = channels
    for d in depths:
        stacks.append(_ImpalaStack(c, d))
        c = d
    conv = nn.Sequential(*stacks, nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        n = conv(torch.zeros(1, channels, *hw)).shape[1]
    return nn.Sequential(*conv, layer(n, out), nn.ReLU()), out


class _Residual(nn.Module):
    """``x + conv(relu(conv(relu(x))))``, 3x3 convolutions keeping the channels."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(c, c, 3, padding=1)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def residual_tower(c_in: int, channels: int, blocks: int) -> nn.Sequential:
    """A 3x3 convolution to ``channels`` filters, ``blocks`` residual blocks (pre-activation,
    He et al. 2016, "Identity Mappings in Deep Residual Networks": ReLU, 3x3 conv, ReLU, 3x3 conv,
    plus the input), then ReLU; padding keeps the board's size: ``(B, c_in, H, W)`` float ->
    ``(B, channels, H, W)``."""
    return nn.Sequential(nn.Conv2d(c_in, channels, 3, padding=1), *[_Residual(channels) for _ in range(blocks)],
                         nn.ReLU())


class _ImpalaStack(nn.Module):
    """One stack of :func:`impala_cnn`: conv to ``c_out``, 3x3 max pool stride 2, two residual blocks."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.res0, self.res1 = _Residual(c_out), _Residual(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res1(self.res0(self.pool(self.conv(x))))


def _nature(channels: int, hw: tuple[int, ...]) -> tuple[nn.Sequential, int]:
    return nature_cnn(channels, hw), 512


#: the trunks for uint8 frame observations, by name (``hparams.cnn``): ``(channels, (H, W)) ->
#: (trunk, its output width)``
CNNS = {"nature": _nature, "impala": impala_cnn}


def nature_cnn(channels: int, hw: tuple[int, ...]) -> nn.Sequential:
    """The DQN paper's convolutional trunk (Mnih et al. 2015, Methods: 32 8x8 filters stride 4,
    64 4x4 stride 2, 64 3x3 stride 1, then 512 units, ReLU), orthogonally initialised as CleanRL's
    ``ppo_atari.py``: ``(B, channels, *hw)`` float in [0, 1] -> ``(B, 512)``."""
    conv = nn.Sequential(_layer_conv(channels, 32, 8, 4), nn.ReLU(), _layer_conv(32, 64, 4, 2), nn.ReLU(),
                         _layer_conv(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        n = conv(torch.zeros(1, channels, *hw)).shape[1]
    return nn.Sequential(*conv, layer(n, 512), nn.ReLU())


def _layer_conv(c_in: int, c_out: int, kernel: int, stride: int) -> nn.Conv2d:
    layer = nn.Conv2d(c_in, c_out, kernel, stride)
    nn.init.orthogonal_(layer.weight, math.sqrt(2))
    nn.init.constant_(layer.bias, 0.0)
    return layer


def build_actor_critic(ctx: BuildContext) -> ActorCritic:
    """An :class:`ActorCritic` for ``ctx``'s spaces and ``ctx.hparams.hidden_sizes``, initialised
    from ``ctx.seed`` (so an actor and a learner built from one seed start equal), on
    ``ctx.device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        hp = ctx.hparams  # PPO's, or another algorithm's (A2C) without normalization options
        net = ActorCritic(ctx.env_spec.observation_space, ctx.env_spec.action_space, hp.hidden_sizes,
                          hp.obs_clip if getattr(hp, "normalize_obs", False) else None, getattr(hp, "cnn", "nature"))
    return net.to(ctx.device)


class PolicyValueNet(nn.Module):
    """``f(s) = (p, v)`` over the observation ``(B, D + A)`` (the game's observation tensor and
    its legal-move mask, :mod:`msrl.envs.openspiel_env`): a torso, a policy head of ``A`` logits
    (illegal moves' set to :data:`ILLEGAL_LOGIT`) and a ``tanh`` value head, the expected outcome
    in ``[-1, 1]`` for the player to move.

    AlphaZero's network (Silver et al. 2018). The torso is a ReLU MLP over the whole observation,
    mask included (``board_shape=None``), or, given the board's ``(C, H, W)`` planes
    (``D = C * H * W``), a residual tower (:func:`residual_tower`) with the heads of Silver et al.
    2017 (Methods, "Neural network architecture"): policy -- a 1x1 convolution to 2 planes, a
    linear layer to ``A`` logits; value -- a 1x1 convolution to 1 plane, a hidden layer of
    ``value_hidden`` units, ``tanh``. Without the paper's batch normalisation: its batch statistics
    would make a leaf's evaluation depend on which leaves share its batch (the central server's
    batches under ``single_learner_fine``).

    Args:
        obs_size: ``D + A``; num_actions: ``A``; hidden_sizes: the MLP torso's widths;
        board_shape: ``(C, H, W)`` for the residual torso; channels: its filters;
        residual_blocks: its blocks; value_hidden: the residual value head's hidden units.

    Raises:
        ValueError: ``board_shape`` does not account for the observation's ``D``.
    """

    def __init__(self, obs_size: int, num_actions: int, hidden_sizes: Sequence[int] = (),
                 board_shape: Sequence[int] | None = None, channels: int = 64, residual_blocks: int = 3,
                 value_hidden: int = 64) -> None:
        super().__init__()
        self.num_actions = num_actions
        self.board_shape = tuple(board_shape) if board_shape is not None else None
        if self.board_shape is None:
            layers: list[nn.Module] = []
            n = obs_size
            for h in hidden_sizes:
                layers += [nn.Linear(n, h), nn.ReLU()]
                n = h
            self.torso = nn.Sequential(*layers)
            self.policy = nn.Linear(n, num_actions)
            self.value = nn.Linear(n, 1)
            return
        if len(self.board_shape) != 3 or math.prod(self.board_shape) != obs_size - num_actions:
            raise ValueError(f"board_shape {self.board_shape}: a residual torso needs the (C, H, W) of the "
                             f"observation's first {obs_size - num_actions} entries")
        c, h, w = self.board_shape
        self.torso = residual_tower(c, channels, residual_blocks)
        self.policy = nn.Sequential(nn.Conv2d(channels, 2, 1), nn.ReLU(), nn.Flatten(),
                                    nn.Linear(2 * h * w, num_actions))
        self.value = nn.Sequential(nn.Conv2d(channels, 1, 1), nn.ReLU(), nn.Flatten(), nn.Linear(h * w, value_hidden),
                                   nn.ReLU(), nn.Linear(value_hidden, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (B, A), value (B,))`` float32 of observations ``(B, D + A)`` float32, also
        under ``torch.autocast`` (the heads' outputs cast back before the mask: illegal logits are
        ILLEGAL_LOGIT exactly)."""
        if self.board_shape is None:  # the MLP reads the mask too
            h = self.torso(obs)
        else:
            h = self.torso(obs[:, :-self.num_actions].reshape(-1, *self.board_shape))
        legal = obs[:, -self.num_actions:] > 0.5
        logits = torch.where(legal, self.policy(h).float(), ILLEGAL_LOGIT)
        return logits, torch.tanh(self.value(h).squeeze(-1).float())
