"""Bad values refused before any work: non-finite hyperparameters (in the config, or a NaN the
probe's first iterations meet), YAML's booleans where a key means on/off, a boundary value larger
than ``cluster.max_message_mb``, a resumed run told to change its algorithm, a policy whose
asynchronous boundaries would drop data or feed an update that cannot correct for the policy
lag, and a ``cluster.address`` where no Ray answers. Each is one line (exit status 2) and leaves
no run directory."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import threading

import pytest

from msrl.config import ConfigError, load_config
from msrl.run.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/ppo_cartpole.yaml")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("msrl:")]
    assert len(lines) == 1 and lines[0].startswith("msrl: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("value, shown", [("inf", "inf"), (".inf", "inf"), ("-.inf", "-inf"), ("1e400", "inf")])
def test_a_non_finite_hyperparameter_is_one_line_naming_it(tmp_path, capsys, value, shown):
    code = main(["train", CONFIG, f"algorithm.hparams.learning_rate={value}", f"runs_dir={tmp_path}"])
    line = _one_line_error(capsys)
    assert code == 2
    if shown == "-inf":  # below a PositiveFloat's bound first
        assert "algorithm.hparams.learning_rate: Input should be greater than 0" in line
    else:
        assert line == ("msrl: error: algorithm.hparams.learning_rate=inf: not a finite number (set in the config); "
                        "hyperparameters are finite (e.g. learning_rate=0.00025)")
    assert not any(tmp_path.iterdir())


def test_a_non_finite_hyperparameter_in_yaml_and_in_a_field_without_bounds(tmp_path):
    """``.inf`` in a YAML file; ``nan`` in a field that declares no bound (a user's algorithm's
    plain ``float``) is refused all the same."""
    text = pathlib.Path(CONFIG).read_text().replace("learning_rate: 0.0025", "learning_rate: .inf")
    assert ".inf" in text
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"algorithm.hparams.learning_rate=inf: not a finite number"):
        load_config(tmp_path / "c.yaml")
    algo = tmp_path / "loose_algo.py"
    algo.write_text(
        "import dataclasses\nfrom msrl.algorithms.ppo import ALGORITHM as PPO, PPOConfig\n\n"
        "@dataclasses.dataclass\nclass LooseConfig(PPOConfig):\n    scale: float = 1.0\n    sizes: tuple = (1.0,)\n\n"
        "ALGORITHM = dataclasses.replace(PPO, name='loose', hparams=LooseConfig)\n")
    for over, match in ((["algorithm.hparams.scale=.nan"], r"algorithm.hparams.scale=nan: not a finite number"),
                        (["algorithm.hparams.sizes=[1.0, .inf]"], r"algorithm.hparams.sizes=inf: not a finite number")):
        with pytest.raises(ConfigError, match=match):
            load_config(CONFIG, [f"algorithm.name={algo}", *over])


def test_a_learning_rate_that_diverges_in_the_probe_is_one_line_before_any_run_directory(tmp_path, capsys):
    """1e30 is finite, so the schema takes it; the probe's first update turns the loss non-finite:
    one line naming the value, the call and its line, and the hyperparameters that feed it."""
    code = main(["train", CONFIG, "algorithm.hparams.learning_rate=1e30", f"runs_dir={tmp_path}",
                 "train.progress=false"])
    line = _one_line_error(capsys)
    assert code == 2
    assert line.startswith("msrl: error: the probe's first iterations (2 envs, before any run directory) met a "
                           "non-finite value: loss is ")
    assert "call learner.learn(trajectory)" in line and "algorithms/ppo.py:" in line
    assert "learning_rate=1e+30" in line and "(set in the config)" in line
    assert not any(tmp_path.iterdir())
    import msrl

    with pytest.raises(msrl.ConfigError, match="met a non-finite value"):  # the Python API's input error
        msrl.train(CONFIG, runs_dir=str(tmp_path), algorithm__hparams__learning_rate=1e30, train__progress=False)


@pytest.mark.parametrize("text, want", [("on", "on"), ("off", "off"), ('"on"', "on"), ("auto", "auto")])
def test_on_and_off_are_read_as_the_words_they_are(tmp_path, text, want):
    """YAML 1.1 reads an unquoted on/off as a boolean; where a key's values are on/off, it means them."""
    assert load_config(CONFIG, [f"cluster.learner_priority={text}"]).cluster.learner_priority == want
    yaml_text = pathlib.Path(CONFIG).read_text() + f"\ncluster:\n  learner_priority: {text}\n"
    (tmp_path / "c.yaml").write_text(yaml_text)
    assert load_config(tmp_path / "c.yaml").cluster.learner_priority == want


