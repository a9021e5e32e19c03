"""Start-up: what the main job's command loads and what it leaves for later (msrl/runtime/startup.py,
the learning curve in a background process), and what importing msrl leaves of a user's
process: everything as it was. Each check runs in a fresh interpreter: what a test process has
imported already says nothing about a user's run."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import textwrap

import pytest
from procs import EVENT_TIMEOUT_S

from msrl.run.cli import main

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
        from msrl.runtime.startup import own_process
        own_process()  # what the msrl command does in its own process (main([...]) runs in its caller's)
        from msrl.run.cli import main
        from msrl.run.plot import wait_for_background_plots
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
    from msrl.runtime.startup import own_process
    own_process()  # a process msrl owns: torch.optim made lean here
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
    from msrl.runtime.startup import _UntilDynamo, own_process
    own_process()
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
        from msrl.runtime.startup import defer_gc, resume_gc
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
    from msrl.run.plot import plot_in_background, wait_for_background_plots

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("iteration,env_steps\n")
    plot_in_background(run)
    assert wait_for_background_plots(timeout_s=EVENT_TIMEOUT_S) == [1]
    assert (run / "learning_curve.txt").read_text().startswith("the learning curve was not drawn (InputError: ")
    assert not (run / "learning_curve.png").exists()


@pytest.mark.parametrize("rows", [1, 3])
def test_a_background_plot_draws_the_curve(tmp_path, rows):
    from msrl.run.plot import plot_in_background, wait_for_background_plots

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
    from msrl.runtime.startup import own_process
    own_process()
    from msrl.config import build_job_spec, load_config
    from msrl.run.job import Job
    job = Job(build_job_spec(load_config("configs/ppo_cartpole_gpu_only.yaml",
                                         ["env.num_envs=4", "algorithm.hparams.num_steps=8",
                                          "distribution_policy.capture.main=graph"])))
    job.reset()
    rows = [job.train_step() for _ in range(5)]  # warm-up, probe (HostSyncRecorder), capture (Tape), replays
    status = job.replica("main", 0).program_status("train_step")
    job.close()
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "status": status,
                      "rows": [{k: float(v) for k, v in r.items()} for r in rows]}, sort_keys=True))
"""


def test_a_capture_probes_and_records_without_loading_dynamo():
    """torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in
    ``torch._disable_dynamo``, whose first call imports TorchDynamo: the capture's probe took
    5-6 s on the H200 machine for it. msrl's modes dispatch without it
    (:func:`msrl.runtime.startup.lean_dispatch_mode`), with the same results as with torch's wrappers."""
    lean = json.loads(_python(CAPTURED).splitlines()[-1])
    stock = json.loads(_python(CAPTURED, env={"MSRL_EAGER_OPTIMIZERS": "0"}).splitlines()[-1])
    assert lean["status"] == stock["status"] == "graph"
    assert lean["dynamo"] is False and stock["dynamo"] is True
    assert lean["rows"] == stock["rows"]


UNTOUCHED = """
    import json, os, pathlib, sys
    import torch, torch.optim
    from torch.optim import optimizer as optimizer_module
    finders = list(sys.meta_path)
    import msrl, msrl.api
    result = msrl.train("configs/ppo_cartpole.yaml", runs_dir=RUNS, train__total_env_steps=256, eval__episodes=1,
                        train__progress=False)
    policy = msrl.load(result.run_dir)
    import tensordict, tensordict.utils
    home = str(pathlib.Path(msrl.__file__).parent)
    from_msrl = []   # an optimiser method whose code (or a code it wraps) is msrl's
    cached = []      # a torch._disable_dynamo cache entry msrl put there
    for cls in [optimizer_module.Optimizer, *[c for c in vars(torch.optim).values()
                                              if isinstance(c, type) and issubclass(c, optimizer_module.Optimizer)]]:
        for name, attr in vars(cls).items():
            fn = attr
            while fn is not None:
                code = getattr(fn, "__code__", None)
                if code is not None and code.co_filename.startswith(home):
                    from_msrl.append(f"{cls.__qualname__}.{name}")
                cache = getattr(fn, "__dynamo_disable", None)
                if cache is not None and type(cache).__module__.startswith("msrl"):
                    cached.append(f"{cls.__qualname__}.{name}")
                fn = getattr(fn, "__wrapped__", None)
    print(json.dumps({"from_msrl": from_msrl, "cached": cached,
                      "finders": [type(f).__module__ for f in sys.meta_path
                                  if f not in finders and type(f).__module__.startswith("msrl")],
                      "marked": getattr(tensordict.utils._lock_warn, "_dynamo_marked_constant", False),
                      "owned": __import__("msrl.runtime.startup").runtime.startup.owned_changes()}))
"""


