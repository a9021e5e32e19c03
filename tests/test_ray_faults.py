"""What a Ray run does when the ground goes from under it, as ``msrl train`` on the command line
runs it (a supervising parent, :mod:`msrl.run.supervisor`, and the driver it forks):

* the run's own raylet killed: one line naming what stopped, the last checkpoint and the
  ``--resume`` command, exit status 3, the checkpoint kept; the run resumes from it;
* the driver SIGKILLed, or the ``msrl train`` process itself: no process of the run outlives it;
* a replica killed while the job starts, or while a restart starts: restarted like any other
  death, within ``cluster.max_restarts``.

Only this run's processes are looked at (its own process tree): other jobs may run Ray beside it.
"""

from __future__ import annotations

import csv
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from procs import EVENT_TIMEOUT_S, descendants, popen, process_table, ray_log_lines, stop_tree, wait_for

pytest.importorskip("ray")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COARSE = ["configs/ppo_cartpole.yaml", "runtime=ray", "distribution_policy.name=single_learner_coarse",
          "train.progress=false", "train.eval_every=0"]


def _train(tmp_path, *over) -> subprocess.Popen:
    return popen([sys.executable, "-m", "msrl.run.cli", "train", *COARSE, f"runs_dir={tmp_path}", "name=r", *over],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _rows(run: pathlib.Path) -> int:
    m = run / "metrics.csv"
    return m.read_text().count("\n") - 1 if m.is_file() else 0


def _tree(root: int, name: bytes) -> list[int]:
    """The processes below ``root`` whose command line holds ``name``."""
    table = process_table()
    return [p for p in descendants(root) if name in table.get(p, (0, b""))[1]]


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _running(pids) -> list[int]:
    from msrl.cluster.actor_manager import process_running as _running

    return [p for p in pids if _running(p)]


def test_the_runs_raylet_killed_is_one_line_with_the_checkpoint_and_the_run_resumes(tmp_path):
    run = tmp_path / "r"
    # a checkpoint every 2 iterations ends a chunk every 2: the driver is never far past the rows
    proc = _train(tmp_path, "train.total_env_steps=15360", "train.checkpoint_every=2")
    try:
        wait_for(lambda: _rows(run) >= 6, f"6 rows in {run}/metrics.csv", alive=proc)
        raylets = _tree(proc.pid, b"/raylet")
        assert len(raylets) == 1, f"the run's raylet below msrl train ({proc.pid}): {raylets}"
        tree = descendants(proc.pid)
        os.kill(raylets[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err
    assert not ray_log_lines(err), "Ray's own log lines reached the terminal"
    last = err.strip().splitlines()[-1]
    assert last.startswith("msrl: error: the Ray cluster of this run stopped (its raylet (pid "), last
    assert "; the last checkpoint is at env step " in last and last.endswith(f"; resume with msrl train --resume {run}")
    assert (run / "checkpoints" / "latest.pt").is_file()
    assert not _running(tree), "processes of the run outlived it"
    steps = int(last.split("; the last checkpoint is at env step ")[1].split(";")[0])
    assert steps > 0 and steps % 512 == 0  # a checkpoint every 2 iterations of 256 env steps
    resumed = popen([sys.executable, "-m", "msrl.run.cli", "train", "--resume", str(run)], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = resumed.communicate(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(resumed)
    assert resumed.returncode == 0, err[-3000:]
    assert f"msrl: resuming {run} at env step {steps}" in err
    with open(run / "metrics.csv") as f:
        assert [int(r["iteration"]) for r in csv.DictReader(f)] == list(range(1, 61))  # 15360 / 256, each once


@pytest.mark.parametrize("victim", ["driver", "msrl train"])
def test_no_process_of_the_run_outlives_its_driver(tmp_path, victim):
    """SIGKILL the driver (the process ``msrl train`` forked, which started Ray): the parent stops
    every process the driver left, and says so in one line (exit status 3). SIGKILL ``msrl train``
    itself: the driver gets SIGINT and stops its replicas and its Ray as after Ctrl-C."""
    run = tmp_path / "r"
    proc = _train(tmp_path, "train.total_env_steps=10000000", "train.checkpoint_every=10")
    try:
        wait_for(lambda: _rows(run) >= 15, f"15 rows in {run}/metrics.csv", alive=proc)
        table = process_table()
        drivers = [p for p, (ppid, cmd) in table.items() if ppid == proc.pid and b"msrl.run.cli" in cmd]
        assert len(drivers) == 1, f"the driver below msrl train ({proc.pid}): {drivers}"
        tree = descendants(proc.pid)
        replicas = _tree(proc.pid, b"ray::ReplicaActor")
        assert _tree(proc.pid, b"/raylet") and replicas, "the run's Ray processes"
        # a Ray msrl starts runs its replicas at the driver's niceness, not above (Ray's default: 15)
        assert all(_niceness(p) <= os.nice(0) for p in replicas), [_niceness(p) for p in replicas]
        t0 = time.monotonic()
        os.kill(drivers[0] if victim == "driver" else proc.pid, signal.SIGKILL)
        wait_for(lambda: not _running(tree), "every process of the run ending", timeout=120, poll=0.2)
        gone_s = time.monotonic() - t0
        _, err = proc.communicate(timeout=120)
    finally:
        stop_tree(proc)
    print(f"every process of the run gone {gone_s:.1f} s after the SIGKILL of the {victim}")
    if victim == "driver":
        assert proc.returncode == 3, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"msrl: error: the training process (pid {drivers[0]}) was ended by SIGKILL; the last "
                               "checkpoint is at env step ") and last.endswith(f"resume with msrl train --resume {run}")
    else:
        assert proc.returncode == -signal.SIGKILL


def test_a_replica_killed_while_the_job_starts_is_restarted(tmp_path):
    """The first replica process SIGKILLed as soon as it appears (the job is placing its replicas,
    connecting them, resetting them): a restart, and the run completes."""
    run = tmp_path / "r"
    proc = _train(tmp_path, "train.total_env_steps=5120", "distribution_policy.replicas.actor=2")
    try:
        first = wait_for(lambda: _tree(proc.pid, b"ray::ReplicaActor"), "a replica process", alive=proc, poll=0.02)
        os.kill(first[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "(restart 1 of 3" in err and "Traceback" not in err
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, 21))
    assert float(rows[-1]["faults/replica_restarts"]) == 1


@pytest.mark.slow
def test_a_replica_killed_while_a_restart_starts_is_restarted_again(tmp_path):
    """SIGKILL an actor mid-run, then the first replica of the restarted job as it appears: two
    restarts, the run completes, each iteration once in metrics.csv."""
    run = tmp_path / "r"
    proc = _train(tmp_path, "train.total_env_steps=15360", "train.checkpoint_every=10",
                  "distribution_policy.replicas.actor=2")
    try:
        wait_for(lambda: _rows(run) >= 15, f"15 rows in {run}/metrics.csv", alive=proc)
        old = set(_tree(proc.pid, b"ray::ReplicaActor"))
        os.kill(sorted(old)[0], signal.SIGKILL)
        new = wait_for(lambda: [p for p in _tree(proc.pid, b"ray::ReplicaActor") if p not in old],
                       "a replica of the restarted job", alive=proc, poll=0.02)
        os.kill(new[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=EVENT_TIMEOUT_S)
    finally:
        stop_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "(restart 1 of 3" in err and "(restart 2 of 3" in err and "Traceback" not in err
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == list(range(1, 61))
    assert float(rows[-1]["faults/replica_restarts"]) == 2
