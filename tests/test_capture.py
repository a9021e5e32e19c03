"""A fragment's iteration captured once and replayed (msrl.runtime.programs.capture).

On the CPU the capture is a host tape (each aten op and native-kernel launch of the iteration,
re-run without the Python that issued it: what a CUDA graph replays); these tests hold it to
the eager program bitwise, and hold the probe to its reasons for refusing what a replay would
get wrong. The CUDA-graph path runs the same tests where a GPU is present.
"""

import copy
import pathlib
import re

import pytest
import torch

import msrl
from msrl.config import ConfigError, build_job_spec, load_config
from msrl.run.job import Job
from msrl.runtime.programs import capture
from msrl.runtime.programs.capture import WARMUP, CapturedProgram
from msrl.runtime.programs.host_state import find_objects, first_change, host_state
from msrl.runtime.programs.packing import Packer
from msrl.runtime.programs.replay import Tape

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
GPU_ONLY = CONFIGS / "ppo_cartpole_gpu_only.yaml"
SMALL = ["env.num_envs=8", "algorithm.hparams.num_steps=16", "train.total_env_steps=4096"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pair(config, overrides):
    """The same job twice: captured (``capture.main=graph``) and eager."""
    graph = Job(build_job_spec(load_config(config, [*overrides, "distribution_policy.capture.main=graph"])))
    eager = Job(build_job_spec(load_config(config, [*overrides, "distribution_policy.capture.main=eager"])))
    return graph, eager


def _replica(job):
    return job.replica("main", 0)


def _status_after(config, overrides, iterations=WARMUP + 2):
    """Runs the captured and the eager job side by side for ``iterations`` iterations, each
    iteration's metrics equal; returns the captured job's ``train_step`` status and whether a
    capture was made."""
    graph, eager = _pair(config, overrides)
    try:
        graph.reset(), eager.reset()
        for _ in range(iterations):
            assert graph.train_step() == eager.train_step()
        rep = _replica(graph)
        fn = rep.programs["train_step"].fn
        made = any(c.graph is not None for c in capture.captures(rep.trainer))
        return fn.status, made
    finally:
        graph.close(), eager.close()


def _same_state(a, b):
    ra, rb = _replica(a), _replica(b)
    for role in ("actor", "learner"):
        for (k, x), (_, y) in zip(ra.weights(role).items(), rb.weights(role).items()):
            assert torch.equal(x, y), f"{role}.{k}"
    assert torch.equal(ra.trainer.obs, rb.trainer.obs)
    assert ra.env_steps == rb.env_steps


@pytest.mark.parametrize("config, overrides", [
    (GPU_ONLY, SMALL),
    (GPU_ONLY, [*SMALL, "env.id=msrl/Pendulum-v1"]),  # Gaussian draws from the actor's own generator
    (GPU_ONLY, [*SMALL, "algorithm.hparams.normalize_obs=true", "algorithm.hparams.normalize_reward=true"]),
    (CONFIGS / "ma_ppo_tag.yaml", ["env.num_envs=4", "algorithm.hparams.num_steps=8"]),  # launch sequences
    (CONFIGS / "impala_cartpole.yaml", ["env.id=msrl/CartPole-v1", "distribution_policy.name=gpu_only", "env.num_envs=8"]),
    # TensorFlow's RMSProp reading the annealed rate from its tensor; APPO's clipped surrogate over 2 epochs
    (CONFIGS / "impala_cartpole.yaml", ["env.id=msrl/CartPole-v1", "distribution_policy.name=gpu_only", "env.num_envs=8",
                                        "algorithm.hparams.optimizer=rmsprop_tf", "algorithm.hparams.clip_coef=0.2",
                                        "algorithm.hparams.update_epochs=2"]),
])
def test_a_captured_gpu_only_job_equals_the_eager_one_bitwise(config, overrides):
    """Warm-up, probe, capture and replays: every iteration's metrics, the finished episodes,
    the env steps, the weights and the observations equal the eager program's bitwise."""
    graph, eager = _pair(config, overrides)
    try:
        graph.reset(), eager.reset()
        for _ in range(WARMUP + 5):  # three replays after the capture
            assert graph.train_step() == eager.train_step()
            eg, ee = _replica(graph).pop_episode_stats(), _replica(eager).pop_episode_stats()
            assert (eg.returns, eg.lengths, eg.extra) == (ee.returns, ee.lengths, ee.extra)
        _same_state(graph, eager)
        fn = _replica(graph).programs["train_step"].fn
        assert isinstance(fn, CapturedProgram) and fn.status == "graph"
        (cap,) = capture.captures(_replica(graph).trainer)
        assert cap.replays == 3 and (DEVICE == "cuda" or len(cap.graph.steps) > 100)
        assert not isinstance(_replica(eager).programs["train_step"].fn, CapturedProgram)
    finally:
        graph.close(), eager.close()


def test_a_checkpoint_loaded_into_a_captured_job_is_captured_again():
    """Loading a replica's state (a restart, a resume) replaces tensors the capture replayed
    on: the program warms up, probes and captures again, and still equals the eager job."""
    graph, eager = _pair(GPU_ONLY, SMALL)
    try:
        graph.reset(), eager.reset()
        for _ in range(3):
            graph.train_step(), eager.train_step()
        saved = {k: copy.deepcopy(r.state_dict()) for k, r in eager.replicas.items()}
        for _ in range(WARMUP + 3):
            graph.train_step(), eager.train_step()
        for job in (graph, eager):  # both back to iteration 3 (each its own copy: loading shares tensors)
            for k, r in job.replicas.items():
                r.load_state_dict(copy.deepcopy(saved[k]))
        for _ in range(WARMUP + 4):
            assert graph.train_step() == eager.train_step()
        _same_state(graph, eager)
        (cap,) = capture.captures(_replica(graph).trainer)
        assert cap.graph is not None and cap.replays == 2  # captured anew after the load
    finally:
        graph.close(), eager.close()


def test_a_whole_captured_training_run_equals_the_eager_run(tmp_path):
    """``msrl.train`` as a user runs it, with a checkpoint and a resume in the middle: the
    metrics of every iteration, the env steps and the final evaluation are the eager run's."""
    runs = {}
    for mode in ("graph", "eager"):
        kw = dict(runs_dir=str(tmp_path / mode), train__progress=False, train__checkpoint_every=3,
                  **{"env.num_envs": 8, "algorithm.hparams.num_steps": 16, "eval.episodes": 3,
                     "distribution_policy.capture.main": mode})
        first = msrl.train(GPU_ONLY, train__total_env_steps=1280, **kw)
        runs[mode] = msrl.train(resume=first.run_dir, train__total_env_steps=2560)
    g, e = runs["graph"], runs["eager"]
    assert g.env_steps == e.env_steps == 2560 and g.eval_returns == e.eval_returns
    keys = [k for k in e.metrics()[0] if k.startswith(("losses/", "charts/episodic", "charts/learning"))]
    assert len(keys) > 5
    assert [[r[k] for k in keys] for r in g.metrics()] == [[r[k] for k in keys] for r in e.metrics()]


def test_the_probe_names_a_python_counter_and_where_it_changes(capfd):
    """A2C keeps its iteration count as a Python int (its learning-rate schedule reads it): a
    replay would not advance it, so the program runs eagerly and says why, with the line."""
    over = ["env.id=msrl/CartPole-v1", "distribution_policy.name=gpu_only", "env.num_envs=4"]
    status, made = _status_after(CONFIGS / "a2c_cartpole.yaml", over, WARMUP + 3)
    assert re.fullmatch(r"eager: learner\.iteration changed from 1 to 2 during an iteration "
                        r"\(at .*algorithms/a2c\.py:\d+\); .*keep it in a tensor updated in place", status), status
    assert not made
    err = capfd.readouterr().err
    assert err.count("msrl: fragment main replica 0: train_step runs eagerly, not captured: learner.iteration changed") == 1, err


def test_a_host_read_is_named_with_the_line_that_makes_it():
    """PPO's ``target_kl`` early stop reads the KL on the host once an epoch (a Python ``if`` on
    a tensor): the program runs eagerly, the reason naming the op and the line."""
    status, _ = _status_after(GPU_ONLY, [*SMALL, "algorithm.hparams.target_kl=0.01"])
    assert re.fullmatch(r"eager: _local_scalar_dense at .*msrl/rl/losses\.py:\d+ in ppo_epochs: a tensor read as a Python "
                        r"number \(\.item\(\), bool\(\), int\(\), float\(\)\); a replay cannot do it", status), status


def test_a_host_env_or_a_boundary_keeps_a_fragment_eager():
    """A gymnasium env steps on the host (its replay contract: not capturable); a fragment that exchanges
    values with other replicas (coarse's learner, multi_learner's all-reduce) has their timing:
    each runs eagerly with the reason, and learns exactly as without the setting."""
    main = CONFIGS / "ppo_cartpole.yaml"
    status, _ = _status_after(main, ["env.num_envs=4", "algorithm.hparams.num_steps=8"], 2)
    assert re.fullmatch(r"eager: its env \(GymnasiumEnv, .*gymnasium_env\.py:\d+\) works on the host, outside torch "
                        r"\(its replay_contract: capturable=False\): a replay would not run it", status), status
    coarse = Job(build_job_spec(load_config(main, ["distribution_policy.name=single_learner_coarse",
                                                   "distribution_policy.capture.learner=graph"])))
    try:
        status = coarse.replica("learner", 0).program_status("train_step")
        assert re.fullmatch(r"eager: the program exchanges values with other replicas \(gather at .*ppo\.py:\d+\); "
                            r"only a fragment without boundaries or collectives is captured", status), status
    finally:
        coarse.close()
    multi = Job(build_job_spec(load_config(main, ["distribution_policy.name=multi_learner",
                                                  "distribution_policy.capture.main=graph"])))
    try:  # the gradient all-reduce among the fragment's own replicas
        status = multi.replica("main", 1).program_status("train_step")
        assert status.startswith("eager: the program exchanges values with other replicas (allreduce_region at "), status
    finally:
        multi.close()


def test_capture_settings_are_checked():
    with pytest.raises(ConfigError, match=r"distribution_policy\.capture\.main=always: unknown capture mode; modes: "
                                          r"graph, eager \(default: graph on a CUDA device, eager on the CPU\)"):
        load_config(GPU_ONLY, ["distribution_policy.capture.main=always"])
    with pytest.raises(ConfigError, match=r"distribution_policy\.capture\.learner: policy gpu_only has no fragment "
                                          r"'learner'; fragments: main"):
        load_config(GPU_ONLY, ["distribution_policy.capture.learner=graph"])
    spec = build_job_spec(load_config(GPU_ONLY, []))
    assert spec.policy.fragment("main").capture is None  # the default: graph on CUDA, eager on the CPU


def test_the_tape_replays_ops_not_python():
    """The tape's semantics are a CUDA graph's: a Python number read while recording is frozen
    into the replay (why the probe refuses programs whose Python state changes), tensors updated
    in place carry the change, fresh outputs are rewritten where the recording returned them,
    and a data-dependent shape is an error."""
    x, step = torch.zeros(3), torch.zeros((), dtype=torch.int64)
    count = [0]

    def body():
        count[0] += 1
        step.add_(1)
        x.add_(float(count[0]))  # a Python number: recorded as the constant it was
        return x * step

    tape = Tape()
    with tape:
        out = body()
    assert out.tolist() == [1.0, 1.0, 1.0]
    tape.replay(), tape.replay()
    assert count[0] == 1 and int(step) == 3 and x.tolist() == [3.0, 3.0, 3.0] and out.tolist() == [9.0, 9.0, 9.0]

    mask = torch.tensor([True, False, True])
    with Tape() as shaped:
        picked = torch.arange(3.0)[mask]
    assert picked.tolist() == [0.0, 2.0]
    mask[1] = True
    with pytest.raises(RuntimeError, match="returned shape \\(3,\\) on replay, \\(2,\\) when captured: a data-dependent shape"):
        shaped.replay()


def test_host_state_sees_counters_rebindings_and_lengths():
    class Comp:
        def __init__(self):
            self.n, self.t, self.items = 0, torch.zeros(2), []

    c = Comp()
    before = host_state({"c": c})
    c.t.add_(1)  # device state, which a replay does change: not host state
    assert first_change(before, host_state({"c": c})) is None
    c.n += 1
    assert first_change(before, host_state({"c": c})) == ("c.n", 0, 1)
    c.n, old, c.t = 0, c.t, torch.zeros(2)
    path, a, b = first_change(before, host_state({"c": c}))
    assert path == "c.t" and a[0] == b[0] == "tensor" and a != b
    c.t = old
    c.items.append(torch.zeros(1))
    assert first_change(before, host_state({"c": c})) == ("c.items#len", 0, 1)
    assert first_change(host_state({"c": Comp()}, skip=["c.items"]), host_state({"c": c}, skip=["c.items"])) \
        is not None  # another object's tensor
    assert first_change(before, host_state({"c": c}, skip=["c.items"])) is not None  # skipped paths are gone


def test_find_reaches_what_components_hold_and_not_module_namespaces():
    """The optimisers and generators a capture needs, found through dicts, lists and objects;
    a module, class or function a component refers to (a GPU env holds the ``cupy`` module) is
    not walked: its namespace is not the trainer's state (walking cupy's was ~0.3 s on a GPU)."""
    import types

    lib = types.ModuleType("fake_lib")
    lib.stray = torch.Generator()  # reachable only through the module: not the component's
    net = torch.nn.Linear(2, 2)

    class Holder:
        def __init__(self):
            self.gen = torch.Generator()

    class Comp:
        def __init__(self):
            self.lib, self.kind, self.fn = lib, Holder, _pair
            self.parts = [{"opt": torch.optim.Adam(net.parameters())}, Holder()]

    class Trainer:
        pass

    trainer = Trainer()
    trainer._components = {"learner": Comp()}
    comp = trainer._components["learner"]
    assert find_objects(trainer, torch.optim.Optimizer) == [("learner.parts.0.opt", comp.parts[0]["opt"])]
    assert find_objects(trainer, torch.Generator) == [("learner.parts.1.gen", comp.parts[1].gen)]
    # a dict keyed by tensors (as an optimiser's state is) is walked without formatting a key:
    # on a GPU that reads the tensor back element by element
    key, gen = torch.zeros(3), torch.Generator()
    comp.parts.append({key: {"g": gen}})

    def no_format(*a):
        raise AssertionError("a tensor was formatted")

    real = torch.Tensor.__format__
    torch.Tensor.__format__ = no_format
    try:
        found = find_objects(trainer, torch.Generator)
    finally:
        torch.Tensor.__format__ = real
    assert found[-1] == ("learner.parts.2[#0].g", gen)


def test_msrl_graph_says_whether_the_iteration_is_captured(capsys):
    from msrl.run.cli import main

    assert main(["graph", str(GPU_ONLY), *SMALL, "distribution_policy.capture.main=graph", "--out", "/dev/null"]) == 0
    text = capsys.readouterr().out
    assert "backend cuda_kernel; device " in text and "; capture graph\n" in text
    what = "a CUDA graph" if DEVICE == "cuda" else "a host tape of"
    assert re.search(rf"## capture of train_step .*\n- main replica 0: captured as {what}.*, replayed\n", text), text
    a2c = ["env.id=msrl/CartPole-v1", "distribution_policy.name=gpu_only", "distribution_policy.capture.main=graph"]
    assert main(["graph", str(CONFIGS / "a2c_cartpole.yaml"), *a2c, "--out", "/dev/null"]) == 0
    assert "- main replica 0: eager: learner.iteration changed from 1 to 2" in capsys.readouterr().out
    assert main(["graph", str(GPU_ONLY), *SMALL, "--out", "/dev/null"]) == 0
    text = capsys.readouterr().out
    assert f"; capture {'graph' if DEVICE == 'cuda' else 'eager'} (default)\n" in text
    assert ("## capture of train_step" in text) == (DEVICE == "cuda")


def test_an_optimiser_that_counts_steps_on_the_host_is_refused():
    """Adam without ``fused`` or ``capturable`` keeps its step count in a host tensor, which a
    CUDA graph does not advance (bias correction frozen at the capture): refused by name."""
    graph = Job(build_job_spec(load_config(GPU_ONLY, [*SMALL, "distribution_policy.capture.main=graph"])))
    try:
        learner = _replica(graph).trainer.learner
        learner.optimizer = torch.optim.Adam(learner.parameters, lr=2.5e-4, foreach=False)
        graph.reset()
        for _ in range(WARMUP + 2):
            graph.train_step()
        assert _replica(graph).program_status() == (
            "eager: learner.optimizer (Adam) keeps its step count on the host: build it with fused=True or capturable=True")
    finally:
        graph.close()


class _Trainer:
    """The least a CapturedProgram needs of a trainer: components and attributes."""

    def __init__(self, **components):
        self._components = components
        self.x = torch.zeros(3)


def _run(body, iterations=WARMUP + 4):
    """``body(trainer)`` as a captured program's iteration, run ``iterations`` times; returns the
    program and each iteration's output (cloned)."""
    program = CapturedProgram(lambda trainer, comm: body(trainer), "train_step", ["x"], "cpu")
    trainer = _Trainer()
    outs = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in program(trainer, None).items()}
            for _ in range(iterations)]
    return program, outs, trainer


