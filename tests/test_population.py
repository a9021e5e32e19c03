"""Population-based training (msrl.run.population): the config's checks, truncation selection and
perturbation, a member taking a donor's learner (bitwise) with its own hyperparameters' optimiser
settings, and a whole population run reproducible from its seed; slow: PBT against the worst of
its fixed members on a task with a sensitive learning rate."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

from msrl.config import ConfigError, load_config

CFG = "configs/pbt_ppo_cartpole.yaml"


def _cfg(tmp_path, *over):
    return load_config(CFG, [f"runs_dir={tmp_path}", *over])


def test_the_config_names_what_a_population_cannot_explore(tmp_path):
    with pytest.raises(ConfigError, match=r"population.explore.num_steps: only float hyperparameters can be explored.*"
                                          r"learning_rate"):
        _cfg(tmp_path, "population.explore={num_steps: {min: 8, max: 32}}")
    with pytest.raises(ConfigError, match=r"population.explore.learning_rat: not a hyperparameter of ppo"):
        _cfg(tmp_path, "population.explore={learning_rat: {min: 0.001, max: 0.01}}")
    with pytest.raises(ConfigError, match=r"init has 2 values for size=4 members"):
        _cfg(tmp_path, "population.explore.learning_rate.init=[0.001, 0.002]")
    with pytest.raises(ConfigError, match=r"init value 0.5 lies outside \[min, max\]"):
        _cfg(tmp_path, "population.explore.learning_rate.init=[0.5, 0.001, 0.001, 0.001]")
    with pytest.raises(ConfigError, match=r"max=0.001 is below min=0.01"):
        _cfg(tmp_path, "population.explore={learning_rate: {min: 0.01, max: 0.001}}")
    with pytest.raises(ConfigError, match=r"population.size"):
        _cfg(tmp_path, "population.size=1")
    # a range past the hyperparameter's own bound, named by its key before any work (issue 73, item 4)
    with pytest.raises(ConfigError, match=r"population.explore.gamma.max=1.5: not a value algorithm.hparams.gamma "
                                          r"accepts \(Input should be less than or equal to 1\)"):
        _cfg(tmp_path, "population.explore={gamma: {min: 0.9, max: 1.5}}")
    with pytest.raises(ConfigError, match=r"the members run in this process \(runtime: local\).*set runtime: local"):
        _cfg(tmp_path, "runtime=ray")


def test_truncation_selection_replaces_the_bottom_with_the_top():
    from msrl.run.population import plan_exploits

    rng = random.Random(0)
    assert plan_exploits([5.0, 1.0, 9.0, 3.0], 0.25, rng) == {1: 2}  # k = ceil(0.25 * 4) = 1
    plan = plan_exploits([5.0, 1.0, 9.0, 3.0, 7.0, 0.0, 2.0, 8.0], 0.25, rng)
    assert set(plan) == {5, 1} and set(plan.values()) <= {2, 7}
    assert len(plan_exploits([1.0, 2.0, 3.0], 0.5, rng)) == 1  # at most n // 2
    assert plan_exploits([-math.inf, 4.0], 0.25, rng) == {0: 1}  # a member that never finished an episode ranks last
    assert plan_exploits([2.0, 2.0], 0.5, rng) == {1: 0}  # ties: the higher index ranks lower


def test_explore_perturbs_by_the_factors_and_stays_in_range(tmp_path):
    from msrl.run.population import explore

    ranges = _cfg(tmp_path).population.explore
    rng = random.Random(1)
    seen = {round(explore({"learning_rate": 0.001}, ranges, (0.8, 1.2), 0.0, rng)["learning_rate"], 12) for _ in range(50)}
    assert seen == {0.0008, 0.0012}
    assert explore({"learning_rate": 0.029}, ranges, (0.8, 1.2), 0.0, random.Random(3))["learning_rate"] <= 0.03
    drawn = [explore({"learning_rate": 0.001}, ranges, (0.8, 1.2), 1.0, rng)["learning_rate"] for _ in range(200)]
    assert all(1e-5 <= v <= 3e-2 for v in drawn) and min(drawn) < 1e-4 and max(drawn) > 3e-3  # log-uniform over the range


def _two_members(tmp_path):
    from msrl.config import build_job_spec
    from msrl.run.job import Job
    from msrl.run.population import member_configs

    cfg = _cfg(tmp_path, "population.size=2", "population.explore.learning_rate.init=[0.0001, 0.01]")
    cfgs = member_configs(cfg, random.Random(0))
    jobs = [Job(build_job_spec(c)) for c in cfgs]
    for j in jobs:
        j.reset()
        j.run(3)
    return cfgs, jobs


def test_a_member_takes_the_donors_learner_bitwise_and_keeps_its_own_learning_rate_and_envs(tmp_path):
    from msrl.config import build_job_spec
    from msrl.run.job import Job
    from msrl.run.population import _with_hparams, exploit

    cfgs, (member, donor) = _two_members(tmp_path)
    assert [c.seed for c in cfgs] == [1, 1001] and [c.algorithm.hparams["learning_rate"] for c in cfgs] == [0.0001, 0.01]
    try:
        own = member.state_dict()
        new_cfg = _with_hparams(cfgs[0], {"learning_rate": 0.012}, cfgs[0].seed)
        rebuilt = Job(build_job_spec(new_cfg))
        obs_before = member.replica("main", 0).trainer.obs.clone()
        exploit(rebuilt, own, donor)
        mine, theirs = rebuilt.component("learner"), donor.component("learner")
        assert all(torch.equal(a, b) for a, b in zip(mine.state_dict()["net"].values(), theirs.state_dict()["net"].values()))
        exp_avg = [s["exp_avg"] for s in mine.optimizer.state_dict()["state"].values()]
        assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(exp_avg, theirs.optimizer.state_dict()["state"].values()))
        assert mine.optimizer.param_groups[0]["lr"] == pytest.approx(0.012)  # its own, not the donor's 0.01
        assert theirs.optimizer.param_groups[0]["lr"] != pytest.approx(0.012)
        actor_w = rebuilt.component("actor").get_weights()
        assert all(torch.equal(actor_w[k], v) for k, v in donor.component("learner").get_weights().items())
        assert torch.equal(rebuilt.replica("main", 0).trainer.obs, obs_before)  # its own envs where they were
        assert not torch.equal(obs_before, donor.replica("main", 0).trainer.obs)
        metrics = rebuilt.run(2)  # and it trains on
        assert all(math.isfinite(v) for r in metrics for k, v in r["output"].items() if k.startswith("losses/"))
        rebuilt.close()
    finally:
        member.close()
        donor.close()


def _population_run(tmp_path, name):
    from msrl.run.training import train

    cfg = _cfg(tmp_path / name, "train.total_env_steps=6144", "population.interval=4", "population.size=3",
               "population.explore.learning_rate.init=[0.00001, 0.001, 0.01]", "train.progress=false", "eval.episodes=2")
    return train(cfg)


def test_a_population_run_writes_each_member_and_replays_from_its_seed(tmp_path):
    from msrl.run.python_api import load

    a = _population_run(tmp_path, "a")
    b = _population_run(tmp_path, "b")
    root_a, root_b = a.run_dir.parent.parent, b.run_dir.parent.parent
    rows = list(csv.DictReader(open(root_a / "population.csv")))
    assert [r["turn"] for r in rows[:3]] == ["1", "1", "1"] and len(rows) == 3 * 6  # 24 iterations in turns of 4
    assert any(r["copied_from"] for r in rows)
    assert [{k: v for k, v in r.items()} for r in rows] == list(csv.DictReader(open(root_b / "population.csv")))
    report = json.loads((root_a / "eval.json").read_text())
    assert len(report["members"]) == 3 and a.run_dir == root_a / "members" / str(report["best_member"])
    for m in report["members"]:
        d = root_a / "members" / str(m["member"])
        saved = load_config(d / "config.yaml")
        assert saved.population is None and saved.algorithm.hparams["learning_rate"] == pytest.approx(m["hparams"]["learning_rate"])
        header = next(csv.reader(open(d / "metrics.csv")))
        assert "pbt/learning_rate" in header and "losses/policy_loss" in header
    assert load(a.run_dir).act(torch.zeros(4).numpy()) in (0, 1)


def test_a_population_runs_its_members_at_the_configs_precision_and_gives_the_callers_back(tmp_path, monkeypatch):
    """``train.float32_matmul_precision`` holds while the members train (as in a single run), and
    the caller's own setting comes back after the population's run."""
    from msrl.run.job import Job
    from msrl.run.training import train

    seen = []
    run = Job.run

    def spy(self, n):
        seen.append(torch.get_float32_matmul_precision())
        return run(self, n)

    monkeypatch.setattr(Job, "run", spy)
    before = torch.get_float32_matmul_precision()
    cfg = _cfg(tmp_path, "train.total_env_steps=2048", "population.interval=4", "population.size=2",
               "population.explore.learning_rate.init=[0.0001, 0.001]",
               "train.progress=false", "eval.episodes=1", "train.float32_matmul_precision=medium")
    train(cfg)
    assert len(seen) == 4 and set(seen) == {"medium"}  # 2 members x 2 turns
    assert torch.get_float32_matmul_precision() == before


def test_an_interrupted_population_resumes_exactly(tmp_path, monkeypatch):
    """Ctrl-C in turn 3 of 6 (population.pt holds turn 2), then msrl train --resume: the same
    population.csv, members' losses, final weights and evaluations as the run never interrupted."""
    import msrl.run.population as population
    from msrl.run.outcome import TrainingInterrupted
    from msrl.run.rundir import resume_config
    from msrl.run.training import train

    over = ["train.total_env_steps=6144", "population.interval=4", "population.size=3", "train.checkpoint_every=4",
            "population.explore.learning_rate.init=[0.00001, 0.001, 0.01]", "train.progress=false", "eval.episodes=2"]
    whole = train(_cfg(tmp_path / "whole", *over)).run_dir.parent.parent
    plan, calls = population.plan_exploits, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return plan(*args)

    monkeypatch.setattr(population, "plan_exploits", interrupted)
    with pytest.raises(TrainingInterrupted, match=r"interrupted at env step 3072; checkpoint kept: .*population.pt "
                                                  r"\(env step 2048\); resume with: msrl train --resume"):
        train(_cfg(tmp_path / "cut", *over))
    monkeypatch.setattr(population, "plan_exploits", plan)
    cut = tmp_path / "cut" / "pbt_ppo_cartpole"
    assert len(list(csv.DictReader(open(cut / "population.csv")))) == 3 * 2  # cut before turn 3's rows
    train(resume_config(cut), resume=cut)

    def rows(root, name):
        return list(csv.DictReader(open(root / name)))

    assert rows(whole, "population.csv") == rows(cut, "population.csv")
    a, b = (json.loads((r / "eval.json").read_text()) for r in (whole, cut))
    assert [(m["hparams"], m["returns"]) for m in a["members"]] == [(m["hparams"], m["returns"]) for m in b["members"]]
    for i in range(3):
        la, lb = (rows(r / "members" / str(i), "metrics.csv") for r in (whole, cut))
        assert [(r["iteration"], r["losses/policy_loss"], r["pbt/learning_rate"]) for r in la] == \
            [(r["iteration"], r["losses/policy_loss"], r["pbt/learning_rate"]) for r in lb]
        wa, wb = (torch.load(r / "members" / str(i) / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
                  for r in (whole, cut))
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_shorter_budget_no_checkpoint_or_a_damaged_one_is_refused_in_one_line(tmp_path):
    from msrl.run.population import POPULATION_CHECKPOINT
    from msrl.run.rundir import resume_config
    from msrl.run.training import train

    _population_run(tmp_path, "a")
    root = tmp_path / "a" / "pbt_ppo_cartpole"
    with pytest.raises(ConfigError, match=r"train.total_env_steps=2048: the population's checkpoint is already at env "
                                          r"step 6144; a resumed run can only train for longer"):
        train(resume_config(root, ["train.total_env_steps=2048"]), resume=root)
    (root / POPULATION_CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"population.pt: damaged population checkpoint"):
        train(resume_config(root), resume=root)
    (root / POPULATION_CHECKPOINT).unlink()
    with pytest.raises(ConfigError, match=r"the population has no checkpoint yet \(population.pt\); start it again"):
        train(resume_config(root), resume=root)


def test_msrl_graph_shows_the_members_and_the_exchange(tmp_path):
    from msrl.config import build_job_spec
    from msrl.run.job import Job
    from msrl.run.population import describe, member_configs

    cfg = _cfg(tmp_path)
    job = Job(build_job_spec(member_configs(cfg, random.Random(0))[0]))
    try:
        text = describe(cfg, job)
    finally:
        job.close()
    assert "4 members" in text and "turns of 10 iterations" in text and "the bottom 1" in text
    assert "learning_rate in [1e-05, 0.03] (init [1e-05, 0.0001, 0.001, 0.01]): x0.8 or x1.2" in text
    import re

    nbytes = int(re.search(r"\((\d+) bytes: weights, optimiser, statistics\)", text).group(1))
    assert nbytes > 4 * 64 * 64 * 2  # two 64x64 layers' weights and their Adam moments at least



def test_population_devices_place_each_members_whole_job_round_robin(tmp_path):
    """``population.devices``: member ``i``'s fragments on ``devices[i % len]``, shown by ``msrl
    graph``; an unknown or absent device, an empty list, and both device settings at once are
    refused naming the key."""
    from msrl.config import build_job_spec
    from msrl.run.job import Job
    from msrl.run.population import describe, member_configs

    cfg = _cfg(tmp_path, "population.devices=[cpu]")
    cfgs = member_configs(cfg, random.Random(0))
    assert [c.distribution_policy.devices for c in cfgs] == [{"main": "cpu"}] * 4
    job = Job(build_job_spec(cfgs[3]))
    try:
        assert {str(job.spec.policy.fragment("main").device)} == {w.device.type for w in job.component("learner").get_weights().values()} == {"cpu"}
        text = describe(cfg, job)
    finally:
        job.close()
    assert "devices: member 0 on cpu, member 1 on cpu, member 2 on cpu, member 3 on cpu" in text
    with pytest.raises(ConfigError, match=r"population.devices: tpu: fragment main: invalid device 'tpu'"):
        _cfg(tmp_path, "population.devices=[cpu, tpu]")
    with pytest.raises(ConfigError, match=r"population.devices is empty"):
        _cfg(tmp_path, "population.devices=[]")
    with pytest.raises(ConfigError, match=r"population.devices places each member's whole job on one device; "
                                          r"distribution_policy.devices=\{'main': 'cpu'\}"):
        _cfg(tmp_path, "population.devices=[cpu]", "distribution_policy.devices.main=cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"population.devices: cuda:0: .*no CUDA device is available"):
            _cfg(tmp_path, "population.devices=[cuda:0]")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="members on a CPU and a GPU need a GPU")
def test_a_member_on_the_cpu_takes_the_learner_of_a_member_on_a_gpu(tmp_path):
    from msrl.config import build_job_spec
    from msrl.run.job import Job
    from msrl.run.population import exploit, member_configs

    cfg = _cfg(tmp_path, "population.size=2", "population.devices=[cpu, cuda:0]")
    cfgs = member_configs(cfg, random.Random(0))
    member, donor = (Job(build_job_spec(c)) for c in cfgs)
    try:
        for j in (member, donor):
            j.reset()
            j.run(2)
        own = member.state_dict()
        exploit(member, own, donor)
        mine, theirs = member.component("learner").state_dict()["net"], donor.component("learner").state_dict()["net"]
        assert all(a.device.type == "cpu" and torch.equal(a, b.cpu()) for a, b in zip(mine.values(), theirs.values()))
        assert all(math.isfinite(v) for r in member.run(2) for k, v in r["output"].items() if k.startswith("losses/"))
    finally:
        member.close()
        donor.close()


@pytest.mark.slow
def test_pbt_beats_its_worst_fixed_member_on_a_sensitive_learning_rate(tmp_path):
    """Over 5 seeds: PPO on CartPole with learning rates 1e-5 ... 1e-2; the population's best
    final evaluation against the final evaluations of the 4 fixed learning rates (members that never exchange)."""
    from msrl.run.training import train

    worse = 0
    for seed in range(5):
        over = [f"seed={seed}", "train.total_env_steps=60000", "train.progress=false"]
        pbt = train(_cfg(tmp_path / f"pbt{seed}", *over)).eval_mean
        train(_cfg(tmp_path / f"fixed{seed}", *over, "population.interval=100000"))  # one turn: no exchange
        report = json.loads((tmp_path / f"fixed{seed}" / "pbt_ppo_cartpole" / "eval.json").read_text())
        fixed = [m["mean_return"] for m in report["members"]]
        worse += pbt > min(fixed)
    assert worse == 5


def test_a_population_run_says_how_each_member_does_each_turn(tmp_path, capsys):
    """With ``train.progress`` on, each turn prints one line per member: its values, iteration,
    env steps, mean return and whom it copies (a population run printed nothing until its end:
    issue 73, item 10); off, nothing."""
    import re

    from msrl.run.training import train

    over = ["train.total_env_steps=3072", "population.interval=4", "population.size=2", "eval.episodes=1",
            "population.explore.learning_rate.init=[0.00001, 0.01]"]
    train(_cfg(tmp_path / "on", *over, "train.progress=true"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("msrl: turn ")]
    assert len(lines) == 2 * 3, lines  # 12 iterations of 256 env steps, 4 a turn: 3 turns, 2 members
    pattern = (r"msrl: turn (\d), member (\d) \(learning_rate=[0-9.e-]+\): iteration (\d+)/12, env step \d+, "
               r"(mean return [0-9.]+|no episode finished)(; copies member \d)?")
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    assert [line.split(",")[0] for line in lines[:2]] == ["msrl: turn 1", "msrl: turn 1"]
    train(_cfg(tmp_path / "off", *over, "train.progress=false"))
    assert "msrl: turn " not in capsys.readouterr().err
