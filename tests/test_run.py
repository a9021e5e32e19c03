"""Training runs end to end: the CLI, the run directory, resume, NaN handling."""

import csv
import json
import pathlib

import gymnasium
import numpy as np
import pytest
from procs import EVENT_TIMEOUT_S, popen, stop_tree, wait_for

from msrl.config import ConfigError, load_config
from msrl.run.cli import main
from msrl.run.job import Job
from msrl.run.plot import wait_for_background_plots
from msrl.run.training import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "configs" / "ppo_cartpole.yaml"
TINY = ["train.total_env_steps=2048", "train.progress=false", "env.num_envs=4", "algorithm.hparams.num_steps=64",
        "train.eval_every=512", "eval.episodes=3"]


def rows(run_dir):
    with open(pathlib.Path(run_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_cli_train_eval_plot_graph_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(MAIN), "runs_dir=runs", "name=tiny", *TINY]) == 0
    out = capsys.readouterr().out
    assert "run runs/tiny: 8 iterations, 2048 env steps" in out and "evaluation: mean return" in out
    run = tmp_path / "runs" / "tiny"
    assert wait_for_background_plots(timeout_s=EVENT_TIMEOUT_S) == [0]  # the curve is drawn beside the run
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "config.yaml", "eval.json", "learning_curve.png",
                                                    "metrics.csv", "tb"]
    assert (run / "checkpoints" / "latest.pt").is_file() and not list((run / "checkpoints").glob("*.tmp"))
    assert list((run / "tb").glob("events.out.tfevents.*"))
    r = rows(run)
    assert [int(x["iteration"]) for x in r] == list(range(1, 9))
    assert int(r[-1]["env_steps"]) == 2048
    assert {"charts/episodic_return", "charts/SPS", "losses/value_loss", "losses/approx_kl", "charts/learning_rate", "eval/mean_return"} <= set(r[0])
    assert sum(1 for x in r if x["eval/mean_return"]) == 4  # every 512 steps
    ev = json.loads((run / "eval.json").read_text())
    assert ev["episodes"] == 3 and len(ev["returns"]) == 3 and ev["env_steps"] == 2048
    # the resolved config round-trips
    saved = load_config(run / "config.yaml")
    assert saved.train.total_env_steps == 2048 and saved.name == "tiny"
    # a second run with the same name gets its own directory
    assert main(["train", str(MAIN), "runs_dir=runs", "name=tiny", *TINY]) == 0
    assert (tmp_path / "runs" / "tiny-1" / "eval.json").is_file()
    capsys.readouterr()

    assert main(["eval", str(run), "--episodes", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["episodes"] == 3 and res["mean_return"] == pytest.approx(ev["mean_return"])  # same seeds, same policy

    (run / "learning_curve.png").unlink()
    assert main(["plot", str(run)]) == 0
    assert (run / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["graph", str(MAIN), "distribution_policy.name=single_learner_coarse", "-o", "fdg.png"]) == 0
    text = capsys.readouterr().out
    assert "## boundaries" in text and "gather trajectory actor (x2) -> learner (x1), sharded, axis 1" in text
    assert (tmp_path / "fdg.png").read_bytes()[:4] == b"\x89PNG"
    assert text.rstrip().endswith(f"picture of the fragmented graph: {(tmp_path / 'fdg.png').resolve()}")  # where it went


def test_graph_prints_the_generated_programs(capsys):
    from msrl.config import build_job_spec
    from msrl.run.printer import format_job

    assert main(["graph", str(MAIN), "distribution_policy.name=single_learner_coarse", "--out", "/dev/null"]) == 0
    printed = capsys.readouterr().out
    job = Job(build_job_spec(load_config(MAIN, ["distribution_policy.name=single_learner_coarse"])))
    for (frag, method), program in job.programs.items():
        assert program.source.rstrip() in printed, (frag, method)
    assert format_job(job) in printed
    job.close()


GPU_ONLY = ROOT / "configs" / "ppo_cartpole_gpu_only.yaml"
TAG = ROOT / "configs" / "ma_ppo_tag.yaml"


@pytest.mark.parametrize(
    "config,over",
    [
        (MAIN, [*TINY, "distribution_policy.name=single"]),
        (MAIN, [*TINY, "distribution_policy.name=single_learner_coarse", "runtime=local"]),  # in-process: the test patches Job
        (GPU_ONLY, ["train.progress=false", "env.num_envs=4", "algorithm.hparams.num_steps=64", "train.total_env_steps=2048"]),
        (TAG, ["train.progress=false", "env.num_envs=4", "algorithm.hparams.num_steps=20", "train.total_env_steps=800"]),
        # draws from the global generators only: their per-replica states are in the checkpoint
        (ROOT / "configs" / "a2c_cartpole.yaml",
         ["train.progress=false", f"algorithm.name={ROOT / 'tests' / 'global_rng_algo.py'}", "env.num_envs=4",
          "train.total_env_steps=480", "distribution_policy.name=single_learner_coarse", "runtime=local"]),
    ],
    ids=["single", "single_learner_coarse", "gpu_only-native-cartpole", "ma_ppo-tag", "global-generators-coarse"],
)
def test_resume_continues_exactly(tmp_path, monkeypatch, config, over):
    over = [*over, f"runs_dir={tmp_path}", "train.checkpoint_every=2"]
    full = train(load_config(config, over + ["name=full"]))

    cfg = load_config(config, over + ["name=crash"])
    real = Job.run
    calls = {"n": 0, "chunks_done": 0}

    def crashing(self, n):
        records = []
        for _ in range(n):
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyboardInterrupt  # killed during iteration 4; the checkpoint is at 2
            records += real(self, 1)
        calls["chunks_done"] = self.iteration  # a chunk that returned: its rows are logged
        return records

    monkeypatch.setattr(Job, "run", crashing)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(Job, "run", real)
    crash_dir = tmp_path / "crash"
    # rows are written per chunk of freely running iterations, and a chunk ends at every
    # checkpoint: the checkpointed iterations (1-2) left rows, and so did any chunk that returned
    # before the crash (how many iterations a chunk holds depends on the machine's speed); the
    # crashed chunk left none
    assert calls["chunks_done"] in (2, 3)
    assert [int(r["iteration"]) for r in rows(crash_dir)] == list(range(1, calls["chunks_done"] + 1))
    resumed = train(cfg, resume=crash_dir)

    def strip(rs):
        return [{k: v for k, v in r.items() if k not in ("time_s", "charts/SPS")} for r in rs]

    assert strip(rows(crash_dir)) == strip(rows(full.run_dir))
    assert resumed.eval_returns == full.eval_returns
    assert resumed.env_steps == full.env_steps


def test_resume_rejects_a_different_config(tmp_path):
    cfg = load_config(MAIN, [*TINY, f"runs_dir={tmp_path}", "name=a"])
    r = train(cfg)
    other = load_config(MAIN, [*TINY, f"runs_dir={tmp_path}", "name=a", "seed=5"])
    with pytest.raises(ConfigError, match=r"seed=5 differs from the run's 1 \(config.yaml\); a resumed run may change only "
                                           r"train.total_env_steps"):
        train(other, resume=r.run_dir)
    with pytest.raises(ConfigError, match="not a run directory"):
        train(cfg, resume=tmp_path / "nothing")
    dqn = load_config(ROOT / "configs" / "dqn_cartpole.yaml", [f"runs_dir={tmp_path}", "name=a"])
    with pytest.raises(ConfigError, match=r"algorithm.name='dqn' differs from the run's 'ppo'"):
        train(dqn, resume=r.run_dir)  # the root of the difference, not one of its hyperparameters


def test_resume_alone_and_for_longer_continues_the_run(tmp_path, capsys):
    """``msrl train --resume RUN_DIR train.total_env_steps=N``: the run's own config, a longer
    budget; the same rows as a run that had that budget... up to the first run's end, then more."""
    run = tmp_path / "a"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=a", *TINY]) == 0
    assert main(["train", "--resume", str(run)]) == 0  # nothing left to do: the run's own config
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.total_env_steps=4096"]) == 0
    captured = capsys.readouterr()
    assert "4096 env steps" in captured.out and "train.total_env_steps=4096" in captured.err
    assert [int(r["iteration"]) for r in rows(run)] == list(range(1, 17))  # 2048 + 2048 steps of 256
    assert load_config(run / "config.yaml").train.total_env_steps == 4096  # a plain --resume now keeps it
    assert main(["train", "--resume", str(run), "train.total_env_steps=1024"]) == 2
    assert "a resumed run can only train for longer" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "algorithm.hparams.learning_rate=0.1"]) == 2
    assert "algorithm.hparams.learning_rate=0.1 differs from the run's" in capsys.readouterr().err
    assert [int(r["iteration"]) for r in rows(run)] == list(range(1, 17))  # refused runs wrote nothing


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background-job"])
def test_ctrl_c_is_an_interruption_with_a_resume_hint(tmp_path, sigint_ignored):
    """SIGINT stops a run with its checkpoint kept and a resume line, also when ``msrl train``
    started with SIGINT ignored (a background job of a script, ``nohup``, a CI wrapper): msrl's
    own process takes SIGINT back (issue 73, item 5)."""
    import signal
    import subprocess
    import sys
    import time

    proc = popen([sys.executable, "-m", "msrl.run.cli", "train", str(MAIN), f"runs_dir={tmp_path}", "name=c",
                  "train.progress=false", "train.total_env_steps=10000000", "train.checkpoint_every=5"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, sigint_ignored=sigint_ignored)
    ckpt = tmp_path / "c" / "checkpoints" / "latest.pt"
    try:
        wait_for(ckpt.is_file, f"a checkpoint at {ckpt}", alive=proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        stop_tree(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("msrl: interrupted at env step ") and f"checkpoint kept: {ckpt} (env step " in last
    assert last.endswith(f"resume with: msrl train --resume {tmp_path / 'c'}")


def test_help_and_config_errors_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom msrl.run.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    for argv in (["--help"], ["train", str(MAIN), "trian.x=1"]):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600)
        assert out.stdout.strip().splitlines()[-1] == "False", (argv, out.stdout, out.stderr)


class NaNCartPole(gymnasium.Wrapper):
    """CartPole whose observations turn NaN after ``after`` steps."""

    def __init__(self, after: int = 300):
        super().__init__(gymnasium.make("CartPole-v1"))
        self.after, self.t = after, 0

    def step(self, action):
        obs, r, te, tr, info = self.env.step(action)
        self.t += 1
        if self.t > self.after:
            obs = np.full_like(obs, np.nan)
        return obs, r, te, tr, info


gymnasium.register("msrl-test/NaNCartPole-v0", entry_point=NaNCartPole)


def test_nan_from_env_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, capsys):
    code = main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=nan", "env.id=msrl-test/NaNCartPole-v0", "env.num_envs=1",
                 "algorithm.hparams.num_steps=64", "train.checkpoint_every=1", "train.total_env_steps=4096", "train.progress=false"])
    assert code == 1
    err = capsys.readouterr().err
    assert "training stopped at iteration 5 (after env step 256)" in err
    assert "FloatingPointError: env 'msrl-test/NaNCartPole-v0' returned a non-finite observation or reward at env step 301" in err
    assert "env.step(action)" in err and "ppo.py" in err
    assert f"last good checkpoint: {tmp_path}/nan/checkpoints/latest.pt" in err
    last = err.strip().splitlines()[-1]  # one line, no traceback
    assert "Traceback" not in err and last.startswith("msrl: training stopped at iteration 5") and "latest.pt" in last
    import torch

    ckpt = torch.load(tmp_path / "nan" / "checkpoints" / "latest.pt", weights_only=False)
    assert ckpt["job"]["iteration"] == 4 and ckpt["env_steps"] == 256
    assert not (tmp_path / "nan" / "eval.json").exists()


