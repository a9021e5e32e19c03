"""Pong throughput against the anchor, in one run: CleanRL's ``ppo_atari_envpool.py`` (the pinned
release, its own hyperparameters, EnvPool) and msrl's PPO with the same hyperparameters
(``configs/ppo_pong.yaml``), and msrl's IMPALA under ``async_learner`` with 2 actor processes
(``configs/impala_pong.yaml``), one after another on the same cores, alternating over rounds.

Reported per system: env steps per second (agent steps, 4 ALE frames each, as CleanRL's
``global_step`` counts them) over the training time of the run (CleanRL's own ``SPS`` line:
``global_step / (time - start_time)``, start-up excluded; msrl's ``env_steps / time_s`` from
``metrics.csv``), the ratio to CleanRL's in the same round, and, with ``--profile``, the share
of the processes' sampled Python stacks in env, act, learn and comm (waiting on or moving a
boundary's data) -- py-spy samples every thread (``--idle``) at 50 Hz; samples outside the
training loop (start-up, evaluation, helper threads) are left out.

The peer: ``cleanrl==1.2.0`` (the last release; its wheel ships ``cleanrl/ppo_atari_envpool.py``),
run unmodified with ``gym==0.23.1`` (its pin) and ``envpool==0.8.4`` (its pin, ``envpool<0.7``,
has no wheel for this Python; 0.8.4 keeps the old gym API the script is written for), installed
into ``--peer-dir`` beside msrl's own environment (the same torch). Its wheel declares Python
< 3.11; the script itself runs on 3.11 unchanged.

    python bench/bench_atari.py --steps 16384 --rounds 2 --profile
    python bench/bench_atari.py --systems cleanrl msrl_ppo --steps 8192 --rounds 1

Needs: ale-py >= 0.10 (msrl's ``ale_vector`` engine), pip access to PyPI for the peer, py-spy
for ``--profile``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLEANRL = "cleanrl==1.2.0"
PEER_PINS = ("gym==0.23.1", "envpool==0.8.4")
SCRIPT = "cleanrl/ppo_atari_envpool.py"
SYSTEMS = ("cleanrl", "msrl_ppo", "msrl_impala")
CATEGORIES = ("env", "act", "learn", "comm", "other")


def prepare_cleanrl(peer_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The pinned CleanRL script and a ``site`` directory with its gym and EnvPool pins, made once
    under ``peer_dir``: ``(script, site)``.

    Raises:
        subprocess.CalledProcessError: pip could not fetch a pin.
    """
    script, site = peer_dir / "ppo_atari_envpool.py", peer_dir / "site"
    if script.exists() and (site / "envpool").exists() and (site / "gym").exists():
        return script, site
    peer_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", CLEANRL, "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.10", "-d", tmp], check=True)
        wheel = next(pathlib.Path(tmp).glob("cleanrl-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            script.write_bytes(z.read(SCRIPT))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *PEER_PINS],
                   check=True)
    return script, site


def _profiled(cmd: list[str], raw: pathlib.Path | None) -> list[str]:
    if raw is None:
        return cmd
    return ["py-spy", "record", "--idle", "--nonblocking", "--subprocesses", "-r", "50", "--format", "raw",
            "-o", str(raw), "--", *cmd]


def run_cleanrl(script: pathlib.Path, site: pathlib.Path, steps: int, seed: int, raw: pathlib.Path | None) -> float:
    """CleanRL's env steps per second: its last ``SPS`` line."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    with tempfile.TemporaryDirectory() as cwd:  # its runs/ (TensorBoard) goes there
        cmd = [sys.executable, str(script), "--cuda", "False", "--env-id", "Pong-v5", "--seed", str(seed),
               "--total-timesteps", str(steps)]
        out = subprocess.run(_profiled(cmd, raw), cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"CleanRL failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    sps = re.findall(r"^SPS: (\d+)", out.stdout, re.M)
    if not sps:
        raise RuntimeError(f"CleanRL printed no SPS line:\n{out.stdout[-2000:]}")
    return float(sps[-1])


def run_msrl(config: str, steps: int, seed: int, overrides: list[str], raw: pathlib.Path | None) -> float:
    """msrl's env steps per second over the run's training time (``metrics.csv``)."""
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "-m", "msrl.cli", "train", str(ROOT / "configs" / config), f"seed={seed}",
               f"runs_dir={runs}", "name=bench", f"train.total_env_steps={steps}", "train.progress=false",
               "train.checkpoint_every=1000000", "eval.episodes=1", *overrides]
        out = subprocess.run(_profiled(cmd, raw), cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"msrl failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        rows = list(csv.DictReader(open(pathlib.Path(runs) / "bench" / "metrics.csv")))
    return int(rows[-1]["env_steps"]) / float(rows[-1]["time_s"])


def _frames(line: str) -> tuple[list[str], int]:
    stack, _, n = line.rstrip("\n").rpartition(" ")
    return stack.split(";"), int(n)


_COMM = ("msrl/runtime/codec.py", "msrl/channels.py", "msrl/runtime/unix_link.py", "cluster/uds_transport.py",
         "cluster/grpc_transport.py", "msrl/runtime/asynchronous.py", "msrl/runtime/dist.py", "ray/_private",
         "ray/_raylet", "ray/util/")


def classify_msrl(frames: list[str]) -> str | None:
    """The category of one sampled msrl stack (outermost frame first), or None outside training:
    comm when any frame moves or waits on a boundary's data; otherwise the component method a
    replica or the generated program runs (``Replica.run_method``'s or ``program``'s callee):
    ``*.learn``/``*.update`` learn, ``*.act`` and the rollout buffer act, an env's
    ``step``/``reset`` env; other for the rest of the training loop."""
    text = ";".join(frames)
    if "evaluate_job" in text or "probe.py" in text:
        return None
    if any(c in text for c in _COMM) and ("Replica" in text or "TrainingLoop" in text or "ReplicaActor" in text):
        return "comm"
    callee = None
    for i, f in enumerate(frames[:-1]):  # the innermost component call: a replica's, or a generated program's
        if f.startswith("Replica.run_method ") or f.startswith("program (<msrl:"):
            callee = frames[i + 1].split(" (")[0]
    if callee is not None:
        method = callee.rsplit(".", 1)[-1]
        if method in ("learn", "update"):
            return "learn"
        if method == "act" or "Actor" in callee or "Buffer" in callee:  # acting and storing the rollout
            return "act"
        if method in ("step", "reset") or "Env" in callee:
            return "env"
        return "other"
    return "other" if "TrainingLoop.run" in text or "ReplicaHost.run" in text else None


def classify_cleanrl(script_text: str) -> collections.abc.Callable[[list[str]], str | None]:
    """A classifier for CleanRL's stacks: the script's ``<module>`` frame's line says where in the
    update loop it is (the rollout's lines act, the bootstrap-to-optimizer lines learn), an
    EnvPool frame under it env."""
    lines = script_text.splitlines()

    def at(marker: str) -> int:
        return next(i + 1 for i, s in enumerate(lines) if marker in s)

    loop, rollout, learn, end = (at("for update in range(1, num_updates + 1)"), at("for step in range(0, args.num_steps)"),
                                 at("# bootstrap value if not done"), at("y_pred, y_true = "))
    name = re.escape(SCRIPT.rsplit("/", 1)[-1])

    def classify(frames: list[str]) -> str | None:
        for i, f in enumerate(frames):
            m = re.match(rf"<module> \(.*{name}:(\d+)\)", f)
            if m:
                line = int(m.group(1))
                if not loop <= line:
                    return None
                rest = ";".join(frames[i + 1:])
                if rollout <= line < learn:
                    return "env" if ("envpool" in rest or "step (" in rest and "Wrapper" in rest) else "act"
                return "learn" if learn <= line < end else "other"
        return None

    return classify


def shares(raw: pathlib.Path, classify: collections.abc.Callable[[list[str]], str | None]) -> dict[str, float]:
    """Each category's share of the classified samples in py-spy's raw output ``raw``."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        frames, n = _frames(line)
        c = classify(frames)
        if c is not None:
            counts[c] += n
    total = sum(counts.values()) or 1
    return {c: round(counts[c] / total, 3) for c in CATEGORIES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--steps", type=int, default=16384, help="env steps a run (a multiple of 1024 and of 640)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="py-spy shares of env/act/learn/comm (needs py-spy)")
    ap.add_argument("--peer-dir", type=pathlib.Path, default=ROOT / "bench" / "out" / "cleanrl-1.2.0")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    if args.profile and shutil.which("py-spy") is None:
        sys.exit("--profile needs py-spy: pip install py-spy")
    script, site = prepare_cleanrl(args.peer_dir) if "cleanrl" in args.systems else (None, None)
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for system in args.systems:
                raw = pathlib.Path(tmp) / f"{system}{r}.raw" if args.profile else None
                if system == "cleanrl":
                    fps = run_cleanrl(script, site, args.steps, args.seed, raw)
                    classify = classify_cleanrl(script.read_text())
                elif system == "msrl_ppo":
                    fps = run_msrl("ppo_pong.yaml", args.steps, args.seed, [], raw)
                    classify = classify_msrl
                else:
                    fps = run_msrl("impala_pong.yaml", args.steps, args.seed, [], raw)
                    classify = classify_msrl
                row = {"round": r, "env_steps_per_s": round(fps, 1)}
                if raw is not None and raw.exists():
                    row["shares"] = shares(raw, classify)
                results[system].append(row)
                print(f"round {r} {system}: {fps:.1f} env steps/s {row.get('shares', '')}", flush=True)
    print(f"\n| system | env steps/s per round | vs CleanRL (same round) |")
    print("|---|---|---|")
    for system, rows in results.items():
        ratios = ""
        if "cleanrl" in results and system != "cleanrl":
            ratios = ", ".join(f"{row['env_steps_per_s'] / peer['env_steps_per_s']:.2f}x"
                               for row, peer in zip(rows, results["cleanrl"]))
        print(f"| {system} | {', '.join(str(row['env_steps_per_s']) for row in rows)} | {ratios} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
