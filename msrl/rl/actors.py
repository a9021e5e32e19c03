"""The rollout actor of an actor-critic network: samples actions and records their
log-probabilities and values."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from msrl.api import Actor, BuildContext, ModuleWeights
from msrl.rl.distributions import sample_categorical, sample_multi_categorical
from msrl.rl.networks import build_actor_critic

__all__ = ["ActorCriticActor", "sample_action"]


def sample_action(net: nn.Module, out: torch.Tensor, generator: torch.Generator,
                  deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An action from the policy head's output ``out`` ``(N, n)`` of ``net`` (set up by
    :func:`~msrl.rl.networks.action_outputs`) and its log-probability ``(N,)`` float32: a
    Categorical's draw (Discrete, ``(N,)`` int64), independent Categoricals' (MultiDiscrete,
    ``(N, k)`` int64) or a diagonal Gaussian's (Box, ``(N, *action_shape)`` float32, unclipped),
    from ``generator``; the mode (argmax / mean) when ``deterministic``."""
    if net.nvec is not None:
        return sample_multi_categorical(out, net.nvec, generator, deterministic)
    if net.discrete:
        log_probs = torch.log_softmax(out, dim=-1)
        action = out.argmax(-1) if deterministic else sample_categorical(log_probs.exp(), generator)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    std = net.actor_logstd.expand_as(out).exp()
    flat = out if deterministic else out + std * torch.randn(out.shape, generator=generator, device=out.device)
    log_prob = torch.distributions.Normal(out, std, validate_args=False).log_prob(flat).sum(-1)
    return flat.view(-1, *net.action_shape), log_prob


class ActorCriticActor(Actor):
    """Samples actions from an :class:`~msrl.rl.networks.ActorCritic` during rollouts, recording
    each action's log-probability under the behaviour policy and the critic's value (PPO, A2C
    and IMPALA act with it; the multi-agent actors build other networks through
    :meth:`build_net` and keep its weights and state handling).

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
            ``(action, log_prob, value)``: action ``(N,)`` int64 (Discrete), ``(N, k)`` int64
            (MultiDiscrete) or ``(N, *action_shape)`` float32 (Box, unclipped); log_prob and value
            ``(N,)`` float32.
        """
        out, value = self.net.head(obs)
        action, log_prob = sample_action(self.net, out, self.generator, deterministic)
        return action, log_prob, value

    def compile_targets(self) -> tuple[str, ...]:
        """The network's forward pass (:meth:`~msrl.rl.networks.ActorCritic.head`); the draw from
        :attr:`generator` stays eager (its seeded stream exactly)."""
        return ("net.head",)

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
