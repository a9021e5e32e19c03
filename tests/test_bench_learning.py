"""``bench/bench_learning.py --state-dir``: runs longer than a sitting (the HalfCheetah tasks' 1M
env steps) keep their state and continue where they stopped -- msrl's through ``--resume``,
exactly; SB3's from its saved model and replay buffer."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import bench_offpolicy  # noqa: E402

#: TD3 on Pendulum-v1, small: 200-step episodes, an evaluation every episode
TASK = dataclasses.replace(bench_offpolicy.TASKS["td3"], budget=400, eval_every=200)
MSRL_OVERRIDES = ["algorithm.hparams.learning_starts=100", "algorithm.hparams.batch_size=32",
                  "algorithm.hparams.hidden_sizes=[16,16]", "train.checkpoint_every=100"]


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(os.path.dirname(BENCH))  # the tasks name their configs from the repository root


def test_a_continued_msrl_run_has_an_unbroken_runs_curve_and_final_evaluation(tmp_path):
    """Stopped at 200 env steps and continued to 400 under one name, the run evaluates as one
    run of 400 does (msrl's resume is exact); run again, the finished run is read back."""
    whole = bench_offpolicy.run_msrl(TASK, 1, None, str(tmp_path / "a"), MSRL_OVERRIDES, whole_budget=True)
    half = dataclasses.replace(TASK, budget=200)
    first = bench_offpolicy.run_msrl(half, 1, None, str(tmp_path / "b"), MSRL_OVERRIDES, whole_budget=True,
                                     resumable="td3_s1")
    assert [c[0] for c in first["curve"]] == [200]
    (tmp_path / "b" / "td3_s1" / "eval.json").unlink()  # as if it had stopped there
    continued = bench_offpolicy.run_msrl(TASK, 1, None, str(tmp_path / "b"), MSRL_OVERRIDES, whole_budget=True,
                                         resumable="td3_s1")
    assert [(c[0], c[2]) for c in continued["curve"]] == [(c[0], c[2]) for c in whole["curve"]]
    assert continued["final_eval"] == whole["final_eval"]
    again = bench_offpolicy.run_msrl(TASK, 1, None, str(tmp_path / "b"), MSRL_OVERRIDES, whole_budget=True,
                                     resumable="td3_s1")
    assert again["curve"] == continued["curve"] and again["final_eval"] == continued["final_eval"]


def test_an_sb3_run_stopped_after_an_evaluation_continues_from_its_state(tmp_path, monkeypatch):
    """Killed at its second evaluation, the SB3 run continues from the state kept after the
    first (model, replay buffer, curve, training time) and finishes the budget; its result is
    then read back without training."""
    monkeypatch.setitem(bench_offpolicy.SB3_KWARGS, "td3", {**bench_offpolicy.SB3_KWARGS["td3"], "learning_starts": 100,
                                                             "batch_size": 32, "policy_kwargs": {"net_arch": [16, 16]}})
    evaluate, calls = bench_offpolicy._sb3_evaluate, []

    def dies_at_the_second(model, env_id):
        calls.append(model.num_timesteps)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(model, env_id)

    monkeypatch.setattr(bench_offpolicy, "_sb3_evaluate", dies_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        bench_offpolicy.run_sb3("td3", TASK, 1, whole_budget=True, state_dir=str(tmp_path))
    kept = json.loads((tmp_path / "progress.json").read_text())
    assert kept["at"] == "200" and [c[0] for c in kept["curve"]] == [200] and kept["train_s"] > 0
    assert sorted(p.name for p in (tmp_path / "200").iterdir()) == ["model.zip", "replay.pkl"]
    monkeypatch.setattr(bench_offpolicy, "_sb3_evaluate", evaluate)
    out = bench_offpolicy.run_sb3("td3", TASK, 1, whole_budget=True, state_dir=str(tmp_path))
    assert [c[0] for c in out["curve"]] == [200, 400] and list(out["curve"][0]) == kept["curve"][0]
    assert out["curve"][1][1] > kept["train_s"] and "final_eval" in out
    monkeypatch.setattr(bench_offpolicy, "_sb3_evaluate", dies_at_the_second)  # a rerun trains nothing
    assert bench_offpolicy.run_sb3("td3", TASK, 1, whole_budget=True, state_dir=str(tmp_path)) == json.loads(
        json.dumps(out))


def test_a_config_variant_keeps_its_own_run_in_a_state_dir():
    """``--override`` variants get run names of their own: a variant never continues the
    shipped config's run (whose resume would refuse the changed config)."""
    import bench_learning

    assert bench_learning._run_name("td3_halfcheetah", 1, []) == "td3_halfcheetah_s1"
    a = bench_learning._run_name("td3_halfcheetah", 1, ["algorithm.hparams.tau=0.01"])
    b = bench_learning._run_name("td3_halfcheetah", 1, ["algorithm.hparams.tau=0.02"])
    assert a.startswith("td3_halfcheetah_s1_") and len({a, b, "td3_halfcheetah_s1"}) == 3
    assert a == bench_learning._run_name("td3_halfcheetah", 1, ["algorithm.hparams.tau=0.01"])


def _part(system: str, final: float) -> dict:
    run = {"time_to_threshold": 10.0, "steps_to_threshold": 200, "sps": 50.0, "final_eval": final,
           "curve": [[200, 10.0, final - 100.0], [400, 20.0, final]]}
    return {"td3": {"task": dataclasses.asdict(TASK), "seeds": [1], "results": {system: [run]}}}


def test_tables_from_two_processes_merge_into_one_table_and_plot(tmp_path):
    """The two systems' JSON files (``--msrl-only`` and ``--peer-only`` run side by side) make one
    table with the ratio row, and ``--plot`` draws their curves; ``--plot`` takes one algo."""
    import subprocess

    files = []
    for system, final in (("msrl", -150.0), ("SB3 TD3", -300.0)):
        files.append(tmp_path / f"{len(files)}.json")
        files[-1].write_text(json.dumps(_part(system, final)))
    png = tmp_path / "curves.png"
    script = os.path.join(BENCH, "bench_learning.py")
    out = subprocess.run([sys.executable, script, "td3", "--tables-from", *map(str, files), "--plot", str(png)],
                         capture_output=True, text=True, check=True).stdout
    assert "td3, seeds [1]:" in out and "| msrl / SB3 TD3 (Mann-Whitney U) |" in out
    assert "| msrl | -150.0" in out and "| SB3 TD3 | -300.0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    two = subprocess.run([sys.executable, script, "td3", "ddpg", "--tables-from", str(files[0]), "--plot", str(png)],
                         capture_output=True, text=True)
    assert two.returncode == 2 and "--plot draws one algorithm's curves" in two.stderr
