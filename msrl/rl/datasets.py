"""Offline datasets in Minari's format (Farama's standard; ``msrl collect`` writes them): opened
by id or path, checked against the env an algorithm trains and evaluates on, and turned into
transitions, the rows an offline learner samples.

A dataset's episode ``e`` of ``T_e`` steps holds ``T_e + 1`` observations and ``T_e`` actions,
rewards, terminations and truncations (Minari's layout); its transitions are the ``T_e`` rows
``(s_t, a_t, r_t, s_{t+1}, terminated_t, truncated_t)``, the episodes concatenated in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from typing import Any, Iterator, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict

from msrl.api import Buffer, BuildContext, returns
from msrl.errors import InputError
from msrl.rl.buffers import ReplayBuffer

__all__ = ["DatasetError", "DatasetSource", "DatasetBuffer", "DatasetReplayBuffer", "read_shard", "dataset_root",
           "open_dataset", "check_spaces", "transitions", "shard"]


class DatasetError(InputError, ValueError):
    """A dataset that cannot be read as asked -- not found, damaged or truncated, or of other
    spaces than the env's -- found before any training step."""


@dataclasses.dataclass(frozen=True)
class DatasetSource:
    """Where a dataset is: a Minari ``id`` under Minari's datasets root (``root``, else
    ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``), or a ``path`` to the dataset's
    directory (the one holding ``data/``) or its ``data`` folder. Exactly one of ``id`` and
    ``path``; ``download``: fetch a remote id that is not local (Minari's remote)."""

    id: str | None = None
    path: str | None = None
    root: str | None = None
    download: bool = False

    def __post_init__(self) -> None:
        if (self.id is None) == (self.path is None):
            raise DatasetError(f"a dataset is given by id or by path, exactly one; got id={self.id!r}, path={self.path!r}")

    def describe(self) -> str:
        """``id X`` or ``path Y``, for messages."""
        return f"id {self.id}" if self.id is not None else f"path {self.path}"


@contextlib.contextmanager
def dataset_root(root: str | os.PathLike | None) -> Iterator[pathlib.Path]:
    """Minari's datasets root (``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``), or
    ``root`` for the duration of the block (Minari reads the root from that environment
    variable only: it is set in this process and restored after).

    Yields:
        the root directory as a path.
    """
    old = os.environ.get("MINARI_DATASETS_PATH")
    if root is not None:
        os.environ["MINARI_DATASETS_PATH"] = str(pathlib.Path(root).resolve())
    try:
        from minari.storage.datasets_root_dir import get_dataset_path

        yield pathlib.Path(get_dataset_path())
    finally:
        if root is not None:
            if old is None:
                os.environ.pop("MINARI_DATASETS_PATH", None)
            else:
                os.environ["MINARI_DATASETS_PATH"] = old


