"""Shared fixtures: small PPO job specs on CartPole-v1; the stress option (``MSRL_TEST_STRESS``)."""

import os

# one OpenMP thread in every test process, set before torch loads OpenMP: the bitwise tests compare
# a run in this process with the same run in a replica (a thread or a Ray process that sets its own
# count), and on some CPUs a kernel's result depends on its thread count (CQL's critic values
# differed in the last bits between single and coarse x1 with the machine's default count)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from msrl.algorithms.ppo import ALGORITHM, PPOConfig
from msrl.policy import load_policy
from msrl.run.job import JobSpec

torch.set_num_threads(1)

# every Ray the suite starts (ray.init, `ray start`, msrl's own) waits up to 3 min for its GCS: Ray's
# default 30 s has run out on a busy CI machine with nothing wrong (a setup error, not a failure)
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")


def ppo_spec(policy: str = "single", num_envs: int = 4, seed: int = 3, total: int = 10_000, **hp) -> JobSpec:
    """A small PPO job: T=16 steps, 2 epochs of 2 minibatches."""
    hparams = PPOConfig(**{"num_steps": 16, "update_epochs": 2, "num_minibatches": 2, **hp})
    return JobSpec(ALGORITHM, hparams, "CartPole-v1", num_envs, load_policy(policy), seed=seed, total_env_steps=total)


@pytest.fixture
def spec_factory():
    return ppo_spec


@pytest.fixture(autouse=True)
def _background_plots_end():
    """Every learning curve a test's run started drawing (:func:`msrl.run.plot.plot_in_background`)
    is drawn before the next test: no process of a test outlives it."""
    yield
    from msrl.run.plot import wait_for_background_plots

    wait_for_background_plots(timeout_s=900)


def pytest_sessionfinish(session, exitstatus):
    session.config._msrl_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ends the test process with the session's status once pytest has reported everything,
    without the interpreter's teardown: native threads of the libraries the suite loads (gRPC's
    pollers, Ray's core worker, OpenMP pools) can crash while Python finalises (seen twice in CI
    as a segfault after every test had passed, with no Python frame to show). Set
    MSRL_TEST_FULL_EXIT=1 to exit through the normal teardown. The stress processes stop first."""
    import sys

    _stop_stress(getattr(config, "_msrl_stress", []))
    status = getattr(config, "_msrl_exitstatus", None)
    if status is not None and os.environ.get("MSRL_TEST_FULL_EXIT") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# -- stress: MSRL_TEST_STRESS=N keeps N busy processes per core running beside the suite, so that
#    a test that depends on how fast the machine is fails here rather than on a user's busy machine.
#    The busy processes are this session's own, stopped by pid when the session ends, and each
#    ends by itself when its parent (this pytest) is gone, even after a SIGKILL.

_BUSY = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


def _start_stress(per_core: int) -> list:
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [subprocess.Popen([sys.executable, "-c", _BUSY, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(per_core * cores)]


def _stop_stress(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a busy process that does not die is left to its parent check
            pass


def pytest_configure(config):
    raw = os.environ.get("MSRL_TEST_STRESS", "").strip()
    if not raw or hasattr(config, "workerinput"):  # the busy processes are the controller's (pytest-xdist)
        return
    try:
        per_core = int(raw)
    except ValueError:
        raise pytest.UsageError(f"MSRL_TEST_STRESS={raw!r}: expected a whole number of busy processes per core "
                                "(e.g. MSRL_TEST_STRESS=2)") from None
    if per_core < 0:
        raise pytest.UsageError(f"MSRL_TEST_STRESS={per_core}: expected 0 or more busy processes per core")
    config._msrl_stress = _start_stress(per_core)


def pytest_report_header(config):
    procs = getattr(config, "_msrl_stress", None)
    if procs:
        return f"msrl: stress on, {len(procs)} busy processes beside the suite (MSRL_TEST_STRESS)"
    return None
