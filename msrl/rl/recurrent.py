"""A recurrent actor-critic: an LSTM core between the trunk and the heads (CleanRL's
``ppo_atari_lstm.py``; IMPALA's LSTM agent, Espeholt et al. 2018, Figure 3), its actor, and the
rollout buffer that keeps each rollout's initial core state.

The core state of ``N`` envs is one tensor ``(N, 2, H)`` (the LSTM's ``h`` and ``c``, env axis
first, so a boundary shards and gathers it along the env axis as it does observations). An env
whose episode ended starts the next from a zero state: after each env step the actor zeroes the
finished envs' rows (:meth:`RecurrentActor.end_episodes`). The learner re-runs each env's whole
rollout from its initial state, cutting it where episodes ended
(:meth:`RecurrentActorCritic.evaluate_sequences`), so the log-probabilities and values it
optimises are the same function of the same inputs as the rollout's.
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from msrl.api import BuildContext
from msrl.envs.dict_obs import is_image_space
from msrl.rl.actors import ActorCriticActor, sample_action
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.distributions import categorical_log_prob_entropy, multi_categorical_log_prob_entropy
from msrl.rl.networks import CNNS, OBSERVATION_SPACES, DictEncoder, action_outputs, layer, scale_frames

__all__ = ["RecurrentActorCritic", "RecurrentActor", "RecurrentRolloutBuffer", "build_recurrent_actor_critic"]


class RecurrentActorCritic(nn.Module):
    """Trunk -> LSTM -> actor and critic heads.

    Args:
        observation_space: a Box: vectors (flattened; a tanh MLP trunk of ``hidden_sizes``) or
            uint8 frames ``(C, H, W)`` (the ``cnn`` trunk of :data:`~msrl.rl.networks.CNNS`); or a
            Dict, packed (:class:`~msrl.rl.networks.DictEncoder`: a ``cnn`` per image key, the
            other keys through the MLP trunk).
        action_space: Discrete, MultiDiscrete (independent Categoricals) or Box (a diagonal
            Gaussian with a state-independent log std).
        hidden_sizes: the MLP trunk's widths (vectors only).
        lstm_size: ``H``, the LSTM's hidden units (CleanRL: 128).
        cnn: the frames' trunk.

    Raises:
        ValueError: another kind of space.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden_sizes: tuple[int, ...],
                 lstm_size: int = 128, cnn: str = "nature") -> None:
        super().__init__()
        if not isinstance(observation_space, OBSERVATION_SPACES):
            raise ValueError(f"the recurrent actor-critic needs a Box or Dict observation space, got {observation_space}")
        n_out = action_outputs(self, action_space)
        self.image = is_image_space(observation_space)
        if self.image:
            self.trunk, width = CNNS[cnn](observation_space.shape[0], observation_space.shape[1:])
        elif isinstance(observation_space, gymnasium.spaces.Dict):  # packed: an encoder per key
            self.trunk = DictEncoder(observation_space, tuple(hidden_sizes), cnn)
            width = self.trunk.width
        else:
            layers: list[nn.Module] = [nn.Flatten()]
            width = int(np.prod(observation_space.shape))
            for h in hidden_sizes:
                layers += [layer(width, h), nn.Tanh()]
                width = h
            self.trunk = nn.Sequential(*layers)
        self.lstm_size = lstm_size
        self.lstm = nn.LSTM(width, lstm_size)
        for name, param in self.lstm.named_parameters():  # CleanRL's ppo_atari_lstm.py
            if "bias" in name:
                nn.init.constant_(param, 0.0)
            else:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer(lstm_size, n_out, std=0.01)
        self.critic = layer(lstm_size, 1, std=1.0)

    def initial_state(self, n: int, device: torch.device | str) -> torch.Tensor:
        """The zero core state of ``n`` envs: ``(n, 2, H)`` float32."""
        return torch.zeros(n, 2, self.lstm_size, device=device)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """The trunk's ``(B, F)`` for observations ``(B, *obs_shape)`` (frames scaled by 1/255)."""
        return self.trunk(scale_frames(obs) if self.image else obs)

    def core(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One LSTM step: features ``(B, F)``, state ``(B, 2, H)`` -> ``(h, new state)``, ``(B, H)``
        and ``(B, 2, H)``."""
        h, c = state[:, 0].unsqueeze(0).contiguous(), state[:, 1].unsqueeze(0).contiguous()
        out, (h, c) = self.lstm(x.unsqueeze(0), (h, c))
        return out[0], torch.stack([h[0], c[0]], dim=1)

    def step(self, obs: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of ``N`` envs from ``state`` (zero rows where an episode starts): ``(out,
        value, new state)``: the actor's ``(N, n)``, the critic's ``(N,)``, ``(N, 2, H)``."""
        h, state = self.core(self.features(obs), state)
        return self.actor(h), self.critic(h).squeeze(-1), state

    def unroll(self, obs: torch.Tensor, state: torch.Tensor, done: torch.Tensor) -> tuple[torch.Tensor, _Ends]:
        """``T`` steps of ``b`` envs from ``state`` ``(b, 2, H)`` (the rollout's initial state):
        observations ``(T, b, *obs_shape)``, ``done`` ``(T, b)`` (step ``t`` ended an episode:
        step ``t + 1`` starts one from a zero state) -> the core's outputs ``(T, b, H)`` and the
        episode segments' ends.

        What :meth:`step` computes ``T`` times, in one LSTM call: each env's steps are cut into
        segments after its episode ends (the first from ``state``, the others from zeros), and
        the segments run as one packed batch of sequences (``torch.nn.utils.rnn.pack_sequence``)
        -- a seventh of the per-step loop's time here. The trunk runs once on all ``T b``
        observations. (Reads ``done`` on the host.)
        """
        T, b = done.shape
        x = self.features(obs.reshape(T * b, *obs.shape[2:])).view(T, b, -1)
        starts = torch.ones(T, b, dtype=torch.bool)
        starts[1:] = done[:-1].detach().cpu()  # every env's first segment starts at step 0
        t_idx, j_idx = torch.nonzero(starts.T, as_tuple=True)  # (env, start) pairs in env order
        env, t0 = t_idx, j_idx
        t1 = torch.cat([t0[1:], t0.new_tensor([T])])
        t1 = torch.where(env == torch.cat([env[1:], env.new_tensor([-1])]), t1, torch.full_like(t1, T))
        seqs = [x[a:z, j] for j, a, z in zip(env.tolist(), t0.tolist(), t1.tolist())]
        zero = torch.zeros_like(state[:1, 0])
        h0 = torch.cat([state[j, 0:1] if a == 0 else zero for j, a in zip(env.tolist(), t0.tolist())]).unsqueeze(0)
        c0 = torch.cat([state[j, 1:2] if a == 0 else zero for j, a in zip(env.tolist(), t0.tolist())]).unsqueeze(0)
        packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
        out, (hn, cn) = self.lstm(packed, (h0.contiguous(), c0.contiguous()))
        padded, lengths = nn.utils.rnn.pad_packed_sequence(out)  # (max length, segments, H), segments in order
        seg = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        times = torch.repeat_interleave(t0, lengths) + pos
        envs = torch.repeat_interleave(env, lengths)
        h = torch.empty(T, b, self.lstm_size, dtype=padded.dtype, device=padded.device)
        dev = padded.device
        h[times.to(dev), envs.to(dev)] = padded[pos.to(dev), seg.to(dev)]
        return h, _Ends((t1 - 1).to(dev), env.to(dev), torch.stack([hn[0], cn[0]], dim=1))

    def _log_prob_entropy(self, out: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.discrete:
            return categorical_log_prob_entropy(out, action)
        if self.nvec is not None:
            return multi_categorical_log_prob_entropy(out, self.nvec, action)
        dist = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
        return dist.log_prob(action.flatten(1)).sum(-1), dist.entropy().sum(-1)

    def evaluate_sequences(self, obs: torch.Tensor, state: torch.Tensor, done: torch.Tensor,
                           action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)`` of ``b`` envs' rollouts re-run from their initial
        ``state`` (:meth:`unroll`), each ``(T, b)``, for actions ``(T, b, *action_shape)``."""
        h, _ = self.unroll(obs, state, done)
        T, b = done.shape
        flat = h.reshape(T * b, -1)
        log_prob, entropy = self._log_prob_entropy(self.actor(flat), action.reshape(T * b, *action.shape[2:]))
        return log_prob.view(T, b), entropy.view(T, b), self.critic(flat).view(T, b)

    def next_values(self, obs: torch.Tensor, next_obs: torch.Tensor, state: torch.Tensor,
                    done: torch.Tensor) -> torch.Tensor:
        """``V(next_obs_t)`` from the state after step ``t``, ``(T, b)``, for a rollout's
        ``next_obs`` (within an episode ``next_obs_t`` is ``obs_{t+1}``, as the rollout buffer
        stores them: its value is the one the unroll computed at ``t + 1``); at a segment's
        last step (the episode ended, or the rollout did) the LSTM steps once more on
        ``next_obs_t`` from the segment's final state, without a reset (a truncated episode's
        final observation continues it)."""
        h, ends = self.unroll(obs, state, done)
        T, b = done.shape
        values = self.critic(h.reshape(T * b, -1)).view(T, b)
        out = torch.empty_like(values)
        out[:-1] = values[1:]
        last = next_obs[ends.t, ends.env]
        h_end, _ = self.core(self.features(last), ends.state)
        out[ends.t, ends.env] = self.critic(h_end).squeeze(-1)
        return out


class _Ends:
    """The episode segments of an :meth:`RecurrentActorCritic.unroll`: each one's last step
    ``t`` and env ``env`` ``(S,)`` int64, and its final core state ``(S, 2, H)``."""

    def __init__(self, t: torch.Tensor, env: torch.Tensor, state: torch.Tensor) -> None:
        self.t, self.env, self.state = t, env, state


def build_recurrent_actor_critic(ctx: BuildContext) -> RecurrentActorCritic:
    """A :class:`RecurrentActorCritic` for ``ctx``'s spaces and hyperparameters
    (``hidden_sizes``, ``lstm_size``, ``cnn``), initialised from ``ctx.seed``, on ``ctx.device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        hp = ctx.hparams
        net = RecurrentActorCritic(ctx.env_spec.observation_space, ctx.env_spec.action_space, hp.hidden_sizes,
                                   hp.lstm_size, getattr(hp, "cnn", "nature"))
    return net.to(ctx.device)


class RecurrentActor(ActorCriticActor):
    """Acts with a :class:`RecurrentActorCritic`, carrying each env's core state from step to
    step as a value of the trainer (``self.lstm_state``: it crosses boundaries as observations
    do); samples from its own generator as :class:`~msrl.rl.actors.ActorCriticActor` does."""

    #: evaluation and :class:`msrl.run.python_api.TrainedPolicy` carry the core state between steps
    recurrent = True

    def build_net(self, ctx: BuildContext) -> nn.Module:
        return build_recurrent_actor_critic(ctx)

    @torch.no_grad()
    def initial_state(self, obs: torch.Tensor) -> torch.Tensor:
        """The core state of the envs whose first observations are ``obs`` ``(N, *obs_shape)``:
        zeros ``(N, 2, H)`` float32."""
        return self.net.initial_state(obs.shape[0], obs.device)

    @torch.no_grad()
    def end_episodes(self, state: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """The state ``(N, 2, H)`` with the rows of the envs whose episode just ended (``(N,)``
        bool each) zeroed: their next observation starts a new episode."""
        return state * (~(terminated | truncated)).to(state.dtype)[:, None, None]

    @torch.no_grad()
    def act(self, obs: torch.Tensor, state: torch.Tensor,
            deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chooses actions and advances the core state.

        Args:
            obs: ``(N, *obs_shape)``; state: ``(N, 2, H)`` float32 (zero rows for envs whose
                episode starts with ``obs``: :meth:`initial_state`, :meth:`end_episodes`).
            deterministic: the mode instead of a sample.

        Returns:
            ``(action, log_prob, value, new state)``: the action as
            :meth:`ActorCriticActor.act`'s, ``(N,)`` float32 twice, ``(N, 2, H)``.
        """
        out, value, state = self.net.step(obs, state)
        action, log_prob = sample_action(self.net, out, self.generator, deterministic)
        return action, log_prob, value, state

    def compile_targets(self) -> tuple[str, ...]:
        """The network's step (trunk, LSTM cell, heads)."""
        return ("net.step",)


class RecurrentRolloutBuffer(RolloutBuffer):
    """:class:`~msrl.rl.buffers.RolloutBuffer` that also keeps the rollout's initial core state
    ``(N, 2, H)`` (:meth:`begin`), which :meth:`gather` returns beside the rollout (the episode
    starts within it follow from ``terminated | truncated``)."""

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.initial: torch.Tensor | None = None

    def begin(self, state: torch.Tensor) -> None:
        """Keeps the core state ``(N, 2, H)`` the rollout starts from (a copy)."""
        self.initial = state.clone()

    def gather(self) -> tuple[TensorDict, torch.Tensor]:
        """``(rollout, initial state)``: the rollout as :meth:`RolloutBuffer.gather`'s and the
        state :meth:`begin` kept, ``(N, 2, H)``.

        Raises:
            RuntimeError: fewer than ``T`` steps inserted, or no :meth:`begin`.
        """
        if self.initial is None:
            raise RuntimeError(f"{type(self).__name__}.gather: begin(state) was not called for this rollout")
        return super().gather(), self.initial

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "initial": self.initial}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.initial = state.get("initial")
