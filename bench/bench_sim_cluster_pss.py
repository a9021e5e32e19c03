"""Peak memory of the simulated 8 x 8 cluster test: PSS (shared pages split between the
processes that map them) of the whole process tree of
``MSRL_SIM_CLUSTER=8x8 python -m pytest -m slow tests/test_ray_cluster.py`` (pytest, the
simulated Ray nodes' daemons, the 64 replica processes), sampled every ``--every`` seconds;
reported: the peak sum, and at that peak the number of replica processes and their median PSS.

    python bench/bench_sim_cluster_pss.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from bench_footprint import pss_kb  # noqa: E402
from procs import descendants, process_table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="8x8", help="MSRL_SIM_CLUSTER (nodes x GPUs)")
    p.add_argument("--every", type=float, default=2.0)
    args = p.parse_args()
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, MSRL_SIM_CLUSTER=args.cluster)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "slow", "tests/test_ray_cluster.py"], cwd=root,
                            env=env)
    peak, at_peak = 0, []
    t0 = time.monotonic()
    while proc.poll() is None:
        table = process_table()
        pids = descendants(proc.pid) | {proc.pid}
        sizes = {pid: pss_kb(pid) for pid in pids}
        total = sum(sizes.values())
        if total > peak:
            peak = total
            at_peak = [kb for pid, kb in sizes.items() if table.get(pid, (0, b""))[1].startswith(b"ray::ReplicaActor")]
        time.sleep(args.every)
    wall = time.monotonic() - t0
    print(f"MSRL_SIM_CLUSTER={args.cluster}: pytest exit {proc.returncode} in {wall:.0f} s; peak PSS of its process tree "
          f"{peak / 1024**2:.1f} GB; at the peak {len(at_peak)} replica processes, median "
          f"{statistics.median(at_peak) / 1024 if at_peak else 0:.0f} MB PSS each")


if __name__ == "__main__":
    main()
