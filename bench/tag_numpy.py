"""A NumPy implementation of the Tag rules (shared/specs/tag_continuous.md), the benchmark peer.

Written the way WarpDrive's CPU env is: one object per game, NumPy arrays over its agents,
float32 state; a batch of games is a Python loop over objects. It is also an independent
implementation of the spec: ``tests/test_bench_tag_numpy.py`` checks that one step from the
same state gives what msrl's torch reference gives.
"""

from __future__ import annotations

import numpy as np

from msrl.envs.native.tag import TagParams

TWO_PI = np.float32(6.28318530717959)
HALF_PI = np.float32(3.14159265358979) / np.float32(2.0)


class NumpyTag:
    """One Tag game.

    Args:
        params: the game's :class:`~msrl.envs.native.tag.TagParams`; seed: NumPy generator seed.
    """

    def __init__(self, params: TagParams, seed: int = 0) -> None:
        self.p = params
        self.rng = np.random.default_rng(seed)
        p = params
        self.n = p.num_agents
        self.acc_table = np.asarray([0.0] + list(np.linspace(p.min_acceleration, p.max_acceleration, p.num_acceleration_levels)),
                                    dtype=np.float32)
        self.turn_table = np.asarray([0.0] + list(np.linspace(p.min_turn, p.max_turn, p.num_turn_levels)), dtype=np.float32)
        self.reset()

    def reset(self) -> np.ndarray:
        """Starts a game; returns observations ``(N, D)`` float32."""
        p, n = self.p, self.n
        self.type = np.zeros(n, dtype=np.float32)
        self.type[self.rng.choice(n, p.num_taggers, replace=False)] = 1.0
        self.x = (self.rng.random(n) * p.grid_length).astype(np.float32)
        self.y = (self.rng.random(n) * p.grid_length).astype(np.float32)
        self.dir = (self.rng.integers(0, 4, n).astype(np.float32) * HALF_PI).astype(np.float32)
        self.speed = np.zeros(n, dtype=np.float32)
        self.acc = np.zeros(n, dtype=np.float32)
        self.in_game = np.ones(n, dtype=np.float32)
        self.t = 0
        self.runners_left = p.num_runners
        return self.observe()

    def observe(self) -> np.ndarray:
        """Observations ``(N, 7M + 1)`` of the current state (feature-major)."""
        p, n = self.p, self.n
        pos = np.float32(np.sqrt(np.float32(2.0)) * np.float32(p.grid_length))
        vel = np.float32(np.float32(p.max_speed) + np.float32(1e-10))
        frac = np.float32(np.float32(self.t) / np.float32(p.episode_length))
        me_in = self.in_game != 0
        feats = [self.x, self.y, self.speed, self.acc, self.dir]
        scales = [pos, pos, vel, vel, TWO_PI]
        if p.use_full_observation:
            m = n - 1
            others = np.array([np.r_[0:i, i + 1 : n] for i in range(n)])
            out = np.zeros((n, 7 * m + 1), dtype=np.float32)
            live = me_in.astype(np.float32)[:, None]
            for f, (v, s) in enumerate(zip(feats, scales)):
                out[:, f * m : (f + 1) * m] = live * (v[others] - v[:, None]) / s
            out[:, 5 * m : 6 * m] = self.type[others]
            out[:, 6 * m : 7 * m] = self.in_game[others]
            out[:, 7 * m] = np.where(me_in, frac, np.float32(0.0))
            return out
        k = p.num_observed
        out = np.zeros((n, 7 * k + 1), dtype=np.float32)
        if self.t == 0:
            return out
        dx = self.x[None, :] - self.x[:, None]
        dy = self.y[None, :] - self.y[:, None]
        dist = np.sqrt(dx * dx + dy * dy)
        dist[np.arange(n), np.arange(n)] = np.inf
        dist[:, ~me_in] = np.inf
        order = np.argsort(dist, axis=1, kind="stable")[:, :k]
        keep = np.isfinite(np.take_along_axis(dist, order, 1))
        for f, (v, s) in enumerate(zip(feats, scales)):
            out[:, f * k : (f + 1) * k] = np.where(keep, (v[order] - v[:, None]) / s, 0.0)
        out[:, 5 * k : 6 * k] = np.where(keep, self.type[order], 0.0)
        out[:, 6 * k : 7 * k] = np.where(keep, self.in_game[order], 0.0)
        out[:, 7 * k] = frac
        out[~me_in] = 0.0
        return out

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """One step; ``action`` ``(N, 2)`` int indices. Returns ``(obs, reward, done)``; a
        finished game is reset (its final observation is returned)."""
        p = self.p
        self.t += 1
        g = self.in_game
        tagger = self.type == 1.0
        d = np.remainder(self.dir + self.turn_table[action[:, 1]], TWO_PI).astype(np.float32) * g
        ac = self.acc + self.acc_table[action[:, 0]]
        max_i = np.where(tagger, np.float32(p.max_speed) * np.float32(p.skill_level_tagger),
                         np.float32(p.max_speed) * np.float32(p.skill_level_runner)).astype(np.float32)
        sp = np.minimum(np.maximum(self.speed + ac, np.float32(0.0)), max_i) * g
        ac = ac * (sp > 0) * (sp < max_i)
        nx = self.x + sp * np.cos(d)
        ny = self.y + sp * np.sin(d)
        L = np.float32(p.grid_length)
        crossed = (nx < 0) | (nx > L) | (ny < 0) | (ny > L)
        self.x, self.y = np.clip(nx, 0, L).astype(np.float32), np.clip(ny, 0, L).astype(np.float32)
        self.dir, self.speed, self.acc = d.astype(np.float32), sp.astype(np.float32), ac.astype(np.float32)
        obs = self.observe()
        reward = np.where(crossed, np.float32(p.edge_hit_penalty), np.float32(0.0)) + np.where(
            tagger, np.float32(p.step_penalty_for_tagger), np.float32(p.step_reward_for_runner))
        reward = np.where(g != 0, reward, np.float32(0.0)).astype(np.float32)
        taggers = np.flatnonzero(tagger)
        for i in np.flatnonzero(~tagger & (g != 0)):
            dist = np.sqrt((self.x[taggers] - self.x[i]) ** 2 + (self.y[taggers] - self.y[i]) ** 2)
            j = int(np.argmin(dist))
            if dist[j] < np.float32(p.tagging_distance) * L:
                reward[i] += np.float32(p.tag_penalty_for_runner)
                reward[taggers[j]] += np.float32(p.tag_reward_for_tagger)
                if p.runner_exits_game_after_tagged:
                    self.in_game[i] = 0.0
                    self.runners_left -= 1
        if self.t >= p.episode_length:
            reward[~tagger & (self.in_game != 0)] += np.float32(p.end_of_game_reward_for_runner)
        done = self.t >= p.episode_length or self.runners_left <= 0
        if done:
            self.reset()
        return obs, reward, done
