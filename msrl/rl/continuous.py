"""What the continuous-control learners with Q-functions share (SAC, DDPG, TD3, IQL, CQL): ReLU
MLPs, a state-action value network, SAC's squashed Gaussian policy, a deterministic tanh policy,
Polyak averaging and TD3's target policy smoothing.

Shared math and plumbing only (:mod:`msrl.rl`): each algorithm's actor, learner and trainer live
in its own file.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from msrl.api import Actor, BuildContext, ModuleWeights

__all__ = ["relu_mlp", "box_space", "QNetwork", "SquashedGaussianPolicy", "DeterministicPolicy", "build_deterministic_policy",
           "DeterministicActor", "polyak_update_", "smoothed_target_action"]


def relu_mlp(n_in: int, hidden: tuple[int, ...], n_out: int) -> nn.Sequential:
    """A ReLU MLP ``(B, n_in) -> (B, n_out)`` with torch's default initialisation (CleanRL's
    continuous-control networks): hidden layers of widths ``hidden``, a linear output layer."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(n_in, h), nn.ReLU()]
        n_in = h
    layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def box_space(space: gymnasium.Space, what: str, algorithm: str) -> gymnasium.spaces.Box:
    """``space`` itself when it is a Box.

    Raises:
        ValueError: a space of another kind, naming ``algorithm`` and ``what`` it was
            (``"observation"``, ``"action"``).
    """
    if not isinstance(space, gymnasium.spaces.Box):
        raise ValueError(f"{algorithm} needs a Box {what} space, got {space}")
    return space


class QNetwork(nn.Module):
    """``Q(s, a)``: observations ``(B, *obs_shape)`` and actions ``(B, *action_shape)``, float32,
    to values ``(B,)``: a ReLU MLP over their concatenation (Lillicrap et al. 2016; Fujimoto et
    al. 2018; Haarnoja et al. 2018's soft Q-function has the same shape).

    Raises:
        ValueError: a non-Box observation or action space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...],
                 algorithm: str = "this algorithm") -> None:
        super().__init__()
        n_in = (int(np.prod(box_space(observation_space, "observation", algorithm).shape))
                + int(np.prod(box_space(action_space, "action", algorithm).shape)))
        self.net = relu_mlp(n_in, hidden, 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The value of each ``(s, a)`` row, ``(B,)``."""
        return self.net(torch.cat([obs.flatten(1), action.flatten(1)], dim=1)).squeeze(-1)


#: the bounds of a squashed Gaussian policy's log standard deviation (CleanRL's SAC)
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class SquashedGaussianPolicy(nn.Module):
    """``a = tanh(u) * scale + bias`` with ``u ~ N(mu(s), sigma(s))`` (Haarnoja et al. 2018,
    Appendix C); log-std squashed into ``[LOG_STD_MIN, LOG_STD_MAX]`` as CleanRL does (SAC's
    and CQL's policy; its ``algorithm`` name is what a wrong space's error names).

    Raises:
        ValueError: a non-Box observation or action space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...],
                 algorithm: str = "SAC") -> None:
        super().__init__()
        obs, act = box_space(observation_space, "observation", algorithm), box_space(action_space, "action", algorithm)
        n_act = int(np.prod(act.shape))
        self.action_shape = tuple(act.shape)
        self.trunk = relu_mlp(int(np.prod(obs.shape)), hidden[:-1], hidden[-1])
        self.mean = nn.Linear(hidden[-1], n_act)
        self.log_std = nn.Linear(hidden[-1], n_act)
        low, high = torch.as_tensor(act.low, dtype=torch.float32).flatten(), torch.as_tensor(act.high, dtype=torch.float32).flatten()
        self.register_buffer("scale", (high - low) / 2.0)
        self.register_buffer("bias", (high + low) / 2.0)

    def forward(
        self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
        n_samples: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples actions.

        Args:
            obs: ``(B, *obs_shape)`` float32.
            generator: the RNG of the Gaussian noise.
            deterministic: take ``tanh(mu)`` instead of sampling.
            n_samples: ``K`` actions per state from one pass of the network over the ``B`` states
                (CQL's sampled actions; d3rlpy's ``sample_n_with_log_prob``). The noise is drawn
                as ``(B, K, n_act)``: the same numbers, in the same order, as for the ``B * K``
                states of ``obs.repeat_interleave(K, 0)``, at a ``K``-th of the network's work.

        Returns:
            ``(action, log_prob)``: action ``(B, n_act)`` float32 within the action bounds,
            log_prob ``(B,)`` with the tanh change of variables (Eq. 26 of the 2018 paper);
            with ``n_samples``, ``(B, K, n_act)`` and ``(B, K)``.

        Raises:
            ValueError: ``n_samples`` below 1, or given with ``deterministic`` (``K`` copies of
                one action are the caller's to make).
        """
        h = F.relu(self.trunk(obs.flatten(1)))
        mean = self.mean(h)
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        if n_samples is not None:
            if n_samples < 1 or deterministic:
                raise ValueError(f"n_samples={n_samples!r} with deterministic={deterministic}: give n_samples >= 1 "
                                 "and sample (deterministic=False)")
            mean, log_std = mean.unsqueeze(1).expand(-1, n_samples, -1), log_std.unsqueeze(1).expand(-1, n_samples, -1)
        std = log_std.exp()
        if deterministic:
            u = mean
        else:
            u = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)
        y = torch.tanh(u)
        action = y * self.scale + self.bias
        normal_log_prob = -0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        log_prob = (normal_log_prob - torch.log(self.scale * (1 - y.pow(2)) + 1e-6)).sum(-1)
        return action, log_prob


