"""AlphaZero's PUCT tree search over a batch of OpenSpiel games (Silver et al. 2018, "A general
reinforcement learning algorithm that masters chess, shogi, and Go through self-play", Science
362; the search as in its supplementary pseudocode), one tree per game, every game's tree held in
the same arrays: a simulation's selection, expansion and backup are array operations over the
games, level by level, and only the game states (an OpenSpiel state cloned per new node) and
their observations are touched one game at a time.

The search is driven from outside, one network evaluation per simulation (the leaf evaluation
is the caller's: ``algorithms/alphazero.py`` makes it a call of the actor, which a distribution
policy may serve centrally):

    leaves = search.begin(states, rngs)                    # the roots' observations
    for _sim in range(num_simulations):
        leaves = search.step(*network(leaves))             # expand, back up, select the next leaves
    pi, move, player = search.result()
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["PUCTSearch"]


class PUCTSearch:
    """AlphaZero's tree search over a batch of games: :meth:`begin` returns the roots'
    observations, each :meth:`step` takes the network's evaluation of the last observations it
    returned and returns the next leaves', and :meth:`result` gives the root's visit distribution
    and the move to play.

    One simulation (the pseudocode's ``run_mcts``): from the root, repeatedly take the child
    maximising ``Q(s, a) + U(s, a)``, ``U = c(s) P(s, a) sqrt(N(s)) / (1 + N(s, a))``,
    ``c(s) = log((1 + N(s) + c_base) / c_base) + c_init``, ``Q`` the child's mean value for the
    player choosing (``puct_q``: in ``[-1, 1]``, 0 while unvisited; or in ``[0, 1]``, 0 while
    unvisited), the lowest move on a tie, until a node not yet expanded; the network evaluates it
    (a finished game's exact outcome replaces the network's value), it is expanded with the legal
    moves' softmax priors, and its value is added along the path, signed for each node's chooser.
    The root's first expansion mixes ``Dirichlet(alpha)`` noise into its priors with weight
    ``root_exploration_fraction`` when ``noise`` is on.

    Args:
        num_actions: ``A``.
        hp: the search's hyperparameters (``AlphaZeroConfig``'s names): ``num_simulations`` (the
            trees' first capacity; they grow past it), ``c_base``, ``c_init``, ``puct_q``,
            ``dirichlet_alpha``, ``root_exploration_fraction``, ``temperature_moves``.
        noise: root noise and temperature moves (self-play); off: evaluation play (the most
            visited move).

    Attributes (game ``g``'s tree, node 0 its root, ``M`` nodes of capacity, statistics on the
    edges, as the pseudocode's ``N(s, a)`` and ``W(s, a)``):
        edge_visits: ``(G, M, A)`` int64 ``N(s, a)``; edge_value: ``(G, M, A)`` float64, the
            values backed up through the edge for the player choosing it (the player to move at
            ``s``); prior, child: ``(G, M, A)``: the expanded nodes' priors and the child node per
            move (-1: none yet); player: ``(G, M)`` int64, the player to move at a node (< 0: a
            finished game); ``N(s) = 1 + sum_a N(s, a)`` (the expansion's visit, then one per
            simulation through it); states: ``states[g][node]``, the OpenSpiel states; path,
            depth: ``(G, M)`` and ``(G,)``: the nodes from the root to each game's pending leaf.
    """

    def __init__(self, num_actions: int, hp: Any, noise: bool = True) -> None:
        from msrl.envs.openspiel_env import observe

        self._observe = observe
        self.num_actions, self.hp, self.noise = num_actions, hp, noise
        self.rngs: Sequence[np.random.Generator] = ()
        self._c = np.zeros(0)
        self.states: list[list[Any]] = []

    def begin(self, states: Sequence[Any], rngs: Sequence[np.random.Generator]) -> np.ndarray:
        """New trees at ``states`` (OpenSpiel states, not finished; cloned), each game's draws
        (root noise, temperature moves) from its own generator in ``rngs`` (empty without
        ``noise``) -- so that how games are split over replicas changes no draw: the roots'
        observations ``(G, D + A)`` float32, for the network's first evaluation."""
        G, A, M = len(states), self.num_actions, self.hp.num_simulations + 2
        self.edge_visits, self.edge_value = np.zeros((G, M, A), np.int64), np.zeros((G, M, A))
        self.prior, self.child = np.zeros((G, M, A)), np.full((G, M, A), -1, np.int64)
        self._offset = np.zeros((G, M, A))  # 0 at a legal move, -inf elsewhere: added to the scores
        self.player, self._selectable = np.zeros((G, M), np.int64), np.zeros((G, M), bool)
        self.path, self._moves, self.depth = np.zeros((G, M), np.int64), np.zeros((G, M), np.int64), np.ones(G, np.int64)
        self.states = [[s.clone()] for s in states]
        self.player[:, 0] = [s[0].current_player() for s in self.states]
        self.rngs, self._steps = rngs, 0
        return self._observations()

    def _grow(self) -> None:
        """Doubles every tree's node capacity (a search run past ``num_simulations``)."""
        for name in ("edge_visits", "edge_value", "prior", "child", "_offset", "player", "_selectable", "path", "_moves"):
            old = getattr(self, name)
            new = np.full((old.shape[0], 2 * old.shape[1], *old.shape[2:]), -1 if name == "child" else 0, old.dtype)
            new[:, :old.shape[1]] = old
            setattr(self, name, new)

    def _observations(self) -> np.ndarray:
        leaves = self.path[np.arange(len(self.states)), self.depth - 1].tolist()
        self._leaves = np.stack([self._observe(self.states[i][leaf], self.num_actions) for i, leaf in enumerate(leaves)])
        return self._leaves

    def path_states(self, g: int) -> list[Any]:
        """The OpenSpiel states from game ``g``'s root to its pending leaf."""
        return [self.states[g][n] for n in self.path[g, :self.depth[g]].tolist()]

    def step(self, logits: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Expands and backs up the pending leaves with the network's ``logits (G, A)`` and
        ``value (G,)`` (for each leaf's player to move), then selects the next leaves:
        returns their observations ``(G, D + A)`` float32."""
        self._expand_and_backup(np.asarray(logits), np.asarray(value))
        self._steps += 1
        if len(self._c) <= self._steps + 1:  # c(s) for every N(s) to come: math.log's values, a table
            hp = self.hp
            self._c = np.array([math.log((1 + k + hp.c_base) / hp.c_base) + hp.c_init for k in range(2 * self._steps + 4)])
        if max(len(t) for t in self.states) >= self.player.shape[1]:
            self._grow()
        self._select()
        return self._observations()

    def _expand_and_backup(self, logits: np.ndarray, value: np.ndarray) -> None:
        G, M, A = self.edge_visits.shape
        g = np.arange(G)
        leaf = self.path[g, self.depth - 1]
        mover = self.player[g, leaf]
        value = value.astype(np.float64)
        v0 = np.where(mover == 0, value, -value)  # the leaf's value for player 0 (two-player zero-sum)
        for i in np.flatnonzero(mover < 0).tolist():  # a finished game: its exact outcome
            v0[i] = self.states[i][leaf[i]].returns()[0]
        new = np.flatnonzero((mover >= 0) & ~self._selectable[g, leaf])
        if new.size:
            at = leaf[new]
            legal = self._leaves[new, -A:] > 0  # (the observation's legal-move mask)
            z = np.where(legal, logits[new].astype(np.float64), -np.inf)
            p = np.exp(z - z.max(1, keepdims=True))
            prior = p / p.sum(1, keepdims=True)
            eps = self.hp.root_exploration_fraction
            if self.noise and eps > 0:
                for j in np.flatnonzero(at == 0).tolist():
                    moves = np.flatnonzero(legal[j])
                    noise = self.rngs[new[j]].dirichlet([self.hp.dirichlet_alpha] * len(moves))
                    prior[j, moves] = (1 - eps) * prior[j, moves] + eps * noise
            self.prior[new, at], self._offset[new, at], self._selectable[new, at] = prior, np.where(legal, 0.0, -np.inf), True
        gi, di = np.nonzero(np.arange(1, int(self.depth.max())) < self.depth[:, None])
        parent = self.path[gi, di] + gi * M  # (flat node ids; di: the edge from path[di] to path[di + 1])
        edge = parent * A + self._moves[gi, di + 1]
        self.edge_visits.reshape(-1)[edge] += 1
        self.edge_value.reshape(-1)[edge] += np.where(self.player.reshape(-1)[parent] == 0, v0[gi], -v0[gi])

    def _select(self) -> None:
        unit = self.hp.puct_q == "unit"
        G, M, A = self.edge_visits.shape
        visits, values, prior = (x.reshape(G * M, A) for x in (self.edge_visits, self.edge_value, self.prior))
        offset, child, selectable = self._offset.reshape(G * M, A), self.child.reshape(-1), self._selectable.reshape(-1)
        self.depth[:] = 1
        active = np.arange(G)
        f = active * M  # the roots (flat node ids)
        while True:
            go = selectable.take(f)
            if not go.all():
                active, f = active[go], f[go]
            if not active.size:
                break
            n = visits.take(f, 0)
            n_parent = n.sum(1) + 1
            mean = values.take(f, 0) / np.maximum(n, 1)  # (0 while unvisited)
            q = np.where(n > 0, 0.5 * mean + 0.5, 0.0) if unit else mean
            score = q + self._c.take(n_parent)[:, None] * prior.take(f, 0) * np.sqrt(n_parent)[:, None] / (1 + n)
            best = (score + offset.take(f, 0)).argmax(1)
            nxt = child.take(f * A + best)
            descend = nxt >= 0
            for j in np.flatnonzero(~descend).tolist():  # a new node: the game's state one move on
                i, parent, move = int(active[j]), int(f[j] - active[j] * M), int(best[j])
                tree = self.states[i]
                state = tree[parent].clone()
                state.apply_action(move)
                k = nxt[j] = len(tree)
                tree.append(state)
                self.child[i, parent, move], self.player[i, k] = k, state.current_player()
            d = self.depth[active]
            self.path[active, d], self._moves[active, d] = nxt, best
            self.depth[active] = d + 1
            active = active[descend]
            f = active * M + nxt[descend]

    def visit_counts(self) -> np.ndarray:
        """The roots' visit count per move ``(G, A)`` float64."""
        return self.edge_visits[:, 0].astype(np.float64)

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pi (G, A) float32, move (G,) int64, player (G,) int64)``: the roots' visit
        distributions (the policy target), the moves to play -- drawn in proportion to the visits
        in a game's first ``temperature_moves`` plies with ``noise`` on, else the most visited
        (the lowest move on a tie) -- and the players to move."""
        counts = self.visit_counts()
        pi = counts / np.maximum(counts.sum(1, keepdims=True), 1)
        move = counts.argmax(1)
        for g, tree in enumerate(self.states):
            if self.noise and len(tree[0].history()) < self.hp.temperature_moves:
                move[g] = self.rngs[g].choice(self.num_actions, p=pi[g])
        return pi.astype(np.float32), move.astype(np.int64), self.player[:, 0].copy()
