"""``msrl collect``: a run's episodes written as a Minari dataset that Minari's own loader reads
back, reproducible from its seed, with exploration noise within the action space; bad input is
one line before any episode runs, and nothing is written."""

import json
import pathlib

import numpy as np
import pytest

import msrl
from msrl.run.cli import main
from msrl.run.collect import CollectError, collect

minari = pytest.importorskip("minari")

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short runs: PG on CartPole (Discrete actions), DDPG on Pendulum (Box)."""
    base = tmp_path_factory.mktemp("runs")
    pg = msrl.train(CONFIGS / "pg_cartpole.yaml", runs_dir=str(base), train__total_env_steps=4000, env__num_envs=2,
                    algorithm__hparams__num_steps=500, train__progress=False, train__eval_every=0, eval__episodes=1)
    ddpg = msrl.train(CONFIGS / "ddpg_pendulum.yaml", runs_dir=str(base), train__total_env_steps=300,
                      algorithm__hparams__learning_starts=100, train__progress=False, train__eval_every=0,
                      eval__episodes=1)
    return {"pg": pg.run_dir, "ddpg": ddpg.run_dir}


def _load(root, dataset_id):
    return minari.MinariDataset(pathlib.Path(root) / dataset_id / "data")


def test_collect_writes_a_dataset_minaris_loader_reads_back(runs, tmp_path, capsys, monkeypatch):
    assert main(["collect", str(runs["pg"]), "--episodes", "3", "--noise", "0.2", "-o", "msrl/cartpole/test-v0",
                 "--root", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"dataset_id": "msrl/cartpole/test-v0", "path": str(tmp_path / "msrl/cartpole/test-v0"), "episodes": 3}
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    ds = minari.load_dataset("msrl/cartpole/test-v0")  # by id, under the root, as Minari's users load
    assert ds.total_episodes == 3
    assert ds.observation_space == msrl.load(runs["pg"]).observation_space and ds.action_space.n == 2
    steps = 0
    for ep in ds.iterate_episodes():
        T = len(ep.actions)
        steps += T
        assert ep.observations.shape == (T + 1, 4) and ep.rewards.shape == (T,)
        assert bool(ep.terminations[-1] or ep.truncations[-1]) and not (ep.terminations[:-1] | ep.truncations[:-1]).any()
        assert set(np.unique(ep.actions)) <= {0, 1}
    assert steps == ds.total_steps
    meta = ds.storage.metadata
    assert meta["algorithm_name"] == "msrl/pg" and "noise 0.2" in meta["description"]


def test_the_same_seed_writes_the_same_episodes_and_noise_changes_them(runs, tmp_path):
    a = _load(tmp_path, collect([runs["pg"]], "a-v0", 2, noise=0.3, seed=5, root=tmp_path).name)
    b = _load(tmp_path, collect([runs["pg"]], "b-v0", 2, noise=0.3, seed=5, root=tmp_path).name)
    greedy = _load(tmp_path, collect([runs["pg"]], "c-v0", 2, noise=0.0, seed=5, root=tmp_path).name)
    for x, y in zip(a.iterate_episodes(), b.iterate_episodes()):
        assert np.array_equal(x.observations, y.observations) and np.array_equal(x.actions, y.actions)
    assert any(not np.array_equal(x.actions, y.actions) or len(x.actions) != len(y.actions)
               for x, y in zip(a.iterate_episodes(), greedy.iterate_episodes()))


def test_box_actions_with_noise_stay_within_the_bounds_and_runs_mix(runs, tmp_path):
    path = collect([runs["ddpg"], runs["ddpg"]], "msrl/pendulum/mixed-v0", 3, noise=1.0, seed=0, root=tmp_path)
    ds = _load(tmp_path, "msrl/pendulum/mixed-v0")
    assert path == tmp_path / "msrl/pendulum/mixed-v0" and ds.total_episodes == 3
    actions = np.concatenate([ep.actions for ep in ds.iterate_episodes()])
    assert actions.shape == (600, 1) and actions.min() >= -2.0 and actions.max() <= 2.0
    assert actions.std() > 0.3  # the noise, at the half-range's scale
    assert "2 episodes of" in ds.storage.metadata["description"] and "1 episodes of" in ds.storage.metadata["description"]


@pytest.mark.parametrize("args, message", [
    (dict(dataset_id="x-v0", episodes=0), "episodes must be at least 1, got 0"),
    (dict(dataset_id="x-v0", episodes=1, noise=1.5), r"noise must be in \[0, 1\]"),
    (dict(dataset_id="bad id-v0", episodes=1), "dataset id 'bad id-v0' is not Minari's"),
    (dict(dataset_id="msrl/cartpole", episodes=1), r"dataset id 'msrl/cartpole' is not Minari's .*name-vN"),
])
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, args, message):
    with pytest.raises(CollectError, match=message):
        collect([runs["pg"]], root=tmp_path, **args)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_dataset_is_never_overwritten(runs, tmp_path, capsys):
    collect([runs["pg"]], "keep-v0", 1, root=tmp_path)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "keep-v0").rglob("*"))
    assert main(["collect", str(runs["pg"]), "--episodes", "1", "-o", "keep-v0", "--root", str(tmp_path)]) == 2
    assert "dataset keep-v0 exists at" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "keep-v0").rglob("*")) == before


def test_runs_of_different_envs_do_not_mix(runs, tmp_path):
    with pytest.raises(CollectError, match="the runs train on different envs"):
        collect([runs["pg"], runs["ddpg"]], "mix-v0", 2, root=tmp_path)


def test_a_directory_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["collect", str(tmp_path), "--episodes", "1", "-o", "x-v0", "--root", str(tmp_path / "root")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msrl: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "root").exists()
