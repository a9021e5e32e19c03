"""``msrl collect``: episodes of trained policies written as a Minari dataset (Farama's format
for offline RL), with Minari's own writer (:class:`minari.DataCollector`), so that Minari's
loader, d3rlpy and TorchRL read it as they read the datasets Minari hosts.

A dataset is made from one run's last checkpoint or from several (a mix: "medium-expert"
style, the episodes split evenly between them), acting greedily or with exploration noise:
for Discrete actions a uniformly random action with probability ``noise`` (epsilon-greedy), for
Box actions Gaussian noise of standard deviation ``noise`` times the half-range of the action
bounds, clipped to them. Episode ``i`` is seeded ``seed + i``.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any, Sequence

import numpy as np

from msrl.errors import InputError
from msrl.rl.datasets import dataset_root

__all__ = ["collect", "CollectError"]


class CollectError(InputError, ValueError):
    """A dataset that cannot be made as asked (an env Minari cannot record, a dataset id that
    exists or is malformed, runs of different envs, a noise out of range), found before any
    episode is run."""


def _noisy(action: np.ndarray, space: Any, noise: float, rng: np.random.Generator) -> np.ndarray:
    """``action`` with the exploration noise of the module docstring."""
    import gymnasium

    if noise == 0.0:
        return action
    if isinstance(space, gymnasium.spaces.Discrete):
        if rng.random() < noise:
            return np.asarray(space.start + rng.integers(space.n), dtype=action.dtype)
        return action
    half = (space.high - space.low) / 2.0
    return np.clip(action + rng.normal(size=action.shape) * noise * half, space.low, space.high).astype(space.dtype)


def collect(
    runs: Sequence[str | os.PathLike],
    dataset_id: str,
    episodes: int,
    noise: float = 0.0,
    seed: int = 0,
    root: str | os.PathLike | None = None,
    description: str | None = None,
) -> pathlib.Path:
    """Writes ``episodes`` episodes of the runs' trained policies as the Minari dataset ``dataset_id``.

    Args:
        runs: run directories (each's last good checkpoint acts; several split the episodes
            evenly, the first ones taking the remainder). All must train on one env.
        dataset_id: Minari's ``(namespace/)(env_name/)dataset_name(-v<version>)``, e.g.
            ``msrl/cartpole/expert-v0``.
        episodes: >= 1.
        noise: in ``[0, 1]``: epsilon for Discrete actions, the Gaussian's standard deviation as a
            fraction of the half-range for Box actions (0: greedy).
        seed: episode ``i`` is seeded ``seed + i``; the noise's generator is seeded ``seed``.
        root: the datasets root (default Minari's: ``MINARI_DATASETS_PATH`` or ``~/.minari/datasets``).
        description: the dataset's description (default: what made it).

    Returns:
        the dataset's directory (``<root>/<dataset_id>``; Minari's loader reads it by id under
        that root, or :class:`minari.MinariDataset` by its ``data`` folder).

    Raises:
        CollectError: the dataset exists, the id is malformed, ``episodes`` < 1, ``noise`` out
            of range, the runs train on different envs, or the env is not a single-agent
            gymnasium env Minari can record (a native env records its gymnasium twin).
        ConfigError: a run directory that is not one or has no readable checkpoint.
    """
    import gymnasium

    try:
        import minari
    except ImportError:
        raise CollectError("msrl collect writes Minari datasets, and minari is not installed: "
                           "pip install 'minari[create,hdf5]' (or msrl's extra: pip install -e '.[offline]')") from None

    from msrl.run.evaluation import evaluation_env
    from msrl.run.python_api import load

    if episodes < 1:
        raise CollectError(f"episodes must be at least 1, got {episodes}")
    if not 0.0 <= noise <= 1.0:
        raise CollectError(f"noise must be in [0, 1] (epsilon, or a fraction of the action range), got {noise}")
    if not runs:
        raise CollectError("collect needs at least one run directory")
    try:
        from minari.utils import parse_dataset_id

        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):  # Minari's ValueError for a malformed id, TypeError for a missing version
        raise CollectError(f"dataset id {dataset_id!r} is not Minari's (namespace/)(env_name/)name-vN, e.g. "
                           "msrl/cartpole/expert-v0") from None
    policies = [load(r) for r in runs]
    envs = [evaluation_env(p.config) for p in policies]
    env_id, kwargs, wrappers = envs[0]
    if any(e[0] != env_id for e in envs):
        raise CollectError(f"the runs train on different envs ({', '.join(sorted({str(e[0]) for e in envs}))}); a "
                           "dataset holds one env's episodes")
    if env_id is None or env_id.startswith(("pettingzoo/", "msrl/")) or policies[0].num_agents != 1:
        raise CollectError(f"{runs[0]}: its env ({policies[0].config.env.id}) is not a single-agent gymnasium env, "
                           "which a Minari dataset records")
    if wrappers:
        raise CollectError(f"{runs[0]}: the run's env has msrl wrappers ({', '.join(wrappers)}); a Minari dataset "
                           "records the gymnasium env as registered")
    with dataset_root(root) as base:
        target = base / dataset_id
        if target.exists():
            raise CollectError(f"dataset {dataset_id} exists at {target}; choose another id (or version: -v1) "
                               "or remove it")
        env = minari.DataCollector(gymnasium.make(env_id, **kwargs))
        rng = np.random.default_rng(seed)
        shares = [episodes // len(policies) + (i < episodes % len(policies)) for i in range(len(policies))]
        returns: list[float] = []
        i = 0
        for policy, share in zip(policies, shares):
            for _ in range(share):
                obs, _ = env.reset(seed=seed + i)
                done, ret = False, 0.0
                while not done:
                    action = _noisy(np.asarray(policy.act(obs, deterministic=True)), env.action_space, noise, rng)
                    obs, reward, terminated, truncated, _ = env.step(action)
                    ret += float(reward)
                    done = bool(terminated or truncated)
                returns.append(ret)
                i += 1
        made = "; ".join(f"{share} episodes of {run} ({p.config.algorithm.name})" for run, share, p in
                         zip(runs, shares, policies))
        text = description or (f"made by msrl collect: {made}; "
                               f"{'greedy' if noise == 0 else f'noise {noise}'}, episode i seeded {seed} + i; "
                               f"mean return {np.mean(returns):.1f}")
        with warnings.catch_warnings():  # Minari's asks for a permalink and an e-mail address: msrl has neither to give
            warnings.filterwarnings("ignore", message=r"`(code_permalink|author_email)` is set to None", category=UserWarning)
            env.create_dataset(dataset_id, eval_env=env_id, algorithm_name=f"msrl/{policies[0].config.algorithm.name}",
                               author="msrl collect", description=text)
        env.close()
        return target
