"""PPO by self-play against frozen past snapshots of itself, for two-or-more-player PettingZoo
games whose players share one observation and one action space: turn-based board games
(``pettingzoo/pettingzoo.classic.tictactoe_v3``, ``connect_four_v3``, stepped a ply at a time
by :class:`~msrl.envs.pettingzoo_env.TurnBasedStackedEnv`) and, with ``turn_based: false``,
simultaneous-move parallel games with Box observations.

In env ``e`` the learning policy plays seat ``e mod A`` (so it learns every seat) and every other
seat is played by an *opponent*: a frozen snapshot of the policy's past weights. The actor keeps
a pool of the newest ``pool_size`` snapshots, taken every ``snapshot_every`` weight updates, and
before each rollout draws the opponent: the newest snapshot with probability ``latest_prob``,
else one uniformly from the pool -- the opponent sampling of OpenAI Five (Berner et al. 2019,
"Dota 2 with Large Scale Deep Reinforcement Learning", section 3.3: 80% newest, 20% past) and of
Bansal et al. 2018 ("Emergent Complexity via Multi-Agent Competition", section 5.2: uniform over
past snapshots), which keeps the policy from cycling as pure latest-self-play does. Every actor
replica keeps its own pool from the weights it receives and draws with its own generator, so
replicas play different opponents. ``opponent_runs`` adds the final policies of earlier runs to
the draw as fixed members (a league of past runs, as AlphaStar's league keeps its past players).

Learning is PPO's (:func:`msrl.rl.losses.ppo_loss`, GAE) over the learning seat's steps only. In
a turn-based game the other players' plies are forced no-ops of the learning seat: their
log-probability and entropy are 0 (no policy gradient), their values are learned, and a reward
that arrives on an opponent's ply (its winning move) is credited back through GAE to the
learner's last move. Illegal moves are masked out of the policy (the game's ``action_mask``).

    msrl train configs/ppo_selfplay_tictactoe.yaml
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

from msrl.advantages import gae
from msrl.api import (
    AlgorithmSpec,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.distributions import categorical_log_prob_entropy, sample_categorical
from msrl.rl.losses import ppo_epochs, ppo_loss
from msrl.rl.networks import mlp
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["SelfPlayPPOConfig", "SelfPlayNet", "SelfPlayActor", "SelfPlayBuffer", "SelfPlayLearner", "SelfPlayTrainer",
           "play_against_random", "ALGORITHM"]

#: the logit of an illegal move (its probability underflows to exactly 0; finite, so that
#: ``p * log p`` stays 0 and never NaN)
ILLEGAL_LOGIT = -1e9


@dataclasses.dataclass
class SelfPlayPPOConfig:
    """Self-play PPO's hyperparameters: PPO's (CleanRL's names and defaults) and the opponent pool's."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T), in plies for a turn-based game"""
    learning_rate: PositiveFloat = 2.5e-4
    """Adam learning rate at the start of training"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor per env step (per ply in a turn-based game)"""
    gae_lambda: UnitInterval = 0.95
    """GAE lambda"""
    num_minibatches: PositiveInt = 4
    """minibatches per epoch"""
    update_epochs: PositiveInt = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: PositiveFloat = 0.2
    """surrogate clipping coefficient"""
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
    turn_based: bool = True
    """the game is turn-based (its observations end with msrl's legal-action mask and to-move
    flag, :data:`msrl.envs.pettingzoo_env.TURN_FEATURES`); false for simultaneous-move games"""
    snapshot_every: PositiveInt = 10
    """weight updates between snapshots of the policy into the opponent pool"""
    pool_size: PositiveInt = 10
    """snapshots the pool keeps (the newest); 1 is pure self-play against the newest snapshot"""
    latest_prob: UnitInterval = 0.5
    """probability that a rollout's opponent is the newest snapshot (else one drawn uniformly from the pool)"""
    opponent_runs: tuple[str, ...] = ()
    """run directories of earlier ``ppo_selfplay`` runs on the same game (same network sizes): each
    one's final policy (its last good checkpoint) joins the pool as a fixed member, never dropped
    and drawn as the snapshots are (a league of past runs)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        self.opponent_runs = tuple(str(r) for r in self.opponent_runs)


class SelfPlayNet(nn.Module):
    """An actor MLP ``(D,) -> n`` logits and a critic MLP ``(D,) -> 1`` over one player's
    observation; with ``turn_based``, illegal moves are masked and the other players' plies are
    forced no-ops.

    Args:
        observation_space: one player's Box ``(D,)`` (with ``turn_based``: ending with the
            action mask ``(n,)`` and the to-move flag).
        action_space: one player's ``Discrete(n)``.
        hidden_sizes: hidden widths; turn_based: as :attr:`SelfPlayPPOConfig.turn_based`.

    Raises:
        ValueError: another action space, or an observation too short to end with the turn features.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden_sizes: tuple[int, ...],
                 turn_based: bool) -> None:
        super().__init__()
        if not isinstance(action_space, gymnasium.spaces.Discrete):
            raise ValueError(f"self-play PPO needs a Discrete action space per player, got {action_space}")
        d, self.n, self.turn_based = int(np.prod(observation_space.shape)), int(action_space.n), turn_based
        if turn_based and d <= self.n + 1:
            raise ValueError(f"algorithm.hparams.turn_based: observations of {d} features cannot end with a {self.n}-move "
                             "action mask and a to-move flag; name a turn-based PettingZoo game "
                             "(e.g. pettingzoo/pettingzoo.classic.tictactoe_v3) or set turn_based: false")
        self.actor = mlp(d, hidden_sizes, self.n, out_std=0.01)
        self.critic = mlp(d, hidden_sizes, 1, out_std=1.0)

    def to_move(self, obs: torch.Tensor) -> torch.Tensor:
        """Whether each row's player moves this step: ``(..., D) -> (...)`` bool (all true for a
        simultaneous-move game)."""
        if not self.turn_based:
            return torch.ones(obs.shape[:-1], dtype=torch.bool, device=obs.device)
        return obs[..., -1] > 0.5

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``(..., n)`` of observations ``(..., D)``; illegal moves' are
        :data:`ILLEGAL_LOGIT` where the row's player moves."""
        logits = self.actor(obs)
        if self.turn_based:
            legal = obs[..., -self.n - 1:-1] > 0.5
            logits = torch.where(legal | ~self.to_move(obs)[..., None], logits, ILLEGAL_LOGIT)
        return logits

    def head(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (..., n), value (...))`` of observations ``(..., D)`` (:meth:`logits`, :meth:`value`)."""
        return self.logits(obs), self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(o)``: ``(..., D) -> (...)``."""
        return self.critic(obs).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)``, each ``(B,)``, of actions ``(B,)`` int64 at
        observations ``(B, D)``; a row whose player does not move (a forced no-op) has
        log-probability and entropy 0."""
        logits, value = self.head(obs)
        log_prob, entropy = categorical_log_prob_entropy(logits, action)
        moves = self.to_move(obs)
        return torch.where(moves, log_prob, 0.0), torch.where(moves, entropy, 0.0), value


def _build_net(ctx: BuildContext) -> SelfPlayNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = SelfPlayNet(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes,
                          ctx.hparams.turn_based)
    return net.to(ctx.device)


def learner_seats(num_envs: int, num_players: int, device: torch.device | str) -> torch.Tensor:
    """The learning policy's seat in each env: ``e mod A``, ``(E,)`` int64."""
    return torch.arange(num_envs, device=device) % num_players


