"""Pong throughput against the anchor, in one run: CleanRL's ``ppo_atari_envpool.py`` (the pinned
release, its own hyperparameters, EnvPool) and msrl's PPO with the same hyperparameters
(``configs/ppo_pong.yaml``), and msrl's IMPALA under ``async_learner`` with 2 actor processes
(``configs/impala_pong.yaml``), one after another on the same cores, alternating over rounds.

Reported per system: env steps per second (agent steps, 4 ALE frames each, as CleanRL's
``global_step`` counts them) over the training time of the run (CleanRL's own ``SPS`` line:
``global_step / (time - start_time)``, start-up excluded; msrl's ``env_steps / time_s`` from
``metrics.csv``), the ratio to CleanRL's in the same round; with ``--floor`` the rate PPO's
network work alone allows (:func:`compute_floor`: the same forwards, backwards and Adam steps
per 1,024 env steps, no env, no framework), in the default and the channels-last layout; and,
with ``--profile``, the share
of the processes' sampled Python stacks in env, act, learn and comm (waiting on or moving a
boundary's data) from one more run of each, sampled by py-spy (every thread, ``--idle``, 50
Hz; the driver, and each Ray replica attached as it starts); samples outside the training loop
(start-up, evaluation, checkpoints, helper threads, a replica idle between the driver's calls)
are left out. The timed rounds run unsampled.

The peer: ``cleanrl==1.2.0`` (the last release; its wheel ships ``cleanrl/ppo_atari_envpool.py``),
run unmodified with ``gym==0.23.1`` (its pin) and ``envpool==0.8.4`` (its pin, ``envpool<0.7``,
has no wheel for this Python; 0.8.4 keeps the old gym API the script is written for), installed
into ``--peer-dir`` beside msrl's own environment (the same torch). Its wheel declares Python
< 3.11; the script itself runs on 3.11 unchanged.

    python bench/bench_atari.py --steps 16384 --rounds 2 --profile --floor
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
import time
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


def compute_floor(channels_last: bool, threads: int = 2, rounds: int = 3) -> float:
    """The env steps per second PPO's network work alone allows (no env, no framework): per 1,024
    steps, 128 batch-8 forwards of the Nature CNN actor-critic (acting) and 4 epochs of 4
    minibatches of 256 forward+backward+Adam (learning), on random uint8 frames scaled by 1/255
    in the default or the channels-last layout; the best of ``rounds``."""
    import time as _time

    import torch
    from torch import nn

    from msrl.rl.networks import nature_cnn

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = nn.Sequential(nature_cnn(4, (84, 84)), nn.Linear(512, 7))
    opt = torch.optim.Adam(net.parameters(), lr=2.5e-4, eps=1e-5)
    frames = torch.randint(0, 256, (1024, 4, 84, 84), dtype=torch.uint8)

    def scale(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        return x.float().div_(255.0)

    best = 0.0
    for _ in range(rounds):
        t0 = _time.perf_counter()
        with torch.no_grad():
            for i in range(128):
                net(scale(frames[i * 8:(i + 1) * 8]))
        for _epoch in range(4):
            perm = torch.randperm(1024)
            for j in range(4):
                loss = net(scale(frames[perm[j * 256:(j + 1) * 256]])).square().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
        best = max(best, 1024 / (_time.perf_counter() - t0))
    return best


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


def _attach_replicas(proc: subprocess.Popen, raw: pathlib.Path) -> list[subprocess.Popen]:
    """py-spy attached to each Ray replica process of the run ``proc`` as it appears (Ray's
    workers are the raylet's children, and py-spy's ``--subprocesses`` loses them once they
    name themselves ``ray::ReplicaActor``): one raw file ``<raw>.<pid>`` each."""
    import psutil

    spies: dict[int, subprocess.Popen] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            kids = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for kid in kids:
            try:
                replica = kid.pid not in spies and " ".join(kid.cmdline()).startswith("ray::ReplicaActor")
            except psutil.Error:
                continue
            if replica:
                spies[kid.pid] = subprocess.Popen(
                    ["py-spy", "record", "--idle", "--nonblocking", "-r", "50", "--format", "raw", "--pid",
                     str(kid.pid), "-o", f"{raw}.{kid.pid}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
    return list(spies.values())


def run_msrl(config: str, steps: int, seed: int, overrides: list[str], raw: pathlib.Path | None) -> float:
    """msrl's env steps per second over the run's training time (``metrics.csv``); profiled, the
    driver's stacks go to ``raw`` and each Ray replica's to ``<raw>.<pid>``."""
    with tempfile.TemporaryDirectory() as runs, tempfile.TemporaryFile("w+") as log:
        cmd = [sys.executable, "-m", "msrl.run.cli", "train", str(ROOT / "configs" / config), f"seed={seed}",
               f"runs_dir={runs}", "name=bench", f"train.total_env_steps={steps}", "train.progress=false",
               "train.checkpoint_every=1000000", "eval.episodes=1", *overrides]
        proc = subprocess.Popen(_profiled(cmd, raw), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        spies = _attach_replicas(proc, raw) if raw is not None else []
        proc.wait()
        for spy in spies:  # each ends with its replica's process (the job's end stops them)
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.terminate()
        if proc.returncode:
            log.seek(0)
            raise RuntimeError(f"msrl failed (rc {proc.returncode}):\n{log.read()[-4000:]}")
        rows = list(csv.DictReader(open(pathlib.Path(runs) / "bench" / "metrics.csv")))
    return int(rows[-1]["env_steps"]) / float(rows[-1]["time_s"])


def _frames(line: str) -> tuple[list[str], int]:
    stack, _, n = line.rstrip("\n").rpartition(" ")
    return stack.split(";"), int(n)


_COMM = ("msrl/runtime/transports/codec.py", "msrl/runtime/channels.py", "msrl/runtime/transports/unix_link.py", "cluster/uds_transport.py",
         "cluster/grpc_transport.py", "msrl/runtime/transports/dist.py")


def classify_msrl(frames: list[str]) -> str | None:
    """The category of one sampled msrl stack (outermost frame first), or None outside training
    (start-up, probe, evaluation, checkpoints, helper threads, a replica idle between the
    driver's calls, a Ray job's driver waiting on its replicas): the component method a replica or the generated program runs
    (``Replica.run_method``'s or ``program``'s callee) says learn (``*.learn``), act (an actor's
    ``act``, the rollout buffer), env (an env's ``step``/``reset``) or comm (an endpoint's
    ``get``/``put``: moving or waiting on a boundary's data); a codec or transport frame
    anywhere is comm; other for the rest of the training loop."""
    text = ";".join(frames)
    if "evaluate_job" in text or "probe.py" in text or "TrainingLoop.checkpoint" in text:
        return None
    if "TrainingLoop._chunk" not in text and "ReplicaActor.run " not in text or "RayJob." in text:
        return None  # (a Ray job's driver only waits on its replicas: their own samples say what they do)
    callee = None
    for i, f in enumerate(frames[:-1]):  # the innermost component call: a replica's, or a generated program's
        if f.startswith("Replica.run_method ") or f.startswith("program (<msrl:"):  # (past torch's decorators)
            callee = next((g for g in frames[i + 1:] if "torch/" not in g and "contextlib" not in g),
                          frames[i + 1]).split(" (")[0]
    if callee is None or "Endpoint" in callee or any(c in text for c in _COMM):
        return "comm" if any(c in text for c in _COMM) or callee and "Endpoint" in callee else "other"
    method = callee.rsplit(".", 1)[-1]
    if method in ("learn", "update"):
        return "learn"
    if method == "act" or "Actor" in callee or "Buffer" in callee:  # acting and storing the rollout
        return "act"
    if method in ("step", "reset") or "Env" in callee:
        return "env"
    return "other"


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
    """Each category's share of the classified samples in py-spy's raw output ``raw`` (and the
    replicas' ``<raw>.<pid>`` files beside it)."""
    counts: collections.Counter[str] = collections.Counter()
    for path in [raw, *raw.parent.glob(raw.name + ".*")]:  # the driver's, then each replica's
        for line in path.read_text().splitlines() if path.exists() else []:
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
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "out" / "atari", help="py-spy's raw stacks")
    ap.add_argument("--floor", action="store_true", help="also the network work's own steps/s (no env, no framework)")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    if args.profile and shutil.which("py-spy") is None:
        sys.exit("--profile needs py-spy: pip install py-spy")
    script, site = prepare_cleanrl(args.peer_dir) if "cleanrl" in args.systems else (None, None)
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    profiled: dict[str, dict] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    # the timed rounds run unprofiled (py-spy's sampling of 3 processes on 2 cores took a third
    # of IMPALA's speed); a profiled run of each system follows them
    for r in range(args.rounds + (1 if args.profile else 0)):
        profiling = r == args.rounds
        for system in args.systems:
            raw = args.out / f"{system}.raw" if profiling else None
            for old in args.out.glob(f"{system}.raw*") if profiling else []:
                old.unlink()
            if system == "cleanrl":
                fps = run_cleanrl(script, site, args.steps, args.seed, raw)
                classify = classify_cleanrl(script.read_text())
            else:
                fps = run_msrl("ppo_pong.yaml" if system == "msrl_ppo" else "impala_pong.yaml", args.steps, args.seed,
                               [], raw)
                classify = classify_msrl
            if profiling:
                profiled[system] = {"env_steps_per_s_profiled": round(fps, 1), "shares": shares(raw, classify)}
                print(f"profiled {system}: {profiled[system]}", flush=True)
            else:
                results[system].append({"round": r, "env_steps_per_s": round(fps, 1)})
                print(f"round {r} {system}: {fps:.1f} env steps/s", flush=True)
    print("\n| system | env steps/s per round | vs CleanRL (same round) |")
    print("|---|---|---|")
    for system, rows in results.items():
        ratios = ""
        if "cleanrl" in results and system != "cleanrl":
            ratios = ", ".join(f"{row['env_steps_per_s'] / peer['env_steps_per_s']:.2f}x"
                               for row, peer in zip(rows, results["cleanrl"]))
        print(f"| {system} | {', '.join(str(row['env_steps_per_s']) for row in rows)} | {ratios} |")
    if profiled:
        print(f"\n| system | {' | '.join(CATEGORIES)} | env steps/s while sampled |")
        print("|---|" + "---|" * (len(CATEGORIES) + 1))
        for system, p in profiled.items():
            cells = " | ".join(f"{p['shares'][c]:.0%}" for c in CATEGORIES)
            print(f"| {system} | {cells} | {p['env_steps_per_s_profiled']} |")
    floors = {}
    if args.floor:
        floors = {"default layout": round(compute_floor(False), 1), "channels-last": round(compute_floor(True), 1)}
        print(f"\nthe network work alone (PPO's acting and learning on 2 threads, no env): {floors} env steps/s")
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "profiled": profiled, "floor": floors}, indent=1))


if __name__ == "__main__":
    main()
