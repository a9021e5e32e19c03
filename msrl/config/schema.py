"""The config schema: the pydantic models of a run's YAML (:class:`RunConfig`) and the one-line
text of their validation errors (:func:`format_errors`: an unknown key names the valid keys at
its level)."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from msrl.envs.engines import ENGINES
from msrl.runtime.transports.kinds import BOUNDARY_TRANSPORTS, INTRA_NODE, SYNC_TRANSPORTS

__all__ = ["RunConfig", "AlgorithmConfig", "EnvConfig", "InferenceConfig", "PolicyConfig", "TrainConfig",
           "EvalConfig", "ClusterConfig", "ExploreRange", "PopulationConfig", "DatasetConfig", "format_errors"]


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
    engine: Literal[ENGINES] = Field(  # type: ignore[valid-type]
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

    total_env_steps: int | None = Field(None, gt=0, description="training budget in env steps (an online algorithm's)")
    total_gradient_steps: int | None = Field(
        None, gt=0, description="training budget in gradient steps, one per iteration (an offline algorithm's, instead "
                                "of total_env_steps)")
    checkpoint_every: int = Field(10, gt=0, description="iterations between checkpoints")
    keep_weights: bool = Field(
        False, description="at every checkpoint also keep the policy's weights as checkpoints/weights/<env steps>.pt "
                           "(a history to evaluate, as SB3's CheckpointCallback keeps models; the job's whole state "
                           "stays in latest.pt and previous.pt only)")
    eval_every: int = Field(0, ge=0, description="env steps (an offline algorithm: gradient steps) between evaluations "
                                                 "during training (0: only at the end)")
    stop_at_return: float | None = Field(None, description="stop once an evaluation's mean return reaches this")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads")
    float32_matmul_precision: Literal["highest", "high", "medium"] = Field(
        "highest",
        description="the internal precision of float32 matrix products (torch.set_float32_matmul_precision): "
                    "highest (float32, the default), high (a CUDA device's TensorFloat32 tensor cores: several "
                    "times faster, ~3 significant digits per product; the CPU keeps float32), medium (bfloat16 "
                    "where torch has it: on a CUDA device, and on a CPU whose oneDNN computes it (as on AMX), "
                    "the products of Linear layers and matmuls, not convolutions); applied in every process that "
                    "runs a fragment",
    )
    flush_denormal: bool = Field(
        True,
        description="on the CPU, read and write float values below the smallest normal one (1.2e-38 in float32) "
                    "as 0 (torch.set_flush_denormal: x86's flush-to-zero and denormals-are-zero modes, as "
                    "TensorFlow's executor sets them) on every thread while it runs a fragment or the run's evaluation, "
                    "and the thread's own mode back afterwards: arithmetic on such values takes a slow path (an AlphaZero tower "
                    "whose weight decay had taken 2,428 weights below it: 3.9x slower forwards); false: IEEE denormals",
    )
    progress: bool = Field(True, description="show a progress bar")

    @pydantic.model_validator(mode="after")
    def _one_budget(self) -> "TrainConfig":
        if (self.total_env_steps is None) == (self.total_gradient_steps is None):
            given = "both" if self.total_env_steps is not None else "neither"
            raise ValueError(f"{given} given: set train.total_env_steps (the budget of an algorithm that steps an env) "
                             "or train.total_gradient_steps (an offline algorithm's), one of them")
        return self

    @property
    def budget(self) -> int:
        """The budget given: ``total_env_steps`` or ``total_gradient_steps``."""
        return self.total_env_steps if self.total_env_steps is not None else self.total_gradient_steps  # type: ignore[return-value]


class DatasetConfig(_Strict):
    """``dataset``: an offline algorithm's Minari dataset, by ``id`` (under ``root``, else Minari's
    datasets root) or by ``path`` (see docs/guide/datasets.md)."""

    id: str | None = Field(None, description="a Minari dataset id, e.g. msrl/cartpole/expert-v0")
    path: str | None = Field(None, description="a Minari dataset's directory (holding data/), instead of id")
    root: str | None = Field(None, description="the datasets root an id is looked up under (default Minari's: "
                                               "$MINARI_DATASETS_PATH or ~/.minari/datasets)")
    download: bool = Field(False, description="fetch an id that is not local from Minari's remote (needs the network)")

    @pydantic.model_validator(mode="after")
    def _id_or_path(self) -> "DatasetConfig":
        if (self.id is None) == (self.path is None):
            raise ValueError("give the dataset by id or by path, one of them")
        return self


class EvalConfig(_Strict):
    """``eval``: deterministic evaluation episodes."""

    episodes: int = Field(20, gt=0, description="episodes per evaluation")
    env_id: str | None = Field(
        None, description="gymnasium env to evaluate on (default: the training env, or a native env's gymnasium twin)"
    )
    seed: int = Field(10_000, ge=0, description="seed of the evaluation envs (>= 0)")
    env_kwargs: dict[str, Any] | None = Field(
        None, description="gymnasium.make kwargs of the evaluation env, over the training env's (e.g. "
        "{opponent: random}: an openspiel/<game> env whose other seat a fixed player takes)")


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
    intra_node: Literal[INTRA_NODE] = Field(  # type: ignore[valid-type]
        "shm",
        description="how a fragment's replicas on one machine all-reduce host tensors: shm (shared memory, Linux; "
                    "Gloo where unavailable or across machines) or gloo (TCP through Gloo)",
    )
    sync_transport: Literal[SYNC_TRANSPORTS] = Field(  # type: ignore[valid-type]
        "auto",
        description="how synchronous boundaries cross between processes, per peer pair: auto (a Unix socket between "
                    "replicas of one machine whose fragments are on the host, Gloo otherwise: NCCL between CUDA devices) "
                    "or gloo (Gloo for all)",
    )
    boundary_transport: Literal[BOUNDARY_TRANSPORTS] = Field(  # type: ignore[valid-type]
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
    """The range of one hyperparameter a population explores (:mod:`msrl.run.population`)."""

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
    values (explore). See :mod:`msrl.run.population`."""

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

    name: str = Field(description="run name; the run directory is runs_dir/name")
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
        None, description="train a population of this job's members with PBT (msrl.run.population); none: one job")
    dataset: DatasetConfig | None = Field(
        None, description="the dataset an offline algorithm learns from (none: the algorithm steps its env)")

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


def format_errors(e: pydantic.ValidationError, root: type[BaseModel] | None, prefix: str = "") -> str:
    """pydantic's validation errors as msrl's one line per error: ``key.path: message (got value)``.

    Args:
        e: the errors of validating a config section.
        root: the model validated (its field names give close-match suggestions), or ``None``.
        prefix: the dotted path of the section in the whole config (``"algorithm.hparams."``).

    Returns:
        the errors joined by ``"; "``, each naming its full dotted key.
    """
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
        elif (err["type"] == "value_error" and isinstance(err.get("input"), dict) and root is not None
              and _model_at(root, loc) is not None):  # a whole section's validator: its own words, not the section's dict
            lines.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] == "value_error":  # a validator's own message names the value
            lines.append(f"{path}={err.get('input')}: {err['msg'].removeprefix('Value error, ')}")
        elif isinstance(err.get("input"), bool) and err["type"] in ("literal_error", "string_type", "enum"):
            lines.append(f"{path}: {err['msg']} (got {err['input']!r}: YAML reads an unquoted yes/no/on/off/true/false "
                         "as a boolean; quote the value, e.g. \"no\")")
        else:
            lines.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)

