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
])
def test_a_bad_choice_is_refused_before_any_game(monkeypatch, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_alphazero.py", *argv])
    with pytest.raises(SystemExit, match=message):
        bench_alphazero.main()