def test_the_probe_refuses_host_randomness_host_data_and_python_outputs():
    import random

    import numpy as np

    def counts(trainer):
        trainer.x = trainer.x + 1.0
        return {"x": trainer.x * 2}

    program, outs, trainer = _run(counts)
    assert program.status == "graph" and [o["x"][0].item() for o in outs] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert trainer.x.tolist() == [5.0] * 3

    cases = {
        re.escape("Python's global random generator (random.random, ...) drew during an iteration"):
            lambda t: {"x": t.x + random.random()},
        re.escape("NumPy's global random generator (np.random.*) drew during an iteration"):
            lambda t: {"x": t.x + float(np.random.rand())},
        "lift_fresh at .*test_capture.py:\\d+ in <lambda>: a tensor made from host data":
            lambda t: {"x": t.x + torch.tensor([1.0, 2.0, 3.0])},
        "the program's output output\\['n'\\] is a Python int; a replay would return the captured value":
            lambda t: {"x": t.x * 1, "n": 3},
    }
    for why, body in cases.items():
        program, _, _ = _run(body)
        assert re.match(f"eager: {why}", program.status), program.status


def test_a_capture_that_fails_half_way_goes_back_and_runs_eagerly(monkeypatch):
    """A capture can fail in the middle of the iteration's Python (on a GPU: an op CUDA cannot
    capture, which records nothing and raises). Here the capture (the host tape; on a GPU the CUDA
    graph's, under a dispatch mode) fails at the 40th matrix
    product: the trainer goes back to its state before the capture, the iteration runs eagerly,
    the program stays eager with the reason, and the job still equals the eager one bitwise."""
    seen = [0]

    def count(func):
        if func.overloadpacket is torch.ops.aten.addmm:
            seen[0] += 1
            if seen[0] == 40:
                raise RuntimeError("operation not permitted when stream is capturing (injected)")

    if DEVICE == "cuda":  # the CUDA graph's capture, with a mode that fails it at the 40th product
        from torch.utils._python_dispatch import TorchDispatchMode

        from msrl.runtime.programs.replay import CudaGraph as _CudaGraph

        class FailAt40(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                count(func)
                return func(*args, **(kwargs or {}))

        real_capture = _CudaGraph.capture

        def capture(self, fn):
            def failing():
                with FailAt40():
                    return fn()
            return real_capture(self, failing)

        monkeypatch.setattr(_CudaGraph, "capture", capture)
    else:
        real = Tape.__torch_dispatch__

        def failing(self, func, types, args=(), kwargs=None):
            count(func)
            return real(self, func, types, args, kwargs)

        monkeypatch.setattr(Tape, "__torch_dispatch__", failing)
    graph, eager = _pair(GPU_ONLY, SMALL)
    try:
        graph.reset(), eager.reset()
        for _ in range(WARMUP + 4):
            assert graph.train_step() == eager.train_step()
            eg, ee = _replica(graph).pop_episode_stats(), _replica(eager).pop_episode_stats()
            assert (eg.returns, eg.lengths) == (ee.returns, ee.lengths)
        _same_state(graph, eager)
        assert seen[0] == 40 and _replica(graph).program_status() == (
            "eager: capturing it failed (RuntimeError: operation not permitted when stream is capturing (injected))")
    finally:
        graph.close(), eager.close()


def test_packed_reads_exactly_and_captures_once_per_layout():
    """:class:`~msrl.runtime.programs.packing.Packer` (the concatenation a replayed iteration's one host read goes
    through): equal to the eager ``cat`` for every dtype, a later call on the same tensors
    replays the same capture and sees their new values, a new layout is a new capture, at most
    ``max_layouts`` are kept; no tensors is an error."""
    packer = Packer(max_layouts=3)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn((), generator=g).to(DEVICE), torch.randn(4, generator=g, dtype=torch.float64).to(DEVICE),
               torch.randint(-5, 5, (2, 3), generator=g).to(DEVICE), (torch.randn(5, generator=g) > 0).to(DEVICE)]

    def expected():
        return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])

    first = packer.packed(tensors)
    assert first.dtype == torch.float64 and torch.equal(first, expected())
    graph = next(iter(packer.layouts.values()))[0]
    for t in tensors:  # new values in the same memory: the same capture replays them
        t.copy_(torch.ones_like(t) * 3 if t.dtype != torch.bool else ~t)
    again = packer.packed(tensors)
    assert again is first and torch.equal(again, expected())
    assert len(packer.layouts) == 1 and next(iter(packer.layouts.values()))[0] is graph
    for n in range(2, 6):  # other layouts: captured anew, the oldest dropped past MAX_PACKS
        other = [torch.arange(n, dtype=torch.float32, device=DEVICE)]
        assert torch.equal(packer.packed(other), torch.arange(n, dtype=torch.float64, device=DEVICE))
    assert len(packer.layouts) == 3
    assert len(packer.noted) <= 3  # the objects' notes go with their dropped layouts
    with pytest.raises(ValueError, match="one device"):
        packer.packed([])


