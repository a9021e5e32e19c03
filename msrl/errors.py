"""msrl's error hierarchy, in a module of its own: processes that only raise these (the Ray
replicas, the runtime, the CLI before it imports anything heavy) need not import pydantic, torch
or the config schema (:mod:`msrl.config` re-exports :class:`ConfigError`).

Every public error of msrl derives from :class:`MsrlError`; ``exit_status`` says how ``msrl``
(the command line) ends on it: :class:`InputError` (a config, an override, a name, traced code
or a partition that cannot run) is one line and status 2; a stopped run
(:class:`msrl.TrainingStopped`) one line and 1; a lost cluster
(:class:`msrl.run.outcome.ClusterLost`) one line and 3; any other (``None``: a failure inside msrl
or the user's components) raises with its traceback.
"""

from __future__ import annotations

__all__ = ["MsrlError", "InputError", "ConfigError", "PlacementError", "PartitionError"]


class MsrlError(Exception):
    """The base of every public msrl error (``except msrl.MsrlError`` catches each).

    Attributes:
        exit_status: ``msrl``'s exit status on this error, printed as one line (``None``: the
            command line raises it, traceback and all).
    """

    exit_status: int | None = None


class InputError(MsrlError):
    """Input that cannot run, found before any work: the message names the problem and what is
    valid (``msrl`` prints it as one line and exits with status 2)."""

    exit_status = 2


class ConfigError(InputError, ValueError):
    """A config, override or name that cannot run; the message says what is valid."""


class PlacementError(ConfigError):
    """The Ray cluster cannot place the job's replicas (too few CPUs/GPUs for the bundles): a
    config error (``cluster.*``, ``distribution_policy.replicas``), reported before anything is
    written. After a replica's death (:func:`msrl.run.training.train`'s restart) it means the cluster did
    not hold the replicas again within ``cluster.capacity_timeout_s``: the run stops with its
    checkpoint kept (:class:`msrl.TrainingStopped`)."""


class PartitionError(InputError, ValueError):
    """A graph that a distribution policy cannot split exactly: the message names the node or
    edge (``file:line``) and, where it helps, the replica counts."""
