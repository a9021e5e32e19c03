"""bench/bench_dreamerv3.py: RLlib's gate read from an msrl run's metrics, and what it refuses
before training anything."""

import csv
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_dreamerv3  # noqa: E402


def _metrics(run_dir: pathlib.Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    keys = ["iteration", "env_steps", "charts/episodic_return", "eval/mean_return"]
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for i, r in enumerate(rows):
            w.writerow({"iteration": i, **r})


def test_the_gate_is_the_mean_of_the_last_window_of_training_episodes(tmp_path):
    """The mean of the last ``window`` finished episodes at the run's end, and the first env step
    at which a full window's mean reached the threshold; rows without an episode are skipped."""
    returns = [10.0, 20.0, 30.0, 40.0, 50.0]
    _metrics(tmp_path, [{"env_steps": 100 * (i + 1), "charts/episodic_return": r} for i, r in enumerate(returns)]
             + [{"env_steps": 600, "charts/episodic_return": "nan", "eval/mean_return": 55.0}])
    g = bench_dreamerv3.run_gate(str(tmp_path), threshold=25.0, window=3)
    assert g == {"episodes": 5, "env_steps": 600, "mean": 40.0, "reached": 400, "evals": [(600, 55.0)]}
    assert bench_dreamerv3.run_gate(str(tmp_path), threshold=45.0, window=3)["reached"] is None
    _metrics(tmp_path / "none", [{"env_steps": 10, "charts/episodic_return": ""}])
    with pytest.raises(ValueError, match="no training episode finished"):
        bench_dreamerv3.run_gate(str(tmp_path / "none"), 1.0)


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda:0", "--rllib-python", "python"], "--device cuda:0 places msrl's side only"),
    (["--runs", "does/not/exist"], "--runs: .*metrics.csv"),
])
def test_a_bad_choice_is_refused_before_any_training(monkeypatch, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_dreamerv3.py", *argv])
    with pytest.raises(SystemExit, match=message):
        bench_dreamerv3.main()
