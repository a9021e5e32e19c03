"""``msrl launch``: a run submitted to a running Ray cluster as a Ray Job; its input errors."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from procs import popen, ray_address_file_kept, stop_tree, wait_for

from msrl.cluster.launch import entrypoint
from msrl.run.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/ppo_cartpole.yaml"


@pytest.fixture()
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_entrypoint_runs_msrl_train_on_the_cluster_it_is_sent_to(in_repo):
    cmd = entrypoint(CONFIG, ["seed=3", "env.num_envs=8"], ".")
    assert cmd.startswith("python -m msrl.run.cli train configs/ppo_cartpole.yaml seed=3 env.num_envs=8 cluster.address=auto")
    assert cmd.endswith('runs_dir="$HOME"/msrl/runs')  # the uploaded copy is temporary
    assert "runs_dir" not in entrypoint(CONFIG, ["runs_dir=/data/runs"], ".").split("auto", 1)[1]


def test_launch_without_an_address_is_an_input_error(in_repo, capsys):
    assert main(["launch", CONFIG]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msrl: error: msrl launch needs the Ray cluster's dashboard address: --address")


def test_launch_checks_the_config_before_submitting(in_repo, capsys):
    assert main(["launch", CONFIG, "algorithm.hparams.gamma=high", "--address", "http://127.0.0.1:1"]) == 2
    assert "algorithm.hparams" in capsys.readouterr().err  # not a connection error: nothing was sent


def test_launch_refuses_files_outside_the_working_dir(in_repo, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    shutil.copy(CONFIG, cfg)
    assert main(["launch", str(cfg), "--address", "http://127.0.0.1:1"]) == 2
    assert "outside the working directory" in capsys.readouterr().err
    assert main(["launch", CONFIG, "cluster.address=ray://x:1", "--address", "http://127.0.0.1:1"]) == 2
    assert "cluster.address cannot be overridden" in capsys.readouterr().err


def test_launch_leaves_devices_to_the_cluster(in_repo, capsys):
    """A CUDA device the submitting machine lacks is the cluster's to provide: launch gets as far
    as contacting the cluster (here: none there), while a local train names the missing device."""
    port = _free_port()
    over = ["distribution_policy.name=single_learner_coarse", "distribution_policy.devices.learner=cuda:0"]
    assert main(["launch", CONFIG, *over, "--address", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Ray cluster at http://127.0.0.1:{port}" in err and "CUDA" not in err
    import torch

    if not torch.cuda.is_available():
        assert main(["train", CONFIG, *over]) == 2
        assert "device cuda:0 requested but no CUDA device is available on this machine" in capsys.readouterr().err


def test_launch_to_an_unreachable_cluster_is_an_input_error(in_repo, capsys):
    port = _free_port()
    assert main(["launch", CONFIG, "--address", f"http://127.0.0.1:{port}"]) == 2
    assert f"cannot reach the Ray cluster at http://127.0.0.1:{port}" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def ray_head(tmp_path):
    """A Ray head node with its dashboard (the Jobs server), as ``ray start --head`` starts one."""
    ray_bin = pathlib.Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        ray_bin = pathlib.Path(shutil.which("ray") or "ray")
    dash = _free_port()
    # no token authentication on this throwaway local cluster (a real one's token must be
    # available to msrl launch as to any Ray client)
    # RAY_worker_niceness=0: the operator's setting the README recommends (Ray's default 15 lets
    # any ordinary process on the machine starve the replicas)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0"}
    # --block: the head's processes stay below this one, and the test stops them by its own
    # process tree (never `ray stop`, which stops every Ray of the machine)
    log = tmp_path / "ray-start.log"
    with ray_address_file_kept():
        for attempt in range(3):  # Ray's own start-up deadlines can pass on a very busy machine
            with open(log, "w") as out:
                head = popen(
                    # the job agent on a free port (Ray's default, 52365, is taken by any other Ray on the machine)
                    [str(ray_bin), "start", "--head", f"--port={_free_port()}", f"--dashboard-port={dash}",
                     "--num-cpus=3", f"--dashboard-agent-listen-port={_free_port()}", "--include-dashboard=true",
                     "--dashboard-host=127.0.0.1", "--disable-usage-stats", "--block"],
                    death_signal=signal.SIGTERM, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )
            try:
                wait_for(lambda: _answers(f"http://127.0.0.1:{dash}/api/version"), f"the Ray dashboard on port {dash}",
                         alive=head)
                break
            except AssertionError as e:
                stop_tree(head)
                if attempt == 2:
                    raise AssertionError(f"{e}; ray start said: {log.read_text()[-3000:]}") from None
        try:
            yield f"http://127.0.0.1:{dash}"
        finally:
            stop_tree(head)


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_launch_runs_a_distributed_job_on_a_running_cluster(in_repo, ray_head, tmp_path, capsys):
    # single_learner_coarse on Ray: 2 actor processes and a learner, placed on the cluster the
    # job was sent to (cluster.address=auto inside the job)
    status = main([
        "launch", CONFIG, "distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2",
        "runtime=ray", "train.total_env_steps=2048", "train.eval_every=0", "train.progress=false",
        f"runs_dir={tmp_path}", "--address", ray_head,
    ])
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    assert "SUCCEEDED" in out and "2048 env steps" in out
    run = tmp_path / "ppo_cartpole"
    assert (run / "metrics.csv").read_text().count("\n") >= 8
    replicas = (run / "replicas.json").read_text()
    assert '"actor"' in replicas and '"learner"' in replicas
