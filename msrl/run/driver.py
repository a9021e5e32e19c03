"""Which runtime runs a job: the local runtime (threads of this process) or Ray (a process per
replica, placed by ``cluster.*``), and the TLS the Ray runtime's gRPC streams use."""

from __future__ import annotations

import pathlib
from typing import Any

from msrl.config import ConfigError, RunConfig
from msrl.run.job import Job, JobSpec

__all__ = ["make_job", "tls_config"]


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
    from msrl.cluster.ray_runtime import RayJob
    from msrl.run.job import available_algorithms, compile_job

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
                         capacity_timeout_s=c.capacity_timeout_s if restarted else None)
    return RayJob(compile_job(spec, True, options.max_message), options, algorithm_ref=ref)


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