def open_dataset(source: DatasetSource) -> Any:
    """The :class:`minari.MinariDataset` at ``source``.

    Raises:
        DatasetError: minari is not installed; no dataset there (with, for an id, the root looked
            in and how to download or write one); a remote id that cannot be downloaded here (one
            line: the machine's network); a damaged or truncated file (the reader's error in one line).
    """
    try:
        import minari
    except ImportError:
        raise DatasetError("offline datasets are Minari's, and minari is not installed: "
                           "pip install 'minari[create,hdf5]' (or msrl's extra: pip install -e '.[offline]')") from None
    if source.path is not None:
        data = pathlib.Path(source.path)
        if (data / "data").is_dir():
            data = data / "data"
        if not data.is_dir():
            raise DatasetError(f"dataset path {source.path}: no such directory (a Minari dataset's directory, which "
                               "holds data/, or that data folder)")
    else:
        with dataset_root(source.root) as root:
            data = root / source.id / "data"
            if not data.is_dir():
                if not source.download:
                    raise DatasetError(f"dataset {source.id} not found under {root} (Minari's datasets root; set "
                                       "root, or MINARI_DATASETS_PATH); write one with msrl collect, or set download: "
                                       "true to fetch a remote id")
                try:
                    minari.download_dataset(source.id)
                except Exception as e:  # noqa: BLE001 - no network, unknown remote id: one line either way
                    raise DatasetError(f"dataset {source.id}: cannot download it here ({type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    try:
        return minari.MinariDataset(os.fspath(data))
    except Exception as e:  # noqa: BLE001 - h5py/json/pyarrow errors all mean a damaged dataset
        raise DatasetError(f"dataset {source.describe()}: damaged or not a Minari dataset ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None


def check_spaces(dataset: Any, observation_space: gymnasium.Space, action_space: gymnasium.Space, what: str) -> None:
    """Checks that ``dataset``'s observation and action spaces are the env's.

    Raises:
        DatasetError: names the space that differs, both values, and ``what`` (the dataset).
    """
    for name, mine, theirs in (("observation", observation_space, dataset.observation_space),
                               ("action", action_space, dataset.action_space)):
        if mine != theirs:
            raise DatasetError(f"dataset {what}: its {name} space is {theirs}, the env's is {mine}; a dataset "
                               "trains an algorithm for the env it was recorded on")


def transitions(dataset: Any, what: str) -> TensorDict:
    """Every transition of ``dataset`` (named ``what`` in errors), its episodes concatenated in order.

    Returns:
        a TensorDict of batch size ``(B,)``, ``B`` = the dataset's total steps: ``obs`` and
        ``next_obs`` ``(B, *obs_shape)`` float32, ``action`` ``(B,)`` int64 (Discrete) or
        ``(B, *action_shape)`` float32 (Box), ``reward`` ``(B,)`` float32, ``terminated`` and
        ``truncated`` ``(B,)`` bool.

    Raises:
        DatasetError: an unreadable file, an episode whose arrays disagree in length (a
            truncated or damaged file), or a dataset with no steps.
    """
    discrete = isinstance(dataset.action_space, gymnasium.spaces.Discrete)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "next_obs", "action", "reward", "terminated", "truncated")}
    try:
        episodes = list(dataset.iterate_episodes())
    except Exception as e:  # noqa: BLE001 - h5py/pyarrow read errors: the file is damaged
        raise DatasetError(f"dataset {what}: damaged or not a Minari dataset ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    for ep in episodes:
        T = len(ep.actions)
        if not (len(ep.observations) == T + 1 and len(ep.rewards) == len(ep.terminations) == len(ep.truncations) == T):
            raise DatasetError(f"dataset {what}: episode {ep.id} has {len(ep.observations)} observations, {T} actions, "
                               f"{len(ep.rewards)} rewards (a truncated or damaged file)")
        obs = np.asarray(ep.observations, dtype=np.float32)
        parts["obs"].append(obs[:-1])
        parts["next_obs"].append(obs[1:])
        parts["action"].append(np.asarray(ep.actions, dtype=np.int64 if discrete else np.float32))
        parts["reward"].append(np.asarray(ep.rewards, dtype=np.float32))
        parts["terminated"].append(np.asarray(ep.terminations, dtype=bool))
        parts["truncated"].append(np.asarray(ep.truncations, dtype=bool))
    if not parts["obs"] or sum(len(x) for x in parts["obs"]) == 0:
        raise DatasetError(f"dataset {what}: no steps")
    out = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
    return TensorDict(out, batch_size=(out["reward"].shape[0],))


def shard(rows: TensorDict, replica: int, num_replicas: int) -> TensorDict:
    """Replica ``replica``'s rows of ``num_replicas`` data-parallel learners: every
    ``num_replicas``-th row from ``replica`` (the shards differ in size by at most one row and
    together hold every row once).

    Raises:
        ValueError: ``replica`` not in ``[0, num_replicas)``, or more replicas than rows.
    """
    if not 0 <= replica < num_replicas:
        raise ValueError(f"replica {replica} of {num_replicas}")
    if num_replicas > rows.batch_size[0]:
        raise ValueError(f"{num_replicas} replicas share a dataset of {rows.batch_size[0]} transitions")
    return rows[replica::num_replicas]


def read_shard(ctx: BuildContext) -> tuple[TensorDict, int]:
    """The config's dataset (:attr:`~msrl.api.BuildContext.dataset`), checked against the env's
    spaces, and this replica's :func:`shard` of its transitions on ``ctx.device``.

    Returns:
        the shard (:func:`transitions`' keys, batch size ``(B_replica,)``) and the dataset's
        total transitions.

    Raises:
        DatasetError: no dataset in the config, one that :func:`open_dataset`,
            :func:`check_spaces` or :func:`transitions` refuses, or more replicas than transitions.
    """
    source = ctx.dataset
    if source is None:
        raise DatasetError("an offline algorithm's buffer reads the config's dataset: give dataset: {id: ...} "
                           "or {path: ...}")
    dataset = open_dataset(source)
    check_spaces(dataset, ctx.env_spec.observation_space, ctx.env_spec.action_space, source.describe())
    rows = transitions(dataset, source.describe())
    try:
        return shard(rows, ctx.replica, ctx.num_replicas).to(ctx.device), rows.batch_size[0]
    except ValueError as e:
        raise DatasetError(f"dataset {source.describe()}: {e}") from None


class DatasetBuffer(Buffer):
    """An offline algorithm's ``buffer`` role: the transitions of the config's dataset
    (:attr:`~msrl.api.BuildContext.dataset`), checked against the env's spaces, this replica's
    shard of them (:func:`shard`; one replica holds them all), on ``ctx.device``.

    :meth:`sample` draws ``ctx.hparams.batch_size`` rows uniformly with replacement (as d3rlpy's
    and CORL's offline learners sample) with the buffer's own generator, seeded ``ctx.seed + 2``
    as :class:`~msrl.rl.buffers.ReplayBuffer`'s. Where replicas of it feed one learner (coarse,
    the reader beside each actor replica) their samples concatenate; under ``multi_learner`` each
    learner replica samples its own shard and the gradients are averaged: data parallel, with a
    batch of ``batch_size`` per replica. Its checkpoint is its generator's state: the rows are the
    dataset's, read again when the job is built.

    Raises:
        DatasetError: no dataset in the config, or one :func:`open_dataset`, :func:`check_spaces`
            or :func:`transitions` refuses.
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.rows, self.total = read_shard(ctx)
        self.size = self.rows.batch_size[0]
        self.batch_size = int(ctx.hparams.batch_size)
        self.device = ctx.device
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 2)

    def insert(self, **step: torch.Tensor) -> None:
        """A dataset is read, never written.

        Raises:
            TypeError: always (an offline algorithm's trainer does not insert).
        """
        raise TypeError("DatasetBuffer holds a dataset's transitions, read-only: an offline algorithm samples it and "
                        "inserts nothing")

    @returns("batch")
    def sample(self) -> TensorDict:
        """``batch_size`` transitions drawn uniformly with replacement from this replica's shard:
        a TensorDict of batch size ``(batch_size,)`` with :func:`transitions`' keys."""
        idx = torch.randint(self.size, (self.batch_size,), generator=self.generator, device=self.device)
        return self.rows[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "size": self.size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["size"]) != self.size:
            raise DatasetError(f"the checkpoint's dataset shard held {state['size']} transitions, this one {self.size}: "
                               "the dataset changed since the run began")
        self.generator.set_state(state["generator"])


class DatasetReplayBuffer(ReplayBuffer):
    """The ``buffer`` role of an algorithm that learns from a dataset first and then from its
    env as well (AWAC's offline-then-online training, Nair et al. 2020, Section 5.2): a
    :class:`~msrl.rl.buffers.ReplayBuffer` whose first rows are this replica's :func:`shard` of the
    config's dataset, with room for ``ctx.hparams.buffer_size`` more that the online phase
    inserts (one actor replica's envs, or every replica's gathered, as a replay buffer takes
    them). Once full, the oldest rows -- the dataset's first -- are overwritten first.

    Samples are drawn uniformly over every row held (dataset and online), with the buffer's own
    generator seeded ``ctx.seed + 2``. Its checkpoint is a replay buffer's: every row, online and
    the dataset's, and the generator.

    Raises:
        DatasetError: as :func:`read_shard`.
    """

    def __init__(self, ctx: BuildContext) -> None:
        rows, self.total = read_shard(ctx)
        super().__init__(ctx)
        self.dataset_size = rows.batch_size[0]
        self.capacity = self.dataset_size + int(ctx.hparams.buffer_size)
        self._write({k: rows[k] for k in self.KEYS})
