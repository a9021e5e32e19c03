"""GAE against a plain-loop reference."""

import pytest
import torch

from msrl.advantages import gae


def reference_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Episode by episode, env by env, straight from the definition."""
    T, N = rewards.shape
    adv = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        for t in range(T):
            # sum over l of (gamma*lam)^l delta_{t+l}, stopping at the end of t's episode
            total, coef = 0.0, 1.0
            for u in range(t, T):
                boot = 0.0 if terminated[u, n] else float(next_values[u, n])
                delta = float(rewards[u, n]) + gamma * boot - float(values[u, n])
                total += coef * delta
                if terminated[u, n] or truncated[u, n]:
                    break
                coef *= gamma * lam
            adv[t, n] = total
    return adv


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.98, 0.8), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_plain_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    T, N = 17, 5
    rewards = torch.randn(T, N, generator=g, dtype=torch.float64)
    values = torch.randn(T, N, generator=g, dtype=torch.float64)
    next_values = torch.randn(T, N, generator=g, dtype=torch.float64)
    terminated = torch.rand(T, N, generator=g) < 0.1
    truncated = (torch.rand(T, N, generator=g) < 0.1) & ~terminated
    adv, ret = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    ref = reference_gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    torch.testing.assert_close(adv, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ret, ref + values)


def test_truncation_bootstraps_from_final_value_and_termination_does_not():
    rewards = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.0, 0.0]])
    next_values = torch.tensor([[10.0, 10.0]])
    adv, _ = gae(rewards, values, next_values, torch.tensor([[True, False]]), torch.tensor([[False, True]]), 0.5, 0.9)
    assert adv.tolist() == [[1.0, 6.0]]


def test_gae_rejects_mismatched_shapes():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="values has shape"):
        gae(x, torch.zeros(3, 3), x, x.bool(), x.bool(), 0.9, 0.9)


def test_gae_is_a_constant_of_the_loss_and_takes_empty_rollouts():
    values = torch.randn(4, 3, requires_grad=True)
    x, flags = torch.randn(4, 3), torch.zeros(4, 3, dtype=torch.bool)
    adv, ret = gae(x, values, x, flags, flags, 0.99, 0.95)
    assert not adv.requires_grad and not ret.requires_grad
    empty = torch.zeros(0, 3)
    adv, ret = gae(empty, empty, empty, empty.bool(), empty.bool(), 0.99, 0.95)
    assert adv.shape == ret.shape == (0, 3)
