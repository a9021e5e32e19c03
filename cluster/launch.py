"""``msrl launch``: a training run submitted to an existing Ray cluster as a Ray Job.

::

    msrl launch CONFIG [key.sub=value ...] --address http://HEAD:8265 [--working-dir DIR] [--no-wait]

The config is loaded and validated here first (a config error is reported before anything is
submitted). The job's entrypoint is ``python -m msrl.run.cli train CONFIG ... cluster.address=auto``
run by Ray Jobs on the cluster's head node, in a copy of ``--working-dir`` (default: the current
directory, uploaded by Ray; the config, and an algorithm given as a file, must lie inside it).
msrl itself must be installed on the cluster's nodes, as RLlib would be. Its replicas are placed
on the cluster like any run with ``cluster.address`` set. A relative ``runs_dir`` becomes
``$HOME/msrl/<runs_dir>`` on the head node (the working-directory copy is temporary); the job's
log ends with the run directory's path.

Without ``--no-wait`` the command follows the job's log and exits with the job's outcome (0: it
succeeded; 1: it failed or was stopped); Ctrl-C stops the job and exits with 130.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import sys
import time
from typing import Any, Sequence

from msrl.config import ConfigError, load_config

__all__ = ["LaunchError", "launch", "entrypoint"]


class LaunchError(ConfigError):
    """The job cannot be submitted: no address, an unreachable cluster, files outside the
    working directory. Reported as ``msrl: error: ...`` with status 2."""


def _inside(path: pathlib.Path, root: pathlib.Path, what: str) -> str:
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        raise LaunchError(
            f"{what} {str(path)!r} is outside the working directory {str(root)!r} that is uploaded to the cluster; "
            "move it inside, or pass --working-dir"
        ) from None


def entrypoint(config: str | pathlib.Path, overrides: Sequence[str], working_dir: str | pathlib.Path) -> str:
    """The shell command Ray Jobs runs on the head node for this run.

    Args:
        config: the config file (inside ``working_dir``).
        overrides: ``key.sub=value`` overrides, passed on unchanged.
        working_dir: the directory uploaded as the job's working directory.

    Returns:
        ``python -m msrl.run.cli train <config relative to working_dir> <overrides>
        cluster.address=auto [runs_dir=...]``, shell-quoted.

    Raises:
        ConfigError: the config (with its overrides) is invalid.
        LaunchError: the config, or an algorithm given as a file, lies outside ``working_dir``;
            an override sets ``cluster.address`` (the job runs on the cluster it is sent to).
    """
    return _command(_load_for_cluster(config, overrides), config, overrides, pathlib.Path(working_dir).resolve())


def _load_for_cluster(config: str | pathlib.Path, overrides: Sequence[str]) -> Any:
    """The config as the job will load it on the cluster (``cluster.address=auto``): devices
    are the cluster's to check, not this machine's.

    Raises:
        ConfigError: the config is invalid; LaunchError: an override sets ``cluster.address``.
    """
    if any(o.split("=", 1)[0].strip() == "cluster.address" for o in overrides):
        raise LaunchError("cluster.address cannot be overridden for msrl launch: the job runs on the cluster "
                          "given by --address")
    return load_config(config, [*overrides, "cluster.address=auto"])


def _command(cfg: Any, config: str | pathlib.Path, overrides: Sequence[str], root: pathlib.Path) -> str:
    """:func:`entrypoint` for a ``cfg`` loaded by :func:`_load_for_cluster`."""
    rel_config = _inside(pathlib.Path(config), root, "config")
    name = cfg.algorithm.name
    if name.endswith(".py") or "/" in name:
        _inside(pathlib.Path(name).expanduser(), root, "algorithm file")
    args = ["python", "-m", "msrl.run.cli", "train", rel_config, *overrides, "cluster.address=auto"]
    command = " ".join(shlex.quote(a) for a in args)
    if not pathlib.PurePath(cfg.runs_dir).is_absolute():  # (the last override wins)
        command += ' runs_dir="$HOME"/msrl/' + shlex.quote(cfg.runs_dir)
    return command


def launch(config: str | pathlib.Path, overrides: Sequence[str], address: str | None,
           working_dir: str | pathlib.Path = ".", wait: bool = True, submission_id: str | None = None) -> int:
    """Submits the run as a Ray Job (see the module docstring) and, with ``wait``, follows it.

    Args:
        config, overrides: as for ``msrl train``.
        address: the Ray dashboard's address (``http://HEAD:8265``); ``None``: ``$RAY_ADDRESS``.
        working_dir: uploaded as the job's working directory.
        wait: follow the job's log until it ends.
        submission_id: the job's id (default ``msrl-<name>-<unix time>``).

    Returns:
        the exit status: 0 when the job succeeded (or was submitted, without ``wait``), 1 when it
        failed or was stopped, 130 after Ctrl-C (the job is stopped).

    Raises:
        ConfigError: an invalid config.
        LaunchError: no address, a cluster that cannot be reached, files outside ``working_dir``.
    """
    root = pathlib.Path(working_dir).resolve()
    cfg = _load_for_cluster(config, overrides)  # a config error stops here, before any submission
    command = _command(cfg, config, overrides, root)
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise LaunchError("msrl launch needs the Ray cluster's dashboard address: --address http://HEAD:8265 "
                          "(or RAY_ADDRESS)")
    try:
        from ray.job_submission import JobStatus, JobSubmissionClient
    except ImportError as e:  # pragma: no cover - ray[default] is a requirement
        raise LaunchError(f"msrl launch needs Ray's job submission client (pip install 'ray[default]'): {e}") from None
    try:
        client = JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - connection errors come in many types
        raise LaunchError(f"cannot reach the Ray cluster at {address}: {' '.join(str(e).split())}") from None
    excludes = ["__pycache__", "*.pt"]  # (Ray leaves .git out itself)
    if not pathlib.PurePath(cfg.runs_dir).is_absolute():
        excludes.append(f"/{cfg.runs_dir}/")  # earlier local runs stay here
    runtime_env: dict[str, Any] = {"working_dir": str(root), "excludes": excludes}
    job_id = _submit(client, address, command, runtime_env, submission_id or f"msrl-{cfg.name}-{int(time.time())}")
    print(f"submitted Ray job {job_id} to {address}: {command}", flush=True)
    if not wait:
        print(f"follow it with: ray job logs --follow --address {address} {job_id}")
        return 0
    try:
        _follow(client, job_id)
    except KeyboardInterrupt:
        client.stop_job(job_id)
        print(f"\nmsrl: interrupted; stopped Ray job {job_id}", flush=True)
        return 130
    status = client.get_job_status(job_id)
    while not status.is_terminal():  # the log can end a moment before the status does
        time.sleep(0.2)
        status = client.get_job_status(job_id)
    print(f"Ray job {job_id}: {status.value}")
    return 0 if status == JobStatus.SUCCEEDED else 1


#: how long a submission waits for a head whose job agent is still starting (s)
AGENT_WAIT_S = 300.0


def _submit(client: Any, address: str, command: str, runtime_env: dict[str, Any], submission_id: str) -> str:
    """Submits the job; while the head answers that its job agent is not up yet (a cluster
    that has just started, or a busy head), tries again for up to :data:`AGENT_WAIT_S`."""
    deadline, said = time.monotonic() + AGENT_WAIT_S, False
    while True:
        try:
            return client.submit_job(entrypoint=command, runtime_env=runtime_env, submission_id=submission_id)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            if not said:
                print(f"msrl: the Ray cluster at {address} has no job agent up yet; waiting for it "
                      f"(at most {AGENT_WAIT_S:.0f} s)", file=sys.stderr, flush=True)
                said = True
            time.sleep(1.0)


def _follow(client: Any, job_id: str) -> None:
    """Prints the job's log as it comes, until the job ends."""
    import asyncio

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(tail())
