"""What a newcomer trips on: each mistake is one line naming its line or key, before any work."""

from __future__ import annotations

import dataclasses
import pathlib
import textwrap

import pytest

from msrl.cli import main

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
    import msrl.run

    f = tmp_path / "a_file"
    f.write_text("x")
    monkeypatch.setattr(msrl.run, "make_job", lambda *a: pytest.fail("a job was built before the run directory was checked"))
    monkeypatch.chdir(tmp_path)
    code = main(["train", CONFIG, override.format(file=f), "train.total_env_steps=256"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("msrl: error: " + message.format(file=f)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def _readme_train_commands() -> list[list[str]]:
    import re
    import shlex

    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("msrl train configs/"):
                out.append(shlex.split(line)[2:])
    return out


@pytest.mark.parametrize("args", _readme_train_commands(), ids=lambda a: " ".join(a))
def test_every_readme_train_command_is_a_valid_job(args, monkeypatch):
    """Each ``msrl train CONFIG ...`` command of the README validates and builds its job spec as
    written (running them all is the slow suite's and the benchmarks' job)."""
    from msrl.config import build_job_spec, load_config

    monkeypatch.chdir(ROOT)
    cfg = load_config(args[0], args[1:])
    import torch

    if "gpu_only" in args[0] and not torch.cuda.is_available():
        pytest.skip("a config for a GPU machine")
    build_job_spec(cfg)


def test_ctrl_c_during_start_up_says_so(monkeypatch, capsys):
    import msrl.config

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(msrl.config, "load_config", interrupted)
    assert main(["train", CONFIG]) == 130
    assert capsys.readouterr().err == "\nmsrl: interrupted\n"


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's "From Python" block, executed as written (in a scratch directory holding
    the configs): it trains, loads, acts, evaluates, resumes and catches msrl.ConfigError."""
    import re

    block = re.search(r"### From Python\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md (From Python)", "exec"), scope)  # noqa: S102 - the README's own example
    out = capsys.readouterr().out
    assert "env.num_envs: Input should be greater than 0 (got 0)" in out
    assert scope["result"].env_steps <= 100_000 and len(scope["returns"]) == 20
    assert scope["action"].shape == () or scope["action"].shape == (1,)


def test_an_algorithm_module_on_pythonpath_is_found_by_its_bare_name(tmp_path, monkeypatch):
    import sys

    from msrl.job import load_algorithm

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
    from msrl.checkpoints import first_sentence as _first_sentence

    long = "PytorchStreamReader failed reading zip archive: failed finding central directory. " + "more words " * 60
    assert _first_sentence(long) == "PytorchStreamReader failed reading zip archive: failed finding central directory."
    cut = _first_sentence("word " * 100)
    assert cut.endswith(" ...") and not cut[:-4].endswith("wor")


def test_rays_token_note_is_dropped_and_its_warnings_are_not():
    import logging

    from msrl.cluster.ray_runtime import _DropTokenNote

    def rec(msg):
        return logging.LogRecord("ray", logging.WARNING, __file__, 1, msg, None, None)

    f = _DropTokenNote()
    assert not f.filter(rec("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ..."))
    assert f.filter(rec("Token authentication is disabled for this Ray cluster. Anyone with network access ..."))


def test_rays_worker_death_reports_are_dropped_and_its_other_lines_kept():
    from msrl.cluster.ray_runtime import _without_worker_deaths

    printed = []
    f = _without_worker_deaths(lambda data, ignore_prefix: printed.append(data["lines"]))
    f({"lines": ["A worker died or was killed while executing a task by an unexpected system error."],
       "pid": "raylet", "is_err": False}, False)
    f({"lines": ["something else", "A worker died or was killed ..."], "pid": "raylet", "is_err": False}, False)
    f({"lines": ["A worker died or was killed (printed by the user's task)"], "pid": 1234, "is_err": True}, False)
    assert printed == [["something else"], ["A worker died or was killed (printed by the user's task)"]]


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
    from msrl.job import Job
    from msrl.printer import format_boundary_bytes

    job = Job(build_job_spec(load_config(CONFIG, ["distribution_policy.name=single_learner_coarse"])))
    try:
        text = format_boundary_bytes(job)
        weights = sum(t.numel() * t.element_size() for t in job.component("learner").get_weights().values())
        kb = f"{2 * weights / 1024:.1f} KB"
        assert f"_learner_get_weights2: {kb} (learner -> actor)" in text, text
        assert "train_step/b0:trajectory: " in text and "0 B" not in text.split("trajectory: ")[1].split("\n")[0]
    finally:
        job.close()


MODULE_STATE = '''
import dataclasses
from msrl.algorithms.dqn import ALGORITHM as DQN, DQNTrainer, DQNActor

{decl}

class CountingActor(DQNActor):
    def act(self, obs, epsilon):
{bump}
        return super().act(obs, epsilon)

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

    from msrl.tracer import _immutable

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

    from msrl.graph import NodeKind
    from msrl.tracer import trace

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