def test_importing_training_and_loading_leave_torch_optim_and_tensordict_as_they_were(tmp_path):
    """``import msrl``, ``msrl.api``, ``msrl.train`` and ``msrl.load`` in a user's process: no
    optimiser method runs msrl's code, no torch cache holds msrl's entry, no import finder is
    left behind, and tensordict's compile marks are applied as tensordict wrote them."""
    out = json.loads(_python(UNTOUCHED.replace("RUNS", repr(str(tmp_path)))).splitlines()[-1])
    assert out == {"from_msrl": [], "cached": [], "finders": [], "marked": True, "owned": []}


USER_COMPILE = """
    import hashlib, json, os, torch
    if os.environ.get("WITH_MSRL"):
        import msrl, msrl.api
    from tensordict import TensorDict
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    td = TensorDict({"x": torch.randn(8, 4), "y": torch.randn(8, 2)}, batch_size=[8])

    @torch.compile(fullgraph=True, backend="eager")
    def loss_of(td):
        td = td.apply(lambda v: v * 2)
        return (net(td["x"]) - td["y"]).square().mean()

    @torch.compile(backend="eager")  # an optimiser's step breaks a full graph in plain torch too
    def step():
        opt.step()

    for _ in range(3):
        opt.zero_grad()
        loss_of(td).backward()
        step()
    print(json.dumps(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()))
"""


def test_a_users_full_graph_compile_of_tensordict_and_an_optimiser_works_after_import_msrl():
    plain = _python(USER_COMPILE).splitlines()[-1]
    with_msrl = _python(USER_COMPILE, env={"WITH_MSRL": "1"}).splitlines()[-1]
    assert with_msrl == plain


