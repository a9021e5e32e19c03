"""bench/time_breakdown.py: a run's training time split into steady iterations and the rest."""

import csv
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from time_breakdown import breakdown  # noqa: E402


def _metrics(run_dir: pathlib.Path, times: list[float]) -> None:
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["iteration", "env_steps", "time_s"])
        w.writeheader()
        w.writerows({"iteration": i + 1, "env_steps": 256 * (i + 1), "time_s": t} for i, t in enumerate(times))


def test_a_slow_start_is_the_rest_and_the_steady_part_is_the_median(tmp_path):
    # 0.5 s first iteration (a start-up), then 99 iterations of 2 ms, with one 50 ms chunk end
    dts = [0.5] + [0.002] * 99
    dts[60] = 0.05
    times, t = [], 0.0
    for d in dts:
        t += d
        times.append(t)
    _metrics(tmp_path, times)
    b = breakdown(tmp_path)
    assert b["iterations"] == 100 and b["steady_ms_per_iteration"] == pytest.approx(2.0)
    assert b["training_s"] == pytest.approx(sum(dts), abs=1e-4)
    assert b["rest_s"] == pytest.approx(sum(dts) - 0.2, abs=1e-4)  # 0.498 start-up + 0.048 chunk end
    assert b["first_iterations_ms"][:2] == [500.0, 2.0]


def test_too_few_rows_or_no_metrics_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        breakdown(tmp_path)
    _metrics(tmp_path, [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="has 3 rows; at least 4 are needed"):
        breakdown(tmp_path)