class DeterministicPolicy(nn.Module):
    """``mu(s) = tanh(f(s)) * scale + bias``: a ReLU MLP squashed into the action bounds
    (Lillicrap et al. 2016, DDPG's actor; Fujimoto et al. 2018, TD3's), observations
    ``(B, *obs_shape)`` float32 to actions ``(B, n_act)`` float32.

    Raises:
        ValueError: a non-Box observation or action space, or an unbounded action space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden: tuple[int, ...],
                 algorithm: str = "this algorithm") -> None:
        super().__init__()
        obs, act = box_space(observation_space, "observation", algorithm), box_space(action_space, "action", algorithm)
        if not (np.all(np.isfinite(act.low)) and np.all(np.isfinite(act.high))):
            raise ValueError(f"{algorithm} squashes its actions into the action space's bounds; {act} is unbounded")
        self.action_shape = tuple(act.shape)
        self.net = relu_mlp(int(np.prod(obs.shape)), hidden, int(np.prod(act.shape)))
        low = torch.as_tensor(act.low, dtype=torch.float32).flatten()
        high = torch.as_tensor(act.high, dtype=torch.float32).flatten()
        self.register_buffer("scale", (high - low) / 2.0)
        self.register_buffer("bias", (high + low) / 2.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's actions ``(B, n_act)``, within the bounds."""
        return torch.tanh(self.net(obs.flatten(1))) * self.scale + self.bias


def build_deterministic_policy(ctx: BuildContext, algorithm: str) -> DeterministicPolicy:
    """The :class:`DeterministicPolicy` of ``ctx``'s env spec and ``ctx.hparams.hidden_sizes``,
    initialised from ``ctx.seed`` alone (the global RNG untouched), on ``ctx.device``: the actor's
    and the learner's copies start equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = DeterministicPolicy(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes,
                                  algorithm=algorithm)
    return net.to(ctx.device)


class DeterministicActor(Actor):
    """Acts with a deterministic policy plus Gaussian exploration noise (Lillicrap et al. 2016,
    Section 3; Fujimoto et al. 2018, Algorithm 1): ``clip(mu(s) + eps, low, high)``, ``eps ~
    N(0, sigma * half-width)`` with ``sigma = ctx.hparams.exploration_noise``; uniformly random
    actions before learning starts. Noise from the actor's own ``torch.Generator`` (seeded by
    ``ctx.seed``). Its ``algorithm`` name is what a wrong space's error names.

    Raises:
        ValueError: a non-Box or unbounded space (at construction).
    """

    #: the algorithm the actor acts for (named in errors); a subclass sets it
    algorithm = "this algorithm"

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = build_deterministic_policy(ctx, self.algorithm)
        self.weights = ModuleWeights(self.policy)
        self.exploration_noise = float(ctx.hparams.exploration_noise)
        space = ctx.env_spec.action_space
        self.low = torch.as_tensor(space.low, dtype=torch.float32, device=ctx.device).flatten()
        self.high = torch.as_tensor(space.high, dtype=torch.float32, device=ctx.device).flatten()
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions ``(N, *action_shape)`` float32 within the bounds for observations ``(N,
        *obs_shape)``; ``deterministic`` takes ``mu(s)`` without noise."""
        action = self.policy(obs)
        if not deterministic:
            noise = torch.randn(action.shape, generator=self.generator, device=action.device)
            action = torch.max(torch.min(action + noise * (self.exploration_noise * self.policy.scale), self.high), self.low)
        return action.view(-1, *self.policy.action_shape)

    @torch.no_grad()
    def random_action(self, obs: torch.Tensor) -> torch.Tensor:
        """Uniform actions ``(N, *action_shape)`` within the bounds, one per row of ``obs``."""
        u = torch.rand((obs.shape[0], *self.low.shape), generator=self.generator, device=obs.device)
        return (self.low + u * (self.high - self.low)).view(-1, *self.policy.action_shape)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the policy (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        """The policy and the noise generator's state."""
        return {"policy": self.policy.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s policy and generator."""
        self.policy.load_state_dict(state["policy"])
        self.generator.set_state(state["generator"])


@torch.no_grad()
def polyak_update_(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``theta' <- tau theta + (1 - tau) theta'`` for every parameter, in place (Lillicrap et al.
    2016, Algorithm 1's soft target update); ``tau`` in [0, 1] (1: a hard copy)."""
    for t, p in zip(target.parameters(), source.parameters()):
        t.lerp_(p, tau)


def smoothed_target_action(policy: nn.Module, next_obs: torch.Tensor, noise_std: float, noise_clip: float,
                           generator: torch.Generator) -> torch.Tensor:
    """TD3's target policy smoothing (Fujimoto et al. 2018, Eq. 15): ``clip(mu'(s') + clip(eps,
    -c, c), low, high)`` with ``eps ~ N(0, sigma)``, ``sigma`` and ``c`` in units of the action
    range's half-width (``policy.scale``, as CleanRL scales them).

    Args:
        policy: a :class:`DeterministicPolicy` (the target policy).
        next_obs: ``(B, *obs_shape)`` float32.
        noise_std: ``sigma``, a fraction of the half-width (TD3: 0.2).
        noise_clip: ``c``, a fraction of the half-width (TD3: 0.5).
        generator: the noise's RNG.

    Returns:
        actions ``(B, n_act)`` float32 within the bounds (no gradient).
    """
    with torch.no_grad():
        action = policy(next_obs)
        noise = torch.randn(action.shape, generator=generator, device=action.device) * noise_std
        noise = noise.clamp(-noise_clip, noise_clip) * policy.scale
        low, high = policy.bias - policy.scale, policy.bias + policy.scale
        return torch.max(torch.min(action + noise, high), low)