PLAIN_WHERE = """
    import json, logging, sys, torch
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s: %(message)s")
    from msrl.runtime.startup import own_process, owned_changes
    compiling = own_process(compiles=True)
    torch.__version__ = "2.99.0+cpu"  # a release msrl's start-up was not tested on
    untested = own_process() + own_process()
    import tensordict
    print(json.dumps({"compiling": compiling, "untested": untested, "owned": owned_changes(),
                      "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_own_process_keeps_plain_torch_for_a_compiling_job_and_an_untested_release_saying_so_once():
    lines = _python(PLAIN_WHERE).splitlines()
    assert json.loads(lines[-1]) == {"compiling": [], "untested": [], "owned": [], "dynamo": True}
    said = [line for line in lines[:-1] if line.startswith("msrl.runtime.startup: ")]
    assert said == ["msrl.runtime.startup: start-up: plain torch (the job compiles a fragment)",
                    "msrl.runtime.startup: start-up: plain torch (2.99.0 is not a release msrl's start-up was tested "
                    "on: 2.13.0)"]


HAND_OVER = """
    import json, threading, torch
    from msrl.runtime.startup import own_process
    changed = own_process()
    nets = [torch.nn.Linear(3, 3) for _ in range(16)]
    opts = [torch.optim.Adam(n.parameters(), lr=0.1) for n in nets]
    import torch._dynamo  # every thread's next call hands over to torch's wrappers at once
    barrier, errors = threading.Barrier(len(opts)), []

    def work(opt):
        barrier.wait()
        try:
            for _ in range(20):
                opt.zero_grad()
                opt.load_state_dict(opt.state_dict())
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(o,)) for o in opts]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"changed": "tensordict" in changed and "Optimizer.zero_grad" in changed, "errors": errors}))
"""


def test_the_hand_over_to_torchs_wrappers_is_thread_safe():
    """Replicas run on threads of one process (``runtime: local``): when Dynamo gets loaded,
    several threads meet the same pre-filled cache entry at once; each hands over, none fails."""
    assert json.loads(_python(HAND_OVER).splitlines()[-1]) == {"changed": True, "errors": []}


ASKED = """
    import json, sys
    import msrl
    result = msrl.train("configs/ppo_cartpole.yaml", own_process=True, runs_dir=RUNS, train__total_env_steps=256,
                        eval__episodes=1, train__progress=False)
    import tensordict.utils
    from msrl.runtime.startup import owned_changes
    owned = owned_changes()
    print(json.dumps({"tensordict": "tensordict" in owned, "optimizers": "Adam.step" in owned,
                      "marked": getattr(tensordict.utils._lock_warn, "_dynamo_marked_constant", False),
                      "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_msrl_train_gives_a_users_process_the_start_up_shortcuts_only_when_asked(tmp_path):
    """``msrl.train(..., own_process=True)``: the command's start-up in the caller's process,
    applied before the config's validation imports the algorithm (and tensordict with it)."""
    out = json.loads(_python(ASKED.replace("RUNS", repr(str(tmp_path)))).splitlines()[-1])
    assert out == {"tensordict": True, "optimizers": True, "marked": False, "dynamo": False}


KEPT = """
    import ctypes, json, os
    if os.environ.get("OWN") == "1":
        from msrl.runtime.startup import own_process
        owned = own_process()
    else:
        import msrl  # importing changes nothing
        owned = []
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    for _ in range(3):  # what a gradient step does with its activations: 128 MB of 8 MB blocks made, written, freed
        blocks = [libc.malloc(8 << 20) for _ in range(16)]
        for b in blocks:
            libc.memset(b, 1, 8 << 20)
        for b in blocks:
            libc.free(b)
    print(json.dumps({"kept_mb": libc.mallinfo2().keepcost >> 20, "owned": owned}))
"""


_LIBC, _LIBC_VERSION = platform.libc_ver()


@pytest.mark.skipif(_LIBC != "glibc" or tuple(int(x) for x in _LIBC_VERSION.split(".")[:2]) < (2, 33), reason="steady_malloc tunes glibc's malloc only (mallinfo2: glibc 2.33)")
def test_a_process_msrl_owns_keeps_its_heap_across_steps_and_a_users_process_is_left_as_it_was():
    """glibc gives a step's freed activations back to the kernel (mapped blocks unmapped, the
    heap's top trimmed past twice the largest freed block), so the next step faults them in
    again. In a process msrl owns (:func:`~msrl.runtime.startup.steady_malloc`) the 128 MB a
    step freed stay on the heap (``mallinfo2().keepcost``) for the next; ``import msrl`` alone
    changes nothing, and ``MSRL_STEADY_MALLOC=0`` turns it off."""
    plain = json.loads(_python(KEPT).splitlines()[-1])
    owned = json.loads(_python(KEPT, env={"OWN": "1"}).splitlines()[-1])
    off = json.loads(_python(KEPT, env={"OWN": "1", "MSRL_STEADY_MALLOC": "0"}).splitlines()[-1])
    assert "glibc malloc" in owned["owned"] and "glibc malloc" not in off["owned"] and plain["owned"] == []
    assert owned["kept_mb"] >= 128
    assert plain["kept_mb"] < 64 and off["kept_mb"] < 64