def test_packed_matches_the_same_objects_by_address_and_sees_a_moved_tensor(monkeypatch):
    """The same tensor objects again are a hit by identity (no layout walk); one of them given
    new memory in place (``set_``) misses and is read from its new memory."""
    packer = Packer()
    tensors = [torch.arange(3.0, device=DEVICE), torch.arange(4, device=DEVICE)]
    first = packer.packed(tensors)
    walks = []
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "stride", lambda self, *a: walks.append(1) or torch.Tensor.size(self, *a))
        assert packer.packed(tensors) is first and walks == []  # matched by identity, no layout walk
    tensors[1].set_(torch.full((4,), 7, device=DEVICE))  # the same object, other memory
    moved = packer.packed(tensors)
    assert torch.equal(moved, torch.tensor([0.0, 1.0, 2.0, 7, 7, 7, 7], dtype=torch.float64, device=DEVICE))
    assert len(packer.layouts) == 2


def test_a_replayed_iteration_reads_its_results_through_one_captured_pack(monkeypatch):
    """After the capture, each iteration's metrics and finished episodes (each step's tensors,
    logged again by every replay) are read through one pack, captured at the first replay and
    replayed from then on; the values read equal the eager job's."""
    calls = []
    from msrl.runtime.programs import packing

    real = packing.packed

    def spy(tensors):
        calls.append(tuple(t.data_ptr() for t in tensors))
        return real(tensors)

    monkeypatch.setattr(packing, "packed", spy)
    graph, eager = _pair(GPU_ONLY, SMALL)
    try:
        graph.reset(), eager.reset()
        for i in range(WARMUP + 6):
            (rg,), (re_,) = graph.runtime.run("train_step").values(), eager.runtime.run("train_step").values()
            assert [(r["output"], r["episodes"], r["env_steps"]) for r in rg] == \
                [(r["output"], r["episodes"], r["env_steps"]) for r in re_]
            assert rg[0]["episodes"].returns or i < 2  # episodes finish (CartPole: within 8 x 16 steps)
            assert len(calls) == max(0, i - WARMUP - 1)  # warm-up, probe, capture: read eagerly
        assert len(calls) == 4 and len(set(calls)) == 1  # the same tensors every replay
    finally:
        graph.close(), eager.close()


