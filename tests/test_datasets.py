"""Offline datasets (msrl.rl.datasets): a Minari dataset msrl collect wrote, opened by id and by
path, turned into transitions that match its episodes row for row, sharded without loss; a
missing, damaged or mismatched dataset is one clear error."""

import pathlib

import gymnasium
import numpy as np
import pytest
import torch

import msrl
from msrl.rl.datasets import DatasetError, DatasetSource, check_spaces, open_dataset, shard, transitions
from msrl.run.collect import collect

minari = pytest.importorskip("minari")

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("datasets")
    run = msrl.train(CONFIGS / "pg_cartpole.yaml", runs_dir=str(base / "runs"), train__total_env_steps=4000,
                     env__num_envs=2, train__progress=False, train__eval_every=0, eval__episodes=1)
    collect([run.run_dir], "msrl/cartpole/tiny-v0", 3, noise=0.5, seed=0, root=base / "root")
    return base / "root"


def test_open_by_id_and_by_path_give_the_same_transitions(root):
    by_id = open_dataset(DatasetSource(id="msrl/cartpole/tiny-v0", root=str(root)))
    by_path = open_dataset(DatasetSource(path=str(root / "msrl/cartpole/tiny-v0")))
    a, b = transitions(by_id, "id"), transitions(by_path, "path")
    assert a.batch_size == b.batch_size == (by_id.total_steps,)
    assert all(torch.equal(a[k], b[k]) for k in a.keys())


def test_transitions_are_the_episodes_row_for_row(root):
    ds = open_dataset(DatasetSource(id="msrl/cartpole/tiny-v0", root=str(root)))
    rows = transitions(ds, "tiny")
    assert rows["obs"].dtype == torch.float32 and rows["action"].dtype == torch.int64 and rows["terminated"].dtype == torch.bool
    i = 0
    for ep in ds.iterate_episodes():
        T = len(ep.actions)
        assert np.array_equal(rows["obs"][i:i + T].numpy(), ep.observations[:-1])
        assert np.array_equal(rows["next_obs"][i:i + T].numpy(), ep.observations[1:])
        assert np.array_equal(rows["action"][i:i + T].numpy(), ep.actions)
        assert np.array_equal(rows["reward"][i:i + T].numpy(), ep.rewards.astype(np.float32))
        # each episode ends on its last row, and only there
        done = (rows["terminated"] | rows["truncated"])[i:i + T]
        assert bool(done[-1]) and not bool(done[:-1].any())
        i += T
    assert i == rows.batch_size[0]


def test_shards_hold_every_row_once(root):
    rows = transitions(open_dataset(DatasetSource(id="msrl/cartpole/tiny-v0", root=str(root))), "tiny")
    parts = [shard(rows, r, 3) for r in range(3)]
    assert sum(p.batch_size[0] for p in parts) == rows.batch_size[0]
    assert max(p.batch_size[0] for p in parts) - min(p.batch_size[0] for p in parts) <= 1
    back = torch.empty_like(rows["reward"])
    for r, p in enumerate(parts):
        back[r::3] = p["reward"]
    assert torch.equal(back, rows["reward"])
    with pytest.raises(ValueError, match="replica 3 of 3"):
        shard(rows, 3, 3)


def test_spaces_of_another_env_are_refused(root):
    ds = open_dataset(DatasetSource(id="msrl/cartpole/tiny-v0", root=str(root)))
    env = gymnasium.make("CartPole-v1")
    check_spaces(ds, env.observation_space, env.action_space, "msrl/cartpole/tiny-v0")
    other = gymnasium.make("Acrobot-v1")
    with pytest.raises(DatasetError, match=r"its observation space is Box.*\(4,\).*the env's is Box.*\(6,\)"):
        check_spaces(ds, other.observation_space, other.action_space, "msrl/cartpole/tiny-v0")


def test_a_missing_dataset_says_where_it_looked_and_what_to_do(tmp_path):
    with pytest.raises(DatasetError, match=rf"dataset msrl/none-v0 not found under {tmp_path}.*msrl collect.*download"):
        open_dataset(DatasetSource(id="msrl/none-v0", root=str(tmp_path)))
    with pytest.raises(DatasetError, match="no such directory"):
        open_dataset(DatasetSource(path=str(tmp_path / "nope")))
    with pytest.raises(DatasetError, match="exactly one"):
        DatasetSource(id="a-v0", path="b")


def test_a_damaged_dataset_is_one_line_naming_it(root, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(root / "msrl/cartpole/tiny-v0", copy)
    data = next(p for p in (copy / "data").iterdir() if p.suffix in (".hdf5", ".h5"))
    data.write_bytes(data.read_bytes()[:200])  # truncated
    with pytest.raises(DatasetError, match=rf"dataset path {copy}: damaged or not a Minari dataset") as e:
        source = DatasetSource(path=str(copy))
        transitions(open_dataset(source), source.describe())
    assert "\n" not in str(e.value)