def test_a_yaml_boolean_where_words_are_expected_says_to_quote_it():
    with pytest.raises(ConfigError, match=r"cluster.intra_node: Input should be 'shm' or 'gloo' \(got False: YAML reads "
                                          r"an unquoted yes/no/on/off/true/false as a boolean; quote the value"):
        load_config(CONFIG, ["cluster.intra_node=off"])


def test_a_boundary_value_over_max_message_mb_is_refused_before_any_replica_or_run_directory(tmp_path, capsys):
    code = main(["train", CONFIG, "distribution_policy.name=single_learner_coarse", "cluster.max_message_mb=0.01",
                 f"runs_dir={tmp_path}", "train.progress=false"])
    line = _one_line_error(capsys)
    assert code == 2 and line.startswith("msrl: error: cluster.max_message_mb=0.01: boundary ")
    assert "set cluster.max_message_mb to at least" in line
    assert not any(tmp_path.iterdir())


def test_message_sizes_scale_with_the_envs_a_replica_holds():
    """The probe's sizes (2 and 3 envs) extrapolate linearly; a replicated value is constant."""
    from msrl.frontend.probe import message_nbytes

    assert message_nbytes({"nbytes": {2: 100, 3: 140}}, 10) == 420  # 20 + 40 per env
    assert message_nbytes({"nbytes": {2: 64, 3: 64}}, 1000) == 64
    assert message_nbytes({"nbytes": None}, 10) is None