class SelfPlayActor(ActorCriticActor):
    """Plays every seat of every env: the learning policy (:attr:`net`, the learner's newest
    weights) its seat, the opponent (:attr:`opponent`, a snapshot drawn from :attr:`pool`) the
    others; samples from its own generator.

    Attributes:
        league: the final policies of ``opponent_runs`` (state dicts on the actor's device), fixed.
        pool: the snapshots, oldest first (state dicts on the actor's device), at most ``pool_size``.
        updates: weight updates received (the pool takes a snapshot when ``updates % snapshot_every == 0``).
        opponent_index: the current opponent's index in ``league + pool``.

    Raises:
        ConfigError: an ``opponent_runs`` entry without a readable checkpoint, or whose policy's
            parameters differ from this network's (another game or other sizes).
    """

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.hp = ctx.hparams
        self.opponent = copy.deepcopy(self.net)
        self.league = [_run_policy(run, self.net, ctx.device) for run in self.hp.opponent_runs]
        self.pool: list[dict[str, torch.Tensor]] = []
        self.updates = 0
        self.opponent_index = 0

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """A :class:`SelfPlayNet`."""
        return _build_net(ctx)

    def compile_targets(self) -> tuple[str, ...]:
        """The two networks' forward passes; the draws from :attr:`generator` stay eager."""
        return ("net.head", "opponent.logits")

    def describe(self) -> str:
        """``msrl graph``'s note on the pool: its size, bytes, snapshot and draw schedule."""
        hp = self.hp
        nbytes = sum(t.numel() * t.element_size() for t in self.net.state_dict().values())
        league = (f"; with {len(self.league)} fixed policies of earlier runs ({', '.join(hp.opponent_runs)})"
                  if self.league else "")
        return (f"self-play opponent pool: a snapshot of the weights it receives every {hp.snapshot_every} updates, the "
                f"newest {hp.pool_size} kept (up to {hp.pool_size} x {nbytes} bytes, in this replica only){league}; "
                f"before each rollout the opponent is the newest snapshot with p={hp.latest_prob:g}, else one drawn "
                "uniformly; in env e the learning policy plays seat e mod players")

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Takes the learner's newest weights; every ``snapshot_every``-th update (the first
        included) snapshots them into the pool (dropping the oldest past ``pool_size``); then
        draws the next rollouts' opponent from the league and the pool."""
        self.weights.load_(weights)
        if self.updates % self.hp.snapshot_every == 0:
            self.pool.append({k: v.detach().clone() for k, v in self.net.state_dict().items()})
            del self.pool[:-self.hp.pool_size]
        self.updates += 1
        candidates = self.league + self.pool
        if float(torch.rand((), generator=self.generator, device=self.generator.device)) < self.hp.latest_prob:
            self.opponent_index = len(candidates) - 1  # the newest snapshot
        else:
            self.opponent_index = int(torch.randint(len(candidates), (), generator=self.generator,
                                                    device=self.generator.device))
        self.opponent.load_state_dict(candidates[self.opponent_index])

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, ...]:
        """Chooses every seat's move.

        Args:
            obs: ``(E, A, D)`` float32; deterministic: argmax instead of sampling.

        Returns:
            ``(action, log_prob, value, seat)``: action ``(E, A)`` int64 (0 for a player not to
            move); the learning seat's log-probability and value ``(E,)`` float32 (log-prob 0
            on a forced no-op); seat ``(E,)`` int64 (:func:`learner_seats`).
        """
        E, A, _ = obs.shape
        seat = learner_seats(E, A, obs.device)
        own = torch.nn.functional.one_hot(seat, A).bool()  # (E, A): the learning policy's seat
        logits, value = self.net.head(obs)
        opp_logits = self.opponent.logits(obs)  # the opponent's values are never used
        logits = torch.where(own[..., None], logits, opp_logits)
        log_probs = torch.log_softmax(logits, dim=-1)
        if deterministic:
            action = logits.argmax(-1)
        else:
            action = sample_categorical(log_probs.exp().flatten(0, 1), self.generator).view(E, A)
        moves = self.net.to_move(obs)
        action = torch.where(moves, action, 0)
        log_prob = torch.where(moves, log_probs.gather(-1, action[..., None]).squeeze(-1), 0.0)
        rows = torch.arange(E, device=obs.device)
        return action, log_prob[rows, seat], value[rows, seat], seat

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "opponent": self.opponent.state_dict(), "pool": list(self.pool),
                "league": list(self.league), "updates": self.updates, "opponent_index": self.opponent_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.opponent.load_state_dict(state["opponent"])
        self.pool = [dict(s) for s in state["pool"]]
        self.league = [dict(s) for s in state.get("league", self.league)]
        self.updates, self.opponent_index = int(state["updates"]), int(state["opponent_index"])


