"""Native Tag (continuous): WarpDrive's ``tag_continuous`` game as a batched multi-agent env,
following the rules in ``shared/specs/tag_continuous.md`` (the reference is WarpDrive's NumPy
env, ``TagContinuous(env_backend="cpu")``).

Taggers chase runners on an ``L x L`` grid; agents steer by choosing an acceleration and a turn
from tables; a runner within ``tagging_distance * L`` of its nearest tagger is tagged (penalty
for it, reward for that tagger) and leaves the game; the game ends after ``episode_length``
steps (runners still in it get a bonus) or when no runner is left.

Shapes (``E`` envs, ``N = num_taggers + num_runners`` agents, ``D = 7 M + 1`` observation
values with ``M = N - 1`` (full observation) or ``K`` (partial)):

* observations ``(E, N, D)`` float32, feature-major per agent (see the spec);
* actions ``(E, N, 2)`` int64: (acceleration index, turn index), index 0 a no-op;
* rewards ``(E, N)`` float32; ``terminated`` ``(E,)`` bool (the game ended: time is up or no
  runner is left; both are ends of the game, not truncations); ``truncated`` always False;
* ``info["agent_type"]`` ``(E, N)`` float32, 1 for taggers: tagger ids are drawn per env and per
  episode (``num_taggers`` of ``N``, not the first ones).

Start states come from splitmix64 streams keyed by (env seed ``seed + e``, agent, episode): one
seed gives one trajectory, on the CPU (host build) and on a GPU alike.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import gymnasium
import numpy as np
import torch

from msrl.device import host_side, read_host
from msrl.envs.native.base import NativeEnv, empty_output, env_keys
from msrl.envs.native.base import uniform_many as uniform

__all__ = ["Tag", "TagParams"]

_TWO_PI = np.float32(6.28318530717959)
_HALF_PI = np.float32(3.14159265358979) / np.float32(2.0)


@dataclasses.dataclass(frozen=True)
class TagParams:
    """The game's parameters (WarpDrive's constructor defaults; ``tag_continuous.yaml``'s in
    brackets in the spec)."""

    num_taggers: int = 1
    num_runners: int = 10
    grid_length: float = 10.0
    episode_length: int = 100
    max_speed: float = 1.0
    skill_level_runner: float = 1.0
    skill_level_tagger: float = 1.0
    max_acceleration: float = 1.0
    min_acceleration: float = -1.0
    max_turn: float = math.pi / 2
    min_turn: float = -math.pi / 2
    num_acceleration_levels: int = 10
    num_turn_levels: int = 10
    edge_hit_penalty: float = -0.0
    use_full_observation: bool = True
    num_other_agents_observed: int = 2
    tagging_distance: float = 0.01
    tag_reward_for_tagger: float = 1.0
    step_penalty_for_tagger: float = -0.0
    tag_penalty_for_runner: float = -1.0
    step_reward_for_runner: float = 0.0
    end_of_game_reward_for_runner: float = 1.0
    runner_exits_game_after_tagged: bool = True
    observe_self: bool = False
    """msrl's extension, not in WarpDrive's rules: append each agent's own x/L, y/L, speed,
    acceleration, cos/sin heading and type to its observation (7 more values). WarpDrive's
    observation holds only differences to others, so an agent cannot tell its own heading."""

    def __post_init__(self) -> None:
        if self.num_taggers < 1 or self.num_runners < 1:
            raise ValueError("Tag needs at least one tagger and one runner")
        if not self.use_full_observation and not 1 <= self.num_other_agents_observed <= min(self.num_agents - 1, 64):
            raise ValueError(f"num_other_agents_observed must lie in [1, {min(self.num_agents - 1, 64)}] (kernels keep at most 64)")

    @property
    def num_agents(self) -> int:
        """``N = num_taggers + num_runners``."""
        return self.num_taggers + self.num_runners

    @property
    def num_observed(self) -> int:
        """``M``: other agents in each observation."""
        return self.num_agents - 1 if self.use_full_observation else self.num_other_agents_observed


class Tag(NativeEnv):
    """``E`` Tag games in tensors (see the module docstring).

    Args:
        num_envs: ``E``; device; impl: ``"kernel"`` or ``"torch"``; ``**params``: any field of
            :class:`TagParams`.

    Raises:
        TypeError: an unknown parameter; ValueError: inconsistent parameters.
    """

    KERNEL_SOURCE = pathlib.Path(__file__).with_name("tag.cu")
    ENV_ID = "msrl/Tag-v0"
    GYMNASIUM_ID = None
    #: threads per block: one per agent, up to this many (then a thread-stride loop)
    MAX_BLOCK = 1024

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", impl: str = "kernel", **params: Any) -> None:
        super().__init__(num_envs, device, impl)
        fields = {f.name for f in dataclasses.fields(TagParams)}
        unknown = sorted(set(params) - fields)
        if unknown:
            raise TypeError(f"unknown Tag parameters {unknown}; valid: {', '.join(sorted(fields))}")
        self.params = p = TagParams(**params)
        E, N, dev = num_envs, p.num_agents, self.device
        self.num_agents = N
        self.obs_dim = 7 * p.num_observed + 1 + (7 if p.observe_self else 0)
        self.spec = dataclasses.replace(
            self.make_spec(
                self.ENV_ID,
                gymnasium.spaces.Box(-np.inf, np.inf, shape=(self.obs_dim,), dtype=np.float32),
                gymnasium.spaces.MultiDiscrete([p.num_acceleration_levels + 1, p.num_turn_levels + 1]),
            ),
            num_agents=N,
        )
        f32 = dict(dtype=torch.float32, device=dev)
        self.x, self.y, self.dir, self.speed, self.acc = (torch.zeros(E, N, **f32) for _ in range(5))
        self.in_game = torch.zeros(E, N, **f32)
        self.agent_type = torch.zeros(E, N, **f32)
        self.tagger_ids = torch.zeros(E, p.num_taggers, dtype=torch.int32, device=dev)
        self.t = torch.zeros(E, dtype=torch.int32, device=dev)
        self.runners_left = torch.zeros(E, dtype=torch.int32, device=dev)
        self.episode = torch.zeros(E, dtype=torch.int64, device=dev)
        self.acc_table = torch.tensor(
            [0.0] + np.linspace(p.min_acceleration, p.max_acceleration, p.num_acceleration_levels).tolist(), **f32)
        self.turn_table = torch.tensor([0.0] + np.linspace(p.min_turn, p.max_turn, p.num_turn_levels).tolist(), **f32)
        self._episode_return = torch.zeros(E, N, dtype=torch.float64, device=dev)
        self._episode_length = torch.zeros(E, dtype=torch.int64, device=dev)
        self._agent_index = torch.arange(N, device=dev)
        self._env_index = torch.arange(E, dtype=torch.int64, device=dev)
        self._no_done = torch.zeros(E, dtype=torch.bool, device=dev)
        # spatial grid for partial observations of many agents (exact either way; see tag.cu). Its
        # three extra launches cost more than they save on small batches (bench/bench_tag.py).
        i32 = dict(dtype=torch.int32, device=dev)
        use_grid = not p.use_full_observation and N >= 64 and E * N >= 4096
        self.grid_cells = int(min(64, max(1, math.isqrt(N // 2)))) if use_grid else 0
        cells = max(1, self.grid_cells) ** 2
        self._cell_count = torch.zeros(E, cells, **i32)
        self._cell_start = torch.zeros(E, cells, **i32)
        self._cell_cursor = torch.zeros(E, cells, **i32)
        self._cell_of = torch.zeros(E, N, **i32)
        self._cell_agents = torch.zeros(E, N, **i32)
        self._seqs: dict[str, Any] | None = None

    def agent_types(self) -> torch.Tensor:
        """The agents' types ``(E, N)`` float32 (1 = tagger) for the current observations."""
        return self.agent_type.clone()

    @property
    def block(self) -> int:
        """Threads per block (one per agent, capped)."""
        return min(self.num_agents, self.MAX_BLOCK)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {"x": self.x, "y": self.y, "dir": self.dir, "speed": self.speed, "acc": self.acc, "in_game": self.in_game,
                "agent_type": self.agent_type, "tagger_ids": self.tagger_ids, "t": self.t, "runners_left": self.runners_left,
                "episode": self.episode}

    def _reset_tracking(self) -> None:
        self._episode_return.zero_()
        self._episode_length.zero_()

    # -- reset ------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Starts episode 0 of every game; returns observations ``(E, N, D)`` float32."""
        if seed is not None:
            self.seed = int(seed)
        self._reset_tracking()
        obs = empty_output(self.num_envs, self.num_agents, self.obs_dim, dtype=torch.float32, device=self.device)
        if self._kernels is not None:
            self._sequences()["reset"](obs=obs, seed=self.seed & ((1 << 64) - 1))
            return obs
        self._reset_torch(self._no_done, only_done=False)
        obs.copy_(self._observe_torch())
        return obs

    # -- the kernels' launches ----------------------------------------------------------------
    def _sequences(self) -> dict[str, Any]:
        """The kernel launches of ``reset`` and ``step``, prepared once (one foreign call per
        sequence on the host): ``reset``; ``step`` (dynamics, observation, rewards, the end of
        the game, resets of the games that ended); ``observe_done`` (new games' observations)."""
        if self._seqs is None:
            from msrl.envs.native.kernels import Slot

            k, p, E, N = self._kernels, self.params, self.num_envs, self.num_agents
            seed, terminated, reward = Slot("seed", pointer=False), Slot("terminated"), Slot("reward")
            dynamics = ("tag_dynamics", E, self.block, (
                self.x, self.y, self.dir, self.speed, self.acc, self.in_game, self.agent_type, Slot("action"),
                self.acc_table, self.turn_table, reward, self.t, E, N, float(p.grid_length), float(p.max_speed),
                float(p.skill_level_tagger), float(p.skill_level_runner), float(p.edge_hit_penalty),
                float(p.step_penalty_for_tagger), float(p.step_reward_for_runner)))
            rewards = ("tag_rewards", E, self.block, (
                self.x, self.y, self.in_game, self.agent_type, self.tagger_ids, p.num_taggers, reward, self.runners_left,
                self.t, E, N, float(p.grid_length), float(p.tagging_distance), float(p.tag_reward_for_tagger),
                float(p.tag_penalty_for_runner), float(p.end_of_game_reward_for_runner), int(p.runner_exits_game_after_tagged),
                p.episode_length))
            finish = ("tag_finish", (E + 255) // 256, 256, (
                self.t, self.runners_left, reward, self._episode_return, self._episode_length, terminated, Slot("done_return"),
                Slot("done_length"), E, N, p.episode_length))
            self._seqs = {
                "reset": k.sequence(self._reset_launches(self._no_done, False, seed)
                                    + self._observe_launches(Slot("obs"), self._no_done, False)),
                "step": k.sequence([dynamics] + self._observe_launches(Slot("final_obs"), self._no_done, False)
                                   + [rewards, finish] + self._reset_launches(terminated, True, seed)),
                "observe_done": k.sequence(self._observe_launches(Slot("obs"), terminated, True)),
            }
        return self._seqs

    def _reset_launches(self, done: Any, only_done: bool, seed: Any) -> list[tuple]:
        """``tag_reset_env`` + ``tag_reset_agents`` (of the games with ``done`` if ``only_done``)."""
        p, E, N = self.params, self.num_envs, self.num_agents
        return [
            ("tag_reset_env", (E + 255) // 256, 256, (self.agent_type, self.tagger_ids, self.t, self.runners_left,
                                                      self.episode, done, int(only_done), seed, E, N, p.num_taggers)),
            ("tag_reset_agents", E, self.block, (self.x, self.y, self.dir, self.speed, self.acc, self.in_game, self.episode,
                                                 done, int(only_done), seed, E, N, float(p.grid_length))),
        ]

    def _observe_launches(self, obs: Any, done: Any, only_done: bool) -> list[tuple]:
        """``tag_observe`` into ``obs``, after the spatial grid's phases when it is used."""
        p, E, N, G = self.params, self.num_envs, self.num_agents, self.grid_cells
        cell_size = float(p.grid_length) / G if G else 1.0
        out = []
        if G:
            cells = G * G
            out += [
                ("tag_grid_clear", E, min(cells, self.MAX_BLOCK), (self._cell_count, E, cells)),
                ("tag_grid_count", E, self.block, (self.x, self.y, self.in_game, self._cell_of, self._cell_count, E, N, G,
                                                   cell_size)),
                ("tag_grid_scan", (E + 255) // 256, 256, (self._cell_count, self._cell_start, self._cell_cursor, E, cells)),
                ("tag_grid_fill", E, self.block, (self._cell_of, self._cell_cursor, self._cell_agents, E, N, cells)),
            ]
        out.append(("tag_observe", E, self.block, (
            self.x, self.y, self.dir, self.speed, self.acc, self.in_game, self.agent_type, self.t, obs, done, int(only_done),
            E, N, int(p.use_full_observation), p.num_observed, int(p.observe_self), p.episode_length, float(p.grid_length),
            float(p.max_speed), self._cell_start, self._cell_count, self._cell_agents, G, cell_size)))
        return out

    def _reset_torch(self, done: torch.Tensor, only_done: bool) -> None:
        """Torch reference of ``tag_reset_env`` + ``tag_reset_agents``."""
        p, E, N = self.params, self.num_envs, self.num_agents
        sel = done if only_done else torch.ones_like(done)
        episode = torch.where(sel, self.episode + 1 if only_done else torch.zeros_like(self.episode), self.episode)
        keys = env_keys(self.seed, self._env_index)
        # Floyd's sampling of the taggers, vectorised over envs
        types = torch.zeros(E, N, dtype=torch.float32, device=self.device)
        for k, j in enumerate(range(N - p.num_taggers, N)):
            u = uniform(keys, 0, episode, k)
            r = (u * float(j + 1)).to(torch.int64).clamp(max=j)
            taken = types.gather(1, r[:, None])[:, 0] == 1.0
            r = torch.where(taken, torch.full_like(r, j), r)
            types.scatter_(1, r[:, None], 1.0)
        stream = (1 << 32) + self._agent_index[None, :].expand(E, N)
        ep, key = episode[:, None].expand(E, N), keys[:, None].expand(E, N)
        x = (uniform(key, stream, ep, 0) * float(p.grid_length)).to(torch.float32)
        y = (uniform(key, stream, ep, 1) * float(p.grid_length)).to(torch.float32)
        d = (uniform(key, stream, ep, 2) * 4.0).to(torch.int32).to(torch.float32) * torch.tensor(_HALF_PI)
        m = sel[:, None]
        for name, new in (("agent_type", types), ("x", x), ("y", y), ("dir", d), ("speed", torch.zeros_like(x)),
                          ("acc", torch.zeros_like(x)), ("in_game", torch.ones_like(x))):
            getattr(self, name).copy_(torch.where(m, new, getattr(self, name)))
        ids = torch.sort(torch.where(types == 1.0, self._agent_index, N), dim=1).values[:, : p.num_taggers].to(torch.int32)
        self.tagger_ids.copy_(torch.where(m, ids, self.tagger_ids))
        self.t.copy_(torch.where(sel, 0, self.t))
        self.runners_left.copy_(torch.where(sel, p.num_runners, self.runners_left))
        self.episode.copy_(episode)

    # -- observe ----------------------------------------------------------------------------
    def _observe_torch(self) -> torch.Tensor:
        """Torch reference of ``tag_observe``: ``(E, N, D)``."""
        out = self._observe_others_torch()
        if not self.params.observe_self:
            return out
        p = self.params
        live = (self.in_game != 0.0).to(torch.float32)
        vel_scale = torch.tensor(float(p.max_speed)) + torch.tensor(1e-10)
        own = [live * self.x / float(p.grid_length), live * self.y / float(p.grid_length), live * self.speed / vel_scale,
               live * self.acc / vel_scale, live * torch.cos(self.dir), live * torch.sin(self.dir), self.agent_type]
        return torch.cat([out, torch.stack(own, dim=2)], dim=2)

    def _observe_others_torch(self) -> torch.Tensor:
        """The spec's part of the observation: ``(E, N, 7M + 1)``."""
        p, E, N = self.params, self.num_envs, self.num_agents
        pos_scale = torch.sqrt(torch.tensor(2.0)) * torch.tensor(float(p.grid_length))
        vel_scale = torch.tensor(float(p.max_speed)) + torch.tensor(1e-10)
        time_frac = self.t.to(torch.float32) / float(p.episode_length)
        self_in = self.in_game != 0.0

        def features(j: torch.Tensor) -> list[torch.Tensor]:
            """The 7 features of agents ``j`` ``(E, N, M)`` relative to each agent."""
            g = lambda v: v.gather(1, j.reshape(E, -1)).reshape(j.shape)  # noqa: E731
            me = lambda v: v[:, :, None]  # noqa: E731
            return [
                (g(self.x) - me(self.x)) / pos_scale,
                (g(self.y) - me(self.y)) / pos_scale,
                (g(self.speed) - me(self.speed)) / vel_scale,
                (g(self.acc) - me(self.acc)) / vel_scale,
                (g(self.dir) - me(self.dir)) / torch.tensor(_TWO_PI),
                g(self.agent_type),
                g(self.in_game),
            ]

        if p.use_full_observation:
            others = torch.stack([torch.cat([self._agent_index[:i], self._agent_index[i + 1:]]) for i in range(N)])
            j = others[None].expand(E, N, N - 1)
            f = features(j)
            live = self_in.to(torch.float32)[:, :, None]
            f = [live * v for v in f[:5]] + f[5:]
            return torch.cat([torch.cat(f, dim=2), torch.where(self_in, time_frac[:, None], 0.0)[:, :, None]], dim=2)
        K = p.num_observed
        dx = self.x[:, None, :] - self.x[:, :, None]
        dy = self.y[:, None, :] - self.y[:, :, None]
        dist = _sqrtf(dx * dx + dy * dy)
        eye = torch.eye(N, dtype=torch.bool, device=self.device)[None]
        valid = ~eye & (self.in_game != 0.0)[:, None, :]
        dist = torch.where(valid, dist, torch.inf)
        order = torch.sort(dist, dim=2, stable=True).indices[:, :, :K]
        keep = torch.isfinite(dist.gather(2, order))
        f = [torch.where(keep, v, 0.0) for v in features(order)]
        out = torch.cat(f + [time_frac[:, None, None].expand(E, N, 1)], dim=2)
        on = (self_in & (self.t != 0)[:, None])[:, :, None]
        return torch.where(on, out, 0.0)

    # -- step -------------------------------------------------------------------------------
    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One step of every game, then same-step autoreset of the games that ended.

        Args:
            action: ``(E, N, 2)`` int64 indices (acceleration, turn).

        Returns:
            ``(obs, reward, terminated, truncated, info)``; ``info["final_obs"]`` holds the
            observations of this step (before autoreset) and ``info["final_agent_type"]`` the
            types during it; ``info["agent_type"]`` the types that go with ``obs`` (a new game's
            for games that were reset).

        Raises:
            ValueError: wrong action shape.
        """
        E, N, p = self.num_envs, self.num_agents, self.params
        if action.shape != (E, N, 2):
            raise ValueError(f"action has shape {tuple(action.shape)}, expected ({E}, {N}, 2)")
        action = action.to(device=self.device, dtype=torch.int64).contiguous()
        dev = self.device
        reward = torch.empty(E, N, dtype=torch.float32, device=dev)
        final_obs = empty_output(E, N, self.obs_dim, dtype=torch.float32, device=dev)
        agent_type = self.agent_type.clone()  # the types during this step
        if self._kernels is not None:
            terminated = torch.empty(E, dtype=torch.bool, device=dev)
            done_return = torch.empty(E, N, dtype=torch.float64, device=dev)
            done_length = torch.empty(E, dtype=torch.int64, device=dev)
            seqs = self._sequences()
            seqs["step"](action=action, reward=reward, final_obs=final_obs, terminated=terminated, done_return=done_return,
                         done_length=done_length, seed=self.seed & ((1 << 64) - 1))
            self._log_games(done_return, done_length, agent_type)
            self._env_steps += E
            obs = empty_output(E, N, self.obs_dim, dtype=torch.float32, device=dev)
            obs.copy_(final_obs)
            seqs["observe_done"](obs=obs, terminated=terminated)
        else:
            self.t += 1  # the clock first (rule "t is incremented first")
            reward.copy_(self._dynamics_torch(action))
            final_obs.copy_(self._observe_torch())
            reward.copy_(self._rewards_torch(reward))
            terminated = (self.t >= p.episode_length) | (self.runners_left <= 0)
            self._track_agents(reward, terminated, agent_type)
            obs = final_obs.clone()
            self._reset_torch(terminated, only_done=True)
            obs.copy_(torch.where(terminated[:, None, None], self._observe_torch(), obs))
        truncated = torch.zeros(E, dtype=torch.bool, device=self.device)
        info = {"final_obs": final_obs, "final_agent_type": agent_type, "agent_type": self.agent_type.clone()}
        return obs, reward, terminated, truncated, info

    def _dynamics_torch(self, action: torch.Tensor) -> torch.Tensor:
        """Torch reference of ``tag_dynamics``; returns the rewards so far ``(E, N)``."""
        p = self.params
        g = self.in_game
        tagger = self.agent_type == 1.0
        d = _remainder32(self.dir + self.turn_table[action[..., 1]], _TWO_PI) * g
        ac = self.acc + self.acc_table[action[..., 0]]
        max_i = torch.where(tagger, np.float32(p.max_speed) * np.float32(p.skill_level_tagger),
                            np.float32(p.max_speed) * np.float32(p.skill_level_runner))
        sp = torch.minimum(torch.clamp(self.speed + ac, min=0.0), max_i) * g
        ac = ac * (sp > 0.0).to(torch.float32) * (sp < max_i).to(torch.float32)
        nx = self.x + sp * torch.cos(d)
        ny = self.y + sp * torch.sin(d)
        L = float(p.grid_length)
        crossed = (nx < 0.0) | (nx > L) | (ny < 0.0) | (ny > L)
        self.x.copy_(nx.clamp(0.0, L))
        self.y.copy_(ny.clamp(0.0, L))
        self.dir.copy_(d)
        self.speed.copy_(sp)
        self.acc.copy_(ac)
        r = torch.where(crossed, np.float32(p.edge_hit_penalty), np.float32(0.0)) + torch.where(
            tagger, np.float32(p.step_penalty_for_tagger), np.float32(p.step_reward_for_runner))
        return torch.where(g != 0.0, r, 0.0)

    def _rewards_torch(self, reward: torch.Tensor) -> torch.Tensor:
        """Torch reference of ``tag_rewards``."""
        p = self.params
        tagger = self.agent_type == 1.0
        runner_in = ~tagger & (self.in_game != 0.0)
        dx = self.x[:, None, :] - self.x[:, :, None]
        dy = self.y[:, None, :] - self.y[:, :, None]
        dist = torch.where(tagger[:, None, :], _sqrtf(dx * dx + dy * dy), torch.inf)
        best_d, best_j = dist.min(dim=2)  # first minimum: lowest id on ties
        tagged = runner_in & (best_d < np.float32(p.tagging_distance) * np.float32(p.grid_length))
        reward = reward + torch.where(tagged, np.float32(p.tag_penalty_for_runner), np.float32(0.0))
        gains = torch.zeros_like(reward).scatter_add_(1, best_j, tagged.to(torch.float32) * np.float32(p.tag_reward_for_tagger))
        reward = reward + gains
        if p.runner_exits_game_after_tagged:
            self.in_game.copy_(torch.where(tagged, 0.0, self.in_game))
            self.runners_left.sub_(tagged.sum(1).to(torch.int32))
        end = (self.t >= p.episode_length)[:, None] & ~tagger & (self.in_game != 0.0)
        return reward + torch.where(end, np.float32(p.end_of_game_reward_for_runner), np.float32(0.0))

    # -- statistics -------------------------------------------------------------------------
    def _track_agents(self, reward: torch.Tensor, done: torch.Tensor, agent_type: torch.Tensor) -> None:
        """Torch reference of ``tag_finish``'s tracking: per-agent returns ``(E, N)``; a finished
        game logs its agents' returns and types."""
        ret = self._episode_return + reward.to(torch.float64)
        length = self._episode_length + 1
        self._log_games(torch.where(done[:, None], ret, 0.0), torch.where(done, length, -1), agent_type)
        self._env_steps += self.num_envs
        self._episode_return.copy_(torch.where(done[:, None], 0.0, ret))
        self._episode_length.copy_(torch.where(done, 0, length))

    def _log_games(self, done_return: torch.Tensor, done_length: torch.Tensor, agent_type: torch.Tensor) -> None:
        """Keeps one step's finished games until :meth:`pop_finished`, reduced on the device to
        what the statistics use: per game ``(E, 3)`` float64 -- the return summed over its
        agents, the mean return of its taggers and of its runners -- and its length ``(E,)``
        (-1 where no game ended). ``done_return`` ``(E, N)`` float64 is each agent's return (0
        where no game ended), ``agent_type`` ``(E, N)`` (1.0: a tagger) the types during the
        step. A read then moves 4 numbers a game, not 2 per agent."""
        taggers = agent_type == 1.0
        runners = ~taggers
        games = torch.stack([done_return.sum(1), (done_return * taggers).sum(1) / taggers.sum(1),
                             (done_return * runners).sum(1) / runners.sum(1)], dim=1)
        self._finished.append((games, done_length))

    def pop_episode_stats(self):
        """Games finished since the last call: each game's return summed over its agents, its
        length, and per game the mean return of its taggers and of its runners (``extra``
        ``tagger_return``/``runner_return``, also in :attr:`last_type_returns`); one
        device-to-host copy."""
        tensors, build = self.pop_finished()
        return build(read_host(tensors))

    def pop_finished(self):
        """The games finished since the last call, still on the device (see
        :meth:`NativeEnv.pop_finished`), as the ``S`` steps since the last call logged them
        (:meth:`_log_games`): the lists of each step's per-game returns ``(E, 3)`` float64 (sum,
        taggers' mean, runners' mean) and lengths ``(E,)`` int64 (-1 where no game ended), read
        as ``(S, ...)`` stacks; ``build`` makes :meth:`pop_episode_stats`'s
        :class:`EpisodeStats` from their host copies."""
        from msrl.api import EpisodeStats

        if not self._finished:
            def nothing(host):
                self.last_type_returns = {"tagger": [], "runner": []}
                return EpisodeStats([], [], {"tagger_return": [], "runner_return": []})
            return [], nothing
        tensors = [[g for g, _ in self._finished], [n for _, n in self._finished]]
        self._finished = []

        def build(host):
            games, lens = host
            with host_side():
                mask = lens >= 0
                total, tagger, runner = games[mask].unbind(1)
                self.last_type_returns = {"tagger": tagger.tolist(), "runner": runner.tolist()}
                extra = {"tagger_return": self.last_type_returns["tagger"], "runner_return": self.last_type_returns["runner"]}
                return EpisodeStats(total.tolist(), lens[mask].tolist(), extra)

        return tensors, build


def _sqrtf(x: torch.Tensor) -> torch.Tensor:
    """IEEE float32 square root, as the kernels' ``sqrtf`` (and NumPy) compute it: torch's
    vectorised float32 sqrt may round the last bit otherwise, which flips (distance, id) ties.
    A float64 square root of a float32 rounds to the correctly rounded float32 result."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _remainder32(a: torch.Tensor, b: np.float32) -> torch.Tensor:
    """NumPy's float32 remainder (floored modulo via fmod)."""
    mod = torch.fmod(a, float(b))
    adjust = (mod != 0) & ((mod < 0) != (b < 0))
    return torch.where(adjust, mod + float(b), torch.where(mod == 0, torch.zeros_like(mod), mod))
