"""Joining a Ray cluster the way an operator starts one (``ray start --head``), and starting
msrl's own Ray beside one that already runs on this machine.

Every test starts its own head on loopback with ``--block`` in a private ``HOME`` (its token
file), and stops it by the pids of its own process tree: other Ray jobs on the machine are never
looked at or touched.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest
from procs import RAY_ADDRESS_FILE, popen, run, stop_tree, wait_for

pytest.importorskip("ray")

ADDRESS_FILE = RAY_ADDRESS_FILE  # the tests' children get no RAY_TMPDIR (see _env): Ray's own default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: pathlib.Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # the user's Ray settings left out
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **more}


class Head:
    """``ray start --head --block`` on 127.0.0.1 with token authentication (Ray's default where the
    operator's machine holds a token; the head writes one into ``home``)."""

    def __init__(self, home: pathlib.Path, cpus: int = 3) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        before = ADDRESS_FILE.read_text() if ADDRESS_FILE.is_file() else None
        ray_cli = str(pathlib.Path(sys.executable).with_name("ray"))
        # the operator's token (~/.ray/auth_token of `home`), as `ray get-auth-token --generate` makes it
        subprocess.run([ray_cli, "get-auth-token", "--generate"], env=_env(home), check=True, capture_output=True,
                       timeout=600)
        self.proc = popen(
            [ray_cli, "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
             "--include-dashboard=false", "--disable-usage-stats", "--block"],
            death_signal=signal.SIGTERM, env=_env(home, RAY_AUTH_MODE="token", RAY_worker_niceness="0"), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        self.before = before
        try:
            wait_for(lambda: ADDRESS_FILE.is_file() and ADDRESS_FILE.read_text().strip().endswith(f":{self.port}"),
                     f"the head's address {self.address} in {ADDRESS_FILE}", alive=self.proc)
        except BaseException:
            self.stop()  # a head that failed to start is stopped too
            raise

    def stop(self) -> None:
        """Kills the head's own process tree; restores the address file it replaced."""
        stop_tree(self.proc)
        if ADDRESS_FILE.is_file() and ADDRESS_FILE.read_text().strip().endswith(f":{self.port}"):
            if self.before is None:
                ADDRESS_FILE.unlink()
            else:
                ADDRESS_FILE.write_text(self.before)


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "operator")
    yield h
    h.stop()


def _train(tmp_path, env, *over):
    cmd = [sys.executable, "-m", "msrl.run.cli", "train", "configs/ppo_cartpole.yaml", f"runs_dir={tmp_path / 'runs'}",
           "distribution_policy.name=single_learner_coarse", "train.total_env_steps=2560", "train.eval_every=0",
           "train.progress=false", *over]
    return run(cmd, env=env, cwd=pathlib.Path(__file__).parents[1])  # its process tree stopped whatever happens


def test_joins_a_token_auth_head_with_the_token_it_holds(tmp_path, head):
    """A head started as `ray start --head` has token authentication on; a driver on a machine
    holding the token (here: the same HOME) joins it with nothing else set."""
    out = _train(tmp_path, _env(tmp_path / "operator"), f"cluster.address={head.address}", "name=joined")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "InvalidAuthToken" not in out.stderr
    assert f"msrl: joined the Ray cluster at {head.address} (1 node(s), 3 CPUs)" in out.stderr
    assert (tmp_path / "runs" / "joined" / "eval.json").is_file()


def test_a_machine_without_the_token_gets_one_line_naming_the_address_and_the_fix(tmp_path, head):
    """Ray retries a refused token until its GCS wait ends: cluster.connect_timeout_s bounds it
    (20 s here rather than the default 60: the suite's time)."""
    out = _train(tmp_path, _env(tmp_path / "stranger"), f"cluster.address={head.address}", "name=refused",
                 "cluster.connect_timeout_s=20")
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("msrl:")]
    assert len(lines) == 1 and lines[0].startswith("msrl: error: cannot join the Ray cluster at "
                                                   f"cluster.address={head.address}")
    assert "ray get-auth-token" in lines[0] and "~/.ray/auth_token" in lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs" / "refused").exists()  # nothing written


def test_without_an_address_msrl_starts_its_own_ray_beside_a_running_cluster(tmp_path, head):
    """A cluster already runs on this machine (its address file in place): a run without
    cluster.address starts a Ray of its own rather than failing (or taking the other one's)."""
    out = _train(tmp_path, _env(tmp_path / "operator"), "name=own")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "num_cpus and num_gpus must not be provided" not in out.stderr
    assert "joined the Ray cluster" not in out.stderr
    assert ADDRESS_FILE.read_text().strip().endswith(f":{head.port}")  # the other cluster is left as it was
    assert head.proc.poll() is None