def test_tensorboard_holds_every_metrics_row(tmp_path):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from msrl.config import load_config
    from msrl.run.training import train

    r = train(load_config("configs/ppo_cartpole.yaml", [f"runs_dir={tmp_path}", "train.total_env_steps=2048",
                                                         "train.progress=false", "train.eval_every=0"]))
    with open(r.run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    ea = EventAccumulator(str(r.run_dir / "tb"))
    ea.Reload()
    for tag in ("losses/value_loss", "charts/learning_rate", "charts/SPS"):
        events = ea.Scalars(tag)
        assert [e.step for e in events] == [int(row["env_steps"]) for row in rows]
        assert [e.value for e in events] == pytest.approx([float(row[tag]) for row in rows], rel=1e-6)


def test_tensorboard_checksums_in_c_are_tensorboards_own(tmp_path):
    """The event records' checksums made by google-crc32c equal TensorBoard's pure-Python ones,
    and a run's event file written with them reads back through TensorBoard's reader, which
    checks every record's checksums."""
    import os

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New, masked_crc32c
    from tensorboard.summary.writer import record_writer

    from msrl.run.metrics import MetricsWriter, _masked_crc32c, use_native_crc32c

    for n in (0, 1, 3, 8, 300, 4097):
        data = os.urandom(n)
        assert _masked_crc32c(data) == masked_crc32c(data)
    assert use_native_crc32c() and record_writer.masked_crc32c is _masked_crc32c
    m = MetricsWriter(tmp_path, None)
    for i in range(1, 40):
        m.log({"iteration": i, "env_steps": 16 * i, "time_s": 0.1 * i, "losses/value_loss": 1.0 / i})
    m.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    reader, records = PyRecordReader_New(str(events)), 0
    while True:
        try:
            reader.GetNext()  # raises DataLossError on a checksum that does not match
        except Exception as e:  # noqa: BLE001 - the stub reader signals the end as OutOfRangeError
            assert type(e).__name__ == "OutOfRangeError", e
            break
        records += 1
    assert records == 40  # the file's version record and one per row


def test_without_google_crc32c_tensorboards_own_checksum_stays(monkeypatch):
    """Where google-crc32c is missing (a machine installing from a few wheels) or runs without
    its C extension, TensorBoard's record writer is left with its own checksum."""
    import sys

    import google_crc32c
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as own
    from tensorboard.summary.writer import record_writer

    from msrl.run.metrics import use_native_crc32c

    monkeypatch.setattr(record_writer, "masked_crc32c", own)  # TensorBoard's own (restored after)
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # import google_crc32c raises ImportError
    assert not use_native_crc32c() and record_writer.masked_crc32c is own
    monkeypatch.setitem(sys.modules, "google_crc32c", google_crc32c)
    monkeypatch.setattr(google_crc32c, "implementation", "python", raising=False)
    assert not use_native_crc32c() and record_writer.masked_crc32c is own


def _snapshot(run_dir):
    """Every file of a run directory but its lock (which names the last process that held it)."""
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(pathlib.Path(run_dir).rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_keep_weights_keeps_each_checkpoints_policy_named_by_its_env_steps(tmp_path):
    """``train.keep_weights``: every checkpoint's actor weights also in ``checkpoints/weights/<env
    steps>.pt``, the last one the latest checkpoint's; a resumed run goes on keeping them."""
    import torch

    run = tmp_path / "k"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=k", *TINY, "train.checkpoint_every=2",
                 "train.keep_weights=true"]) == 0
    kept = sorted((run / "checkpoints" / "weights").iterdir(), key=lambda p: int(p.stem))
    steps = [int(r["env_steps"]) for r in rows(run)]
    assert [int(p.stem) for p in kept] == steps[1::2]
    last, latest = torch.load(kept[-1]), torch.load(run / "checkpoints" / "latest.pt", weights_only=False)
    assert last["env_steps"] == latest["env_steps"] == steps[-1]
    assert all(torch.equal(last["actor_weights"][k], v) for k, v in latest["actor_weights"].items())
    assert main(["train", "--resume", str(run), f"train.total_env_steps={steps[-1] + 2 * (steps[1] - steps[0])}"]) == 0
    assert len(list((run / "checkpoints" / "weights").iterdir())) == len(kept) + 1