def test_read_host_reads_a_list_as_its_stack():
    """A list item of ``read_host`` (each step's finished episodes) comes back as the stack of
    its tensors, in their dtype, beside scalars and plain tensors, from one concatenation."""
    from msrl.device import read_host

    steps = [torch.tensor([1, -1, 3]), torch.tensor([-1, 5, 6])]
    out = read_host([torch.tensor(2.5), steps, torch.tensor([[True, False]])], scalars=1)
    assert out[0] == 2.5
    assert out[1].dtype == torch.int64 and torch.equal(out[1], torch.stack(steps))
    assert out[2].dtype == torch.bool and out[2].tolist() == [[True, False]]


def test_a_chunk_of_replays_reads_each_iteration_after_launching_the_next():
    """The runtime finishes iteration i's read after launching i+1 (on a GPU the host unpacks
    i while the device runs i+1): a chunk of iterations in one call gives, record by record,
    the eager job's outputs, finished episodes and env steps."""
    graph, eager = _pair(GPU_ONLY, SMALL)
    try:
        graph.reset(), eager.reset()
        for job in (graph, eager):
            for _ in range(WARMUP + 2):
                job.runtime.run("train_step")
        (rg,), (re_,) = graph.runtime.run("train_step", 5).values(), eager.runtime.run("train_step", 5).values()
        assert len(rg) == 5 and all(r["time_s"] > 0 for r in rg)
        assert [(r["output"], r["episodes"], r["env_steps"]) for r in rg] == \
            [(r["output"], r["episodes"], r["env_steps"]) for r in re_]
        assert sum(len(r["episodes"].returns) for r in rg) > 0
        assert _replica(graph).program_status() == "graph"
        _same_state(graph, eager)
    finally:
        graph.close(), eager.close()


