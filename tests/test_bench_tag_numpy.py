"""The benchmark's NumPy Tag and msrl's torch reference: two implementations of the spec agree."""

import pathlib
import sys

import numpy as np
import pytest
import torch

from msrl.envs.native.tag import Tag

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from tag_numpy import NumpyTag  # noqa: E402


@pytest.mark.parametrize("full", [True, False])
def test_numpy_peer_and_torch_reference_agree_step_by_step(full):
    params = dict(num_taggers=3, num_runners=9, tagging_distance=0.12, use_full_observation=full, num_other_agents_observed=4)
    ref = Tag(1, impl="torch", **params)
    ref.reset(seed=5)
    peer = NumpyTag(ref.params, seed=0)
    rng = np.random.default_rng(1)
    tags = 0
    for _ in range(150):
        for name in ("x", "y", "dir", "speed", "acc", "in_game"):
            setattr(peer, name, getattr(ref, name)[0].numpy().copy())
        peer.type = ref.agent_type[0].numpy().copy()
        peer.t, peer.runners_left = int(ref.t[0]), int(ref.runners_left[0])
        act = rng.integers(0, 11, (ref.num_agents, 2))
        obs, reward, done = peer.step(act)
        o, r, term, _, info = ref.step(torch.as_tensor(act)[None])
        np.testing.assert_allclose(obs, info["final_obs"][0].numpy(), atol=1e-5)
        np.testing.assert_array_equal(reward, r[0].numpy())
        assert done == bool(term[0])
        tags += int((r[0] < 0).sum())
    assert tags > 5