@pytest.mark.parametrize("damage", ["truncate", "random", "empty"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, damage):
    run = tmp_path / "d"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=d", *TINY, "train.checkpoint_every=2"]) == 0
    latest, previous = run / "checkpoints" / "latest.pt", run / "checkpoints" / "previous.pt"
    assert previous.is_file()  # the checkpoint before the latest is kept
    data = latest.read_bytes()
    latest.write_bytes({"truncate": data[: len(data) // 2], "random": np.random.default_rng(0).bytes(len(data)),
                        "empty": b""}[damage])
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    err = capsys.readouterr().err
    assert f"{latest}: damaged checkpoint" in err and f"falling back to {previous}" in err
    assert main(["train", "--resume", str(run), "train.total_env_steps=2560"]) == 0
    assert "falling back" in capsys.readouterr().err
    assert [int(r["iteration"]) for r in rows(run)] == list(range(1, 11))
    assert (run / "checkpoints" / "latest.pt.damaged").read_bytes() != data  # set aside, not deleted
    assert main(["eval", str(run), "--episodes", "2"]) == 0  # the new latest.pt is good
    assert "falling back" not in capsys.readouterr().err


def test_no_readable_checkpoint_is_a_one_line_error_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "d"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=d", *TINY, "train.checkpoint_every=2"]) == 0
    (run / "checkpoints" / "latest.pt").write_bytes(b"not a checkpoint at all")
    (run / "checkpoints" / "previous.pt").write_bytes(b"")
    wait_for_background_plots(timeout_s=EVENT_TIMEOUT_S)  # the run's curve, drawn beside it, is the run's
    before = _snapshot(run)
    capsys.readouterr()
    for argv in (["train", "--resume", str(run), "train.total_env_steps=4096"], ["eval", str(run)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("msrl: error: ")
        assert "latest.pt: damaged checkpoint" in err[0] and "previous.pt: damaged checkpoint (empty file)" in err[0]
    assert _snapshot(run) == before  # nothing written


def test_eval_episodes_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", str(tmp_path), "--episodes", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "msrl: error: msrl eval: argument --episodes: must be at least 1, got 0 (see msrl eval --help)\n"


def test_every_bad_input_is_one_line_exit_2_and_changes_no_run(tmp_path, capsys):
    """The misuse cases of the CLI, each against an existing run: exit status 2, one line on
    stderr naming the problem, and the run directory byte for byte as before."""
    from msrl.run.rundir import RunLock

    run = tmp_path / "r"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=r", *TINY, "train.checkpoint_every=2"]) == 0
    # the learning curve is drawn by a background process after the run returns: the run is whole
    # once it is there (a picture, or its text where none can be drawn)
    wait_for(lambda: (run / "learning_curve.png").is_file() or (run / "learning_curve.txt").is_file(),
             "the run's learning curve")
    before = _snapshot(run)
    capsys.readouterr()

    def status(argv):
        try:
            return main(argv)
        except SystemExit as e:  # argparse's usage errors
            return e.code

    new = ["train", str(MAIN), f"runs_dir={tmp_path}", "name=r"]
    cases = [
        (new + ["algorithm.hparams.learning_rate=-1"], "algorithm.hparams.learning_rate: Input should be greater than 0"),
        (new + ["algorithm.name=ma_ppo"], "ma_ppo is multi-agent"),
        (new + ["algorithm.hparams.hidden_sizes=[]"], "algorithm.hparams.hidden_sizes"),
        (new + ["trian.total_env_steps=5"], "unknown key 'trian'"),
        (["train", "--resume", str(run), "seed=9"], "seed=9 differs from the run's 1"),
        (["train", "--resume", str(run), "train.total_env_steps=512"], "a resumed run can only train for longer"),
        (["train", "--resume", str(tmp_path / "nope")], "is not a run directory"),
        (["train"], "msrl train needs a CONFIG"),
        (["eval", str(run), "--episodes", "0"], "--episodes: must be at least 1"),
        (["eval", str(run), "--episodes", "many"], "--episodes: expected a positive whole number"),
    ]
    for argv, expected in cases:
        assert status(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("msrl: error: ") and expected in err, (argv, err)
    lock = RunLock(run)  # another process training in the run
    try:
        assert status(["train", "--resume", str(run), "train.total_env_steps=4096"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"run directory {run} is in use by process " in err
    finally:
        lock.release()
    assert _snapshot(run) == before  # none of them wrote anything
    latest = run / "checkpoints" / "latest.pt"
    good = latest.read_bytes()
    latest.write_bytes(good[: len(good) // 3])
    (run / "checkpoints" / "previous.pt").write_bytes(b"")
    damaged = _snapshot(run)
    for argv in (["train", "--resume", str(run), "train.total_env_steps=4096"], ["eval", str(run)]):
        assert status(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "latest.pt: damaged checkpoint" in err
    assert _snapshot(run) == damaged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # no other run directory was made


def test_two_processes_on_one_run_directory(tmp_path, capsys):
    """A second ``--resume`` of a run that is training is refused with the holder's pid and
    changes nothing; once the holder ends (even by SIGKILL) the lock is stale and taken over."""
    import signal
    import subprocess
    import sys

    run = tmp_path / "r"
    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=r", *TINY]) == 0
    holder = popen([sys.executable, "-m", "msrl.run.cli", "train", "--resume", str(run),
                    "train.total_env_steps=10000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: str(holder.pid) in (run / ".lock").read_text(), f"process {holder.pid} holding {run}/.lock",
                 alive=holder)
        capsys.readouterr()
        assert main(["train", "--resume", str(run), "train.total_env_steps=20000000"]) == 2
        err = capsys.readouterr().err
        assert f"run directory {run} is in use by process {holder.pid} on " in err
        assert load_config(run / "config.yaml").train.total_env_steps == 10000000  # the refused one wrote nothing
        holder.send_signal(signal.SIGKILL)  # a crash: the lock file stays, the lock does not
        holder.wait(300)
    finally:
        stop_tree(holder)
    assert str(holder.pid) in (run / ".lock").read_text()
    assert main(["train", "--resume", str(run), "train.total_env_steps=10240", "train.progress=false"]) == 0


def test_progress_bar_shows_one_speed_an_evaluating_state_and_the_run_directory(tmp_path, capsys, monkeypatch):
    from msrl.run.loop import TrainingLoop

    make_bar = TrainingLoop._progress_bar

    def every_update_draws(self):  # as on a slow machine, where tqdm's 0.1 s between draws has passed
        bar = make_bar(self)
        bar.mininterval = 0
        return bar

    monkeypatch.setattr(TrainingLoop, "_progress_bar", every_update_draws)
    over = [f"runs_dir={tmp_path}", "name=p", "train.total_env_steps=3072", "train.eval_every=1024", "eval.episodes=2"]
    assert main(["train", str(MAIN), *over]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"msrl: run directory {tmp_path / 'p'}\n")
    frames = [f for f in err.replace("\r", "\n").splitlines() if "%|" in f]
    assert "/s" not in frames[0]  # nothing measured yet
    assert len(frames) > 2 and all(f.count("/s") == 1 and "steps/s=" in f for f in frames[1:])  # not tqdm's own rate
    assert any(f.startswith("evaluating:") for f in frames) and frames[-1].startswith("training: 100%")
    assert main(["train", str(MAIN), *over, "train.eval_every=0"]) == 0
    assert capsys.readouterr().err.startswith(f"msrl: run directory {tmp_path / 'p-1'} ({tmp_path / 'p'} exists)\n")


def test_a_multi_agent_plot_draws_the_per_type_returns():
    from msrl.run.plot import return_series

    tag = ["iteration", "env_steps", "charts/episodic_return", "charts/tagger_return", "charts/runner_return"]
    assert return_series(tag) == [("tagger return", "charts/tagger_return"), ("runner return", "charts/runner_return")]
    assert return_series(["iteration", "charts/episodic_return"]) == [("episodic return", "charts/episodic_return")]
    selfplay = ["iteration", "charts/episodic_return", "selfplay/games", "selfplay/win_rate", "selfplay/draw_rate",
                "selfplay/loss_rate"]
    assert [c for _, c in return_series(selfplay)] == ["selfplay/win_rate", "selfplay/draw_rate", "selfplay/loss_rate"]


def test_ctrl_c_during_the_final_evaluation_says_where_to_resume(tmp_path, monkeypatch):
    """The budget is trained and checkpointed when the final evaluation starts: Ctrl-C there is
    an interruption with the resume hint, and the resume only evaluates."""
    import msrl.run.loop
    from msrl.run.outcome import TrainingInterrupted

    real = msrl.run.loop.evaluate_job

    def interrupted(job, cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(msrl.run.loop, "evaluate_job", interrupted)
    cfg = load_config(MAIN, [*TINY, f"runs_dir={tmp_path}", "name=e", "train.eval_every=0"])
    with pytest.raises(TrainingInterrupted) as info:
        train(cfg)
    run = tmp_path / "e"
    assert str(info.value).endswith(f"resume with: msrl train --resume {run}") and "env step 2048" in str(info.value)
    monkeypatch.setattr(msrl.run.loop, "evaluate_job", real)
    resumed = train(cfg, resume=run)
    assert resumed.env_steps == 2048 and len(resumed.eval_returns) == cfg.eval.episodes
    assert [int(r["iteration"]) for r in rows(run)] == list(range(1, 9))


def test_the_latest_checkpoint_is_never_missing_while_the_next_one_is_saved(tmp_path, monkeypatch):
    """Rotating latest.pt into previous.pt never leaves a moment without latest.pt (a Ctrl-C or a
    crash there once made `msrl: interrupted ...; no checkpoint was written yet` under load):
    every rename of the save is made with latest.pt in place, and the files end as they must."""
    import os

    import torch

    from msrl.run import checkpoints

    path = tmp_path / "latest.pt"
    checkpoints.atomic_save({"v": 1}, path, keep_previous=True)
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        assert path.is_file(), f"latest.pt missing before renaming {src} -> {dst}"
        renames.append((pathlib.Path(src).name, pathlib.Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoints.os, "replace", replace)
    checkpoints.atomic_save({"v": 2}, path, keep_previous=True)
    assert renames and renames[-1] == ("latest.pt.tmp", "latest.pt")
    assert torch.load(path)["v"] == 2 and torch.load(tmp_path / "previous.pt")["v"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "previous.pt"]
    checkpoints.atomic_save({"v": 3}, path, keep_previous=True)
    assert torch.load(path)["v"] == 3 and torch.load(tmp_path / "previous.pt")["v"] == 2


def test_an_asynchronous_policy_runs_chunks_of_several_slow_iterations():
    """A chunk's end drains an asynchronous pipeline, so under ``async_learner`` the driver lets
    the replicas run at least ``ASYNC_MIN_ITERATIONS`` however slow an iteration is (a chunk of one
    1-s IMPALA iteration ran the actors and the learner one after the other); a synchronous policy
    keeps chunks of about ``CHUNK_S``; the next checkpoint still ends a chunk."""
    from types import SimpleNamespace

    from msrl.policy import load_policy
    from msrl.run.loop import TrainingLoop

    def chunk(policy, iter_s, iteration=0, checkpoint_every=50):
        loop = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(checkpoint_every=checkpoint_every, eval_every=0)),
                               job=SimpleNamespace(iteration=iteration, env_steps=0), progress=SimpleNamespace(done_eval=0),
                               spec=SimpleNamespace(num_iterations=1000, policy=load_policy(policy)), steps_per_iteration=320,
                               CHUNK_S=TrainingLoop.CHUNK_S, ASYNC_MIN_ITERATIONS=TrainingLoop.ASYNC_MIN_ITERATIONS)
        return TrainingLoop._chunk_size(loop, iter_s)

    assert TrainingLoop.ASYNC_MIN_ITERATIONS == 8
    assert chunk("async_learner", 1.0) == 8 and chunk("single_learner_coarse", 1.0) == 1
    assert chunk("async_learner", 0.001) == chunk("single_learner_coarse", 0.001) == 50  # the checkpoint first
    assert chunk("async_learner", 1.0, iteration=47) == 3  # a checkpoint due ends the chunk
    assert chunk("async_learner", None) == 1  # the first iteration alone: its time is unknown


def test_the_printed_resume_command_pastes_into_a_shell(tmp_path):
    """The resume line names the run directory shell-quoted: a runs directory with a space (or a
    quote) pastes back as one argument (issue 73, item 8)."""
    import shlex

    from msrl.run.outcome import TrainingInterrupted, resume_command

    run_dir = tmp_path / "my runs" / "it's c"
    line = str(TrainingInterrupted(run_dir, 100, run_dir / "checkpoints" / "latest.pt", 80))
    command = line.split("resume with: ", 1)[1]
    assert command == resume_command(run_dir)
    assert shlex.split(command) == ["msrl", "train", "--resume", str(run_dir)]


def test_a_resume_may_change_a_number_into_a_per_fragment_mapping(tmp_path, capsys):
    """``--resume RUN 'cluster.cpus_per_replica={learner: 2}'`` (a key the refusal lists as one a
    resume may change, given per fragment where the run had one number) resumes and says what it
    changed, once, whole (issue 73, item 1: a KeyError traceback)."""
    from msrl.run.cli import main

    base = [f"runs_dir={tmp_path}", "name=a", "train.progress=false", "train.eval_every=0", "eval.episodes=1",
            "distribution_policy.name=single_learner_coarse", "runtime=local", "env.num_envs=4",
            "algorithm.hparams.num_steps=16"]
    assert main(["train", str(MAIN), *base, "train.total_env_steps=256"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "a"), "cluster.cpus_per_replica={learner: 2}",
                 "train.total_env_steps=512"]) == 0
    err = capsys.readouterr().err
    assert f"msrl: resuming {tmp_path / 'a'} with cluster.cpus_per_replica={{'learner': 2.0}}, train.total_env_steps=512" in err
    assert "Traceback" not in err


def test_a_read_only_run_directory_is_one_line_for_resume_and_plot(tmp_path, capsys, monkeypatch):
    """``--resume`` and ``msrl plot`` of a run directory msrl may not write (a read-only
    filesystem, simulated in this process: every open for writing under it fails with EROFS) end
    in one line naming the path, exit 2, not a traceback (issue 73, item 7)."""
    import builtins
    import errno
    import os

    from msrl.run.cli import main

    base = [f"runs_dir={tmp_path}", "name=a", "train.progress=false", "train.eval_every=0", "eval.episodes=1",
            "env.num_envs=4", "algorithm.hparams.num_steps=16", "train.total_env_steps=256"]
    assert main(["train", str(MAIN), *base]) == 0
    capsys.readouterr()
    run, real_open, real_os_open = str(tmp_path / "a"), builtins.open, os.open

    def read_only(path) -> bool:
        return str(path).startswith(run)

    def open_(file, mode="r", *a, **k):
        if read_only(file) and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *a, **k)

    def os_open(path, flags, *a, **k):
        if read_only(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    for argv in (["train", "--resume", run, "train.total_env_steps=512"], ["plot", run]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"msrl: error: cannot write {run}") and "Read-only file system" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_signal_during_a_checkpoint_write_waits_for_its_end(tmp_path, monkeypatch):
    """SIGTERM (or Ctrl-C) arriving while a checkpoint is written acts after the write: the new
    checkpoint whole, the one before it as ``previous.pt``, no temporary file left; a write that
    fails (a full disk) leaves the old checkpoint and no temporary file (issue 73, item 9)."""
    import errno
    import os
    import signal

    import torch

    from msrl.run import checkpoints

    path = tmp_path / "latest.pt"
    checkpoints.atomic_save({"v": 1}, path, keep_previous=True)
    real_save = torch.save

    def save_then_signalled(obj, f):
        real_save(obj, f)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered mid-write: the handler would run here

    def interrupt(signum, frame):  # what the msrl command installs for SIGTERM
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_then_signalled)
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoints.atomic_save({"v": 2}, path, keep_previous=True)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert torch.load(path)["v"] == 2 and torch.load(tmp_path / "previous.pt")["v"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "previous.pt"]

    def disk_full(obj, f):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.atomic_save({"v": 3}, path, keep_previous=True)
    assert torch.load(path)["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt", "previous.pt"]


def test_a_run_stopped_at_its_return_threshold_says_so_in_its_result_line(tmp_path, capsys):
    """A run that stops early at ``train.stop_at_return`` says so in its result line, with the env
    step it reached the threshold at and how much of its budget it used (issue 73, item 10)."""
    from msrl.run.cli import main

    assert main(["train", str(MAIN), f"runs_dir={tmp_path}", "name=a", "train.progress=false", "train.eval_every=1",
                 "eval.episodes=3", "train.stop_at_return=15", "train.total_env_steps=100000", "env.num_envs=4",
                 "algorithm.hparams.num_steps=16"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads((tmp_path / "a" / "eval.json").read_text())
    steps = result["steps_to_threshold"]
    assert steps is not None and steps < 100000
    assert line.endswith(f"; stopped early: an evaluation reached train.stop_at_return=15.0 at env step {steps} "
                         f"({result['time_to_threshold_s']:.1f} s), {result['env_steps']} of the budget's 100000 env "
                         "steps used"), line