def _run_policy(run_dir: str, net: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The final policy of run ``run_dir`` (its last good checkpoint's actor weights), checked
    against ``net``'s parameters, on ``device``.

    Raises:
        ConfigError: no readable checkpoint there, or other parameter names or shapes.
    """
    from msrl.errors import ConfigError
    from msrl.run.checkpoints import CheckpointError, load_checkpoint

    try:
        ckpt, _ = load_checkpoint(run_dir)
    except (FileNotFoundError, CheckpointError) as e:
        raise ConfigError(f"algorithm.hparams.opponent_runs: {run_dir}: {e}") from None
    weights = ckpt.get("actor_weights") or {}
    mine = net.state_dict()
    bad = sorted(set(mine) ^ set(weights)) or [k for k in mine if tuple(mine[k].shape) != tuple(weights[k].shape)]
    if bad:
        raise ConfigError(f"algorithm.hparams.opponent_runs: {run_dir}: its policy's parameters do not fit this network "
                         f"(first difference: {bad[0]}); it must be a ppo_selfplay run on the same game with the same "
                         "hidden_sizes")
    return {k: v.detach().to(device).clone() for k, v in weights.items()}


class SelfPlayBuffer(RolloutBuffer):
    """Preallocated ``(T, E, ...)`` storage: ``obs``/``next_obs`` ``(T, E, A, D)`` float32,
    ``action`` and ``reward`` ``(T, E, A)`` (int64, float32), the learning seat's ``log_prob``
    and ``value`` ``(T, E)`` float32, ``seat`` ``(T, E)`` int64, ``terminated``/``truncated``
    ``(T, E)`` bool (insert, gather and checkpoints as :class:`msrl.rl.buffers.RolloutBuffer`)."""

    KEYS = ("obs", "action", "log_prob", "value", "reward", "terminated", "truncated", "next_obs", "seat")

    def __init__(self, ctx: BuildContext) -> None:
        spec, T = ctx.env_spec, ctx.hparams.num_steps
        E, A, D = spec.num_envs, spec.num_agents, int(np.prod(spec.observation_space.shape))
        f32, dev = torch.float32, ctx.device
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
                "action": torch.zeros(T, E, A, dtype=torch.int64, device=dev),
                "log_prob": torch.zeros(T, E, dtype=f32, device=dev),
                "value": torch.zeros(T, E, dtype=f32, device=dev),
                "reward": torch.zeros(T, E, A, dtype=f32, device=dev),
                "terminated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
                "seat": torch.zeros(T, E, dtype=torch.int64, device=dev),
            },
            batch_size=[T, E],
            device=dev,
        )
        self.t = 0


def _seat_rows(x: torch.Tensor, seat: torch.Tensor) -> torch.Tensor:
    """The learning seat's entries: ``(T, E, A, *rest)`` with seat ``(T, E)`` -> ``(T, E, *rest)``."""
    index = seat.view(*seat.shape, 1, *([1] * (x.dim() - 3))).expand(*seat.shape, 1, *x.shape[3:])
    return x.gather(2, index).squeeze(2)


class SelfPlayLearner(Learner):
    """PPO's update (Schulman et al. 2017, Eq. 7 and 9, :func:`msrl.rl.losses.ppo_loss`) over the
    learning seat's steps of a ``(T, E)`` rollout, with GAE (Schulman et al. 2016) per env."""

    #: the minibatch loss (:func:`msrl.rl.losses.ppo_loss`), an attribute so that
    #: ``compile: inductor`` can replace it by its compiled form (:meth:`compile_targets`)
    ppo_loss = staticmethod(ppo_loss)

    def compile_targets(self) -> tuple[str, ...]:
        """The network's evaluation of a minibatch and PPO's loss on it."""
        return ("net.evaluate", "ppo_loss")

    def __init__(self, ctx: BuildContext) -> None:
        self.hp = ctx.hparams
        self.net = _build_net(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5, fused=True)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The networks' state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": int(self.iteration),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One PPO update on the learning seat's steps.

        Args:
            batch: TensorDict of batch size ``(T, E)`` with :attr:`SelfPlayBuffer.KEYS`.

        Returns:
            PPO's losses (``losses/...``, as :func:`msrl.rl.losses.ppo_epochs`),
            ``charts/learning_rate``, and over the games that ended in the batch, judged by the
            sign of the learning seat's reward on the game's last step (board games reward only
            the end): ``selfplay/win_rate``, ``selfplay/draw_rate``, ``selfplay/loss_rate``
            (NaN when no game ended), ``selfplay/games``: 0-d tensors on the learner's device.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        seat = batch["seat"]
        obs, next_obs = _seat_rows(batch["obs"], seat), _seat_rows(batch["next_obs"], seat)
        action, reward = _seat_rows(batch["action"], seat), _seat_rows(batch["reward"], seat)
        with torch.no_grad():
            next_values = net.value(next_obs)
        advantages, returns = gae(reward, batch["value"], next_values, batch["terminated"], batch["truncated"],
                                  hp.gamma, hp.gae_lambda)
        D = obs.shape[-1]
        b_obs, b_actions = obs.reshape(-1, D), action.reshape(-1)
        anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        stats = ppo_epochs(lambda mb: net.evaluate(b_obs[mb], b_actions[mb]), batch["log_prob"].reshape(-1),
                           batch["value"].reshape(-1), advantages.reshape(-1), returns.reshape(-1), hp.clip_coef,
                           step=lambda loss: self.apply_gradients(loss, hp.max_grad_norm), generator=self.generator,
                           update_epochs=hp.update_epochs, num_minibatches=hp.num_minibatches, norm_adv=hp.norm_adv,
                           clip_vloss=hp.clip_vloss, ent_coef=hp.ent_coef, vf_coef=hp.vf_coef, target_kl=hp.target_kl,
                           loss=self.ppo_loss)
        stats["charts/learning_rate"] = self.lr.clone()
        stats.update(game_outcomes(reward, batch["terminated"] | batch["truncated"]))
        return stats


def game_outcomes(reward: torch.Tensor, done: torch.Tensor) -> dict[str, torch.Tensor]:
    """Win, draw and loss rates of the games that ended: reward ``(T, E)`` of the learning
    seat, done ``(T, E)`` bool; a game's outcome is the sign of its last step's reward.
    Returns ``selfplay/win_rate``, ``selfplay/draw_rate``, ``selfplay/loss_rate`` (NaN when no
    game ended) and ``selfplay/games``, 0-d float32 tensors."""
    games = done.sum().to(torch.float32)
    final = reward[done]
    out = {"selfplay/games": games}
    for name, hit in (("win", final > 0), ("draw", final == 0), ("loss", final < 0)):
        out[f"selfplay/{name}_rate"] = torch.where(games > 0, hit.sum() / games.clamp(min=1), torch.nan)
    return out


class SelfPlayTrainer(Trainer):
    """The loop body: a rollout of every seat of every env (the learning policy and its drawn
    opponent), one learner update, weight sync (which snapshots and draws the next opponent)."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor (the pool's first snapshot)."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value, seat = self.actor.act(self.obs)
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
                seat=seat,
            )
            self.obs = next_obs
        trajectory = self.buffer.gather()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


def random_legal_moves(obs: np.ndarray, num_actions: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random legal move for every player of a turn-based observation ``(A, D)``
    (0 for a player not to move): ``(A,)`` int64."""
    masks = obs[:, -num_actions - 1:-1] > 0.5
    return np.array([rng.choice(np.flatnonzero(m)) if m.any() else 0 for m in masks], dtype=np.int64)


@torch.no_grad()
def play_against_random(net: SelfPlayNet, env_id: str, games: int, seed: int, env_kwargs: dict | None = None,
                        deterministic: bool = True) -> dict[str, float]:
    """Plays ``net`` against a uniformly random legal player on a turn-based game, taking each
    seat in turn (game ``g``: seat ``g mod A``) -- the usual yardstick of a board-game policy.

    Args:
        net: a :class:`SelfPlayNet` with ``turn_based``; env_id: ``pettingzoo/<module>``;
        games: how many games; seed: of the games and the random player.
        deterministic: play ``net``'s most probable legal move (else sample).

    Returns:
        ``{"win": w, "draw": d, "loss": l}``, fractions of ``games`` (by the sign of ``net``'s
        last reward).

    Raises:
        ValueError: ``net`` is not turn-based.
    """
    from msrl.envs.pettingzoo_env import make_parallel

    if not net.turn_based:
        raise ValueError("play_against_random needs a turn-based game (turn_based: true)")
    env = make_parallel(env_id, dict(env_kwargs or {}))
    rng = np.random.default_rng(seed)
    device = next(net.parameters()).device
    counts = {"win": 0, "draw": 0, "loss": 0}
    for g in range(games):
        obs, _ = env.reset(seed=seed + g)
        seat, done, reward = g % len(env.agents), False, np.zeros(len(env.agents))
        while not done:
            action = random_legal_moves(obs, net.n, rng)
            logits, _ = net.head(torch.as_tensor(obs[seat], device=device))
            if deterministic:
                action[seat] = int(logits.argmax())
            else:
                action[seat] = int(torch.distributions.Categorical(logits=logits).sample())
            obs, reward, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
        counts["win" if reward[seat] > 0 else "loss" if reward[seat] < 0 else "draw"] += 1
    env.close()
    return {k: v / games for k, v in counts.items()}


ALGORITHM = AlgorithmSpec(
    name="ppo_selfplay",
    hparams=SelfPlayPPOConfig,
    trainer=SelfPlayTrainer,
    components={"actor": SelfPlayActor, "buffer": SelfPlayBuffer, "learner": SelfPlayLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    num_agents=(2, None),
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
