"""Job-spec assembly: a validated :class:`~msrl.config.schema.RunConfig` to the
:class:`msrl.run.job.JobSpec` it runs, with the checks that need the algorithm, the env, the policy
and the backends (each delegating to what owns the rule: the env engines' table, the policy's
``configured``, a backend's ``check``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import pydantic

from msrl.cluster.options import per_fragment
from msrl.config.schema import RunConfig, format_errors
from msrl.errors import ConfigError

__all__ = ["build_job_spec", "resolve_device", "resolve_runtime", "check_population", "on_device"]


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
        raise ConfigError(format_errors(e, None, "algorithm.hparams")) from None
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
    """The :class:`msrl.run.job.JobSpec` of a validated config.

    Raises:
        ConfigError: an unknown algorithm, env id, policy, fragment, backend or device; envs
            that do not split over replicas; hyperparameters the algorithm rejects.
    """
    import torch

    from msrl.envs import UnknownEnvError, check_env_id, is_native
    from msrl.envs.engines import engine as engine_kind
    from msrl.registry import UnknownAlgorithmError, load_algorithm
    from msrl.run.job import JobSpec
    from msrl.runtime.programs.backends import UnknownBackendError, load_backend

    engine = engine_kind(cfg.env.engine)
    from msrl.policy import UnknownPolicyError, load_policy

    try:
        algorithm = load_algorithm(cfg.algorithm.name)
        engine.check_id(cfg.env.id)
        policy = load_policy(cfg.distribution_policy.name)
    except (UnknownAlgorithmError, UnknownEnvError, UnknownPolicyError) as e:
        raise ConfigError(str(e)) from None
    from msrl.envs import env_spec as make_env_spec
    from msrl.envs.single_env import EnvKwargsError, check_wrappers

    try:
        check_wrappers(cfg.env.wrappers)
        if cfg.env.wrappers and is_native(cfg.env.id):
            raise ValueError(f"wrappers apply to gymnasium envs, not the native env {cfg.env.id!r}")
        problem = engine.wrappers_problem(cfg.env.wrappers)
        if problem is not None:
            raise ValueError(problem)
        es = make_env_spec(cfg.env.id, 1, cfg.env.kwargs, cfg.env.wrappers, cfg.env.engine)
    except EnvKwargsError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"env.wrappers: {e}") from None
    if not engine.steps_native and is_native(cfg.env.id):
        raise ConfigError(f"env.engine={cfg.env.engine} steps gymnasium envs; {cfg.env.id} is a native env, batched "
                          "already (set env.engine=sync)")
    why = algorithm.unsupported(es)
    if why is not None:
        raise ConfigError(f"algorithm.name={cfg.algorithm.name} cannot train on env.id={cfg.env.id}: {why}")
    dp = cfg.distribution_policy
    policy = policy.configured(
        replicas=dp.replicas, backends=dp.backends, devices=dp.devices, placement=dp.placement, boundaries=dp.boundaries,
        queue_capacity=dp.queue_capacity, capture=dp.capture, compile=dp.compile,
        inference=dp.inference.model_dump(exclude_none=True) if dp.inference is not None else None)
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
    if cfg.env.num_workers is not None and not engine_kind(load_backend(env_frag.backend).env_engine(cfg.env.engine)).workers:
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
    if cfg.eval.env_kwargs:  # the evaluation env built once, so that a bad key fails before any work
        from msrl.envs.single_env import make_single_env
        from msrl.run.evaluation import evaluation_env

        eval_id, eval_kwargs, eval_wrappers = evaluation_env(cfg)
        if eval_id is None:
            raise ConfigError(f"eval.env_kwargs: {cfg.env.id} has no gymnasium env to evaluate on; set eval.env_id too")
        try:
            make_single_env(eval_id, eval_kwargs, eval_wrappers).close()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"eval.env_kwargs: {str(e).replace('env.kwargs.', '', 1)}") from None
    from msrl.envs import eval_env_id

    if not engine.gymnasium_ids and cfg.eval.env_id is None and cfg.train.eval_every:
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
    _check_offline(cfg, algorithm)
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
        total_env_steps=cfg.train.total_env_steps or 0,
        total_gradient_steps=cfg.train.total_gradient_steps or 0,
        dataset=_dataset_source(cfg),
        env_engine=cfg.env.engine,
        env_kwargs=dict(cfg.env.kwargs),
        env_wrappers=tuple(cfg.env.wrappers),
        env_num_workers=cfg.env.num_workers,
        float32_matmul_precision=cfg.train.float32_matmul_precision,
        flush_denormal=cfg.train.flush_denormal,
    )
    try:
        spec.envs_per_replica()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    per = spec.env_steps_per_iteration
    if not algorithm.offline and cfg.train.total_env_steps < per:
        raise ConfigError(f"train.total_env_steps={cfg.train.total_env_steps}: less than one iteration, which is {per} "
                          f"env steps for this job (env.num_envs={cfg.env.num_envs}); a run trains whole iterations "
                          f"within its budget: set at least {per}")
    if cfg.population is not None:
        check_population(cfg, algorithm)
    return spec


def _dataset_source(cfg: RunConfig) -> Any:
    """The config's ``dataset:`` as a :class:`msrl.rl.datasets.DatasetSource` (``None``: none given)."""
    if cfg.dataset is None:
        return None
    from msrl.rl.datasets import DatasetSource

    return DatasetSource(id=cfg.dataset.id, path=cfg.dataset.path, root=cfg.dataset.root, download=cfg.dataset.download)


