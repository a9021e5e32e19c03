"""AlphaZero: self-play with a PUCT tree search guided by a policy-value network, trained on the
search's visit counts and the games' outcomes (Silver et al. 2018, "A general reinforcement
learning algorithm that masters chess, shogi, and Go through self-play", Science 362;
the search as in its supplementary pseudocode), on OpenSpiel's two-player board games
(``openspiel/tic_tac_toe``, ``openspiel/connect_four``: :mod:`msrl.envs.openspiel_env`).

Read top to bottom: hyperparameters; the network ``f(s) = (p, v)`` (an MLP or the paper's
residual tower: :class:`~msrl.rl.networks.PolicyValueNet`) built for the game; the actor, whose
:meth:`AlphaZeroActor.evaluate` is the search's leaf evaluation; :class:`MCTS`, the env-side
wrapper that runs the search beside the games it clones (the search itself,
:class:`~msrl.rl.mcts.PUCTSearch`, every game's tree in shared arrays); the replay of
``(s, pi, z)``, ``z`` filled in when the game ends; the learner (Eq. 1 of the paper:
``(z - v)^2 - pi^T log p`` plus L2); the evaluation against fixed opponents; and the trainer,
whose loop over simulations is a plain ``for``:

    leaves = self.env.search_begin()                     # every game's root
    for _sim in range(num_simulations):
        logits, value = self.actor.evaluate(leaves)      # the network call
        leaves = self.env.search_step(logits, value)     # expand, back up, select the next leaves

Where the search's network calls run is the policy's decision, not this file's: under
``single`` and coarse each actor evaluates its own games' leaves; under ``single_learner_fine``
the env replicas search and the central replica evaluates every replica's leaves in one batch
(``distribution_policy.inference`` batches them dynamically, SEED RL's central inference).

    msrl train configs/alphazero_tictactoe.yaml
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    EnvWrapper,
    Fraction,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    returns,
)
from msrl.device import native_bfloat16
from msrl.rl.buffers import ReplayBuffer
from msrl.rl.mcts import PUCTSearch
from msrl.rl.networks import ILLEGAL_LOGIT, PolicyValueNet

__all__ = ["AlphaZeroConfig", "policy_value_net", "AlphaZeroActor", "PUCTSearch", "MCTS", "AlphaZeroBuffer",
           "AlphaZeroLearner", "AlphaZeroTrainer", "play_match", "infer", "ALGORITHM", "ILLEGAL_LOGIT", "PolicyValueNet"]


@dataclasses.dataclass
class AlphaZeroConfig:
    """AlphaZero's hyperparameters (the paper's names; defaults sized for tic-tac-toe on a CPU,
    OpenSpiel's ``alpha_zero`` example's where the paper's are for Go)."""

    num_simulations: PositiveInt = 50
    """network evaluations per move: the root's, then one per simulation (the paper: 800)"""
    c_base: PositiveFloat = 19652.0
    """PUCT's exploration schedule ``c(s) = log((1 + N(s) + c_base) / c_base) + c_init`` (pseudocode)"""
    c_init: PositiveFloat = 1.25
    """PUCT's exploration constant at small visit counts (pseudocode)"""
    puct_q: Literal["signed", "unit"] = "signed"
    """PUCT's ``Q``: ``signed``, a child's mean value in ``[-1, 1]``, 0 (a draw) while unvisited
    (OpenSpiel's); ``unit``, the pseudocode's ``[0, 1]`` (its backup adds ``1 - value``), for which
    ``c_init`` was set: ``(mean + 1) / 2``, 0 (a loss) while unvisited"""
    dirichlet_alpha: PositiveFloat = 1.0
    """concentration of the Dirichlet noise mixed into the root's priors (the paper: 0.3 for chess)"""
    root_exploration_fraction: Fraction = 0.25
    """weight of that noise at the root (the paper: 0.25)"""
    temperature_moves: NonNegativeInt = 4
    """plies of each game, from its start, whose move is drawn in proportion to the root's visit
    counts; later moves are the most visited (the paper: 30 for chess)"""
    plies_per_iteration: PositiveInt = 8
    """self-play moves per game per iteration, between two rounds of learner updates"""
    buffer_size: PositiveInt = 20_000
    """positions the replay keeps (the newest)"""
    batch_size: PositiveInt = 256
    """positions per gradient step"""
    updates_per_iteration: PositiveInt = 4
    """gradient steps per iteration"""
    learning_starts: NonNegativeInt = 512
    """self-play positions (over every env) before the first update"""
    learning_rate: PositiveFloat = 1e-3
    """Adam's learning rate"""
    anneal_lr: bool = False
    """anneal the learning rate linearly toward 0 over the run's updates (CleanRL's schedule; the
    paper's dropped tenfold three times)"""
    weight_decay: NonNegativeFloat = 1e-4
    """Adam's ``weight_decay``: ``weight_decay * theta`` added to the gradient, the L2 term
    ``c ||theta||^2`` of Eq. 1 with ``c = weight_decay / 2``"""
    network: Literal["mlp", "resnet"] = "mlp"
    """the torso shared by the two heads: ``mlp`` over the flat observation (``hidden_sizes``), or
    ``resnet``, the paper's residual tower of 3x3 convolutions over the board's planes
    (``channels``, ``residual_blocks``; games whose observation tensor is ``(C, H, W)``)"""
    hidden_sizes: LayerSizes = (128, 128)
    """widths of the ``mlp`` torso"""
    channels: PositiveInt = 64
    """filters of every convolution of the ``resnet`` torso (the paper: 256)"""
    residual_blocks: PositiveInt = 3
    """residual blocks of the ``resnet`` torso after its first convolution (the paper: 19 or 39)"""
    inference_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """the dtype of the network's evaluations in the search and the raw policy (:func:`infer`):
    ``bfloat16`` runs the network under ``torch.autocast`` (its convolutions and matrix products in
    bfloat16, the outputs cast back to float32); ``auto``: bfloat16 on a device that computes it in
    hardware (:func:`msrl.device.native_bfloat16`: an AVX512_BF16 or AMX CPU, a CUDA device of
    compute capability 8.0+; each replica by its own device), float32 elsewhere; the learner
    trains in float32 either way. On an AVX-512 BF16 CPU a 64x3 tower's search ran 1.51x the
    positions a second, the small MLP's 0.72x (autocast casts the weights at every call); a CPU
    without bfloat16 instructions emulates them, 2.3x (AVX-512) to 25.8x (AVX2) slower than
    float32, and ``bfloat16`` warns there (bench/RESULTS.md#alphazero-bf16-inference,
    #alphazero-bf16-emulated)"""
    eval_interval: NonNegativeInt = 0
    """iterations between evaluations against ``eval_opponents`` (0: none during training)"""
    eval_games: PositiveInt = 20
    """games per opponent per evaluation, half with each colour"""
    eval_opponents: tuple[str, ...] = ("random",)
    """the fixed opponents: ``random``, ``mcts`` (OpenSpiel's MCTSBot, ``eval_mcts_simulations``
    random-rollout simulations), ``solver`` (alpha-beta: small games only)"""
    eval_mcts_simulations: PositiveInt = 1000
    """the MCTS opponent's simulations per move"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        self.eval_opponents = tuple(self.eval_opponents)
        from msrl.envs.openspiel_env import OPPONENTS

        bad = [o for o in self.eval_opponents if o not in OPPONENTS]
        if bad:
            raise ValueError(f"eval_opponents: {bad[0]!r} is not one of {', '.join(OPPONENTS)}")


def policy_value_net(hp: AlphaZeroConfig, env_id: str) -> PolicyValueNet:
    """The network ``hp`` describes for the game ``env_id`` (``openspiel/<game>``), with torch's
    current random state.

    Raises:
        ConfigError: ``env_id`` is not ``openspiel/<game>``, or ``network: resnet`` for a game whose
            observation tensor is not ``(C, H, W)``.
        OpenSpielGameError: ``env_id`` is not a game these envs play.
    """
    from msrl.envs.openspiel_env import NAMESPACE, game_of, is_openspiel, observation_size
    from msrl.errors import ConfigError

    if not is_openspiel(env_id):
        raise ConfigError(f"alphazero searches OpenSpiel games: env.id must be openspiel/<game> (got {env_id!r})")
    game = game_of(env_id[len(NAMESPACE):])
    num_actions, shape = game.num_distinct_actions(), tuple(game.observation_tensor_shape())
    if hp.network == "mlp":
        return PolicyValueNet(observation_size(game), num_actions, hp.hidden_sizes)
    if len(shape) != 3:
        raise ConfigError(f"algorithm.hparams.network: resnet convolves the board's (C, H, W) planes; {env_id}'s "
                         f"observation tensor is {shape} (use network: mlp)")
    return PolicyValueNet(observation_size(game), num_actions, board_shape=shape, channels=hp.channels,
                          residual_blocks=hp.residual_blocks)


def infer(net: PolicyValueNet, obs: torch.Tensor, dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """``net``'s ``(logits (B, A), value (B,))`` float32 of observations ``(B, D + A)`` float32,
    computed in ``dtype`` (``float32``, or ``bfloat16`` under ``torch.autocast`` on ``obs``'s
    device: AlphaZeroConfig.inference_dtype as :func:`inference_dtype` resolves it).

    Raises:
        ValueError: ``dtype`` is neither.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"inference dtype {dtype!r}: float32 or bfloat16 (inference_dtype() resolves auto)")
    with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        return net(obs)


