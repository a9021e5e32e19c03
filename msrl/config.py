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
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Literal, Mapping, Sequence

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from msrl.cluster.options import per_fragment
from msrl.errors import ConfigError

__all__ = ["ConfigError", "RunConfig", "load_config", "apply_overrides", "parse_overrides", "validate", "build_job_spec",
           "on_device", "check_population"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _on_off_from_yaml_booleans(cls, data: Any) -> Any:
        """YAML 1.1 reads an unquoted ``on``/``off`` (and ``yes``/``no``) as a boolean: where a
        key's values are the words ``on`` and ``off``, ``True``/``False`` mean them."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            words = getattr(field.annotation, "__args__", ())
            if isinstance(out.get(name), bool) and "on" in words and "off" in words:
                out[name] = "on" if out[name] else "off"
        return out


class AlgorithmConfig(_Strict):
    """``algorithm``: which file of ``algorithms/`` and its hyperparameters."""

    name: str = Field(description="an algorithm in algorithms/ (e.g. ppo)")
    hparams: dict[str, Any] = Field(default_factory=dict, description="fields of the algorithm's hyperparameter dataclass")


class EnvConfig(_Strict):
    """``env``: the gymnasium environment and how many copies step together."""

    id: str = Field(description="a registered gymnasium env id")
    num_envs: int = Field(8, gt=0, description="envs in total, split evenly over env replicas")
    engine: Literal["sync", "process", "envpool", "ale_vector"] = Field(
        "sync", description="how gymnasium envs step: sync (one after another in the actor's process), "
        "process (worker processes over shared memory; for simulators such as MuJoCo and Atari), envpool "
        "(EnvPool's own tasks, e.g. Pong-v5, on its thread pool; no exact checkpoints) or ale_vector (ale-py's "
        "vector env: ALE/<Game>-v5 with wrappers [atari], preprocessed in C++ on its thread pool; no exact "
        "checkpoints)"
    )
    num_workers: int | None = Field(
        None, gt=0, description="env worker processes per env replica (engine: process; default: one per CPU, "
        "at most one per env), or the pool's threads (engine: envpool, ale_vector)"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of gymnasium.make")
    wrappers: list[str] = Field(
        default_factory=list, description="msrl's named env wrappers, applied in order (atari: the standard "
        "Atari preprocessing, 84x84 grayscale frames, 4 stacked; flatten_observation: gymnasium's "
        "FlattenObservation, a Dict or Tuple observation as one vector (PPO, A2C and IMPALA take Dict "
        "observations as they are); mask_velocity: classic control with its velocities hidden; "
        "multi_discrete_action: a Tuple of Discrete actions as one MultiDiscrete)"
    )


class InferenceConfig(_Strict):
    """``distribution_policy.inference``: central inference with dynamic batching (SEED RL), for a
    policy that offers it (``single_learner_fine``)."""

    max_batch: int | None = Field(
        None, ge=1, description="env replicas whose requests one inference batch holds (default: all of them)"
    )
    timeout_ms: float | None = Field(
        None, ge=0, description="the longest a request waits for its batch to fill, in ms (default: no deadline)"
    )


class PolicyConfig(_Strict):
    """``distribution_policy``: a file of ``distribution_policies/`` and per-fragment overrides."""

    name: str = Field("single", description="a policy in distribution_policies/")
    replicas: dict[str, int] = Field(default_factory=dict, description="fragment -> replicas")
    backends: dict[str, str] = Field(default_factory=dict, description="fragment -> backend in fragments/")
    devices: dict[str, str] = Field(default_factory=dict, description="fragment -> torch device")
    capture: dict[str, str] = Field(
        default_factory=dict,
        description="fragment -> graph (its iteration captured once and replayed: a CUDA graph on a GPU, a host tape "
                    "on the CPU, which checks that the program can be captured) or eager (op by op); default: graph "
                    "on a CUDA device, eager on the CPU",
    )
    compile: dict[str, str] = Field(
        default_factory=dict,
        description="fragment -> inductor (its components' pure tensor methods compiled by torch.compile into fused "
                    "kernels, falling back to eager with one line on a graph break) or off (the default)",
    )

    @pydantic.field_validator("compile", mode="before")
    @classmethod
    def _compile_off(cls, v: Any) -> Any:
        """YAML reads an unquoted ``off`` as ``False``: that is the mode ``off``."""
        if isinstance(v, dict):
            return {k: "off" if m is False else m for k, m in v.items()}
        return v
    placement: dict[str, str] = Field(
        default_factory=dict, description="role -> fragment, moving a role from the policy's default fragment"
    )
    boundaries: dict[str, str] = Field(
        default_factory=dict,
        description="boundary class -> kind: sync (both sides meet it every iteration), fifo (a bounded queue), "
                    "latest (a latest-value slot), fresh (a latest-value slot read once per new version: lockstep), "
                    "e.g. {trajectories: fifo, weights: latest}",
    )
    queue_capacity: int | None = Field(
        None, gt=0, description="items a producer may have queued in a fifo boundary before it waits (default: the policy's)"
    )
    inference: InferenceConfig | None = Field(
        None, description="central inference with dynamic batching: {max_batch: B, timeout_ms: D} (single_learner_fine)"
    )


class TrainConfig(_Strict):
    """``train``: budget, checkpoints, periodic evaluation."""

    total_env_steps: int = Field(gt=0, description="training budget in env steps")
    checkpoint_every: int = Field(10, gt=0, description="iterations between checkpoints")
    eval_every: int = Field(0, ge=0, description="env steps between evaluations during training (0: only at the end)")
    stop_at_return: float | None = Field(None, description="stop once an evaluation's mean return reaches this")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads")
    float32_matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest",
        description="the internal precision of float32 matrix products on a CUDA device "
                    "(torch.set_float32_matmul_precision): highest (float32, the default), high (TensorFloat32 "
                    "tensor cores: several times faster, ~3 significant digits per product), medium (bfloat16 "
                    "where torch has it); applied in every process that runs a fragment; the CPU is unaffected",
    )
    progress: bool = Field(True, description="show a progress bar")


class EvalConfig(_Strict):
    """``eval``: deterministic evaluation episodes."""

    episodes: int = Field(20, gt=0, description="episodes per evaluation")
    env_id: str | None = Field(
        None, description="gymnasium env to evaluate on (default: the training env, or a native env's gymnasium twin)"
    )
    seed: int = Field(10_000, ge=0, description="seed of the evaluation envs (>= 0)")


class ClusterConfig(_Strict):
    """``cluster``: where the Ray runtime runs its replicas."""

    address: str | None = Field(None, description="a Ray cluster's address: HOST:PORT (the head's GCS port), "
                                "ray://HOST:PORT (Ray Client) or auto (default: start Ray on this machine)")
    connect_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="the longest a join of cluster.address may take, in seconds: nothing "
        "answering there by then is one error line (exit status 2)"
    )
    cpus_per_replica: float | dict[str, float] = Field(
        1.0, description="CPUs of each replica's placement-group bundle (its torch/OpenMP threads): one number for "
        "every fragment, or fragment name -> CPUs (e.g. {learner: 2}; a fragment not named: 1)")
    gpus_per_replica: float | dict[str, float] = Field(
        0.0, description="GPUs of each replica's placement-group bundle: one number for every fragment, or "
        "fragment name -> GPUs (e.g. {learner: 1}; a fragment not named: 0)")
    strategy: Literal["PACK", "SPREAD"] = Field("PACK", description="placement-group strategy")
    max_restarts: int = Field(
        3, ge=0, description="restarts from the last checkpoint after a replica process dies or hangs (any role)"
    )
    on_replica_loss: Literal["auto", "replace", "restart"] = Field(
        "auto",
        description="what a replica's death or hang does: replace (the lost replica alone is started again and rejoins "
                    "its boundaries while the others keep running: the actors of async_learner), restart (every replica "
                    "restarts from the last checkpoint, exactly), or auto (replace where the policy allows it, else "
                    "restart)",
    )
    capacity_timeout_s: float = Field(
        600.0, gt=0, le=86400.0, allow_inf_nan=False,
        description="after a replica's death (a node lost), how long the restart waits, in seconds, for the cluster to "
                    "hold the job's replicas again (nodes joining, resources freed), saying so on stderr; then training "
                    "stops with the last checkpoint kept",
    )
    replica_timeout_s: float = Field(
        30.0, ge=2.0, le=86400.0, allow_inf_nan=False,
        description="seconds without a heartbeat after which a replica process counts as hung (restarted like a "
                    "death); at most a day (turn the watchdog off with cluster.watchdog: off)",
    )
    watchdog: bool = Field(
        True, description="call a replica hung after cluster.replica_timeout_s without a heartbeat (off: a stopped "
                          "or stuck replica stalls the run until it is killed; a dead one is still restarted)",
    )
    tls_cert: str | None = Field(
        None, description="PEM certificate the gRPC servers of asynchronous boundaries present (with tls_key: TLS)"
    )
    tls_key: str | None = Field(None, description="PEM private key of tls_cert")
    tls_server_name: str | None = Field(
        None, description="the name clients check tls_cert against (default: the address they dial)"
    )
    max_message_mb: float = Field(
        1024.0, gt=0, le=2047,
        description="the largest message of a boundary between processes (MiB): a Gloo channel's buffer, a gRPC frame; "
                    "a receiver never allocates more, a sender names this key when a value is larger",
    )
    intra_node: Literal["shm", "gloo"] = Field(
        "shm",
        description="how a fragment's replicas on one machine all-reduce host tensors: shm (shared memory, Linux; "
                    "Gloo where unavailable or across machines) or gloo (TCP through Gloo)",
    )
    sync_transport: Literal["auto", "unix", "gloo"] = Field(
        "auto",
        description="how synchronous boundaries cross between processes, per peer pair: auto (a Unix socket between "
                    "replicas of one machine whose fragments are on the host, Gloo otherwise: NCCL between CUDA devices) "
                    "or gloo (Gloo for all)",
    )
    boundary_transport: Literal["auto", "grpc"] = Field(
        "auto",
        description="how asynchronous boundaries (fifo, latest, fresh) cross between processes: auto (a Unix socket between "
                    "replicas of one machine, gRPC between machines) or grpc (gRPC for all)",
    )
    learner_priority: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run producer-only replicas (they put on fifo boundaries and take from none: the actors of "
                    "overlapped coarse and of async_learner) at niceness 10, so that the replicas they feed run "
                    "whenever they can: auto (on a machine whose cores the job's replicas outnumber), on, or off",
    )

    @pydantic.field_validator("cpus_per_replica", "gpus_per_replica")
    @classmethod
    def _per_replica(cls, value: float | dict[str, float], info: pydantic.ValidationInfo) -> float | dict[str, float]:
        cpus = info.field_name == "cpus_per_replica"
        values = value.values() if isinstance(value, dict) else [value]
        if any(v <= 0 if cpus else v < 0 for v in values):
            raise ValueError(f"{'CPUs must be > 0' if cpus else 'GPUs must be >= 0'}; valid: a number for every "
                             "fragment, or fragment name -> number (e.g. {learner: 2})")
        return value

    @pydantic.field_validator("address")
    @classmethod
    def _ray_address(cls, address: str | None) -> str | None:
        if address is None or address == "auto":
            return address
        host, sep, port = address.removeprefix("ray://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
            raise ValueError("not a Ray address; valid: HOST:PORT (the head's GCS port, 6379 by default, e.g. "
                             "10.0.0.5:6379), ray://HOST:PORT (Ray Client, e.g. ray://10.0.0.5:10001) or auto")
        return address


class ExploreRange(_Strict):
    """The range of one hyperparameter a population explores (:mod:`msrl.population`)."""

    min: float = Field(gt=0, description="smallest value (> 0)")
    max: float = Field(gt=0, description="largest value")
    log: bool = Field(True, description="sample initial and resampled values log-uniformly (else uniformly)")
    init: list[float] | None = Field(
        None, description="each member's starting value (population.size of them, within [min, max]); default: sampled")

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> "ExploreRange":
        if self.max < self.min:
            raise ValueError(f"max={self.max:g} is below min={self.min:g}")
        bad = [v for v in self.init or () if not self.min <= v <= self.max]
        if bad:
            raise ValueError(f"init value {bad[0]:g} lies outside [min, max] = [{self.min:g}, {self.max:g}]")
        return self


class PopulationConfig(_Strict):
    """Population-based training (Jaderberg et al. 2017, "Population Based Training of Neural
    Networks"): ``size`` members train the same algorithm under the same policy, each with its
    own values of the ``explore``d hyperparameters; every ``interval`` iterations the bottom
    ``quantile`` of members (by the mean return of the episodes they finished in the interval)
    copy the learner state of a member of the top ``quantile`` (exploit) and perturb the copied
    values (explore). See :mod:`msrl.population`."""

    size: int = Field(ge=2, description="members (>= 2)")
    interval: int = Field(gt=0, description="iterations each member trains between exploit/explore steps")
    quantile: float = Field(0.25, gt=0, le=0.5, description="fraction of members in the top and in the bottom group")
    explore: dict[str, ExploreRange] = Field(description="hyperparameter (a float field of algorithm.hparams) -> its range")
    perturbation_factors: tuple[float, float] = Field(
        (0.8, 1.2), description="an explored value is multiplied by one of these, drawn uniformly (then clipped to its range)")
    resample_probability: float = Field(
        0.25, ge=0, le=1, description="probability that an explored value is drawn anew from its range instead")
    devices: list[str] | None = Field(
        None, description="member i runs every fragment of its job on devices[i % len(devices)] (e.g. [cuda:0, cuda:1]: "
                          "members on separate GPUs); none: the policy's devices, shared by every member")

    @pydantic.model_validator(mode="after")
    def _sizes(self) -> "PopulationConfig":
        if not self.explore:
            raise ValueError("explore is empty: name at least one float hyperparameter, e.g. "
                             "explore: {learning_rate: {min: 1.0e-4, max: 1.0e-2}}")
        for name, r in self.explore.items():
            if r.init is not None and len(r.init) != self.size:
                raise ValueError(f"explore.{name}.init has {len(r.init)} values for size={self.size} members")
        if any(f <= 0 for f in self.perturbation_factors):
            raise ValueError(f"perturbation_factors must be > 0, got {self.perturbation_factors}")
        return self


class RunConfig(_Strict):
    """A whole job (see the module docstring)."""

    name: str = Field(description="run name; the run directory is <runs_dir>/<name>")
    seed: int = Field(1, ge=0, description="base seed (>= 0: seeds of every replica's generators and envs derive from it)")
    runs_dir: str = Field("runs", description="where run directories are made")
    algorithm: AlgorithmConfig
    env: EnvConfig
    distribution_policy: PolicyConfig = Field(default_factory=PolicyConfig)
    train: TrainConfig
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: Literal["auto", "local", "ray"] = Field(
        "auto",
        description="local: every fragment replica a thread of this process; ray: each its own process (Ray actor); "
                    "auto: ray when the policy runs more than one replica, else local",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    population: PopulationConfig | None = Field(
        None, description="train a population of this job's members with PBT (msrl.population); none: one job")

    @pydantic.field_validator("name")
    @classmethod
    def _one_directory_name(cls, name: str) -> str:
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError("not one directory name: the run directory is <runs_dir>/<name>, so a name holds no '/' "
                             "and is not '.' or '..' (e.g. ppo_cartpole)")
        return name


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    for key in loc:
        field = model.model_fields.get(str(key))
        annotation = field.annotation if field is not None else None
        if annotation is not None and not isinstance(annotation, type):  # Optional[Model]: the model
            annotation = next((a for a in getattr(annotation, "__args__", ()) if isinstance(a, type)
                               and issubclass(a, BaseModel)), annotation)
        if field is None or not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _format(e: pydantic.ValidationError, root: type[BaseModel] | None, prefix: str = "") -> str:
    lines = []
    errors = e.errors()
    item_errors = {tuple(str(x) for x in err["loc"][:-1]) for err in errors if err["loc"] and isinstance(err["loc"][-1], int)}
    for err in errors:
        loc = [str(x) for x in err["loc"]]
        path = ".".join([prefix] + loc if prefix else loc)
        if err["type"] == "too_short" and tuple(loc) in item_errors:
            continue  # "at least 1 item after validation" only restates the bad items' errors
        if err["type"] in ("tuple_type", "list_type"):  # a YAML user writes a list, not a "tuple"
            lines.append(f"{path}: expected a list, e.g. [64, 64] (got {err.get('input')!r})")
        elif err["type"] == "too_short":
            n = err.get("ctx", {}).get("min_length", 1)
            lines.append(f"{path}: expected a list of at least {n} item{'s' if n != 1 else ''} (got {err.get('input')!r})")
        elif err["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1]) if root is not None else None
            valid = ", ".join(parent.model_fields) if parent else "?"
            level = ".".join(([prefix] if prefix else []) + loc[:-1]) or "top level"
            lines.append(f"unknown key {path!r}; valid keys at {level}: {valid}")
        elif err["type"] == "missing":
            lines.append(f"missing key {path!r}")
        elif err["type"] == "value_error":  # a validator's own message names the value
            lines.append(f"{path}={err.get('input')}: {err['msg'].removeprefix('Value error, ')}")
        elif isinstance(err.get("input"), bool) and err["type"] in ("literal_error", "string_type", "enum"):
            lines.append(f"{path}: {err['msg']} (got {err['input']!r}: YAML reads an unquoted yes/no/on/off/true/false "
                         "as a boolean; quote the value, e.g. \"no\")")
        else:
            lines.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def parse_overrides(overrides: Sequence[str]) -> list[tuple[list[str], Any]]:
    """Parses ``key.sub=value`` strings (values read as YAML: ``3``, ``true``, ``[64, 64]``).

    Raises:
        ConfigError: an override without ``=``, with an empty key part, or an unreadable value.
    """
    out = []
    for o in overrides:
        key, sep, raw = o.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"bad override {o!r}: expected key.sub=value (e.g. train.total_env_steps=100000)")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(f"bad override {o!r}: the value is not valid YAML ({e})") from None
        out.append((key.split("."), value))
    return out


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a copy of ``raw`` with dotted overrides set (validation happens later).

    Raises:
        ConfigError: a malformed override, or one that descends into a plain value.
    """
    return set_values(raw, parse_overrides(overrides))


def set_values(raw: Mapping[str, Any], values: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    """Returns a copy of ``raw`` with each ``(key path, value)`` set (validation happens later).

    Raises:
        ConfigError: a path that descends into a plain value.
    """
    import copy

    data = copy.deepcopy(dict(raw))
    for path, value in values:
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"bad override {'.'.join(path)}={value!r}: {where!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def read_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Reads a config file and applies dotted overrides, without validating it (nothing is
    imported: the ``msrl`` command reads what its process start-up depends on from it).

    Raises:
        ConfigError: unreadable file, invalid YAML, a top level that is not a mapping, or a
            malformed override.
    """
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {str(p)!r}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return apply_overrides(raw, overrides)


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads, overrides and fully validates a config file (see :func:`validate`).

    Raises:
        ConfigError: unreadable file, invalid YAML, or any validation error.
    """
    return validate(read_config(path, overrides))


def _has_frames(space: Any) -> bool:
    """Whether observations of ``space`` hold uint8 frames ``(C, H, W)`` (a Dict: in some key)."""
    from msrl.envs.dict_obs import is_image_space

    subs = getattr(space, "spaces", None)
    if isinstance(subs, dict):
        return any(is_image_space(s) for s in subs.values())
    return is_image_space(space)


def _hparams(cfg: RunConfig, algorithm: Any) -> Any:
    cls = algorithm.hparams
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in cfg.algorithm.hparams if k not in fields]
    if unknown:
        raise ConfigError(
            f"unknown key 'algorithm.hparams.{unknown[0]}'; valid keys at algorithm.hparams ({cfg.algorithm.name}): "
            + ", ".join(fields)
        )
    try:
        hparams = pydantic.TypeAdapter(cls).validate_python(dict(cfg.algorithm.hparams))
    except pydantic.ValidationError as e:
        if any(not x["loc"] for x in e.errors()):  # a check across fields
            raise ConfigError("; ".join(f"algorithm.hparams: {x['msg'].removeprefix('Value error, ')}"
                                        for x in e.errors() if not x["loc"])) from None
        raise ConfigError(_format(e, None, "algorithm.hparams")) from None
    except ValueError as e:
        raise ConfigError(f"algorithm.hparams: {e}") from None
    for f in dataclasses.fields(hparams):
        bad = _non_finite(getattr(hparams, f.name))
        if bad is not None:
            given = "set in the config" if f.name in cfg.algorithm.hparams else f"the default of {cls.__name__}"
            raise ConfigError(f"algorithm.hparams.{f.name}={bad}: not a finite number ({given}); hyperparameters are "
                              f"finite (e.g. {f.name}={_finite_example(f.default)})")
    return hparams


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinite float in ``value`` (a number, or a tuple/list/dict of them)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for v in items:
        bad = _non_finite(v)
        if bad is not None:
            return bad
    return None


def _finite_example(default: Any) -> Any:
    return default if default is not dataclasses.MISSING and _non_finite(default) is None else 0.001


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
        raise ConfigError(_format(e, RunConfig)) from None
    build_job_spec(cfg)  # raises ConfigError on unknown names and bad combinations
    return cfg


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda:0"`` when torch sees a CUDA device, else ``"cpu"``; other names as given."""
    if device == "auto":
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return device


def resolve_runtime(runtime: str, policy: Any) -> str:
    """``"local"`` or ``"ray"``: ``runtime``, with ``"auto"`` resolved to ``"ray"`` when
    ``policy`` (overrides applied) runs more than one fragment replica and to ``"local"``
    otherwise."""
    if runtime != "auto":
        return runtime
    return "ray" if sum(f.replicas for f in policy.fragments) > 1 else "local"


def build_job_spec(cfg: RunConfig) -> Any:
    """The :class:`msrl.job.JobSpec` of a validated config.

    Raises:
        ConfigError: an unknown algorithm, env id, policy, fragment, backend or device; envs
            that do not split over replicas; hyperparameters the algorithm rejects.
    """
    import torch

    from msrl.backend import UnknownBackendError, load_backend
    from msrl.envs import UnknownEnvError, check_env_id, is_native
    from msrl.job import JobSpec, UnknownAlgorithmError, load_algorithm
    from msrl.policy import UnknownPolicyError, load_policy

    try:
        algorithm = load_algorithm(cfg.algorithm.name)
        if cfg.env.engine == "envpool":
            from msrl.envs.envpool_env import check_envpool_id

            check_envpool_id(cfg.env.id)
        elif cfg.env.engine == "ale_vector":
            from msrl.envs.ale_vector_env import ale_game

            ale_game(cfg.env.id)
        else:
            check_env_id(cfg.env.id)
        policy = load_policy(cfg.distribution_policy.name)
    except (UnknownAlgorithmError, UnknownEnvError, UnknownPolicyError) as e:
        raise ConfigError(str(e)) from None
    from msrl.envs import env_spec as make_env_spec
    from msrl.envs.single import EnvKwargsError, check_wrappers

    try:
        check_wrappers(cfg.env.wrappers)
        if cfg.env.wrappers and is_native(cfg.env.id):
            raise ValueError(f"wrappers apply to gymnasium envs, not the native env {cfg.env.id!r}")
        if cfg.env.wrappers and cfg.env.engine == "envpool":
            raise ValueError("they apply to gymnasium envs; EnvPool's tasks take their options as env.kwargs")
        if cfg.env.engine == "ale_vector" and list(cfg.env.wrappers) != ["atari"]:
            raise ValueError(f"env.engine=ale_vector does the atari preprocessing itself, in C++: set "
                             f"env.wrappers: [atari] (got {list(cfg.env.wrappers)})")
        es = make_env_spec(cfg.env.id, 1, cfg.env.kwargs, cfg.env.wrappers, cfg.env.engine)
    except EnvKwargsError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"env.wrappers: {e}") from None
    if cfg.env.engine != "sync" and is_native(cfg.env.id):
        raise ConfigError(f"env.engine={cfg.env.engine} steps gymnasium envs; {cfg.env.id} is a native env, batched "
                          "already (set env.engine=sync)")
    why = algorithm.unsupported(es)
    if why is not None:
        raise ConfigError(f"algorithm.name={cfg.algorithm.name} cannot train on env.id={cfg.env.id}: {why}")
    dp = cfg.distribution_policy
    policy = policy.configured(dp.replicas, dp.backends, dp.devices, dp.placement, dp.boundaries, dp.queue_capacity,
                               dp.inference.model_dump(exclude_none=True) if dp.inference is not None else None,
                               dp.capture, dp.compile)
    for frag_name, problem in policy.replica_problems():
        n = policy.fragment(frag_name).replicas
        raise ConfigError(f"distribution_policy.replicas.{frag_name}={n}: {problem}")
    lagging = [bc for bc in policy.boundaries if bc.channel == "latest"]
    if lagging and algorithm.policy_lag == "uncorrected":
        slots = ", ".join(f"{bc.name}: latest" for bc in lagging)
        raise ConfigError(
            f"algorithm.name={cfg.algorithm.name} under distribution_policy.name={policy.name} ({slots}): the actors act "
            f"with weights the learner has since updated (the policy lag), and {cfg.algorithm.name}'s update assumes the "
            "learner's own policy acted, with no correction for it; use an algorithm that corrects for it (impala: "
            f"V-trace; ppo) or synchronous weights (distribution_policy.boundaries.{lagging[0].name}=sync)")
    policy = policy.with_overrides(devices={f.name: resolve_device(f.device) for f in policy.fragments})
    for frag in policy.fragments:
        try:
            backend = load_backend(frag.backend)
        except UnknownBackendError as e:
            raise ConfigError(f"fragment {frag.name}: {e}") from None
        try:
            device = torch.device(frag.device)
        except RuntimeError:
            raise ConfigError(f"fragment {frag.name}: invalid device {frag.device!r} (e.g. cpu, cuda:0)") from None
        if device.type not in backend.devices:
            raise ConfigError(f"fragment {frag.name}: backend {backend.name} runs on {backend.devices}, not {device.type}")
        backend.check(frag, policy, cfg.env.id, cfg.env.engine)
        if device.type == "cuda" and not torch.cuda.is_available() and cfg.cluster.address is None:
            # on a cluster the replicas' nodes hold the GPUs, not the submitting machine: Ray's
            # placement checks them (cluster.gpus_per_replica)
            raise ConfigError(f"fragment {frag.name}: device {frag.device} requested but no CUDA device is available "
                              "on this machine (to run on a cluster's GPUs, set cluster.address or use msrl launch)")
    cores = os.cpu_count() or 1
    names = [f.name for f in policy.fragments]
    try:
        cpus = per_fragment(cfg.cluster.cpus_per_replica, names, "cluster.cpus_per_replica", 1.0)
        per_fragment(cfg.cluster.gpus_per_replica, names, "cluster.gpus_per_replica", 0.0)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.cluster.address is None and resolve_runtime(cfg.runtime, policy) == "ray":
        for name, c in cpus.items():
            if c > cores:
                key = "cluster.cpus_per_replica" + (f".{name}" if isinstance(cfg.cluster.cpus_per_replica, dict) else "")
                raise ConfigError(f"{key}={c:g}: each replica runs on this machine, which has {cores} CPUs; "
                                  f"valid: up to {cores} (or set cluster.address to run on a cluster)")
    env_frag = policy.fragment(policy.fragment_of_role("env"))
    if cfg.env.num_workers is not None and load_backend(env_frag.backend).env_engine(cfg.env.engine) == "sync":
        raise ConfigError(f"env.num_workers={cfg.env.num_workers} sets the process engine's workers (or EnvPool's "
                          "threads), but env.engine='sync'; set env.engine=process (or the env's fragment's backend "
                          f"to cpu_process_group: distribution_policy.backends.{env_frag.name}) or drop env.num_workers")
    if cfg.eval.env_id is not None:
        if is_native(cfg.eval.env_id):
            raise ConfigError(f"eval.env_id={cfg.eval.env_id!r}: evaluations run on gymnasium envs, not native ones")
        try:
            check_env_id(cfg.eval.env_id)
        except UnknownEnvError as e:
            raise ConfigError(f"eval.env_id: {e}") from None
    from msrl.envs import eval_env_id

    if cfg.env.engine == "envpool" and cfg.eval.env_id is None and cfg.train.eval_every:
        try:
            check_env_id(cfg.env.id)
        except UnknownEnvError:
            raise ConfigError(f"train.eval_every={cfg.train.eval_every}: envpool task {cfg.env.id} is not a gymnasium "
                              "id to evaluate on; set train.eval_every=0 or eval.env_id (e.g. ALE/Pong-v5)") from None
    if cfg.eval.env_id is None and eval_env_id(cfg.env.id) is None and cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every}: {cfg.env.id} has no gymnasium twin to evaluate on; "
            "set train.eval_every=0 (the training curves report returns) or eval.env_id"
        )
    hparams = _hparams(cfg, algorithm)
    cnn = getattr(hparams, "cnn", "nature")
    if cnn != "nature" and not _has_frames(es.observation_space):
        raise ConfigError(f"algorithm.hparams.cnn={cnn}: the {cnn} trunk is for uint8 frame observations (C, H, W); "
                          f"{cfg.env.id} has {es.observation_space}")
    spec = JobSpec(
        algorithm=algorithm,
        hparams=hparams,
        env_id=cfg.env.id,
        num_envs=cfg.env.num_envs,
        policy=policy,
        seed=cfg.seed,
        total_env_steps=cfg.train.total_env_steps,
        env_engine=cfg.env.engine,
        env_kwargs=dict(cfg.env.kwargs),
        env_wrappers=tuple(cfg.env.wrappers),
        env_num_workers=cfg.env.num_workers,
        float32_matmul_precision=cfg.train.float32_matmul_precision,
    )
    try:
        spec.envs_per_replica()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per = spec.env_steps_per_iteration
    if cfg.train.total_env_steps < per:
        raise ConfigError(f"train.total_env_steps={cfg.train.total_env_steps}: less than one iteration, which is {per} "
                          f"env steps for this job (env.num_envs={cfg.env.num_envs}); a run trains whole iterations "
                          f"within its budget: set at least {per}")
    if cfg.population is not None:
        check_population(cfg, algorithm)
    return spec


