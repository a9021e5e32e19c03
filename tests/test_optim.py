"""msrl's TensorFlow-style RMSProp (:class:`msrl.rl.optim.RMSpropTF`) against Stable Baselines3's
``RMSpropTFLike`` (the reference), with a Python and a tensor learning rate, and its state through a
checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
from stable_baselines3.common.sb2_compat.rmsprop_tf_like import RMSpropTFLike

from msrl.rl.optim import RMSpropTF
from msrl.rl.schedules import learning_rate_tensor

SHAPES = [(32, 4, 8, 8), (32,), (6, 512), (1,)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _run(optimizer, params, steps=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("eps", [1e-5, 0.01])
def test_steps_equal_stable_baselines3s_rmsprop_tf_like_bitwise(eps):
    ours, ref = _params(), _params()
    got = _run(RMSpropTF(ours, lr=7e-4, alpha=0.99, eps=eps), ours)
    want = _run(RMSpropTFLike(ref, lr=7e-4, alpha=0.99, eps=eps), ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # and not torch's RMSprop, whose steps are ~lr * sign(g) here
    other = _params()
    torch_rms = _run(torch.optim.RMSprop(other, lr=7e-4, alpha=0.99, eps=eps), other)
    assert not any(torch.allclose(a, b) for a, b in zip(got, torch_rms))


def test_a_tensor_learning_rate_steps_as_the_float_and_a_schedule_moves_it():
    ours, ref = _params(), _params()
    lr = learning_rate_tensor(7e-4, torch.device("cpu"))
    opt = RMSpropTF(ours, lr=lr, eps=1e-5)
    got = _run(opt, ours)
    want = _run(RMSpropTFLike(ref, lr=7e-4, alpha=0.99, eps=1e-5), ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    lr.fill_(0.0)  # the group reads the tensor at each step: a rate of 0 leaves the weights
    before = [p.detach().clone() for p in ours]
    _run(opt, ours, steps=1)
    assert all(torch.equal(a, p) for a, p in zip(before, ours))


def test_the_mean_squares_survive_a_checkpoint():
    a, b = _params(), _params()
    opt_a = RMSpropTF(a, lr=1e-3, eps=1e-5)
    _run(opt_a, a, steps=3)
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    opt_b = RMSpropTF(b, lr=1e-3, eps=1e-5)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    assert all(torch.equal(x, y) for x, y in zip(_run(opt_a, a, seed=5), _run(opt_b, b, seed=5)))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lr must be >= 0"):
        RMSpropTF(_params(), lr=-1.0)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\)"):
        RMSpropTF(_params(), alpha=1.0)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        RMSpropTF(_params(), eps=-1e-5)