def inference_dtype(dtype: str, device: torch.device | str) -> str:
    """The dtype :func:`infer` computes in on ``device`` for AlphaZeroConfig.inference_dtype
    ``dtype``: ``auto`` resolved (``bfloat16`` where :func:`msrl.device.native_bfloat16`, else
    ``float32``), the others as they are; ``bfloat16`` on a device that emulates it is kept and warns
    (a ``UserWarning`` naming the setting and its alternatives: under Python's default filter
    once per process).

    Raises:
        ValueError: ``dtype`` is not float32, bfloat16 or auto.
    """
    if dtype not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"inference dtype {dtype!r}: float32, bfloat16 or auto")
    if dtype == "float32":
        return dtype
    native = native_bfloat16(device)
    if dtype == "auto":
        return "bfloat16" if native else "float32"
    if not native:
        warnings.warn(f"algorithm.hparams.inference_dtype=bfloat16 on {torch.device(device)}, which has no bfloat16 "
                      "instructions (AVX512_BF16 or AMX; CUDA: compute capability 8.0+): the search's evaluations are "
                      "emulated, 2.3x to 25.8x slower than float32 on a CPU (bench/RESULTS.md#alphazero-bf16-emulated); "
                      "set algorithm.hparams.inference_dtype=auto or float32", UserWarning, stacklevel=2)
    return dtype


