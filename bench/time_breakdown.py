"""Where a run's training time went: its steady iterations against the rest (start-up: warm-up,
probe, capture, first CUDA launches; and the loop's work between chunks), from the run's
``metrics.csv``.

``time_s`` of an iteration's row is the training time at its end (evaluation excluded; the
loop spreads a chunk's time evenly over its iterations, and adds its logging and checkpoint
time at the chunk's end), so the differences between rows are each iteration's share.

    python bench/time_breakdown.py runs/ppo_cartpole_gpu_only       # a run directory
    python bench/time_breakdown.py RUN_DIR --json breakdown.json

Prints: iterations, training time (s), the steady time per iteration (ms: the median from the
run's tenth on), the steady part (iterations x steady) and the rest, and the first rows'
times.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics


def breakdown(run_dir: pathlib.Path, first: int = 5) -> dict:
    """The figures above for ``run_dir``.

    Raises:
        FileNotFoundError: no ``metrics.csv`` in ``run_dir``.
        ValueError: fewer than 4 rows (too few to call any steady).
    """
    with open(run_dir / "metrics.csv", newline="") as f:
        times = [float(r["time_s"]) for r in csv.DictReader(f)]
    if len(times) < 4:
        raise ValueError(f"{run_dir}/metrics.csv has {len(times)} rows; at least 4 are needed")
    dts = [b - a for a, b in zip([0.0, *times], times)]
    steady = statistics.median(dts[len(dts) // 10:])
    total = times[-1]
    return {"iterations": len(times), "training_s": round(total, 4), "steady_ms_per_iteration": round(steady * 1e3, 4),
            "steady_part_s": round(steady * len(times), 4), "rest_s": round(total - steady * len(times), 4),
            "first_iterations_ms": [round(d * 1e3, 3) for d in dts[:first]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path, default=None)
    args = p.parse_args()
    b = breakdown(args.run_dir)
    print(f"{b['iterations']} iterations, {b['training_s']} s training: steady {b['steady_ms_per_iteration']} ms per "
          f"iteration x {b['iterations']} = {b['steady_part_s']} s, the rest {b['rest_s']} s "
          f"(start-up and the loop between chunks); first iterations (ms): {b['first_iterations_ms']}")
    if args.json:
        args.json.write_text(json.dumps(b, indent=1))


if __name__ == "__main__":
    main()
