"""``distribution_policy.compile.<fragment>: inductor`` (msrl.runtime.programs.compiled): the components'
pure tensor methods compiled by ``torch.compile``.

A compiled fragment computes what its eager program computes up to float rounding (inductor
fuses and reorders pointwise ops), so these tests hold the two to a tolerance, iteration by
iteration, on the main job and on Tag's multi-agent learner; a target Dynamo cannot trace whole
falls back to the eager method with one line and then equals eager bitwise. On a GPU the same
tests run with the iteration captured as a CUDA graph around the compiled kernels.
"""

import pathlib
import re

import pytest
import torch

from msrl.config import ConfigError, build_job_spec, load_config
from msrl.rl.actors import ActorCriticActor
from msrl.run.job import Job
from msrl.runtime.programs.capture import WARMUP
from msrl.runtime.programs.compiled import CompiledMethod, CompileTargetError, compiled_program_of

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
GPU_ONLY = CONFIGS / "ppo_cartpole_gpu_only.yaml"
SMALL = ["env.num_envs=8", "algorithm.hparams.num_steps=16", "train.total_env_steps=4096"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_pair(config, overrides, iterations):
    """The job compiled and eager, ``iterations`` iterations each; returns both jobs' per-iteration
    metrics and the jobs (closed by the caller)."""
    jobs = [Job(build_job_spec(load_config(config, [*overrides, f"distribution_policy.compile.main={m}"])))
            for m in ("inductor", "off")]
    out = [[], []]
    for job, rows in zip(jobs, out):
        job.reset()
        for _ in range(iterations):
            rows.append(job.train_step())
    return jobs, out


def _close_metrics(a, b, rel=1e-3, abs_=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        x, y = float(a[k]), float(b[k])
        if x != x and y != y:  # both nan (an unclipped grad norm)
            continue
        assert y == pytest.approx(x, rel=rel, abs=abs_), (k, x, y)


def _weights_close(jobs, role, atol=1e-4):
    a, b = (j.replica("main", 0).weights(role) for j in jobs)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-3, msg=f"{role}.{k}")


@pytest.mark.parametrize("config, overrides", [
    (CONFIGS / "ppo_cartpole.yaml", ["env.num_envs=4", "algorithm.hparams.num_steps=16"]),  # the main job
    # native env, the compiled kernels inside the CUDA graph (on the CPU the main job's case)
    pytest.param(GPU_ONLY, SMALL, marks=pytest.mark.skipif(DEVICE != "cuda", reason="the capture of compiled kernels "
                                                           "needs a GPU (the CPU tape records eager ops)")),
    (CONFIGS / "ma_ppo_tag.yaml", ["env.num_envs=4", "algorithm.hparams.num_steps=8"]),  # Tag's learner
])
def test_a_compiled_fragment_equals_its_eager_program_to_float_tolerance(config, overrides, capfd):
    jobs, (compiled, eager) = _run_pair(config, overrides, WARMUP + 4)
    try:
        for c, e in zip(compiled, eager):
            _close_metrics(c, e)
        for role in ("actor", "learner"):
            _weights_close(jobs, role)
        rep = jobs[0].replica("main", 0)
        status = rep.compile_status()
        assert status and all(line.endswith(": inductor") for line in status), status
        names = {line.split(":")[0] for line in status}
        assert {"learner.ppo_loss", "learner.net.evaluate"} <= names, names
        # the targets really are compiled methods on the components, the draws are not
        assert isinstance(rep.trainer.learner.ppo_loss, CompiledMethod)
        assert not isinstance(rep.trainer.actor.act, CompiledMethod)
        err = capfd.readouterr().err
        for name in names:  # each target's compile time, once, in the run's start-up notices
            assert len(re.findall(rf"msrl: fragment main replica 0: compiled {re.escape(name)} with inductor in "
                                  rf"\d+\.\d s\n", err)) == 1, err
    finally:
        for j in jobs:
            j.close()


def test_a_target_with_a_graph_break_runs_eagerly_with_one_line(monkeypatch, capfd):
    """``act`` draws from the actor's own ``torch.Generator``, which Dynamo cannot trace: declared
    as a target, it runs eagerly from its first call, says so once with the break and the line,
    and the run is the eager run bitwise."""
    monkeypatch.setattr(ActorCriticActor, "compile_targets", lambda self: ("act",))
    over = ["env.num_envs=4", "algorithm.hparams.num_steps=8"]
    main = CONFIGS / "ppo_cartpole.yaml"
    jobs = [Job(build_job_spec(load_config(main, [*over, f"distribution_policy.compile.main={m}"])))
            for m in ("inductor", "off")]
    try:
        monkeypatch.setattr(type(jobs[0].replica("main", 0).trainer.learner), "compile_targets", lambda self: ())
        for j in jobs:
            j.reset()
        for _ in range(3):
            assert jobs[0].train_step() == jobs[1].train_step()
        a, b = (j.replica("main", 0).weights("learner") for j in jobs)
        assert all(torch.equal(a[k], b[k]) for k in a)
        rep = jobs[0].replica("main", 0)
        [line] = rep.compile_status()
        assert re.fullmatch(r"actor\.act: eager: Unsupported: .*at .*msrl/rl/distributions\.py:\d+ \(.*generator.*\)",
                            line), line
        err = capfd.readouterr().err
        assert err.count("msrl: fragment main replica 0: actor.act runs eagerly (compile: inductor): Unsupported") == 1, err
    finally:
        for j in jobs:
            j.close()


def test_compile_settings_are_checked_and_off_by_default():
    with pytest.raises(ConfigError, match=r"distribution_policy\.compile\.main=max: unknown compile mode; modes: "
                                          r"off, inductor \(default: off\)"):
        load_config(GPU_ONLY, ["distribution_policy.compile.main=max"])
    with pytest.raises(ConfigError, match=r"distribution_policy\.compile\.learner: policy gpu_only has no fragment "
                                          r"'learner'; fragments: main"):
        load_config(GPU_ONLY, ["distribution_policy.compile.learner=inductor"])
    spec = build_job_spec(load_config(GPU_ONLY, []))
    assert spec.policy.fragment("main").compile is None
    job = Job(spec)
    try:  # off: the program as generated (or captured), no compiled wrapper anywhere
        assert compiled_program_of(job.replica("main", 0).programs["train_step"].fn) is None
    finally:
        job.close()


def test_a_target_that_is_not_a_method_is_named(monkeypatch):
    monkeypatch.setattr(ActorCriticActor, "compile_targets", lambda self: ("net.actor",))  # a module
    job = Job(build_job_spec(load_config(GPU_ONLY, [*SMALL, "distribution_policy.compile.main=inductor",
                                                    "distribution_policy.capture.main=eager"])))
    try:
        with pytest.raises(Exception, match=r"ActorCriticActor\.compile_targets\(\) names 'net\.actor', which is not a "
                                            r"method or function of the component \(a module: name its forward\)") as e:
            job.reset()  # the first program run installs the compiled targets
        assert isinstance(e.value, CompileTargetError) or isinstance(e.value.__cause__, CompileTargetError)
    finally:
        job.close()


def test_msrl_graph_lists_the_compiled_methods(capsys):
    from msrl.run.cli import main

    assert main(["graph", str(GPU_ONLY), *SMALL, "distribution_policy.compile.main=inductor",
                 "distribution_policy.capture.main=eager", "--out", "/dev/null"]) == 0
    text = capsys.readouterr().out
    assert "; capture eager; compile inductor\n" in text
    assert re.search(r"## compiled methods \(distribution_policy\.compile\)\n- main replica 0: actor\.net\.head: inductor\n"
                     r"- main replica 0: learner\.net\.evaluate: inductor\n- main replica 0: learner\.ppo_loss: inductor\n",
                     text), text
