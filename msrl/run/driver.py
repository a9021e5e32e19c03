"""Which runtime runs a job: the local runtime (threads of this process) or Ray (a process per
replica, placed by ``cluster.*``), and the TLS the Ray runtime's gRPC streams use."""

from __future__ import annotations

import pathlib
from typing import Any

from msrl.config import ConfigError, RunConfig
from msrl.run.job import Job, JobSpec

__all__ = ["make_job", "ray_job", "tls_config", "oversubscription"]


def make_job(spec: JobSpec, cfg: RunConfig, restarted: bool = False) -> Any:
    """The job of ``cfg`` on its runtime: :class:`~msrl.run.job.Job` (``runtime: local``) or
    :class:`~msrl.cluster.ray_runtime.RayJob` (``runtime: ray``; ``cluster.*`` places it);
    ``runtime: auto`` runs policies with more than one replica on Ray. A ``restarted`` job
    (after a replica's death) waits up to ``cluster.capacity_timeout_s`` for the cluster to
    hold its replicas; a first start fails at once where the cluster is too small."""
    from msrl.config import resolve_runtime

    if resolve_runtime(cfg.runtime, spec.policy) == "local":
        return Job(spec)
    from msrl.cluster.options import RayOptions
    from msrl.registry import available_algorithms

    name = cfg.algorithm.name
    ref = None if name in available_algorithms() else (
        str(pathlib.Path(name).expanduser().resolve()) if name.endswith(".py") or "/" in name else name
    )
    c = cfg.cluster
    options = RayOptions(address=c.address, cpus_per_replica=c.cpus_per_replica, gpus_per_replica=c.gpus_per_replica,
                         strategy=c.strategy, intra_node=c.intra_node, tls=tls_config(cfg),
                         max_message=round(c.max_message_mb * (1 << 20)),
                         replica_timeout_s=c.replica_timeout_s if c.watchdog else None,
                         boundary_transport=c.boundary_transport, sync_transport=c.sync_transport,
                         learner_priority=c.learner_priority, connect_timeout_s=c.connect_timeout_s,
                         on_replica_loss=c.on_replica_loss, replacement_timeout_s=c.capacity_timeout_s,
                         capacity_timeout_s=c.capacity_timeout_s if restarted else None,
                         on_ray_started=_report_ray)
    return ray_job(spec, options, algorithm_ref=ref)


def oversubscription(cfg: RunConfig, spec: JobSpec, cores: int, load: float) -> str | None:
    """The one line a run prints at its start when its threads exceed this machine's cores, or
    ``None``. On Ray started here (no ``cluster.address``): a replica runs
    ``floor(cluster.cpus_per_replica)`` torch threads, and replicas of several threads whose
    threads outnumber the cores compete for them (one-thread replicas sharing cores is msrl's
    plan for a small machine, and is not said). In this process (``runtime: local``):
    ``train.torch_threads`` above 1 for each replica thread, with the machine's 1-minute load
    (other jobs) counted, above the cores.

    Args:
        cores: this machine's cores (``os.cpu_count()``); load: its 1-minute load average.
    """
    import math

    from msrl.config import resolve_runtime

    if resolve_runtime(cfg.runtime, spec.policy) == "ray":
        if cfg.cluster.address is not None:
            return None  # a cluster's nodes are its operator's to size
        from msrl.cluster.options import per_fragment

        names = [f.name for f in spec.policy.fragments]
        cpus = per_fragment(cfg.cluster.cpus_per_replica, names, "cluster.cpus_per_replica", 1.0)
        threads = {f.name: max(1, math.floor(cpus[f.name])) for f in spec.policy.fragments}
        total = sum(threads[f.name] * f.replicas for f in spec.policy.fragments)
        wide = {name: n for name, n in threads.items() if n > 1}
        if wide and total > cores:
            return (f"msrl: cluster.cpus_per_replica gives {', '.join(f'{k} replicas {n} threads' for k, n in wide.items())}: "
                    f"{total} threads in all on this {cores}-core machine, so they compete for cores (slower than one "
                    f"thread each); lower cluster.cpus_per_replica to fit {cores} cores")
        return None
    threads = cfg.train.torch_threads
    replicas = sum(f.replicas for f in spec.policy.fragments)
    if threads > 1 and threads * replicas + math.floor(load) > cores:
        busy = f" whose load is {load:.1f}" if math.floor(load) else ""
        return (f"msrl: train.torch_threads={threads} for {replicas} replica thread(s) on this {cores}-core machine{busy}: "
                "the threads compete for cores (on a busy or small machine train.torch_threads=1 is often faster)")
    return None


def ray_job(spec: JobSpec, options: Any = None, algorithm_ref: str | None = None, probe: bool = True) -> Any:
    """Compiles ``spec`` (:func:`msrl.run.job.compile_job`, boundary values checked against
    ``options.max_message``) and starts it on Ray as a :class:`~msrl.cluster.ray_runtime.RayJob`
    (``options``: a :class:`~msrl.cluster.options.RayOptions`; ``None``: the defaults): what
    :func:`make_job`, the tests and the benchmarks call.

    Raises:
        as :func:`msrl.run.job.compile_job` and :class:`~msrl.cluster.ray_runtime.RayJob` do.
    """
    from msrl.cluster.options import RayOptions
    from msrl.cluster.ray_runtime import RayJob
    from msrl.run.job import compile_job
    from msrl.runtime.transports.codec import MAX_MESSAGE

    options = options or RayOptions()
    return RayJob(compile_job(spec, probe, options.max_message or MAX_MESSAGE), options, algorithm_ref)


def _report_ray(facts: dict[str, Any]) -> None:
    """Tells a supervising ``msrl train`` (:mod:`msrl.run.supervisor`) the Ray this driver started."""
    from msrl.run.supervisor import report

    report(ray=facts)


def tls_config(cfg: RunConfig) -> Any:
    """The :class:`~msrl.cluster.grpc_transport.TlsConfig` of ``cluster.tls_*`` (``None``
    without ``cluster.tls_cert``).

    Raises:
        ConfigError: only one of certificate and key, or a file that cannot be read or is not PEM.
    """
    c = cfg.cluster
    if c.tls_cert is None and c.tls_key is None:
        return None
    if c.tls_cert is None or c.tls_key is None:
        raise ConfigError("cluster.tls_cert and cluster.tls_key go together: TLS needs the certificate and its key")
    pem = {}
    for key, path in (("tls_cert", c.tls_cert), ("tls_key", c.tls_key)):
        try:
            data = pathlib.Path(path).expanduser().read_bytes()
        except OSError as e:
            raise ConfigError(f"cluster.{key}={path}: {e.strerror}") from None
        if b"-----BEGIN " not in data:
            raise ConfigError(f"cluster.{key}={path}: not a PEM file")
        pem[key] = data
    from msrl.cluster.grpc_transport import TlsConfig

    return TlsConfig(pem["tls_cert"], pem["tls_key"], c.tls_server_name)
