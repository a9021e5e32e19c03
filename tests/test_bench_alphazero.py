"""bench/bench_alphazero.py's choice of what to play: the kept policies in a range of env steps,
and the opponents a game has."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_alphazero  # noqa: E402


def _keep(run_dir: pathlib.Path, steps: list[int]) -> None:
    weights = run_dir / "checkpoints" / "weights"
    weights.mkdir(parents=True)
    for s in steps:
        (weights / f"{s}.pt").write_bytes(b"")


def test_kept_weights_are_the_range_oldest_first(tmp_path):
    _keep(tmp_path, [983040, 20480, 901120, 999936, 921600])
    names = lambda paths: [pathlib.Path(p).stem for p in paths]  # noqa: E731
    assert names(bench_alphazero.kept_weights(str(tmp_path), 900000)) == ["901120", "921600", "983040", "999936"]
    assert names(bench_alphazero.kept_weights(str(tmp_path), 900000, 921600)) == ["901120", "921600"]
    with pytest.raises(SystemExit, match="no weights kept from 930000 env steps to 950000"):
        bench_alphazero.kept_weights(str(tmp_path), 930000, 950000)


@pytest.mark.parametrize("argv, message", [
    (["play", "connect_four", "--runs", "r", "--opponents", "solver"],
     "--opponents: solver not an opponent of connect_four \\(its opponents: mcts, random\\)"),
    (["play", "connect_four", "--runs", "r", "--kept-to", "5"], "--kept-to bounds --kept-from's range"),
    (["search", "connect_four", "--device", "cuda"], "--dtype and --device are where and how --tower evaluates"),
    (["search", "connect_four", "--tower", "8x1", "--device", "gpu"], "--device gpu: Expected one of cpu, cuda"),
])
def test_a_bad_choice_is_refused_before_any_game(monkeypatch, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_alphazero.py", *argv])
    with pytest.raises(SystemExit, match=message):
        bench_alphazero.main()


def test_match_seed_seeds_the_first_game_and_defaults_to_the_runs(tmp_path, monkeypatch):
    """``--match-seed``: the seed of game 0 of every match (10000 + the run's seed without it),
    so one policy's games split over processes play disjoint games."""
    import msrl
    from msrl.algorithms import alphazero
    from msrl.config import load_config

    run = msrl.train(load_config("configs/alphazero_tictactoe.yaml", [
        f"runs_dir={tmp_path}", "seed=3", "train.total_env_steps=20", "algorithm.hparams.num_simulations=2",
        "algorithm.hparams.plies_per_iteration=5", "algorithm.hparams.hidden_sizes=[8]",
        "algorithm.hparams.eval_interval=0", "env.num_envs=4", "train.progress=false", "eval.episodes=1"]))
    seeds = []
    monkeypatch.setattr(alphazero, "play_match",
                        lambda net, game, opponent, hp, games, seed, num_simulations=None:
                        seeds.append(seed) or {"win": 1.0, "draw": 0.0, "loss": 0.0})
    default = bench_alphazero.play("tic_tac_toe", str(run.run_dir), None, 2, None, opponents=("random",))
    given = bench_alphazero.play("tic_tac_toe", str(run.run_dir), None, 2, None, opponents=("random",),
                                 match_seed=20_000)
    assert seeds == [10_003, 20_000] and (default["match_seed"], given["match_seed"]) == (10_003, 20_000)


def test_search_time_with_a_tower_on_a_device_evaluates_there_and_counts_every_leaf(monkeypatch):
    """``search --tower CxB --device D --dtype T``: every simulation's leaves, one per game, go
    through the tower's evaluation (``infer``) on ``D`` in ``T``, and the median time a leaf is
    positive. Only ``D`` = cpu runs here: that the leaves land on another device is checked by
    bench/gpu_check.sh's ALGOS parts on a GPU, not by this test."""
    from msrl.algorithms import alphazero

    seen = []
    real = alphazero.infer
    monkeypatch.setattr(alphazero, "infer", lambda net, obs, dtype: seen.append((obs.device.type, obs.shape)) or
                        real(net, obs, dtype))
    us = bench_alphazero.search_time("tic_tac_toe", 3, 4, 2, tower="8x1", dtype="bfloat16", device="cpu")
    assert us > 0 and len(seen) == 2 * 4 and all(d == "cpu" and s[0] == 3 for d, s in seen)