def _build_net(ctx: BuildContext) -> PolicyValueNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = policy_value_net(ctx.hparams, ctx.env_spec.env_id)
    return net.to(ctx.device)


class AlphaZeroActor(Actor):
    """The network on the acting side: :meth:`evaluate` is the search's leaf evaluation;
    :meth:`act` plays the raw policy (the most probable legal move: msrl's own evaluation and
    ``msrl collect``, which have no search)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.net = _build_net(ctx)
        self.weights = ModuleWeights(self.net)
        self.dtype = inference_dtype(ctx.hparams.inference_dtype, ctx.device)

    @torch.no_grad()
    def evaluate(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The network at search leaves: observations ``(B, D + A)`` float32 ->
        ``(logits (B, A), value (B,))`` float32 (computed in ``inference_dtype``)."""
        return infer(self.net, obs, self.dtype)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = True) -> torch.Tensor:
        """The most probable legal move ``(B,)`` int64 of observations ``(B, D + A)`` (no search;
        ``deterministic`` is accepted for msrl's evaluation and changes nothing)."""
        del deterministic
        return infer(self.net, obs, self.dtype)[0].argmax(-1)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the network (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])


class MCTS(EnvWrapper):
    """The self-play search beside the games (:class:`~msrl.api.EnvWrapper`): the search's
    three calls are ``env`` calls, so the search runs where the games are. Game ``i``'s draws come
    from its own generator (seeded from the env's seed ``ctx.seed + i``), saved in checkpoints.

    Raises:
        ConfigError: the env is not OpenSpiel games stepped in this process
            (``env.id: openspiel/<game>``, ``env.engine: sync``).
    """

    def __init__(self, env: Any, ctx: BuildContext) -> None:
        super().__init__(env)
        from msrl.errors import ConfigError

        inner = getattr(env, "envs", None)
        from msrl.envs.openspiel_env import is_openspiel

        if not (is_openspiel(ctx.env_spec.env_id) and inner is not None):
            raise ConfigError(f"alphazero searches OpenSpiel games in the process that steps them: env.id must be "
                              f"openspiel/<game> and env.engine sync (got {ctx.env_spec.env_id!r} on "
                              f"{type(env).__name__})")
        self.device, self.hp = ctx.device, ctx.hparams
        self.rngs = [np.random.default_rng([ctx.seed + i, 3]) for i in range(len(inner))]
        self.search = PUCTSearch(int(ctx.env_spec.action_space.n), ctx.hparams, noise=True)

    def describe(self) -> str:
        """``msrl graph``'s note: where the search runs and what it asks of the actor."""
        hp = self.hp
        return (f"PUCT tree search beside this replica's {len(self.rngs)} games: {hp.num_simulations} network "
                f"evaluations a move (actor.evaluate, wherever the policy puts the actor), Dirichlet({hp.dirichlet_alpha:g}) "
                f"root noise at {hp.root_exploration_fraction:g}, moves drawn by visit count for the first "
                f"{hp.temperature_moves} plies of a game")

    def _states(self) -> list[Any]:
        return [e.unwrapped.state for e in self.env.envs]

    def search_begin(self) -> torch.Tensor:
        """New trees at every game's current position: the roots' observations ``(N, D + A)`` float32."""
        return torch.from_numpy(self.search.begin(self._states(), self.rngs)).to(self.device)

    def search_step(self, logits: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One simulation per game (:meth:`PUCTSearch.step`) with the network's evaluation of the
        last leaves, ``logits (N, A)`` and ``value (N,)``: the next leaves' observations ``(N, D + A)``."""
        obs = self.search.step(logits.detach().cpu().numpy(), value.detach().cpu().numpy())
        return torch.from_numpy(obs).to(self.device)

    def search_result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pi (N, A) float32, move (N,) int64, player (N,) int64)`` (:meth:`PUCTSearch.result`)."""
        pi, move, player = self.search.result()
        return tuple(torch.from_numpy(x).to(self.device) for x in (pi, move, player))

    def state_dict(self) -> dict[str, Any]:
        """The games' state and the search generators'."""
        return {**super().state_dict(), "rngs": [r.bit_generator.state for r in self.rngs]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        for r, saved in zip(self.rngs, state["rngs"], strict=True):
            r.bit_generator.state = saved


class AlphaZeroBuffer(ReplayBuffer):
    """The replay of self-play positions ``(obs, pi, z)``: ``obs`` ``(D + A,)`` float32, ``pi``
    ``(A,)`` float32 the search's visit distribution, ``z`` float32 the game's final outcome for
    the player to move there. A game's positions wait per env row (saved in checkpoints) until it
    ends; then ``z`` is the last mover's reward for positions of the last mover and its negation
    for the other player's (two-player zero-sum), and they join the circular store of
    ``buffer_size`` positions. Every insert must bring the same env rows in the same order."""

    KEYS = ("obs", "policy", "outcome")

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        self.games: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = []

    def insert(self, **step: torch.Tensor) -> None:
        """One move of ``N`` games: ``obs (N, D + A)``, ``policy (N, A)``, ``player (N,)`` int64,
        ``reward (N,)`` (the mover's), ``terminated``/``truncated (N,)`` bool; stores the
        positions of the games this move ended.

        Raises:
            KeyError: other keys.
        """
        need = {"obs", "policy", "player", "reward", "terminated", "truncated"}
        if set(step) != need:
            raise KeyError(f"AlphaZeroBuffer.insert takes exactly {sorted(need)}, got {sorted(step)}")
        n = step["obs"].shape[0]
        if not self.games:
            self.games = [[] for _ in range(n)]
        done = (step["terminated"] | step["truncated"]).tolist()
        player, reward = step["player"].tolist(), step["reward"].tolist()
        rows: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        for i in range(n):
            self.games[i].append((step["obs"][i], step["policy"][i], player[i]))
            if done[i]:
                rows += [(o, p, reward[i] if who == player[i] else -reward[i]) for o, p, who in self.games[i]]
                self.games[i] = []
        if rows:
            self._write({"obs": torch.stack([r[0] for r in rows]), "policy": torch.stack([r[1] for r in rows]),
                         "outcome": torch.tensor([r[2] for r in rows], dtype=torch.float32, device=self.device)})

    @returns("batch", axis=1)
    def sample_many(self, num_batches: int) -> TensorDict:
        """As :meth:`msrl.rl.buffers.ReplayBuffer.sample_many`: ``(num_batches, batch_size)``
        positions drawn uniformly.

        Raises:
            RuntimeError: no game has ended yet (the replay is empty).
        """
        if self.size == 0:
            raise RuntimeError("AlphaZeroBuffer: no self-play game has ended yet, so the replay holds no position; "
                               "raise algorithm.hparams.learning_starts to at least env.num_envs times the game's "
                               "longest length in plies (tic-tac-toe: 9)")
        return super().sample_many(num_batches)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "games": self.games}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.games = [list(g) for g in state["games"]]


def alphazero_loss(logits: torch.Tensor, value: torch.Tensor, pi: torch.Tensor, z: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 1 of Silver et al. 2018 without its L2 term: the value loss ``mean (z - v)^2`` and the
    policy loss ``mean -pi^T log p``, each a 0-d tensor; logits ``(B, A)``, value ``(B,)``, pi
    ``(B, A)``, z ``(B,)``."""
    log_p = torch.log_softmax(logits, -1)
    policy_loss = -(pi * torch.where(pi > 0, log_p, 0.0)).sum(-1).mean()
    return ((z - value) ** 2).mean(), policy_loss


class AlphaZeroLearner(Learner):
    """Minimises Eq. 1 (:func:`alphazero_loss`, L2 as Adam's ``weight_decay``) on replayed
    positions; every ``eval_interval``-th :meth:`learn` (learner replica 0) also plays the fixed
    opponents (:func:`play_match`)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp = ctx.hparams
        self.net = _build_net(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate,
                                          weight_decay=self.hp.weight_decay)
        from msrl.envs.openspiel_env import NAMESPACE, is_openspiel

        env_id = ctx.env_spec.env_id
        self.game = env_id[len(NAMESPACE):] if is_openspiel(env_id) else None
        self.replica, self.learns, self.seed = ctx.replica, 0, ctx.seed
        plies = self.hp.plies_per_iteration * ctx.total_num_envs  # env steps an iteration; learning from the first past learning_starts
        self.num_learns = max(1, ctx.total_env_steps // plies - max(1, -(-self.hp.learning_starts // plies)) + 1)

    @returns("replicated")  # (declared: a run whose learning branch the probe never reaches still partitions)
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's state dict (detached tensors)."""
        return self.weights.get()

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One gradient step per minibatch of ``batch`` (batch size ``(K, B)``, keys
        :attr:`AlphaZeroBuffer.KEYS`).

        Returns:
            ``losses/value_loss``, ``losses/policy_loss`` (the last minibatch's, 0-d tensors), and
            on an evaluation's turn ``eval/<opponent>_{win,draw,loss}_rate`` floats.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        if self.hp.anneal_lr:  # 1 - learns / num_learns of the base rate, as CleanRL's 1 - (iteration - 1) / iterations
            for group in self.optimizer.param_groups:
                group["lr"] = self.hp.learning_rate * max(0.0, 1.0 - self.learns / self.num_learns)
        for k in range(batch.batch_size[0]):
            mb = batch[k]
            logits, value = self.net(mb["obs"])
            value_loss, policy_loss = alphazero_loss(logits, value, mb["policy"], mb["outcome"])
            loss = value_loss + policy_loss
            if not torch.isfinite(loss):
                raise FloatingPointError(f"alphazero: the loss is {float(loss)} (value {float(value_loss)}, "
                                         f"policy {float(policy_loss)})")
            self.apply_gradients(loss)
        metrics: dict[str, Any] = {"losses/value_loss": value_loss.detach(), "losses/policy_loss": policy_loss.detach()}
        self.learns += 1
        hp = self.hp
        if hp.eval_interval and self.learns % hp.eval_interval == 0 and self.replica == 0 and self.game is not None:
            for opponent in hp.eval_opponents:
                rates = play_match(self.net, self.game, opponent, hp, hp.eval_games, seed=self.seed + self.learns)
                metrics.update({f"eval/{opponent}_{k}_rate": v for k, v in rates.items()})
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "learns": self.learns}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.learns = int(state["learns"])


@torch.no_grad()
def play_match(net: PolicyValueNet, game: str, opponent: str, hp: AlphaZeroConfig, games: int, seed: int,
               num_simulations: int | None = None) -> dict[str, float]:
    """Plays ``net`` with its search (no noise, the most visited move; ``num_simulations``,
    default ``hp``'s) against a fixed ``opponent`` of :class:`~msrl.envs.openspiel_env.OpenSpielGameEnv`
    (``random``, ``mcts`` with ``hp.eval_mcts_simulations``, ``solver``) in ``games`` games, the
    first half with ``net`` moving first; all games searched as one batch, the network evaluated
    in ``hp.inference_dtype`` (:func:`inference_dtype` on ``net``'s device).

    Returns:
        ``{"win": w, "draw": d, "loss": l}``, fractions of ``games``.
    """
    from msrl.envs.openspiel_env import OpenSpielGameEnv

    device = next(net.parameters()).device
    dtype = inference_dtype(hp.inference_dtype, device)
    envs = [OpenSpielGameEnv(game, opponent=opponent, opponent_simulations=hp.eval_mcts_simulations,
                             agent_seat=int(g >= games / 2)) for g in range(games)]
    for g, e in enumerate(envs):
        e.reset(seed=seed + g)
    result: list[float | None] = [None] * games
    search = PUCTSearch(envs[0].num_actions, hp, noise=False)
    sims = num_simulations or hp.num_simulations
    while True:
        live = [g for g in range(games) if result[g] is None]
        if not live:
            break
        leaves = search.begin([envs[g].state for g in live], ())
        for _ in range(sims):
            logits, value = infer(net, torch.from_numpy(leaves).to(device), dtype)
            leaves = search.step(logits.cpu().numpy(), value.cpu().numpy())
        _, move, _ = search.result()
        for g, a in zip(live, move):
            _, reward, done, _, _ = envs[g].step(int(a))
            if done:
                result[g] = reward
    return {"win": sum(r > 0 for r in result) / games, "draw": sum(r == 0 for r in result) / games,
            "loss": sum(r < 0 for r in result) / games}


class AlphaZeroTrainer(Trainer):
    """The loop body: ``plies_per_iteration`` self-play moves of every game, each after a
    search of ``num_simulations`` network evaluations; then, once ``learning_starts`` positions
    were played, ``updates_per_iteration`` gradient steps and the new weights to the actor."""

    def reset(self) -> None:
        """First positions, the move counter, the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the updates' metrics (empty before learning starts)."""
        hp = self.hparams
        for _ply in range(hp.plies_per_iteration):
            leaves = self.env.search_begin()
            for _sim in range(hp.num_simulations):
                logits, value = self.actor.evaluate(leaves)
                leaves = self.env.search_step(logits, value)
            policy, action, player = self.env.search_result()
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, policy=policy, player=player, reward=reward, terminated=terminated,
                               truncated=truncated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step >= hp.learning_starts:
            metrics = self.learner.learn(self.buffer.sample_many(hp.updates_per_iteration))
            self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="alphazero",
    hparams=AlphaZeroConfig,
    trainer=AlphaZeroTrainer,
    components={"actor": AlphaZeroActor, "buffer": AlphaZeroBuffer, "learner": AlphaZeroLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.plies_per_iteration * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    policy_lag="corrected",  # learns from a replay of search targets, as the paper's
    env_wrapper=MCTS,
)
