"""Start-up: what the main job's command loads and what it leaves for later (msrl/_lean_imports.py,
the learning curve in a background process). Each check runs in a fresh interpreter: what a
test process has imported already says nothing about a user's run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from procs import EVENT_TIMEOUT_S

from msrl.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "configs/ppo_cartpole.yaml")


def _python(code: str, env: dict[str, str] | None = None) -> str:
    """Runs ``code`` in a fresh interpreter (cwd: the repository); returns its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=EVENT_TIMEOUT_S, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_main_job_loads_no_dynamo_matplotlib_or_mujoco(tmp_path):
    """The issue's command, from Python: TorchDynamo (an optimiser's wrappers), matplotlib (the
    curve, drawn by another process) and MuJoCo (a checkpoint's env state) are never imported."""
    out = _python(f"""
        import json, sys
        from msrl.cli import main
        from msrl.plot import wait_for_background_plots
        code = main(["train", {MAIN!r}, "train.total_env_steps=256", "eval.episodes=1", "runs_dir={tmp_path}",
                     "train.progress=false"])
        loaded = [m for m in ("torch._dynamo", "matplotlib", "mujoco") if m in sys.modules]
        print(json.dumps({{"code": code, "loaded": loaded, "plots": wait_for_background_plots(900)}}))
    """)
    result = json.loads(out.splitlines()[-1])
    assert result == {"code": 0, "loaded": [], "plots": [0]}
    assert (tmp_path / "ppo_cartpole" / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


OPTIMIZERS = """
    import hashlib, json, sys
    import torch
    import msrl.api  # msrl's components import it: torch.optim made lean here
    torch.manual_seed(0)
    digest = hashlib.sha256()
    for make in (lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-5, fused=True),
                 lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2, dtype=torch.float64), foreach=False),
                 lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                 lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
                 lambda p: torch.optim.RMSprop(p, lr=1e-3)):
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = make(net.parameters())
        x = torch.randn(16, 4)
        for step in range(5):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
            if step == 2:  # a checkpoint's round trip
                opt.load_state_dict(opt.state_dict())
        for p in net.parameters():
            digest.update(p.detach().numpy().tobytes())
    print(json.dumps({"digest": digest.hexdigest(), "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_lean_optimizers_step_bitwise_as_torch_and_load_no_dynamo():
    lean = json.loads(_python(OPTIMIZERS))
    stock = json.loads(_python(OPTIMIZERS, env={"MSRL_EAGER_OPTIMIZERS": "0"}))
    assert lean["digest"] == stock["digest"]
    assert lean["dynamo"] is False and stock["dynamo"] is True


COMPILED_STEP = """
    import json, torch
    import msrl.api
    from msrl._lean_imports import _UntilDynamo
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.Adam([p], lr=0.1)
    import torch._dynamo
    opt.state_dict()
    cache = getattr(torch.optim.Optimizer.state_dict.__wrapped__, "__dynamo_disable", None)
    @torch.compile(backend="eager")
    def step(o):
        o.step()
    for _ in range(3):
        p.grad = torch.ones(5)
        step(opt)
    print(json.dumps({"torch_cache": cache is not None and not isinstance(cache, _UntilDynamo),
                      "p": p.detach().numpy().tobytes().hex()}))
"""


def test_once_dynamo_is_loaded_torch_s_own_wrappers_run_and_compiled_steps_match():
    """After something loads TorchDynamo, the optimisers' methods go through torch's wrappers
    (the pre-filled cache entry removes itself), and a compiled function that steps an
    optimiser gives, bitwise, what it gives with torch's optimisers untouched."""
    lean = json.loads(_python(COMPILED_STEP).splitlines()[-1])
    stock = json.loads(_python(COMPILED_STEP, env={"MSRL_EAGER_OPTIMIZERS": "0"}).splitlines()[-1])
    assert lean["torch_cache"] is True and lean["p"] == stock["p"]


def test_the_collector_is_deferred_through_start_up_and_frozen_after():
    out = _python("""
        import gc, json
        from msrl._lean_imports import defer_gc, resume_gc
        defer_gc()
        during = gc.isenabled()
        resume_gc()
        after, frozen = gc.isenabled(), gc.get_freeze_count()
        gc.disable()  # a caller that turned it off keeps it off
        defer_gc(); resume_gc()
        print(json.dumps([during, after, frozen > 0, gc.isenabled()]))
    """)
    assert json.loads(out) == [False, True, True, False]


def test_plot_of_a_run_without_iterations_is_one_line_and_keeps_the_curve(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("iteration,env_steps,charts/episodic_return\n")
    (run / "learning_curve.png").write_bytes(b"an earlier curve")
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == f"msrl: error: {run / 'metrics.csv'} holds no iteration yet: nothing to plot (an earlier learning curve is kept)\n"
    assert (run / "learning_curve.png").read_bytes() == b"an earlier curve"
    assert sorted(p.name for p in run.iterdir()) == ["learning_curve.png", "metrics.csv"]


def test_a_background_plot_that_fails_says_why_where_the_picture_would_be(tmp_path):
    from msrl.plot import plot_in_background, wait_for_background_plots

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("iteration,env_steps\n")
    plot_in_background(run)
    assert wait_for_background_plots(timeout_s=EVENT_TIMEOUT_S) == [1]
    assert (run / "learning_curve.txt").read_text().startswith("the learning curve was not drawn (InputError: ")
    assert not (run / "learning_curve.png").exists()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_background_plot_draws_the_curve(tmp_path, rows):
    from msrl.plot import plot_in_background, wait_for_background_plots

    run = tmp_path / "run"
    run.mkdir()
    lines = ["iteration,env_steps,charts/episodic_return"] + [f"{i},{256 * i},{10.0 * i}" for i in range(1, rows + 1)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    plot_in_background(run)
    assert wait_for_background_plots(timeout_s=EVENT_TIMEOUT_S) == [0]
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in run.iterdir()) == ["learning_curve.png", "metrics.csv"]  # no temporary file left


CAPTURED = """
    import json, sys
    from msrl.config import build_job_spec, load_config
    from msrl.job import Job
    job = Job(build_job_spec(load_config("configs/ppo_cartpole_gpu_only.yaml",
                                         ["env.num_envs=4", "algorithm.hparams.num_steps=8",
                                          "distribution_policy.capture.main=graph"])))
    job.reset()
    rows = [job.train_step() for _ in range(5)]  # warm-up, probe (HostSyncRecorder), capture (Tape), replays
    status = job.runtime.replicas[("main", 0)].programs["train_step"].fn.status
    job.close()
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "status": status,
                      "rows": [{k: float(v) for k, v in r.items()} for r in rows]}, sort_keys=True))
"""


def test_a_capture_probes_and_records_without_loading_dynamo():
    """torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in
    ``torch._disable_dynamo``, whose first call imports TorchDynamo: the capture's probe took
    5-6 s on the H200 machine for it. msrl's modes dispatch without it
    (:func:`msrl._lean_imports.lean_dispatch_mode`), with the same results as with torch's wrappers."""
    lean = json.loads(_python(CAPTURED).splitlines()[-1])
    stock = json.loads(_python(CAPTURED, env={"MSRL_EAGER_OPTIMIZERS": "0"}).splitlines()[-1])
    assert lean["status"] == stock["status"] == "graph"
    assert lean["dynamo"] is False and stock["dynamo"] is True
    assert lean["rows"] == stock["rows"]
