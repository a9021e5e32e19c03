"""Rollout and replay storage: the on-policy ``(T, N, ...)`` :class:`RolloutBuffer` (PPO, A2C,
IMPALA; the multi-agent ones extend its storage), the uniform :class:`ReplayBuffer` (DQN,
SAC) and :class:`PrioritizedReplayBuffer` (Ape-X), :class:`SequenceReplay`, each env's stream
of steps sampled as windows (DreamerV3's world model), and :class:`EpisodeReplay`, whole episodes
sampled whole (QMIX's recurrent agents)."""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict

from msrl.api import Buffer, BuildContext, ReplayContract, returns
from msrl.envs.dict_obs import storage_space
from msrl.rl.sum_tree import SumTree

__all__ = ["RolloutBuffer", "ReplayBuffer", "PrioritizedReplayBuffer", "SequenceReplay", "EpisodeReplay"]


class RolloutBuffer(Buffer):
    """Preallocated ``(T, N, ...)`` storage for one rollout of ``T = num_steps`` steps.

    Keys: ``obs`` ``(T, N, *obs_shape)`` float32 (uint8 for uint8 frames; a Dict observation's
    packed rows ``(T, N, R)``, :func:`~msrl.envs.dict_obs.storage_space`), ``action`` ``(T, N, *action_shape)``
    (int64 for Discrete ``()`` and MultiDiscrete ``(k,)`` actions, float32 for Box),
    ``log_prob``, ``value``, ``reward`` ``(T, N)`` float32, ``terminated``, ``truncated``
    ``(T, N)`` bool, ``next_obs`` (the true next observation: the final one where an episode
    ended) ``(T, N, *obs_shape)`` float32.
    """

    KEYS = ("obs", "action", "log_prob", "value", "reward", "terminated", "truncated", "next_obs")
    #: per-step views of ``storage`` for :meth:`insert`, and the storage they view (rebuilt when
    #: a subclass or a checkpoint replaces it)
    _rows: list[dict[str, torch.Tensor]] = []
    _rows_of: TensorDict | None = None
    _key_groups: list[list[str]] = []

    def __init__(self, ctx: BuildContext) -> None:
        spec, T, N = ctx.env_spec, ctx.hparams.num_steps, ctx.env_spec.num_envs
        stored = storage_space(spec.observation_space)  # a Dict's packed row (msrl.envs.dict_obs)
        obs_shape = tuple(stored.shape)
        discrete = isinstance(spec.action_space, (gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete))
        act_shape = tuple(spec.action_space.shape)  # () for Discrete, (k,) for MultiDiscrete
        f32, dev = torch.float32, ctx.device
        # uint8 frames stay bytes (a quarter of the memory); the network scales them
        obs_t = torch.uint8 if stored.dtype == np.uint8 else f32
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, N, *obs_shape, dtype=obs_t, device=dev),
                "action": torch.zeros(T, N, *act_shape, dtype=torch.int64 if discrete else f32, device=dev),
                "log_prob": torch.zeros(T, N, dtype=f32, device=dev),
                "value": torch.zeros(T, N, dtype=f32, device=dev),
                "reward": torch.zeros(T, N, dtype=f32, device=dev),
                "terminated": torch.zeros(T, N, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, N, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, N, *obs_shape, dtype=obs_t, device=dev),
            },
            batch_size=[T, N],
            device=dev,
        )
        self.t = 0

    def insert(self, **step: torch.Tensor) -> None:
        """Stores step ``t`` (each tensor ``(N, ...)``, keys exactly :attr:`KEYS`).

        Raises:
            KeyError: missing or unknown keys.
            IndexError: the buffer already holds ``T`` steps.
        """
        name = type(self).__name__
        if set(step) != set(self.KEYS):
            raise KeyError(f"{name}.insert takes exactly {self.KEYS}, got {sorted(step)}")
        if self.t >= self.storage.batch_size[0]:
            raise IndexError(f"{name} is full ({self.t} steps); call gather() first")
        if self._rows_of is not self.storage:  # views of each step's row, made once (TensorDict indexing costs ~25 us)
            self._rows = [{k: v[t] for k, v in self.storage.items()} for t in range(self.storage.batch_size[0])]
            self._rows_of = self.storage
            groups: dict[torch.dtype, list[str]] = {}
            for k in self.KEYS:
                groups.setdefault(self.storage[k].dtype, []).append(k)
            self._key_groups = list(groups.values())
        row = self._rows[self.t]
        # one multi-tensor copy per dtype: on a GPU one kernel for each (float, int64, bool)
        # instead of one per key (torch's fused path needs one dtype per call)
        for keys in self._key_groups:
            torch._foreach_copy_([row[k] for k in keys], [step[k] for k in keys])
        self.t += 1

    def gather(self) -> TensorDict:
        """Returns the rollout, a TensorDict of batch size ``(T, N)``, and empties the buffer.

        The returned tensors are the buffer's storage: valid until the next :meth:`insert`.

        Raises:
            RuntimeError: fewer than ``T`` steps were inserted.
        """
        T = self.storage.batch_size[0]
        if self.t != T:
            raise RuntimeError(f"{type(self).__name__} holds {self.t} of {T} steps")
        self.t = 0
        return self.storage

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t = int(state["t"])