def _check_offline(cfg: RunConfig, algorithm: Any) -> None:
    """An offline algorithm has a ``dataset:`` and ``train.total_gradient_steps``; one that steps
    its env has neither (``train.total_env_steps`` instead), unless it imitates demonstrations
    (:attr:`~msrl.api.AlgorithmSpec.demonstrations`), which need a ``dataset:``.

    Raises:
        ConfigError: naming the key and what the algorithm needs.
    """
    name = cfg.algorithm.name
    if algorithm.offline:
        if cfg.dataset is None:
            raise ConfigError(f"dataset: missing; {name} is an offline algorithm, which learns from a dataset: "
                              "dataset: {id: <a Minari id>} or {path: <its directory>} (msrl collect writes one)")
        if cfg.train.total_gradient_steps is None:
            raise ConfigError(f"train.total_env_steps={cfg.train.total_env_steps}: {name} is an offline algorithm, "
                              "whose budget is train.total_gradient_steps (one per iteration), not env steps")
        if cfg.population is not None:
            raise ConfigError(f"population: PBT trains algorithms that step their env; {name} is an offline one")
        return
    if algorithm.demonstrations and cfg.dataset is None:
        raise ConfigError(f"dataset: missing; {name} imitates an expert's demonstrations, read from a dataset: "
                          "dataset: {id: <a Minari id>} or {path: <its directory>} (msrl collect writes one)")
    if cfg.dataset is not None and not algorithm.demonstrations:
        raise ConfigError(f"dataset: {name} learns from its env, not from a dataset; dataset is an offline "
                          "algorithm's (e.g. algorithm.name=bc) or an imitation one's (gail)")
    if cfg.train.total_gradient_steps is not None:
        raise ConfigError(f"train.total_gradient_steps={cfg.train.total_gradient_steps}: {name} steps its env; its "
                          "budget is train.total_env_steps (total_gradient_steps is an offline algorithm's)")


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
        _check_explored_values(cfg, algorithm, name)
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


def _check_explored_values(cfg: RunConfig, algorithm: Any, name: str) -> None:
    """Every value ``population.explore.<name>`` can give (its ``min``, its ``max`` -- explored
    values are clipped into the range -- and its ``init`` values) is one the hyperparameter accepts,
    checked by the algorithm's own bounds before any work.

    Raises:
        ConfigError: naming ``population.explore.<name>.<min|max|init>``, the value and the bound.
    """
    r = cfg.population.explore[name]
    for where, value in (("min", r.min), ("max", r.max), *((f"init[{i}]", v) for i, v in enumerate(r.init or ()))):
        try:
            pydantic.TypeAdapter(algorithm.hparams).validate_python({**cfg.algorithm.hparams, name: value})
        except pydantic.ValidationError as e:
            why = "; ".join(x["msg"].removeprefix("Value error, ") for x in e.errors())
            raise ConfigError(f"population.explore.{name}.{where}={value:g}: not a value algorithm.hparams.{name} "
                              f"accepts ({why}); the explored range must lie within the hyperparameter's bounds") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"population.explore.{name}.{where}={value:g}: {e}") from None


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

