"""Native Tag: the rules of shared/specs/tag_continuous.md, host kernel vs torch reference."""

import math
import pathlib

import pytest
import torch

from msrl.envs.native.check import check_tag
from msrl.envs.native.tag import Tag

IMPLS = ["kernel", "torch"]


@pytest.mark.parametrize("full", [True, False])
def test_kernel_matches_torch_reference_step_by_step(full):
    params = dict(num_taggers=3, num_runners=8, tagging_distance=0.15, use_full_observation=full, num_other_agents_observed=4)
    r = check_tag(num_envs=6, steps=250, seed=3, **params)
    assert r.ok, r
    assert r.episodes > 6  # games end (time up or every runner tagged)


def _place(env, xs, ys, types):
    env.x[0] = torch.tensor(xs)
    env.y[0] = torch.tensor(ys)
    env.agent_type[0] = torch.tensor(types)
    env.tagger_ids[0] = torch.tensor([i for i, t in enumerate(types) if t == 1.0], dtype=torch.int32)
    env.speed.zero_(), env.acc.zero_(), env.dir.zero_()
    env.in_game.fill_(1.0)
    env.runners_left[0] = int(sum(1 for t in types if t == 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_tags_reward_taggers_once_per_runner_and_runners_leave(impl):
    env = Tag(1, impl=impl, num_taggers=2, num_runners=3, tagging_distance=0.05, grid_length=10.0)
    env.reset(seed=0)
    # tagger 0 at (5, 5) with runners 1 and 2 within 0.5; runner 3 near tagger 4 but farther than 0.5
    _place(env, [5.0, 5.2, 4.8, 8.0, 8.7], [5.0, 5.0, 5.1, 8.0, 8.0], [1.0, 0.0, 0.0, 0.0, 1.0])
    obs, reward, terminated, _, info = env.step(torch.zeros(1, 5, 2, dtype=torch.int64))
    assert reward[0].tolist() == [2.0, -1.0, -1.0, 0.0, 0.0]  # both tags summed on tagger 0 (atomics)
    assert env.in_game[0].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert int(env.runners_left[0]) == 1 and not bool(terminated[0])
    # the observation was taken before the tags: the tagged runners still show as in the game
    assert info["final_obs"][0, 0, 6 * 4 : 7 * 4].tolist() == [1.0, 1.0, 1.0, 1.0]
    # tagging the last runner ends the game, and the next game starts at once
    env.x[0, 3], env.y[0, 3] = 8.65, 8.0
    obs, reward, terminated, _, _ = env.step(torch.zeros(1, 5, 2, dtype=torch.int64))
    assert reward[0, 3] == -1.0 and reward[0, 4] == 1.0 and bool(terminated[0])
    assert int(env.runners_left[0]) == 3 and int(env.t[0]) == 0 and env.in_game.all()


@pytest.mark.parametrize("impl", IMPLS)
def test_end_of_game_bonus_and_time_limit(impl):
    env = Tag(2, impl=impl, num_taggers=1, num_runners=2, episode_length=3, end_of_game_reward_for_runner=1.0)
    env.reset(seed=1)
    types = env.agent_type.clone()
    for _step in range(3):
        obs, reward, terminated, truncated, info = env.step(torch.zeros(2, 3, 2, dtype=torch.int64))
    assert terminated.tolist() == [True, True] and truncated.tolist() == [False, False]
    runners = info["final_agent_type"] == 0.0
    assert torch.equal(info["final_agent_type"], types)
    assert torch.equal(info["agent_type"], env.agent_types())  # the new games' types
    assert (reward[runners] == 1.0).all() and (reward[~runners] == 0.0).all()
    stats = env.pop_episode_stats()
    assert stats.lengths == [3, 3] and env.last_type_returns["runner"] == [1.0, 1.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_dynamics_tables_speed_limit_and_edges(impl):
    env = Tag(1, impl=impl, num_taggers=1, num_runners=1, edge_hit_penalty=-0.5, grid_length=10.0, max_speed=1.0,
              skill_level_runner=0.5)
    env.reset(seed=2)
    _place(env, [9.5, 1.0], [5.0, 5.0], [1.0, 0.0])
    # acceleration index 10 = +1.0 (the table is [0] + linspace(-1, 1, 10)); no turn
    obs, reward, *_ = env.step(torch.tensor([[[10, 0], [10, 0]]]))
    assert env.acc_table.tolist()[0] == 0.0 and env.acc_table[10].item() == 1.0
    # tagger: speed 1 (its max) -> acc reset to 0; moves to x = 10.5 -> clipped to 10, edge penalty
    assert env.speed[0].tolist() == [1.0, 0.5] and env.acc[0].tolist() == [0.0, 0.0]
    assert env.x[0].tolist() == [10.0, 1.5] and reward[0].tolist() == [-0.5, 0.0]
    # turn index 10 = +pi/2: heading wraps into [0, 2 pi)
    env.dir[0] = torch.tensor([6.0, 0.0])
    env.step(torch.tensor([[[0, 10], [0, 0]]]))
    assert env.dir[0, 0].item() == pytest.approx(6.0 + math.pi / 2 - 2 * math.pi, abs=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_observation_layout(impl):
    env = Tag(1, impl=impl, num_taggers=1, num_runners=2, grid_length=10.0)
    obs = env.reset(seed=3)
    assert obs.shape == (1, 3, 7 * 2 + 1)
    _place(env, [1.0, 2.0, 4.0], [1.0, 1.0, 5.0], [0.0, 1.0, 0.0])
    obs, *_ = env.step(torch.zeros(1, 3, 2, dtype=torch.int64))
    o = obs[0, 0]  # agent 0 sees agents 1 and 2, feature-major
    s = math.sqrt(2) * 10
    torch.testing.assert_close(o[0:2], torch.tensor([1.0 / s, 3.0 / s]))  # dx
    torch.testing.assert_close(o[2:4], torch.tensor([0.0, 4.0 / s]))  # dy
    assert o[10:12].tolist() == [1.0, 0.0] and o[12:14].tolist() == [1.0, 1.0]  # type, in_game
    assert o[14].item() == pytest.approx(1 / 100)  # t / T
    partial = Tag(1, impl=impl, num_taggers=1, num_runners=3, use_full_observation=False, num_other_agents_observed=2)
    assert partial.reset(seed=0).abs().sum() == 0  # all zeros at t = 0
    _place(partial, [0.0, 3.0, 1.0, 9.0], [0.0, 0.0, 0.0, 9.0], [1.0, 0.0, 0.0, 0.0])
    o, *_ = partial.step(torch.zeros(1, 4, 2, dtype=torch.int64))
    p0 = o[0, 0]  # nearest first: agent 2 (d=1), then agent 1 (d=3)
    torch.testing.assert_close(p0[0:2], torch.tensor([1.0, 3.0]) / (math.sqrt(2) * 10))


def test_tag_parameters_are_checked():
    with pytest.raises(TypeError, match="unknown Tag parameters \\['num_tagger'\\]"):
        Tag(1, num_tagger=3)
    with pytest.raises(ValueError, match="num_other_agents_observed must lie in"):
        Tag(1, use_full_observation=False, num_other_agents_observed=50)


def test_spatial_grid_search_is_exact():
    """Many agents and partial observations switch the kernel to the spatial grid; it must find
    exactly the nearest agents the reference finds (ties by id included)."""
    params = dict(num_taggers=5, num_runners=100, use_full_observation=False, num_other_agents_observed=10,
                  grid_length=20.0, tagging_distance=0.02)
    assert Tag(40, **params).grid_cells > 0 and Tag(1, **params).grid_cells == 0
    r = check_tag(num_envs=40, steps=60, seed=7, **params)
    assert r.ok, r


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("full", [True, False])
def test_gpu_kernels_match_the_host_build_step_by_step(full):
    params = dict(num_taggers=5, num_runners=100, use_full_observation=full, num_other_agents_observed=10,
                  grid_length=20.0, tagging_distance=0.02)
    host, gpu = Tag(40, impl="kernel", **params), Tag(40, device="cuda", impl="kernel", **params)
    host.reset(seed=1)
    gpu.reset(seed=1)
    assert torch.equal(host.agent_type, gpu.agent_type.cpu()) and torch.equal(host.x, gpu.x.cpu())
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        gpu.load_state_dict(host.state_dict())
        act = torch.randint(0, 11, (40, 105, 2), generator=g)
        h, d = host.step(act), gpu.step(act.cuda())
        torch.testing.assert_close(h[4]["final_obs"], d[4]["final_obs"].cpu(), rtol=0, atol=1e-5)
        assert torch.equal(h[1], d[1].cpu()) and torch.equal(h[2], d[2].cpu())


def _thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding the middle of ``t`` may use transparent huge pages
    (/proc/self/smaps)."""
    ptr, current = t.data_ptr() + t.nbytes // 2, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                current = lo <= ptr < hi
            elif current and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError("tensor's mapping not found")


def test_large_step_outputs_ask_for_huge_pages():
    """Large CPU outputs are advised MADV_HUGEPAGE before the kernels fill them; where THP is
    in ``madvise`` mode, a plain allocation of the same size is not eligible."""
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off here")
    from msrl.envs.native.base import HUGE_PAGE_MIN_BYTES, empty_output

    big = empty_output(HUGE_PAGE_MIN_BYTES // 4 + 1024, dtype=torch.float32, device=torch.device("cpu"))
    assert _thp_eligible(big)
    if "[madvise]" in thp.read_text():
        assert not _thp_eligible(torch.empty(HUGE_PAGE_MIN_BYTES // 4 + 1024))