class ReplayBuffer(Buffer):
    """A circular replay buffer of ``buffer_size`` transitions, preallocated on first write.

    Keys: ``obs``/``next_obs`` ``(*obs_shape)`` float32, ``action`` ``(*action_shape)`` (int64
    for Discrete, float32 for Box), ``reward`` float32, ``terminated`` bool. It takes however
    many envs' rows each insert brings, so it serves one actor replica or, placed beside the
    learner, every replica's gathered transitions. Samples are drawn uniformly with the
    buffer's own generator (seeded ``ctx.seed + 2``).

    With ``n_step = n > 1`` in the hyperparameters (Sutton & Barto 2018, Section 7.1; the
    n-step transitions of Ape-X, Horgan et al. 2018, and Rainbow, Hessel et al. 2018) each
    insert also takes ``truncated`` and the buffer stores, per env row, the transition
    ``(s_t, a_t, R = sum_{k<m} gamma^k r_{t+k}, s_{t+m}, terminated_{t+m-1}, gamma^m)`` with
    ``m = n``, or fewer where the episode ended first (``next_obs`` is then the final
    observation); the extra key ``discount`` (float32, ``gamma^m``) is what a TD target
    bootstraps with. The up to ``n - 1`` newest steps of each env wait in the buffer (saved by
    :meth:`state_dict`) until their ``n`` rewards are in. Every insert must bring the same env
    rows in the same order (one actor replica's envs, or every replica's gathered in replica
    order), which each synchronous policy does.
    """

    KEYS = ("obs", "action", "reward", "next_obs", "terminated")

    def __init__(self, ctx: BuildContext) -> None:
        self.capacity, self.batch_size = ctx.hparams.buffer_size, ctx.hparams.batch_size
        self.device = ctx.device
        self.storage: TensorDict | None = None
        self.pos, self.size = 0, 0
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 2)
        self.n_step = int(getattr(ctx.hparams, "n_step", 1))
        self.gamma = float(getattr(ctx.hparams, "gamma", 1.0))
        #: the n-step window, oldest first: per step ``obs``, ``action``, ``reward`` (the
        #: discounted sum so far), ``discount`` (gamma^rewards summed) and ``open`` (rows whose
        #: transition is not yet stored), each ``(N, ...)``
        self.pending: list[dict[str, torch.Tensor]] = []

    def insert(self, **step: torch.Tensor) -> None:
        """Stores one step of ``N`` transitions (each tensor ``(N, ...)``, keys exactly
        :attr:`KEYS`, plus ``truncated`` ``(N,)`` bool, which ``n_step > 1`` needs and a one-step
        buffer ignores), overwriting the oldest when full; with ``n_step > 1`` it stores the
        n-step transitions this step completes (see the class).

        Raises:
            KeyError: missing or unknown keys.
        """
        keys = set(step) - {"truncated"}
        if keys != set(self.KEYS) or (self.n_step > 1 and "truncated" not in step):
            need = self.KEYS + (("truncated",) if self.n_step > 1 else ())
            raise KeyError(f"{type(self).__name__}.insert takes exactly {need}"
                           f"{'' if self.n_step > 1 else ' (and optionally truncated)'}, got {sorted(step)}")
        truncated = step.pop("truncated", None)
        if self.n_step > 1:
            step = self._n_step_rows(step, truncated)
        self._write(step)

    def _n_step_rows(self, step: dict[str, torch.Tensor], truncated: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adds ``step`` to the n-step window; returns the transitions it completes (rows of
        the window's steps, oldest first), with ``discount``."""
        n_envs, dev = step["obs"].shape[0], step["obs"].device
        terminated = step["terminated"].bool()
        done = terminated | truncated.bool()
        self.pending.append({"obs": step["obs"].clone(), "action": step["action"].clone(),
                             "reward": torch.zeros(n_envs, dtype=torch.float32, device=dev),
                             "discount": torch.ones(n_envs, dtype=torch.float32, device=dev),
                             "open": torch.ones(n_envs, dtype=torch.bool, device=dev)})
        reward = step["reward"].float()
        full = len(self.pending) == self.n_step  # the oldest step now has its n rewards
        out: list[dict[str, torch.Tensor]] = []
        for i, p in enumerate(self.pending):
            p["reward"] = torch.where(p["open"], p["reward"] + p["discount"] * reward, p["reward"])
            p["discount"] = torch.where(p["open"], p["discount"] * self.gamma, p["discount"])
            emit = p["open"].clone() if (i == 0 and full) else p["open"] & done
            if bool(emit.any()):
                out.append({"obs": p["obs"][emit], "action": p["action"][emit], "reward": p["reward"][emit],
                            "next_obs": step["next_obs"][emit], "terminated": step["terminated"][emit],
                            "discount": p["discount"][emit]})
            p["open"] &= ~emit
        if full:
            self.pending.pop(0)
        if not out:
            return {"obs": step["obs"][:0]}  # nothing completed (written as no rows)
        return {k: torch.cat([o[k] for o in out]) for k in out[0]}

    def _write(self, rows: dict[str, torch.Tensor]) -> None:
        """Writes ``rows`` (each ``(n, ...)``) at the circular position."""
        n = rows["obs"].shape[0]
        if n == 0:
            return
        if self.storage is None:
            self.storage = TensorDict(
                {k: torch.zeros(self.capacity, *v.shape[1:], dtype=v.dtype, device=self.device) for k, v in rows.items()},
                batch_size=[self.capacity],
                device=self.device,
            )
        columns = self.storage.to_dict()  # the storage's own tensors (no copies)
        if self.pos + n <= self.capacity:  # one contiguous run of rows: slices, not an index tensor
            for k, v in rows.items():
                columns[k][self.pos:self.pos + n] = v
        else:
            idx = (self.pos + torch.arange(n, device=self.device)) % self.capacity
            for k, v in rows.items():
                columns[k][idx] = v
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    @returns("batch")
    def sample(self) -> TensorDict:
        """``batch_size`` transitions drawn uniformly with replacement: a TensorDict of batch
        size ``(batch_size,)``. Gathered from several replicas, the samples concatenate.

        Raises:
            RuntimeError: the buffer is empty.
        """
        return self._draw((self.batch_size,))

    @returns("batch", axis=1)
    def sample_many(self, num_batches: int) -> TensorDict:
        """``num_batches`` minibatches of ``batch_size`` transitions at once, each drawn as
        :meth:`sample` draws (uniformly, with replacement): a TensorDict of batch size
        ``(num_batches, batch_size)``, indexed with one gather instead of ``num_batches``.
        Gathered from several replicas, minibatch ``k`` concatenates every replica's ``k``-th.

        Raises:
            RuntimeError: the buffer is empty.
            ValueError: ``num_batches`` is not a positive int.
        """
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"{type(self).__name__}.sample_many: num_batches must be a positive int, got {num_batches!r}")
        return self._draw((num_batches, self.batch_size))

    def _draw(self, shape: tuple[int, ...]) -> TensorDict:
        if self.storage is None or self.size == 0:
            raise RuntimeError(f"{type(self).__name__} is empty; learning must start after some steps")
        idx = torch.randint(self.size, shape, generator=self.generator, device=self.device)
        return self.storage[idx]

    def update_priorities(self, index: torch.Tensor, td_error: torch.Tensor) -> None:
        """Uniform replay keeps no priorities (:class:`PrioritizedReplayBuffer` does).

        Raises:
            TypeError: always; a trainer calls this only with prioritized replay on.
        """
        raise TypeError(f"{type(self).__name__} draws uniformly and keeps no priorities; prioritized replay "
                        "(algorithm.hparams.prioritized_replay=true) builds a PrioritizedReplayBuffer")

    def state_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "pos": self.pos, "size": self.size, "generator": self.generator.get_state(),
                "pending": self.pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.storage, self.pos, self.size = state["storage"], int(state["pos"]), int(state["size"])
        self.generator.set_state(state["generator"])
        self.pending = [dict(p) for p in state.get("pending", [])]


class PrioritizedReplayBuffer(ReplayBuffer):
    """Proportional prioritized replay (Schaul et al. 2016, "Prioritized Experience Replay",
    Section 3.3): transition ``i`` is drawn with probability ``P(i) = p_i^alpha / sum_k p_k^alpha``,
    ``p_i = |delta_i| + eps`` its last TD error's magnitude; a new transition gets the largest
    priority seen so far (Algorithm 1, line 6), so each is replayed at least once soon. The sums
    live in a :class:`~msrl.rl.sum_tree.SumTree` on the buffer's device; draws are stratified.

    A sample carries, besides :attr:`ReplayBuffer.KEYS`, ``index`` (int64: the slot, for
    :meth:`update_priorities`) and ``scale`` (float32: ``N * P(i)`` with ``N`` the stored
    transitions, from which the learner computes the importance-sampling weight ``(N P(i))^-beta``,
    Section 3.4). Split over ``R`` replicas (shards of one replay), each shard draws its share of a
    batch from its own tree: ``N P(i)`` with the shards' ``N`` and ``P`` is the same ratio (the
    shards hold equal shares of the data).

    Hyperparameters read from ``ctx.hparams``: ``buffer_size``, ``batch_size``, ``per_alpha``
    (``alpha``), ``per_eps`` (``eps``).
    """

    def __init__(self, ctx: BuildContext) -> None:
        super().__init__(ctx)
        hp = ctx.hparams
        self.alpha, self.eps = float(hp.per_alpha), float(hp.per_eps)
        self.tree = SumTree(self.capacity, ctx.device)
        self.max_priority = torch.ones((), dtype=torch.float64, device=ctx.device)

    def _write(self, rows: dict[str, torch.Tensor]) -> None:
        """As :meth:`ReplayBuffer._write`; the new rows' priority is the largest seen so far."""
        n, pos = rows["obs"].shape[0], self.pos
        super()._write(rows)
        if n:
            slots = (pos + torch.arange(n, device=self.device)) % self.capacity
            self.tree.set(slots, self.max_priority.pow(self.alpha).expand(n))

    def _draw(self, shape: tuple[int, ...]) -> TensorDict:
        if self.storage is None or self.size == 0:
            raise RuntimeError(f"{type(self).__name__} is empty; learning must start after some steps")
        idx = self.tree.sample(shape, self.size, self.generator)
        out = self.storage[idx]
        out["index"] = idx
        out["scale"] = (self.size * self.tree.get(idx) / self.tree.total).to(torch.float32)
        return out

    def update_priorities(self, index: torch.Tensor, td_error: torch.Tensor) -> None:
        """Sets the priorities of slots ``index`` (int64, any shape) from their TD errors
        ``td_error`` (the same shape): ``p = |td_error| + eps``. A slot listed twice (drawn twice)
        takes its last error.

        Raises:
            ValueError: shapes differ, or an index outside the buffer.
        """
        if index.shape != td_error.shape:
            raise ValueError(f"update_priorities: index {tuple(index.shape)} and td_error {tuple(td_error.shape)} differ")
        p = td_error.detach().abs().to(torch.float64).reshape(-1) + self.eps
        self.max_priority = torch.maximum(self.max_priority, p.max())
        self.tree.set(index.reshape(-1).to(self.device), p.to(self.device).pow(self.alpha))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tree": self.tree.state_dict(), "max_priority": self.max_priority}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.tree.load_state_dict(state["tree"])
        self.max_priority = state["max_priority"].to(self.device)


class SequenceReplay(Buffer):
    """Each env's stream of steps, oldest overwritten, sampled as ``(B, T)`` windows.

    A row is what the world model reads at one step: ``obs`` as the env gives it (``(D,)``
    float32, or a frame ``(C, H, W)`` uint8, stored as uint8), ``action`` int64
    the action taken *before* it (0 at an episode's first), ``reward`` float32 received on
    arriving at it, ``is_first`` and ``is_terminal`` bool. A finished episode's final observation
    and the next episode's first are two rows. Windows may cross episodes (``is_first`` resets
    the model state there, as in DreamerV3). Draws come from its own generator (``ctx.seed + 2``).

    Hyperparameters read from ``ctx.hparams``: ``buffer_size`` (rows over every env),
    ``batch_size`` (B), ``batch_length`` (T).
    """

    KEYS = ("obs", "action", "reward", "is_first", "is_terminal")

    def __init__(self, ctx: BuildContext) -> None:
        hp = ctx.hparams
        self.num_envs = ctx.env_spec.num_envs
        self.capacity = max(hp.buffer_size // self.num_envs, hp.batch_length)
        self.batch_size, self.length, self.device = hp.batch_size, hp.batch_length, ctx.device
        space = ctx.env_spec.observation_space
        self.obs_shape, self.obs_dtype = tuple(space.shape), torch.from_numpy(np.zeros(0, space.dtype)).dtype
        self.storage: TensorDict | None = None
        self.pos = torch.zeros(self.num_envs, dtype=torch.int64)
        self.count = torch.zeros(self.num_envs, dtype=torch.int64)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 2)

    def _write(self, rows: torch.Tensor, **row: torch.Tensor) -> None:
        if self.storage is None:
            n, c = self.num_envs, self.capacity
            self.storage = TensorDict({"obs": torch.zeros(n, c, *self.obs_shape, dtype=self.obs_dtype),
                                       "action": torch.zeros(n, c, dtype=torch.int64),
                                       "reward": torch.zeros(n, c), "is_first": torch.zeros(n, c, dtype=torch.bool),
                                       "is_terminal": torch.zeros(n, c, dtype=torch.bool)}, batch_size=[n, c])
        at = self.pos[rows]
        for k, v in row.items():
            self.storage[k][rows, at] = v.to(self.storage[k].dtype).cpu()
        self.pos[rows] = (at + 1) % self.capacity
        self.count[rows] = (self.count[rows] + 1).clamp(max=self.capacity)

    def start(self, obs: torch.Tensor) -> None:
        """Every env's first observation ``(N, *obs_shape)``: its first row."""
        n = obs.shape[0]
        rows = torch.arange(n)
        zero = torch.zeros(n)
        self._write(rows, obs=obs, action=zero.long(), reward=zero, is_first=torch.ones(n, dtype=torch.bool),
                    is_terminal=torch.zeros(n, dtype=torch.bool))

    def insert(self, **step: torch.Tensor) -> None:
        """One env step of ``N`` envs: ``action``, ``reward``, ``terminated``, ``truncated`` ``(N,)``,
        ``final_obs`` and ``next_obs`` ``(N, *obs_shape)`` (the env's ``info["final_obs"]`` and its
        next observation): a row at the observation arrived at, and where an episode ended a
        second, the next episode's first.

        Raises:
            KeyError: other keys.
        """
        need = {"action", "reward", "terminated", "truncated", "final_obs", "next_obs"}
        if set(step) != need:
            raise KeyError(f"SequenceReplay.insert takes exactly {sorted(need)}, got {sorted(step)}")
        n = step["action"].shape[0]
        rows = torch.arange(n)
        self._write(rows, obs=step["final_obs"], action=step["action"], reward=step["reward"],
                    is_first=torch.zeros(n, dtype=torch.bool), is_terminal=step["terminated"].bool())
        done = (step["terminated"] | step["truncated"]).cpu()
        if bool(done.any()):
            d = rows[done]
            zero = torch.zeros(d.numel())
            self._write(d, obs=step["next_obs"][done.to(step["next_obs"].device)], action=zero.long(),
                        reward=zero, is_first=torch.ones(d.numel(), dtype=torch.bool),
                        is_terminal=torch.zeros(d.numel(), dtype=torch.bool))

    @returns("batch")
    def sample(self) -> TensorDict:
        """``batch_size`` windows of ``batch_length`` consecutive rows of one env each, the env
        drawn in proportion to its windows and the start uniformly: a TensorDict ``(B, T)``.

        Raises:
            RuntimeError: no env holds ``batch_length`` rows yet.
        """
        windows = (self.count - self.length + 1).clamp(min=0)
        if int(windows.sum()) == 0:
            raise RuntimeError(f"SequenceReplay: no env holds {self.length} steps yet; raise "
                               "algorithm.hparams.learning_starts to at least batch_length x env.num_envs")
        env = torch.multinomial(windows.double(), self.batch_size, replacement=True, generator=self.generator)
        start = (torch.rand(self.batch_size, generator=self.generator, dtype=torch.float64) * windows[env]).long()
        oldest = (self.pos[env] - self.count[env]) % self.capacity
        index = (oldest[:, None] + start[:, None] + torch.arange(self.length)) % self.capacity
        return self.storage[env[:, None], index].to(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "pos": self.pos.clone(), "count": self.count.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.storage, self.pos, self.count = state["storage"], state["pos"].clone(), state["count"].clone()
        self.generator.set_state(state["generator"])


class EpisodeReplay(Buffer):
    """Whole episodes, each padded to ``episode_limit`` steps, sampled whole and uniformly:
    the episode replay of PyMARL / EPyMARL (Rashid et al. 2018, Section 5; Samvelyan et al.
    2019), on which recurrent agents are unrolled from an episode's first step.

    An episode of ``n <= L`` steps (``L = episode_limit``) is stored as ``obs`` ``(L + 1,
    *obs_shape)`` (the ``n`` observations acted on, then the episode's final observation at
    index ``n``), ``action`` ``(L, *action_shape)``, ``reward`` ``(L, *reward_shape)`` float32,
    ``terminated`` ``(L,)`` bool and ``filled`` ``(L,)`` bool (true for the first ``n`` steps);
    what lies past the end is zeros. Shapes and dtypes come from the first insert (a
    multi-agent env's ``(A, D)`` observations, ``(A,)`` actions and rewards). Each env's running
    episode waits in the buffer (and in its checkpoint) until it ends; a finished episode
    overwrites the oldest when ``buffer_size`` episodes are stored. Every insert must bring the
    same env rows in the same order (one actor replica's envs, or every replica's gathered in
    replica order). Draws come from its own generator (``ctx.seed + 2``).

    Hyperparameters read from ``ctx.hparams``: ``buffer_size`` (episodes), ``batch_size``
    (episodes a sample), ``episode_limit`` (``L``).
    """

    KEYS = ("obs", "action", "reward", "terminated", "truncated", "final_obs")

    def __init__(self, ctx: BuildContext) -> None:
        hp = ctx.hparams
        self.capacity, self.batch_size, self.limit = hp.buffer_size, hp.batch_size, hp.episode_limit
        self.device = ctx.device
        self.storage: TensorDict | None = None
        #: each env's running episode, ``(N, L (+1), ...)``, and the steps it holds ``(N,)``
        self.running: TensorDict | None = None
        self.t: torch.Tensor | None = None
        self.pos, self.size = 0, 0
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 2)

    def replay_contract(self) -> ReplayContract:
        """Episodes end when the envs say so: host bookkeeping a replayed iteration cannot repeat."""
        return ReplayContract(capturable=False)

    def _allocate(self, step: dict[str, torch.Tensor]) -> None:
        n, L, dev = step["obs"].shape[0], self.limit, self.device
        def zeros(lead: tuple[int, ...], v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.zeros(*lead, *v.shape[1:], dtype=dtype or v.dtype, device=dev)
        episode = lambda lead: {"obs": zeros((*lead, L + 1), step["obs"], torch.float32),  # noqa: E731
                                "action": zeros((*lead, L), step["action"]),
                                "reward": zeros((*lead, L), step["reward"], torch.float32),
                                "terminated": torch.zeros(*lead, L, dtype=torch.bool, device=dev)}
        self.running = TensorDict(episode((n,)), batch_size=[n], device=dev)
        self.storage = TensorDict({**episode((self.capacity,)),
                                   "filled": torch.zeros(self.capacity, L, dtype=torch.bool, device=dev)},
                                  batch_size=[self.capacity], device=dev)
        self.t = torch.zeros(n, dtype=torch.int64, device=dev)

    def insert(self, **step: torch.Tensor) -> None:
        """One env step of ``N`` envs: ``obs`` (acted on) and ``final_obs`` (the env's
        ``info["final_obs"]``: the observation arrived at, before any reset) ``(N, *obs_shape)``,
        ``action`` ``(N, *action_shape)``, ``reward`` ``(N, *reward_shape)``, ``terminated`` and
        ``truncated`` ``(N,)``. The envs whose episode ended store it.

        Raises:
            KeyError: other keys.
            ValueError: an episode reached ``episode_limit`` steps without ending (nothing of
                this step is written).
        """
        if set(step) != set(self.KEYS):
            raise KeyError(f"EpisodeReplay.insert takes exactly {self.KEYS}, got {sorted(step)}")
        if self.running is None:
            self._allocate(step)
        assert self.running is not None and self.t is not None and self.storage is not None
        step = {k: v.to(self.device) for k, v in step.items()}
        done = step["terminated"].bool() | step["truncated"].bool()
        t, n = self.t, step["obs"].shape[0]
        if bool(((t == self.limit - 1) & ~done).any()):
            raise ValueError(f"EpisodeReplay: an episode reached episode_limit={self.limit} steps without ending; set "
                             "algorithm.hparams.episode_limit to the env's longest episode (MPE: its max_cycles)")
        rows = torch.arange(n, device=self.device)
        run = self.running
        run["obs"][rows, t] = step["obs"].float()
        run["action"][rows, t] = step["action"].to(run["action"].dtype)
        run["reward"][rows, t] = step["reward"].float()
        run["terminated"][rows, t] = step["terminated"].bool()
        self.t = t + 1
        if not bool(done.any()):
            return
        d = rows[done]
        run["obs"][d, self.t[d]] = step["final_obs"][d].float()
        k = d.numel()
        at = (self.pos + torch.arange(k, device=self.device)) % self.capacity
        ended = run[d]
        self.storage[at] = TensorDict({**ended.to_dict(),
                                       "filled": torch.arange(self.limit, device=self.device) < self.t[d, None]},
                                      batch_size=[k], device=self.device)
        run[d] = torch.zeros_like(ended)
        self.t[d] = 0
        self.pos = (self.pos + k) % self.capacity
        self.size = min(self.size + k, self.capacity)

    @returns("batch")
    def sample(self) -> TensorDict:
        """``batch_size`` distinct stored episodes drawn uniformly (EPyMARL draws without
        replacement): a TensorDict of batch size ``(batch_size,)`` with ``obs`` ``(B, L + 1,
        ...)`` and ``action``, ``reward``, ``terminated``, ``filled`` ``(B, L, ...)``. Gathered
        from several replicas, the samples concatenate.

        Raises:
            RuntimeError: fewer than ``batch_size`` finished episodes are stored.
        """
        if self.size < self.batch_size:
            raise RuntimeError(f"EpisodeReplay holds {self.size} finished episodes, fewer than batch_size="
                               f"{self.batch_size}; raise algorithm.hparams.learning_starts (env steps before the first "
                               "update) or lower batch_size")
        assert self.storage is not None
        idx = torch.randperm(self.size, generator=self.generator, device=self.device)[:self.batch_size]
        return self.storage[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "running": self.running, "t": self.t, "pos": self.pos, "size": self.size,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # (copies: a live buffer's state_dict holds its own tensors, which it goes on writing)
        self.storage, self.running, self.t = (None if state[k] is None else state[k].clone() for k in ("storage", "running", "t"))
        self.pos, self.size = int(state["pos"]), int(state["size"])
        self.generator.set_state(state["generator"])