def test_a_replay_is_known_beforehand_and_runs_without_the_generator_watch(monkeypatch):
    """``replays_next`` says whether the next call replays (after the capture; not after
    another program ran, nor when a state attribute no longer fits its buffer); the runtime
    watches the global generators around every iteration that runs Python, and skips the watch
    around a replay, which runs none."""
    from msrl.runtime import generators

    watched = []
    real = generators.Baton.watch
    monkeypatch.setattr(generators.Baton, "watch", lambda self: watched.append(1) or real(self))
    job = Job(build_job_spec(load_config(GPU_ONLY, [*SMALL, "distribution_policy.capture.main=graph"])))
    try:
        job.reset()
        rep = _replica(job)
        program = rep.programs["train_step"].fn
        seen = []
        for _ in range(WARMUP + 2):  # warm-up, probe, capture: Python runs, watched
            seen.append(program.replays_next(rep.trainer))
            job.runtime.run("train_step")
        assert seen == [False] * (WARMUP + 2) and len(watched) == WARMUP + 3  # (+ the reset)
        assert program.replays_next(rep.trainer)
        job.runtime.run("train_step", 3)  # replays: no watch
        assert len(watched) == WARMUP + 3 and program.replays_next(rep.trainer)
        obs = rep.trainer.obs
        rep.trainer.obs = obs[:4].clone()  # a state attribute that no longer fits: warm-up again
        assert not program.replays_next(rep.trainer)
        rep.trainer.obs = obs
        assert program.replays_next(rep.trainer)
        job.runtime.run("reset")  # another program ran: its next call warms up again
        assert not program.replays_next(rep.trainer)
    finally:
        job.close()


def test_a_component_declares_its_replay_contract_through_one_method():
    """The contract is :meth:`msrl.api.Component.replay_contract`: components by default are
    capturable without host bookkeeping, host envs are not capturable, native envs declare
    their step counter and finished-episode log; no class attribute is read."""
    from msrl.api import Component, Environment, ReplayContract
    from msrl.envs.native.cartpole import CartPole

    assert Component().replay_contract() == ReplayContract(True, (), ())
    assert Environment.replay_contract(object.__new__(Environment)) == ReplayContract(capturable=False)
    env = CartPole(2, impl="torch")
    assert env.replay_contract() == ReplayContract(True, ("_env_steps",), ("_finished",))
    assert isinstance(env._env_steps, int) and isinstance(env._finished, list)
    assert not [c for c in (Component, Environment, CartPole)
                if {"CAPTURABLE", "REPLAYED_COUNTERS", "REPLAYED_LOGS"} & set(dir(c))]
