"""Job configuration: YAML validated with a schema, dotted overrides, semantic checks.

A config file reads::

    name: ppo_cartpole                 # run directory: <runs_dir>/<name>[-k]
    seed: 1
    algorithm: {name: ppo, hparams: {num_steps: 32, ...}}
    env: {id: CartPole-v1, num_envs: 8, engine: sync}
    distribution_policy: {name: single, replicas: {actor: 2}}
    train: {total_env_steps: 200000, eval_every: 20000, stop_at_return: null}
    eval: {episodes: 20, seed: 10000}

Every error is a :class:`ConfigError` raised before anything runs or is written: an unknown
key names the valid keys at its level; an unknown algorithm, env id, policy, fragment or
backend lists what exists; a bad override names the override.

The package's parts: the schema (:mod:`msrl.config.schema`), dotted overrides and reading
(:mod:`msrl.config.overrides`), job-spec assembly (:mod:`msrl.config.jobspec`); loading and
validation here.
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, Sequence

import pydantic

from msrl.config.jobspec import build_job_spec, check_population, on_device, resolve_device, resolve_runtime
from msrl.config.overrides import apply_overrides, parse_overrides, read_config, set_values
from msrl.config.schema import RunConfig, format_errors
from msrl.errors import ConfigError

__all__ = ["ConfigError", "RunConfig", "load_config", "read_config", "apply_overrides", "parse_overrides", "set_values",
           "validate", "build_job_spec", "resolve_device", "resolve_runtime", "on_device", "check_population"]


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads, overrides and fully validates a config file (see :func:`validate`).

    Raises:
        ConfigError: unreadable file, invalid YAML, or any validation error.
    """
    return validate(read_config(path, overrides))


def validate(raw: Mapping[str, Any]) -> RunConfig:
    """Validates a config mapping: schema, names of things that must exist, and consistency.

    Checks that the algorithm, env id, policy, the fragments named in overrides and their
    backends exist; that hyperparameters are fields of the algorithm's dataclass; that
    devices parse and exist; and that envs split evenly over env replicas.

    Raises:
        ConfigError: the first problem found, saying what is valid.
    """
    try:
        cfg = RunConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(format_errors(e, RunConfig)) from None
    build_job_spec(cfg)  # raises ConfigError on unknown names and bad combinations
    return cfg