def check_population(cfg: RunConfig, algorithm: Any) -> None:
    """Checks ``cfg.population`` against the algorithm and the runtime.

    Raises:
        ConfigError: an explored name that is not a float field of the algorithm's
            hyperparameters, or the job runs on Ray (members run in this process).
    """
    pop = cfg.population
    if pop is None:
        return
    defaults = {f.name: f for f in dataclasses.fields(algorithm.hparams)}
    for name in pop.explore:
        if name not in defaults:
            raise ConfigError(f"population.explore.{name}: not a hyperparameter of {cfg.algorithm.name}; valid "
                              f"(float ones): {', '.join(_float_fields(algorithm.hparams))}")
        if name not in _float_fields(algorithm.hparams):
            raise ConfigError(f"population.explore.{name}: only float hyperparameters can be explored (an int or a "
                              f"bool may change a tensor's shape or the traced program); float ones of "
                              f"{cfg.algorithm.name}: {', '.join(_float_fields(algorithm.hparams))}")
    if pop.devices is not None:
        if not pop.devices:
            raise ConfigError("population.devices is empty: list one device or more (e.g. [cuda:0, cuda:1]), or leave it out")
        if cfg.distribution_policy.devices:
            raise ConfigError("population.devices places each member's whole job on one device; "
                              f"distribution_policy.devices={dict(cfg.distribution_policy.devices)} would place its "
                              "fragments too: set one of them")
    spec = build_job_spec(cfg.model_copy(update={"population": None}))
    fragments = [f.name for f in spec.policy.fragments]
    for device in dict.fromkeys(pop.devices or ()):  # each exists, and the policy's backends run on it
        try:
            build_job_spec(on_device(cfg.model_copy(update={"population": None}), device, fragments))
        except ConfigError as e:
            raise ConfigError(f"population.devices: {device}: {e}") from None
    if resolve_runtime(cfg.runtime, spec.policy) != "local":
        raise ConfigError(f"population: the members run in this process (runtime: local); runtime={cfg.runtime} "
                          f"would run {spec.policy.name}'s replicas on Ray: set runtime: local")


def on_device(cfg: RunConfig, device: str, fragments: Sequence[str]) -> RunConfig:
    """``cfg`` with each of ``fragments`` (the policy's fragment names) on ``device``
    (``distribution_policy.devices``): a population member's whole job on its device."""
    placed = cfg.distribution_policy.model_copy(update={"devices": {name: device for name in fragments}})
    return cfg.model_copy(update={"distribution_policy": placed})


def _float_fields(cls: type) -> list[str]:
    """The hparams dataclass's fields whose defaults are floats."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, float) and not isinstance(default, bool):
            out.append(f.name)
    return out
