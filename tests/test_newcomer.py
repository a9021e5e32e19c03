"""What a newcomer trips on: each mistake is one line naming its line or key, before any work."""

from __future__ import annotations

import dataclasses
import pathlib
import textwrap

import pytest

from msrl.run.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/ppo_cartpole.yaml")

TYPO = '''
import dataclasses
from msrl.algorithms.ppo import ALGORITHM as PPO, PPOTrainer

class TypoTrainer(PPOTrainer):
    def train_step(self):
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.{actor}.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, log_prob=log_prob, value=value, reward=reward,
                               terminated=terminated, truncated=truncated, next_obs=info["final_obs"])
            self.obs = next_obs
        trajectory = self.buffer.{gather}()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics

ALGORITHM = dataclasses.replace(PPO, name="typo", trainer=TypoTrainer)
'''


@pytest.mark.parametrize("actor, gather, line, message", [
    ("actor", "gather_all", 13, "self.buffer (RolloutBuffer) has no method 'gather_all'. Did you mean 'gather'?"),
    ("policy", "gather", 8, "self.policy is neither a component of this trainer (self.env, self.actor, self.buffer, "
                            "self.learner) nor an attribute it has or writes"),
])
def test_a_misspelt_component_or_method_is_one_line_naming_it(tmp_path, capsys, actor, gather, line, message):
    path = tmp_path / "typo_algo.py"
    path.write_text(textwrap.dedent(TYPO.format(actor=actor, gather=gather)))
    code = main(["train", CONFIG, f"algorithm.name={path}", f"runs_dir={tmp_path / 'runs'}", "train.total_env_steps=512"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"msrl: error: {path}:{line}: {message}\n"
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize("override, message", [
    ("name=../../escape", "name=../../escape: not one directory name: the run directory is <runs_dir>/<name>"),
    ("name=a/b", "name=a/b: not one directory name"),
    ("runs_dir={file}", "runs_dir={file}: {file} is a file, not a directory; choose another runs_dir"),
    ("runs_dir={file}/sub", "runs_dir={file}/sub: {file} is a file, not a directory"),
    ("runs_dir=/proc/msrl-x", "runs_dir=/proc/msrl-x: cannot make a run directory there: "),
])
def test_a_run_directory_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys, monkeypatch, override, message):
    """Checked before tracing and probing (which take seconds), and nothing is written."""
    import msrl.run.training

    f = tmp_path / "a_file"
    f.write_text("x")
    monkeypatch.setattr(msrl.run.training, "make_job", lambda *a: pytest.fail("a job was built before the run directory was checked"))
    monkeypatch.chdir(tmp_path)
    code = main(["train", CONFIG, override.format(file=f), "train.total_env_steps=256"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("msrl: error: " + message.format(file=f)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


#: the pages a user reads: the README and the documentation site's sources
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _readme_train_commands() -> list[list[str]]:
    import re
    import shlex

    text = "\n".join(p.read_text() for p in DOC_PAGES)
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("msrl train configs/"):
                out.append(shlex.split(line)[2:])
    return out


@pytest.mark.parametrize("args", _readme_train_commands(), ids=lambda a: " ".join(a))
def test_every_readme_train_command_is_a_valid_job(args, monkeypatch):
    """Each ``msrl train CONFIG ...`` command of the README and the docs validates and builds its job spec as
    written (running them all is the slow suite's and the benchmarks' job)."""
    from msrl.config import build_job_spec, load_config

    monkeypatch.chdir(ROOT)
    cfg = load_config(args[0], args[1:])
    import torch

    if "gpu_only" in args[0] and not torch.cuda.is_available():
        pytest.skip("a config for a GPU machine")
    build_job_spec(cfg)


def test_the_readme_is_short_and_every_link_in_it_resolves():
    """The README is the front door (at most ~150 lines); the manual is the documentation site.
    Every relative link and image of it names a file of the repository (links checked by
    ``mkdocs build --strict`` cover the site's own pages)."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "the README links into the docs"
    for target in targets:
        if "://" in target:
            continue
        path = target.split("#")[0]
        assert (ROOT / path).exists(), f"README links to {target}, which does not exist"


def test_ctrl_c_during_start_up_says_so(monkeypatch, capsys):
    import msrl.config

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(msrl.config, "load_config", interrupted)
    assert main(["train", CONFIG]) == 130
    assert capsys.readouterr().err == "\nmsrl: interrupted\n"


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """Getting started's "From Python" block, executed as written (in a scratch directory holding
    the configs): it trains, loads, acts, evaluates, resumes and catches msrl.ConfigError."""
    import re

    page = ROOT / "docs" / "getting-started.md"
    block = re.search(r"## From Python\n\n```python\n(.*?)```", page.read_text(), re.S).group(1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "docs/getting-started.md (From Python)", "exec"), scope)  # noqa: S102 - the README's own example
    out = capsys.readouterr().out
    assert "env.num_envs: Input should be greater than 0 (got 0)" in out
    assert scope["result"].env_steps <= 100_000 and len(scope["returns"]) == 20
    assert scope["action"].shape == () or scope["action"].shape == (1,)


def test_an_algorithm_module_on_pythonpath_is_found_by_its_bare_name(tmp_path, monkeypatch):
    import sys

    from msrl.registry import load_algorithm

    (tmp_path / "my_dqn_mod.py").write_text(
        "import dataclasses\nfrom msrl.algorithms.dqn import ALGORITHM as DQN\n"
        "ALGORITHM = dataclasses.replace(DQN, name='my_dqn')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_algorithm("my_dqn_mod").name == "my_dqn"
    finally:
        sys.modules.pop("my_dqn_mod", None)


def test_a_budget_that_is_not_whole_iterations_is_announced(tmp_path, capsys):
    code = main(["train", CONFIG, "train.total_env_steps=600", f"runs_dir={tmp_path}", "train.eval_every=0",
                 "train.progress=false"])
    err = capsys.readouterr().err
    assert code == 0 and ("msrl: train.total_env_steps=600 is 2 whole iterations of 256 env steps: 512 env steps "
                          "(a run trains whole iterations within its budget)") in err


def test_a_damaged_checkpoint_names_the_loaders_error_without_cutting_a_word():
    from msrl.run.checkpoints import first_sentence as _first_sentence

    long = "PytorchStreamReader failed reading zip archive: failed finding central directory. " + "more words " * 60
    assert _first_sentence(long) == "PytorchStreamReader failed reading zip archive: failed finding central directory."
    cut = _first_sentence("word " * 100)
    assert cut.endswith(" ...") and not cut[:-4].endswith("wor")


def test_rays_token_note_is_dropped_and_its_warnings_are_not():
    import logging

    from msrl.cluster.bootstrap import _DropTokenNote

    def rec(msg):
        return logging.LogRecord("ray", logging.WARNING, __file__, 1, msg, None, None)

    f = _DropTokenNote()
    assert not f.filter(rec("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ..."))
    assert f.filter(rec("Token authentication is disabled for this Ray cluster. Anyone with network access ..."))


def test_rays_daemon_lines_are_dropped_and_a_workers_own_lines_kept():
    """What Ray's daemons send the driver's terminal (the raylet's worker-death reports and its
    "N PYTHON worker processes have been started" warning at 32 replicas, a lost node's state
    dumps from the GCS or the autoscaler) stays in Ray's log folder; a worker's own lines pass."""
    from msrl.cluster.bootstrap import _without_daemon_lines

    printed = []
    f = _without_daemon_lines(lambda data, ignore_prefix: printed.append(data["lines"]))
    f({"lines": ["A worker died or was killed while executing a task by an unexpected system error."],
       "pid": "raylet", "is_err": False}, False)
    f({"lines": ["WARNING: 24 PYTHON worker processes have been started on node: ..."], "pid": "raylet",
       "is_err": True}, False)
    f({"lines": ["node 7fef... marked dead"], "pid": "autoscaler", "is_err": True}, False)
    f({"lines": ["A worker died or was killed (printed by the user's task)"], "pid": 1234, "is_err": True}, False)
    assert printed == [["A worker died or was killed (printed by the user's task)"]]


def test_state_read_before_it_is_set_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "uninit_algo.py"
    path.write_text(textwrap.dedent(TYPO.format(actor="actor", gather="gather")).replace(
        "        metrics = self.learner.learn(trajectory)\n",
        "        metrics = self.learner.learn(trajectory)\n        self.updates = self.updates + 1\n"))
    code = main(["train", CONFIG, f"algorithm.name={path}", f"runs_dir={tmp_path / 'runs'}", "train.total_env_steps=512"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"msrl: error: {path}:15: self.updates is read before it is set: train_step() reads "
                                 "it here, and neither the trainer's __init__ nor reset() sets it. Set it in reset() "
                                 "(e.g. self.updates = 0)\n"), err


def test_msrl_graph_prints_the_bytes_each_boundary_moves_per_iteration():
    """Measured on one iteration: the learner's weights broadcast to 2 actors is twice their size."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job
    from msrl.run.printer import format_boundary_bytes

    job = Job(build_job_spec(load_config(CONFIG, ["distribution_policy.name=single_learner_coarse"])))
    try:
        text = format_boundary_bytes(job, job.measure_boundary_bytes())
        weights = sum(t.numel() * t.element_size() for t in job.component("learner").get_weights().values())
        kb = f"{2 * weights / 1024:.1f} KB"
        assert f"_learner_get_weights2: {kb} (learner -> actor)" in text, text
        assert "train_step/b0:trajectory: " in text and "0 B" not in text.split("trajectory: ")[1].split("\n")[0]
    finally:
        job.close()



def test_msrl_graph_says_when_a_boundary_sits_in_a_branch_the_measured_iteration_did_not_take():
    """DQN before ``learning_starts``: its replay sample crosses inside a branch the measured
    iteration does not take; ``msrl graph`` says so rather than "0 B" (issue 73, item 12)."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job
    from msrl.run.printer import format_boundary_bytes

    job = Job(build_job_spec(load_config("configs/dqn_cartpole.yaml", [
        "distribution_policy.name=single_learner_coarse", "runtime=local", "env.num_envs=4",
        "algorithm.hparams.learning_starts=1000"])))
    try:
        lines = format_boundary_bytes(job, job.measure_boundary_bytes()).splitlines()
        branch = [line for line in lines if "in a branch" in line]
        assert any(line.startswith("- train_step/b0:batch: not taken in the measured iteration (actor -> learner, in a "
                                   "branch)") for line in branch), lines
        assert not any(line.split(": ", 1)[1].startswith("0 B") for line in branch), lines
    finally:
        job.close()


MODULE_STATE = '''
import dataclasses
from msrl.algorithms.dqn import ALGORITHM as DQN, DQNTrainer, DQNActor

{decl}

class CountingActor(DQNActor):
    def act(self, obs, epsilon=0.0, deterministic=False):
{bump}
        return super().act(obs, epsilon, deterministic)

class StateTrainer(DQNTrainer):
    def train_step(self):
        if {cond}:
            return super().train_step()
        return super().train_step()

ALGORITHM = dataclasses.replace(DQN, name="state", trainer=StateTrainer,
                                components={{**DQN.components, "actor": CountingActor}})
'''


@pytest.mark.parametrize("decl, bump, cond, what", [
    ("STEPS = {'n': 0}", "        STEPS['n'] += 1", "STEPS['n'] > 3", "module-level 'STEPS' is a mutable dict"),
    ("STEPS = 0", "        global STEPS\n        STEPS += 1", "STEPS > 3",
     "module-level 'STEPS' is a name functions of its module rebind (global)"),
])
def test_branching_on_module_level_state_is_refused_naming_the_line(tmp_path, capsys, decl, bump, cond, what):
    """A global the actor changes would be seen by the actor's fragment only (on Ray: its
    process), so the fragments would take different sides; it is an error at its line."""
    path = tmp_path / "state_algo.py"
    path.write_text(MODULE_STATE.format(decl=decl, bump=bump, cond=cond))
    code = main(["train", str(ROOT / "configs/dqn_cartpole.yaml"), f"algorithm.name={path}",
                 f"runs_dir={tmp_path / 'runs'}", "distribution_policy.name=single_learner_coarse",
                 "distribution_policy.replicas.actor=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"msrl: error: {path}:"), err
    assert what in err and "keep it in trainer state" in err and err.count("\n") == 1


def test_immutable_module_constants_are_read_as_constants():
    import enum

    import torch

    from msrl.frontend.tracer import _immutable

    class Mode(enum.Enum):
        A = 1

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: int = 1

    @dataclasses.dataclass
    class Thawed:
        x: int = 1

    for ok in (3, 2.5, "s", None, (1, ("a", 2.0)), frozenset({1}), Mode.A, torch.float32, Frozen(), torch, len):
        assert _immutable(ok), ok
    for bad in ({}, [], {1}, torch.zeros(1), Thawed(), (1, [2])):
        assert not _immutable(bad), bad


HELPERS = '''
import numpy as np
from msrl.api import Trainer


def linear_schedule(start_e, end_e, duration, t):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


class Helped(Trainer):
    def reset(self):
        self.global_step = 0

    def train_step(self):
        self.global_step += self.num_envs
        if np.floor(linear_schedule(1.0, 0.05, 1000, self.global_step) * 10) > 3:
            self.learner.learn(self.buffer.gather())
        return {}
'''


def test_pure_module_functions_and_numpy_elementwise_calls_are_control(tmp_path, monkeypatch):
    """A schedule written as a module-level function (CleanRL's ``linear_schedule``) and
    ``np.floor`` on control values make a control condition: the branch is traced, not refused."""
    import importlib

    from msrl.frontend.tracer import trace
    from msrl.graph import NodeKind

    (tmp_path / "helped_algo.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("helped_algo")
    try:
        graph = trace(module.Helped, "train_step")
        branches = [n for n in graph.walk() if n.kind is NodeKind.BRANCH]
        assert len(branches) == 1
        conds = [n for n in graph.walk() if branches[0].target in n.outputs]
        assert conds and all(n.meta.get("control") for n in conds)
    finally:
        import sys

        sys.modules.pop("helped_algo", None)


# -- what a newcomer's run still tripped on (issue "The house before the climb", item 5)


def test_each_record_of_a_chunk_times_one_iteration():
    """charts/SPS at a chunk's end: each record holds one iteration's launch (the work on the
    CPU) and the read of the one before it; the first does not hold two launches, nor the last
    none (the spikes of 0.1-9.9 million steps/s at every chunk boundary)."""
    from msrl.runtime.replica import pipelined_records

    now = [0.0]

    def iteration():
        now[0] += 1.0  # the launch: one iteration's work

        def read():
            now[0] += 0.01  # the read of its results
            return None, "episodes"
        return read, {}

    records = pipelined_records(5, iteration, clock=lambda: now[0])
    times = [round(r["time_s"], 6) for r in records]
    assert times == [1.0, 1.01, 1.01, 1.01, 1.02] and sum(times) == pytest.approx(now[0])
    assert [r["episodes"] for r in records] == ["episodes"] * 5


def test_a_single_runs_rows_have_no_sps_spike_at_chunk_ends(tmp_path):
    """A run's metrics.csv: every row's charts/SPS is its env steps over its own time_s, and
    time_s grows by each row's share (no row's time is a read alone)."""
    import csv

    assert main(["train", CONFIG, f"runs_dir={tmp_path}", "train.total_env_steps=8192", "train.eval_every=0",
                 "eval.episodes=1", "train.progress=false"]) == 0
    with open(tmp_path / "ppo_cartpole" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sps = [float(r["charts/SPS"]) for r in rows]
    # the whole run's rate bounds every row's: a row at 10x the run's mean is a read-only row
    mean = int(rows[-1]["env_steps"]) / float(rows[-1]["time_s"])
    assert max(sps) < 10 * mean, (max(sps), mean)


#: starts msrl train as a background job of a non-interactive shell does (``msrl train ... &``,
#: ``nohup``): with SIGINT ignored, which exec keeps
SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.parametrize("sig, start", [("SIGTERM", "foreground"), ("SIGHUP", "foreground"), ("SIGTERM", "sigint_ignored"),
                                        ("SIGHUP", "ray")])
def test_sigterm_or_sighup_stops_a_local_run_as_ctrl_c_does(tmp_path, sig, start):
    """Also a Ray run started with SIGINT ignored (a background job): its supervising parent hands
    a SIGTERM on to the driver as SIGINT, which the driver acts on whatever it inherited; and a Ray
    run of two actor replicas given SIGHUP (a closed terminal) stops with msrl's line alone: no
    traceback of a Ray worker or of the driver on its stderr."""
    import signal
    import subprocess
    import sys

    from procs import popen, stop_tree, wait_for

    metrics = tmp_path / "ppo_cartpole" / "metrics.csv"
    launch = [sys.executable, "-c", SIGINT_IGNORED] if start == "sigint_ignored" else [sys.executable]
    ray = {"sigint_ignored": ["distribution_policy.name=single_learner_coarse"],  # supervised
           "ray": ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2"]}.get(start, [])
    proc = popen([*launch, "-m", "msrl.run.cli", "train", CONFIG, f"runs_dir={tmp_path}", "train.progress=false",
                  "train.checkpoint_every=1", *ray], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > 2, "two logged iterations",
                 alive=proc)
        proc.send_signal(getattr(signal, sig))
        err = proc.stderr.read()
        assert proc.wait(timeout=300) == 130, err
    finally:
        stop_tree(proc)
    last = err.strip().splitlines()[-1]
    assert last.startswith("msrl: interrupted at env step ") and "resume with: msrl train --resume" in last, err
    assert "Traceback" not in err and "(pid=" not in err, err  # neither a driver's nor a Ray worker's


def test_a_negative_seed_is_one_line_and_a_msrl_error(tmp_path, capsys):
    import msrl

    assert main(["train", CONFIG, "seed=-1", f"runs_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == "msrl: error: seed: Input should be greater than or equal to 0 (got -1)\n"
    with pytest.raises(msrl.ConfigError, match="seed: Input should be greater than or equal to 0"):
        msrl.train(CONFIG, seed=-1, runs_dir=str(tmp_path))
    assert main(["train", CONFIG, "eval.seed=-5", f"runs_dir={tmp_path}"]) == 2
    assert not any(tmp_path.iterdir())


USER_ENV = '''
import gymnasium
from gymnasium.envs.classic_control import CartPoleEnv


class Reach(CartPoleEnv):
    def __init__(self, target: float = 1.0, render_mode=None):
        super().__init__(render_mode=render_mode)
        self.target = target


gymnasium.register("Reach1D-v0", entry_point=Reach)
'''


def test_a_misspelt_env_kwarg_of_a_users_env_is_one_line_naming_the_valid_ones(tmp_path, capsys, monkeypatch):
    import sys

    (tmp_path / "reach_env.py").write_text(USER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(["train", CONFIG, "env.id=reach_env:Reach1D-v0", "env.kwargs.taget=2.0", f"runs_dir={tmp_path / 'r'}"])
    finally:
        sys.modules.pop("reach_env", None)
    assert code == 2
    assert capsys.readouterr().err == (
        "msrl: error: env.kwargs.taget: an unexpected keyword argument 'taget' for reach_env:Reach1D-v0. Did you mean "
        "'target'? Valid: "
        "apply_api_compatibility, autoreset, disable_env_checker, max_episode_steps, render_mode, target\n")


def test_a_users_env_module_in_the_current_directory_says_pythonpath(tmp_path, capsys, monkeypatch):
    (tmp_path / "reach_env2.py").write_text(USER_ENV.replace("Reach1D-v0", "Reach1D-v2"))
    monkeypatch.chdir(tmp_path)
    code = main(["train", CONFIG, "env.id=reach_env2:Reach1D-v2", f"runs_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        "msrl: error: env id reach_env2:Reach1D-v2: no module 'reach_env2' on Python's path; the current directory "
        "holds one, but the msrl command does not search it: run with PYTHONPATH=."), err


@pytest.mark.parametrize("address", ["garbage", "10.0.0.5", "ray://host", "host:99999", "host:port"])
def test_a_cluster_address_without_a_port_is_one_line(tmp_path, capsys, address):
    code = main(["train", CONFIG, f"cluster.address={address}", "distribution_policy.name=single_learner_coarse",
                 f"runs_dir={tmp_path}"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"msrl: error: cluster.address={address}: not a Ray address; valid: HOST:PORT (the head's GCS port, 6379 by "
        "default, e.g. 10.0.0.5:6379), ray://HOST:PORT (Ray Client, e.g. ray://10.0.0.5:10001) or auto\n")


@pytest.mark.parametrize("value, shown", [(500.0, "500.0"), (0.9575, "0.9575"), (51.0, "51.0"), (54.55, "54.55"),
                                          (-3.14159, "-3.142"), (-250.26, "-250.3"), (0.0, "0.0")])
def test_the_result_line_shows_a_return_as_it_is(value, shown):
    from msrl.run.cli import _format_return

    assert _format_return(value) == shown


@pytest.mark.parametrize("value, message", [
    ("[0]", "algorithm.hparams.hidden_sizes.0: Input should be greater than or equal to 1 (got 0)"),
    ("32", "algorithm.hparams.hidden_sizes: expected a list, e.g. [64, 64] (got 32)"),
    ("[]", "algorithm.hparams.hidden_sizes: expected a list of at least 1 item (got [])"),
])
def test_layer_sizes_errors_say_one_thing_in_yaml_terms(tmp_path, capsys, value, message):
    assert main(["train", CONFIG, f"algorithm.hparams.hidden_sizes={value}", f"runs_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"msrl: error: {message}\n"


def test_a_config_with_resume_keeps_the_runs_name_and_says_give_one(tmp_path, capsys):
    args = [f"runs_dir={tmp_path}", "train.total_env_steps=256", "eval.episodes=1", "train.progress=false"]
    assert main(["train", CONFIG, "name=mine", *args]) == 0
    capsys.readouterr()
    run = tmp_path / "mine"
    # the config's own name (ppo_cartpole) is not the run's: the run keeps its name
    assert main(["train", CONFIG, "--resume", str(run), "train.total_env_steps=512", "eval.episodes=1",
                 "train.progress=false"]) == 0
    assert f"run {run}: 2 iterations, 512 env steps" in capsys.readouterr().out
    assert main(["train", str(ROOT / "configs/dqn_cartpole.yaml"), "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"msrl: error: --resume {run}: algorithm.name='dqn' differs from the run's 'ppo'"), err
    assert err.rstrip().endswith(f"give CONFIG (a new run) or --resume {run} (the run's own config.yaml), not both")


def test_eval_load_and_evaluate_use_the_runs_torch_threads(tmp_path, monkeypatch):
    import torch

    import msrl

    assert main(["train", CONFIG, f"runs_dir={tmp_path}", "train.total_env_steps=256", "eval.episodes=1",
                 "train.progress=false", "train.torch_threads=1"]) == 0
    run = tmp_path / "ppo_cartpole"
    from msrl.run import evaluation

    seen, episodes = [], evaluation.evaluate

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return episodes(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        msrl.load(run)
        assert torch.get_num_threads() == 1  # (its policy acts in this process afterwards)
        torch.set_num_threads(2)
        msrl.evaluate(run, episodes=1)
        assert seen.pop() == 1 and torch.get_num_threads() == 2  # the run's while it plays, the caller's after
        assert main(["eval", str(run), "--episodes", "1"]) == 0  # (msrl's own process: load's setting stays)
        assert seen.pop() == 1
    finally:
        torch.set_num_threads(before)


FAILS_LATER = '''
import dataclasses
from msrl.algorithms.ppo import ALGORITHM as PPO, PPOLearner


class LaterLearner(PPOLearner):
    calls = 0

    def learn(self, batch):
        type(self).calls += 1
        if type(self).calls > 2:  # the probe's two calls pass; the first real iteration fails
            raise ValueError("boom in learn")
        return super().learn(batch)


ALGORITHM = dataclasses.replace(PPO, name="later", components={**PPO.components, "learner": LaterLearner})
'''


def test_msrl_graph_says_in_one_line_that_the_measured_iteration_failed(tmp_path, capsys, monkeypatch):
    path = tmp_path / "later_algo.py"
    path.write_text(FAILS_LATER)
    monkeypatch.chdir(tmp_path)
    assert main(["graph", CONFIG, f"algorithm.name={path}", "-o", "g.png"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("msrl: the iteration msrl graph measures bytes on stopped: fragment main replica 0, "
                          "train_step: ValueError: boom in learn") and err.count("\n") == 1, err


def test_every_command_a_shipped_config_points_to_exists():
    """The commands in the configs' comments run as written: each ``msrl <command>`` is one of the
    command's subcommands, each ``python bench/<script>.py`` exists, and every ``--option`` it
    names is one the script or the command takes (a comment pointed to ``--run``, which did not
    exist: issue 73, item 10)."""
    import pathlib
    import re

    from msrl.run.cli import build_parser

    parser = build_parser()
    subcommands = next(a.choices for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    assert {"train", "graph", "plot"} <= set(subcommands)
    missing = []
    for config in sorted(pathlib.Path("configs").glob("*.yaml")):
        for line in config.read_text().splitlines():
            if not line.lstrip().startswith("#"):
                continue
            for m in re.finditer(r"\bmsrl (\w+)\b", line):
                if m.group(1) not in subcommands:
                    missing.append(f"{config.name}: msrl {m.group(1)}")
            for m in re.finditer(r"python (bench/[\w/]+\.py)([^#]*)", line):
                script = pathlib.Path(m.group(1))
                if not script.is_file():
                    missing.append(f"{config.name}: {script}")
                    continue
                text = script.read_text()
                missing += [f"{config.name}: {script} {opt}" for opt in re.findall(r"(--[\w-]+)", m.group(2))
                            if f'"{opt}"' not in text]
    assert missing == []


NO_STATE = '''
import dataclasses
import torch
from msrl.algorithms.dqn import ALGORITHM as DQN, DQNLearner
from msrl.api import Component


class ForgetfulLearner(DQNLearner):
    """A user's learner with a second network and the base class's state (which returns {})."""

    state_dict = Component.state_dict
    load_state_dict = Component.load_state_dict

    def __init__(self, ctx):
        super().__init__(ctx)
        self.extra = torch.nn.Linear(4, 4)


ALGORITHM = dataclasses.replace(DQN, name="forgetful", components={**DQN.components, "learner": ForgetfulLearner})
'''


def test_a_component_holding_state_without_state_dict_is_refused_before_training(tmp_path, capsys):
    """A learner that holds networks but saves nothing would be silently restarted by ``--resume``
    (a user's TD3 lost its critics that way); building the job refuses it in one line naming the
    class, its file:line and what it holds, exit 2, before any run directory (issue 73, item 12)."""
    path = tmp_path / "forgetful.py"
    path.write_text(NO_STATE)
    code = main(["train", str(ROOT / "configs/dqn_cartpole.yaml"), f"algorithm.name={path}",
                 f"runs_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"msrl: error: the learner ForgetfulLearner ({path}:8) holds self.") and err.count("\n") == 1, err
    assert "does not define state_dict and load_state_dict" in err and "--resume would silently restart it" in err
    assert not (tmp_path / "runs").exists()


BUGGY = '''
import dataclasses
from msrl.algorithms.dqn import ALGORITHM as DQN, DQNLearner


class BuggyLearner(DQNLearner):
    def learn(self, batch):
        return self.apply_gradients(batch["obs"].sum(), self.paramters)


ALGORITHM = dataclasses.replace(DQN, name="buggy", components={**DQN.components, "learner": BuggyLearner})
'''


def test_an_exception_in_user_code_during_the_probe_is_one_line(tmp_path, capsys):
    """A bug the probe's first iterations meet (a misspelt attribute in ``learn``) is one line
    naming the exception, the user's ``file:line`` that raised it and the ``train_step`` node it
    was called from, exit 2, no run directory -- as the same error reads in training, not a
    51-line traceback (issue 73, item 12)."""
    path = tmp_path / "buggy.py"
    path.write_text(BUGGY)
    code = main(["train", str(ROOT / "configs/dqn_cartpole.yaml"), f"algorithm.name={path}",
                 f"runs_dir={tmp_path / 'runs'}", "algorithm.hparams.learning_starts=0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("msrl: error: the probe's first iterations (2 envs, before any run directory) stopped: "
                          "AttributeError: 'BuggyLearner' object has no attribute 'paramters'; raised at "
                          f"{path}:8 in learn, in %"), err
    assert "call learner.learn(" in err and "algorithms/dqn.py:" in err
    assert not (tmp_path / "runs").exists()


NO_DETERMINISTIC = '''
import dataclasses
from msrl.algorithms.dqn import ALGORITHM as DQN, DQNActor


class GreedyActor(DQNActor):
    def act(self, obs, epsilon):
        return super().act(obs, epsilon)


ALGORITHM = dataclasses.replace(DQN, name="greedy", components={**DQN.components, "actor": GreedyActor})
'''


def test_an_actor_that_does_not_fit_evaluation_is_refused_before_training(tmp_path, capsys):
    """Evaluation calls ``act(obs, deterministic=True)``; an actor without that keyword failed
    only at the first evaluation (after the whole budget with ``eval_every: 0``) in a 48-line
    traceback. It is one line before training, naming the class, its file:line and the call,
    exit 2, no run directory (issue 73, item 12)."""
    path = tmp_path / "greedy.py"
    path.write_text(NO_DETERMINISTIC)
    code = main(["train", str(ROOT / "configs/dqn_cartpole.yaml"), f"algorithm.name={path}",
                 f"runs_dir={tmp_path / 'runs'}", "train.eval_every=0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"msrl: error: the actor GreedyActor ({path}:6) defines act(obs, epsilon), but evaluation calls "
                   "act(obs, deterministic=True): add a keyword argument deterministic (act greedily when True), as "
                   "the docs' actor contract says\n"), err
    assert not (tmp_path / "runs").exists()


def test_thread_and_bundle_settings_that_crowd_the_machine_say_so():
    """One line at start when the job's threads exceed the cores (issue 73, item 3): replicas of
    several threads on Ray started here (``cluster.cpus_per_replica={learner: 2}`` on 2 cores), or
    ``train.torch_threads`` above 1 in this process on a small or busy machine; not for msrl's
    plan of one-thread replicas sharing a small machine's cores, nor for a cluster's nodes."""
    from msrl.config import build_job_spec, load_config
    from msrl.run.driver import oversubscription

    def line(over, cores=2, load=0.0):
        cfg = load_config(CONFIG, over)
        return oversubscription(cfg, build_job_spec(cfg), cores, load)

    coarse = ["distribution_policy.name=single_learner_coarse", "runtime=ray"]
    assert line(coarse) is None  # 3 one-thread replicas on 2 cores: the plan
    said = line([*coarse, "cluster.cpus_per_replica={learner: 2}"])
    assert said.startswith("msrl: cluster.cpus_per_replica gives learner replicas 2 threads: 4 threads in all on this "
                           "2-core machine"), said
    assert line([*coarse, "cluster.cpus_per_replica={learner: 2}"], cores=8) is None
    assert line([*coarse, "cluster.cpus_per_replica={learner: 2}", "cluster.address=10.0.0.1:6379"]) is None
    assert line(["train.torch_threads=2"]) is None  # one replica thread, 2 threads, 2 idle cores
    assert "whose load is 3.2" in line(["train.torch_threads=2"], load=3.2)
    assert line(["train.torch_threads=4"]).startswith("msrl: train.torch_threads=4 for 1 replica thread(s) on this 2-core")


def test_a_long_evaluation_says_how_far_it_is(capsys):
    """An evaluation running longer than ``progress_every_s`` says how many episodes are done
    (a 154 s evaluation printed nothing: issue 73, item 3)."""
    import torch

    from msrl.run.evaluation import evaluate

    class Left:
        def act(self, obs, deterministic=True):
            return torch.zeros(obs.shape[0], dtype=torch.int64)

    returns = evaluate(Left(), "CartPole-v1", 3, seed=0, progress_every_s=0.0)
    lines = capsys.readouterr().err.splitlines()
    assert len(returns) == 3 and lines, lines
    assert all(line.startswith("msrl: evaluating on CartPole-v1: ") and " of 3 episodes done, " in line for line in lines)
    assert evaluate(Left(), "CartPole-v1", 3, seed=0, progress_every_s=None) == returns
    assert capsys.readouterr().err == ""
