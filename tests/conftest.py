"""Shared fixtures: small PPO job specs on CartPole-v1."""

import pytest
import torch

from msrl.algorithms.ppo import ALGORITHM, PPOConfig
from msrl.job import JobSpec
from msrl.policy import load_policy

torch.set_num_threads(1)


def ppo_spec(policy: str = "single", num_envs: int = 4, seed: int = 3, total: int = 10_000, **hp) -> JobSpec:
    """A small PPO job: T=16 steps, 2 epochs of 2 minibatches."""
    hparams = PPOConfig(**{"num_steps": 16, "update_epochs": 2, "num_minibatches": 2, **hp})
    return JobSpec(ALGORITHM, hparams, "CartPole-v1", num_envs, load_policy(policy), seed=seed, total_env_steps=total)


@pytest.fixture
def spec_factory():
    return ppo_spec


def pytest_sessionfinish(session, exitstatus):
    session.config._msrl_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ends the test process with the session's status once pytest has reported everything,
    without the interpreter's teardown: native threads of the libraries the suite loads (gRPC's
    pollers, Ray's core worker, OpenMP pools) can crash while Python finalises (seen twice in CI
    as a segfault after every test had passed, with no Python frame to show). Set
    MSRL_TEST_FULL_EXIT=1 to exit through the normal teardown."""
    import os
    import sys

    status = getattr(config, "_msrl_exitstatus", None)
    if status is not None and os.environ.get("MSRL_TEST_FULL_EXIT") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
