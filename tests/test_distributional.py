"""C51's projection (msrl.rl.distributional) against Algorithm 1 of Bellemare et al. 2017 written
as its loops, and the properties a projection must have."""

import math

import pytest
import torch

from msrl.rl.distributional import categorical_projection, categorical_support


def _algorithm_1(next_pmf, reward, not_done, gamma, v_min, v_max, n_atoms):
    """The paper's Algorithm 1, one sample and one atom at a time."""
    dz = (v_max - v_min) / (n_atoms - 1)
    z = [v_min + i * dz for i in range(n_atoms)]
    m = [0.0] * n_atoms
    for j in range(n_atoms):
        tz = min(max(reward + gamma * not_done * z[j], v_min), v_max)
        b = (tz - v_min) / dz
        lo, up = math.floor(b), math.ceil(b)
        if lo == up:
            m[lo] += next_pmf[j]
        else:
            m[lo] += next_pmf[j] * (up - b)
            m[up] += next_pmf[j] * (b - lo)
    return m


def test_the_projection_is_algorithm_1_and_keeps_the_mass():
    g = torch.Generator().manual_seed(0)
    support = categorical_support(-10.0, 10.0, 21)
    pmfs = torch.softmax(torch.randn(64, 21, generator=g), -1)
    rewards = torch.randn(64, generator=g) * 5
    not_done = (torch.rand(64, generator=g) > 0.2).float()
    out = categorical_projection(pmfs, rewards, not_done, 0.9, support)
    assert torch.allclose(out.sum(-1), torch.ones(64), atol=1e-5)
    for i in range(64):
        ref = _algorithm_1(pmfs[i].tolist(), float(rewards[i]), float(not_done[i]), 0.9, -10.0, 10.0, 21)
        assert torch.allclose(out[i], torch.tensor(ref), atol=1e-5), i


def test_a_terminal_transition_puts_the_reward_on_its_atoms():
    support = categorical_support(-2.0, 2.0, 5)  # atoms -2, -1, 0, 1, 2
    pmf = torch.full((2, 5), 0.2)
    out = categorical_projection(pmf, torch.tensor([1.0, 0.5]), torch.zeros(2), 0.99, support)
    assert out[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]  # exactly on an atom: all of it there
    assert torch.allclose(out[1], torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0]))  # halfway: split


def test_the_support_refuses_what_is_not_one():
    with pytest.raises(ValueError, match="at least 2 atoms"):
        categorical_support(0.0, 1.0, 1)
    with pytest.raises(ValueError, match="v_min < v_max"):
        categorical_support(1.0, 1.0, 11)