def test_resume_with_another_algorithm_names_the_algorithm(tmp_path, capsys):
    run = tmp_path / "a"
    assert main(["train", CONFIG, f"runs_dir={tmp_path}", "name=a", "train.total_env_steps=512", "train.eval_every=0",
                 "train.progress=false"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "algorithm.name=dqn"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"msrl: error: --resume {run}: algorithm.name='dqn' differs from the run's 'ppo' (config.yaml)")


def test_a_resume_may_move_the_bundles_per_fragment_but_not_what_the_run_computes():
    """``cluster.cpus_per_replica`` / ``gpus_per_replica`` (a number or per fragment) are
    placement, as ``cluster.address`` is: a resume may change them, never a hyperparameter."""
    from msrl.run.rundir import check_resumable

    config = ROOT / "configs/impala_cartpole.yaml"
    saved = load_config(config)
    moved = load_config(config, ["cluster.cpus_per_replica={learner: 2}", "cluster.gpus_per_replica.learner=1"])
    assert check_resumable(saved, moved, "runs/x") == ["cluster.cpus_per_replica", "cluster.cpus_per_replica.learner",
                                                       "cluster.gpus_per_replica", "cluster.gpus_per_replica.learner"]
    with pytest.raises(ConfigError, match=r"--resume runs/x: algorithm.hparams.clip_coef=0.1 differs from the run's None"):
        check_resumable(saved, load_config(config, ["cluster.cpus_per_replica.learner=2", "algorithm.hparams.clip_coef=0.1"]),
                        "runs/x")


@pytest.mark.parametrize("config, over, match", [
    ("a2c_cartpole.yaml", ["distribution_policy.name=async_learner"],
     "algorithm.name=a2c under distribution_policy.name=async_learner (weights: latest): the actors act with weights "
     "the learner has since updated"),
    ("a2c_cartpole.yaml", ["distribution_policy.name=single_learner_coarse", "distribution_policy.boundaries.weights=latest"],
     "a2c's update assumes the learner's own policy acted"),
    ("impala_cartpole.yaml", ["distribution_policy.boundaries.trajectories=latest"],
     "distribution_policy.boundaries.trajectories=latest: a latest-value slot keeps only the newest value, and every "
     "value of trajectories"),
])
def test_asynchronous_boundaries_that_would_change_what_the_algorithm_computes_are_refused(config, over, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load_config(ROOT / "configs" / config, over)


def test_an_algorithm_that_corrects_for_the_lag_runs_under_async_learner():
    assert load_config(ROOT / "configs/impala_cartpole.yaml").distribution_policy.name == "async_learner"
    load_config(CONFIG, ["distribution_policy.name=async_learner"])  # PPO: the clipped ratio to the behaviour policy


def test_an_address_where_nothing_listens_is_one_line_at_once(tmp_path, capsys):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["train", CONFIG, f"cluster.address=127.0.0.1:{port}", "distribution_policy.name=single_learner_coarse",
                 f"runs_dir={tmp_path}", "train.progress=false"])
    line = _one_line_error(capsys)
    assert code == 2 and line.startswith(f"msrl: error: cannot join the Ray cluster at cluster.address=127.0.0.1:{port}: "
                                         f"127.0.0.1 refused the connection at once: nothing listens on port {port} there")
    assert not any(tmp_path.iterdir())


def test_an_address_whose_host_does_not_resolve_says_so(tmp_path, capsys):
    code = main(["train", CONFIG, "cluster.address=no-such-host.invalid:6379", "distribution_policy.name=single_learner_coarse",
                 f"runs_dir={tmp_path}", "train.progress=false"])
    line = _one_line_error(capsys)
    assert code == 2 and line.startswith("msrl: error: cannot join the Ray cluster at cluster.address=no-such-host.invalid:6379: "
                                         "the host name 'no-such-host.invalid' does not resolve ("), line
    assert "nothing answered" not in line and not any(tmp_path.iterdir())


def test_an_address_that_answers_but_not_as_ray_is_bounded_by_connect_timeout_s(tmp_path, capsys):
    """A listener that is no Ray GCS (here: one that accepts and says nothing) is given up after
    cluster.connect_timeout_s, in one line, rather than Ray's minutes of retries."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        port = server.getsockname()[1]
        code = main(["train", CONFIG, f"cluster.address=127.0.0.1:{port}", "cluster.connect_timeout_s=2",
                     "distribution_policy.name=single_learner_coarse", f"runs_dir={tmp_path}", "train.progress=false"])
        line = _one_line_error(capsys)
        assert code == 2 and "something listens there but did not answer as a Ray GCS (gRPC) within " \
                              "cluster.connect_timeout_s=2 s" in line
        assert not any(tmp_path.iterdir())
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        server.close()


def test_a_ray_that_fails_to_start_is_one_line_with_its_cause(tmp_path, capsys, monkeypatch):
    """Ray's own start failing (seen on a machine under heavy load: "The current node timed out
    during startup"), after the one more start msrl tries, is one error line naming Ray's words
    and where its logs are, exit status 2."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()

    def timed_out(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the Ray "
                        "processes failed to startup.\nmore lines")

    monkeypatch.setattr(ray, "init", timed_out)
    code = main(["train", CONFIG, "distribution_policy.name=single_learner_coarse", f"runs_dir={tmp_path}",
                 "train.progress=false"])
    err = capsys.readouterr().err
    retry = [line for line in err.splitlines() if line.startswith("msrl: Ray's node did not register")]
    errors = [line for line in err.splitlines() if line.startswith("msrl:") and line not in retry]
    assert len(retry) == 1 and len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert code == 2 and line.startswith("msrl: error: cannot start Ray on this machine (Exception: The current node "
                                         "timed out during startup.")
    assert "Ray's logs are under " in line and "more lines" not in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("user_value", [None, "7"], ids=["default", "user_set"])
def test_a_ray_msrl_starts_waits_minutes_for_its_gcs_unless_the_user_says(monkeypatch, user_value):
    """Ray waits 30 s for a new GCS to come up; on a busy machine that ran out with nothing wrong
    (CI: "Timed out waiting for file .../gcs_server_port_..."). A Ray msrl starts waits
    :data:`LOCAL_GCS_WAIT_S`; ``RAY_gcs_server_port_wait_time_s`` set by the user wins."""
    ray = pytest.importorskip("ray")
    from msrl.cluster import bootstrap as ray_runtime

    if ray.is_initialized():
        ray.shutdown()
    if user_value is None:
        monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    else:
        monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", user_value)
    seen = {}

    def record(*args, **kwargs):
        seen["wait"] = os.environ.get("RAY_gcs_server_port_wait_time_s")
        raise Exception("stop here")

    monkeypatch.setattr(ray, "init", record)
    with pytest.raises(ray_runtime.ClusterJoinError, match="cannot start Ray on this machine"):
        ray_runtime.init_ray(None, num_cpus=2)
    assert seen["wait"] == (user_value or str(ray_runtime.LOCAL_GCS_WAIT_S))
    assert ray_runtime.LOCAL_GCS_WAIT_S >= 120


@pytest.mark.parametrize("failures", [1, 2])
def test_a_ray_whose_raylet_registers_late_is_started_once_more(monkeypatch, capsys, failures):
    """Ray waits a fixed 30 s for a new node's raylet to register (a CI run on a busy 2-core
    machine overran it: "The current node timed out during startup"): msrl shuts the half-started
    Ray down and starts it once more, saying so; a second overrun is one ClusterJoinError."""
    ray = pytest.importorskip("ray")
    from msrl.cluster import bootstrap as ray_runtime

    if ray.is_initialized():
        ray.shutdown()
    calls = {"init": 0, "shutdown": 0}

    def init(*args, **kwargs):
        calls["init"] += 1
        if calls["init"] <= failures:
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    if failures < ray_runtime.LOCAL_START_ATTEMPTS:
        ray_runtime.init_ray(None, num_cpus=2)
        assert calls == {"init": 2, "shutdown": 1}
        assert "msrl: Ray's node did not register within Ray's 30 s" in capsys.readouterr().err
    else:
        with pytest.raises(ray_runtime.ClusterJoinError, match="cannot start Ray on this machine.*timed out during startup"):
            ray_runtime.init_ray(None, num_cpus=2)
        assert calls["init"] == ray_runtime.LOCAL_START_ATTEMPTS


@pytest.mark.parametrize("over, match", [
    ("cluster.replica_timeout_s=inf", "cluster.replica_timeout_s: Input should be a finite number"),
    ("cluster.replica_timeout_s=1e9", "cluster.replica_timeout_s: Input should be less than or equal to 86400"),
])
def test_the_watchdog_is_turned_off_explicitly_not_by_an_endless_timeout(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, [over])
    assert load_config(CONFIG, ["cluster.watchdog=off"]).cluster.watchdog is False


@pytest.mark.parametrize("key, value, valid", [
    ("repeat_action_probability", "2", r"the sticky-action probability, in \[0, 1\]"),
    ("repeat_action_probability", "-0.1", r"in \[0, 1\]"),
    ("frameskip", "0", r"an integer >= 1"),
    ("mode", "-1", r"an integer >= 0"),
    ("full_action_space", "3", r"true or false"),
])
def test_ale_options_outside_their_range_are_refused_before_any_work(tmp_path, capsys, key, value, valid):
    """ALE's options are checked against their ranges before anything is made (ale-py takes a
    sticky-action probability of 2 and a whole run trains on a meaningless game): one line
    naming the key, exit 2, no run directory (issue 73, item 6). Under every engine."""
    for engine in ("sync", "ale_vector"):
        status = main(["train", "configs/ppo_pong.yaml", f"runs_dir={tmp_path}", f"env.kwargs.{key}={value}",
                       f"env.engine={engine}"])
        err = capsys.readouterr().err
        assert status == 2, err
        assert err.startswith(f"msrl: error: env.kwargs.{key}={value}: not a value ALE/Pong-v5 accepts; {key} is "), err
        assert re.search(valid, err), err
        assert not any(tmp_path.iterdir())
