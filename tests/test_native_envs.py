"""Native envs (CartPole, Pendulum): host kernel vs torch reference vs gymnasium; kernel build machinery."""

import pathlib
import shutil

import pytest
import torch

from msrl.envs.native import CartPole
from msrl.envs.native.check import check_cartpole
from msrl.envs.native.kernels import DeviceKernelModule, KernelCompileError, KernelModule, Slot, load_kernels, nvcc_compile, parse_kernels

CU_FILES = sorted(pathlib.Path(__file__).resolve().parents[1].glob("msrl/envs/native/*.cu"))


@pytest.mark.parametrize("controller", ["random", "balance"])
@pytest.mark.parametrize("mode", ["trajectory", "step"])
def test_host_kernel_and_torch_reference_equal_gymnasium_exactly(controller, mode):
    # trajectory: the native envs follow their own states through whole episodes; step: each
    # step from the reference's state and step count (the GPU's mode: last-ulp differences
    # cannot grow), which must keep the time limit's truncations in step
    reports = check_cartpole(num_envs=6, steps=1500, seed=4, controller=controller, mode=mode)
    for r in reports:
        assert r.mode == mode
        assert r.ok, r
        assert r.max_obs_diff == 0.0 and r.flag_mismatches == 0  # bitwise, on this machine
    assert reports[0].episodes > (40 if controller == "random" else 10)
    if controller == "balance":
        assert reports[0].truncations > 5  # the 500-step time limit is exercised


def test_kernel_and_torch_agree_bitwise_including_their_own_resets():
    a, b = CartPole(33, impl="kernel"), CartPole(33, impl="torch")
    assert torch.equal(a.reset(seed=9), b.reset(seed=9))
    g = torch.Generator().manual_seed(1)
    for _ in range(400):
        act = torch.randint(0, 2, (33,), generator=g)
        for x, y in zip(a.step(act)[:4], b.step(act)[:4]):
            assert torch.equal(x, y)
    assert torch.equal(a.state, b.state) and torch.equal(a.episode, b.episode)
    sa, sb = a.pop_episode_stats(), b.pop_episode_stats()
    assert sa == sb and len(sa.returns) > 300 and all(r == n for r, n in zip(sa.returns, sa.lengths))


def test_seeds_give_distinct_reproducible_starts_and_sizes_need_no_rebuild():
    x = CartPole(4).reset(seed=1)
    assert torch.equal(x, CartPole(4).reset(seed=1))
    assert not torch.equal(x, CartPole(4).reset(seed=2))
    assert len(set(map(tuple, x.tolist()))) == 4  # envs differ
    assert x.abs().max() < 0.05
    # a 4-env and a 1000-env batch share one compiled module
    assert CartPole(1000)._kernels is CartPole(4)._kernels


def test_state_dict_round_trip():
    a = CartPole(5)
    a.reset(seed=0)
    for _ in range(30):
        a.step(torch.ones(5, dtype=torch.int64))
    a.pop_episode_stats()
    b = CartPole(5)
    b.reset(seed=123)
    b.load_state_dict(a.state_dict())
    for _ in range(50):
        assert torch.equal(a.step(torch.zeros(5, dtype=torch.int64))[0], b.step(torch.zeros(5, dtype=torch.int64))[0])


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown native env implementation 'cuda'; valid: torch, kernel"):
        CartPole(2, impl="cuda")
    env = CartPole(2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"action has shape \(3,\), expected \(2,\)"):
        env.step(torch.zeros(3, dtype=torch.int64))


def test_kernel_launcher_checks_arguments():
    mod = load_kernels(CartPole.KERNEL_SOURCE)
    with pytest.raises(KeyError, match="no kernel 'nope'"):
        mod.launch("nope", 1, 1)
    with pytest.raises(TypeError, match="takes 6 arguments, got 1"):
        mod.launch("cartpole_reset", 1, 1, 3)
    with pytest.raises(ValueError, match="must be contiguous"):
        mod.launch("cartpole_reset", 1, 1, torch.zeros(4, 2, dtype=torch.float64).t(), torch.zeros(1, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4), 0, 1)


SEQ_SOURCE = """
extern "C" __global__ void axpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void count(long long* c, unsigned long long step, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] += (long long)step;
}
"""


def test_launch_sequence_equals_launches_one_by_one(tmp_path, monkeypatch):
    """A prepared sequence (one foreign call) runs its launches in order, with slots rebound
    per call (tensors and numbers) and fixed tensors updated in place."""
    monkeypatch.setenv("MSRL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "seq.cu"
    src.write_text(SEQ_SOURCE)
    mod = load_kernels(src)
    n = 1000
    x = torch.arange(n, dtype=torch.float32)
    c, c_ref = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    seq = mod.sequence([("axpy", 4, 256, (Slot("y"), x, 2.0, n)), ("axpy", 4, 256, (Slot("y"), Slot("y"), 1.0, n)),
                        ("count", 8, 128, (c, Slot("step", pointer=False), n))])
    for step in range(3):
        y, y_ref = torch.full((n,), float(step)), torch.full((n,), float(step))
        seq(y=y, step=(1 << 63) + step)
        mod.launch("axpy", 4, 256, y_ref, x, 2.0, n)
        mod.launch("axpy", 4, 256, y_ref, y_ref, 1.0, n)
        mod.launch("count", 8, 128, c_ref, (1 << 63) + step, n)
        assert torch.equal(y, y_ref) and torch.equal(c, c_ref)
    assert torch.equal(y, 2 * (2 * x + 2))
    with pytest.raises(TypeError, match=r"unknown slots \['z'\]; this sequence's slots: \['step', 'y'\]"):
        seq(z=y)
    fresh = mod.sequence([("axpy", 4, 256, (Slot("y"), x, 2.0, n))])
    with pytest.raises(TypeError, match=r"slots \['y'\] were never bound"):
        fresh()
    with pytest.raises(TypeError, match="slot 'a' is a tensor, parameter a takes a number"):
        mod.sequence([("axpy", 4, 256, (Slot("y"), x, Slot("a"), n))])
    with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
        mod.sequence([("axpy", 4, 256, (Slot("y"), x, 2.0))])
    with pytest.raises(TypeError, match="slot 'k' is passed as float elsewhere, parameter n takes int"):
        mod.sequence([("axpy", 4, 256, (Slot("y"), x, Slot("k", pointer=False), Slot("k", pointer=False)))])
    # the launch-by-launch sequence (what a GPU module runs) does the same
    one_by_one = KernelModule.sequence(mod, [("axpy", 4, 256, (Slot("y"), x, 2.0, n)),
                                             ("count", 8, 128, (c, Slot("step", pointer=False), n))])
    y_ref, c_ref = y.clone(), c.clone()
    one_by_one(y=y, step=5)
    mod.launch("axpy", 4, 256, y_ref, x, 2.0, n)
    mod.launch("count", 8, 128, c_ref, 5, n)
    assert torch.equal(y, y_ref) and torch.equal(c, c_ref)


def test_gpu_module_converts_arguments_once_and_launches_in_order(tmp_path, monkeypatch):
    """The GPU build's launch path with CuPy replaced by a recorder whose kernels run the host
    build: fixed arguments are converted when a sequence is prepared, slots once per call,
    scalars to CuPy scalars of the parameter's C type, all launches on torch's current stream."""
    monkeypatch.setenv("MSRL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "seq.cu"
    src.write_text(SEQ_SOURCE)
    host = load_kernels(src)
    log = []

    class View:  # what cupy.asarray returns: a view of the tensor's memory
        def __init__(self, tensor):
            log.append("asarray")
            self.tensor = tensor

    def scalar(kind):
        return lambda v: (kind, v)

    class Stream:
        def __init__(self, ptr):
            log.append(("stream", ptr))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cupy = type("FakeCupy", (), dict(asarray=View, int32=scalar("int32"), uint32=scalar("uint32"), int64=scalar("int64"),
                                      uint64=scalar("uint64"), float32=scalar("float32"), float64=scalar("float64")))
    # CuPy >= 14: Stream.from_external over the CUDA stream protocol (ExternalStream is deprecated)
    from_external = staticmethod(lambda torch_stream: Stream(torch_stream.cuda_stream))
    cupy.cuda = type("cuda", (), dict(Stream=type("Stream", (), dict(from_external=from_external)),
                                      Device=lambda index: Stream(f"device {index}")))

    def kernel(name):
        def run(grid, block, args):
            log.append((name, grid, block, tuple(a if isinstance(a, tuple) else "view" for a in args)))
            host.launch(name, grid[0], block[0], *[a.tensor if isinstance(a, View) else a[1] for a in args])
        return run

    gpu = object.__new__(DeviceKernelModule)
    gpu.signatures, gpu.device, gpu.device_index, gpu._cupy = host.signatures, torch.device("cpu"), 0, cupy
    gpu._kernels = {n: kernel(n) for n in host.signatures}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 1234})())

    n = 300
    x, c = torch.arange(n, dtype=torch.float32), torch.zeros(n, dtype=torch.int64)
    seq = gpu.sequence([("axpy", 2, 256, (Slot("y"), x, 2.0, n)), ("count", 3, 128, (c, Slot("step", pointer=False), n))])
    assert log == ["asarray", "asarray"]  # x and c, once
    log.clear()
    y = torch.ones(n)
    seq(y=y, step=7)
    seq(y=y, step=7)
    assert torch.equal(y, 1 + 4 * x) and torch.equal(c, torch.full((n,), 14))
    launch_axpy = ("axpy", (2,), (256,), ("view", "view", ("float32", 2.0), ("int32", n)))
    launch_count = ("count", (3,), (128,), ("view", ("uint64", 7), ("int32", n)))
    call = ["asarray", ("stream", 1234), ("stream", "device 0"), launch_axpy, launch_count]
    assert log == call + call
    log.clear()
    gpu.launch("count", 3, 128, c, 1, n)
    assert log == ["asarray", ("stream", 1234), ("stream", "device 0"), ("count", (3,), (128,), ("view", ("uint64", 1), ("int32", n)))]
    # a call's slot values are not kept once launched (a step's outputs are the caller's to free)
    import gc
    import weakref

    out = torch.ones(n)
    ref = weakref.ref(out)
    seq(y=out, step=1)
    del out
    gc.collect()
    assert ref() is None
    # an older CuPy (no Stream.from_external): ExternalStream with the stream's device
    cupy.cuda = type("cuda", (), dict(ExternalStream=lambda ptr, device_id: Stream((ptr, device_id)),
                                      Device=lambda index: Stream(f"device {index}")))
    gpu.device_index = 1
    log.clear()
    gpu.launch("count", 3, 128, c, 1, n)
    assert log[1:3] == [("stream", (1234, 1)), ("stream", "device 1")]


def test_gpu_source_changes_with_its_headers(tmp_path):
    """CuPy caches kernels by source text: a header's edit must change the text NVRTC gets."""
    from msrl.envs.native.kernels import keyed_source

    (tmp_path / "h.cuh").write_text("#define K 1\n")
    src = tmp_path / "k.cu"
    src.write_text('#include "h.cuh"\nextern "C" __global__ void k(float* x) { x[0] = K; }\n')
    before = keyed_source(src)
    assert before.startswith(src.read_text())  # NVRTC's line numbers are the file's
    (tmp_path / "h.cuh").write_text("#define K 2\n")
    assert keyed_source(src) != before


def test_unsupported_parameter_types_and_compile_errors(tmp_path, monkeypatch):
    with pytest.raises(KernelCompileError, match="has type 'short'"):
        parse_kernels('extern "C" __global__ void k(short x) {}')
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(int n) { this is not C++; }\n')
    monkeypatch.setenv("MSRL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(KernelCompileError, match="host build of bad.cu failed"):
        load_kernels(bad)
    sync = tmp_path / "sync.cu"
    sync.write_text('extern "C" __global__ void k(int n) { __syncthreads(); }\n')
    with pytest.raises(KernelCompileError, match="MSRL_HOST_BUILD_DOES_NOT_SUPPORT___syncthreads"):
        load_kernels(sync)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX")
    other = tmp_path / "other.cu"
    other.write_text('extern "C" __global__ void k(int n) {}\n')
    with pytest.raises(KernelCompileError, match="no C\\+\\+ compiler found"):
        load_kernels(other)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CU_FILES, ids=[p.name for p in CU_FILES])
def test_every_kernel_compiles_for_the_gpu_with_nvcc(tmp_path, source, arch):
    out = nvcc_compile(source, arch, tmp_path)
    assert out.stat().st_size > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_kernel_matches_host_build():
    host, gpu = CartPole(64, impl="kernel"), CartPole(64, device="cuda", impl="kernel")
    torch.testing.assert_close(host.reset(seed=3), gpu.reset(seed=3).cpu(), rtol=0, atol=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        act = torch.randint(0, 2, (64,), generator=g)
        h, d = host.step(act), gpu.step(act.cuda())
        torch.testing.assert_close(h[0], d[0].cpu(), rtol=0, atol=1e-5)
        assert torch.equal(h[2], d[2].cpu()) and torch.equal(h[3], d[3].cpu())


def test_native_pendulum_equals_gymnasium_exactly_and_its_kernel_equals_its_reference():
    from msrl.envs.native import Pendulum
    from msrl.envs.native.check import check_pendulum

    reports = check_pendulum(num_envs=5, steps=500, seed=2)
    for r in reports:
        assert r.ok and r.max_obs_diff == 0.0 and r.flag_mismatches == 0, r
    assert reports[0].truncations == 10  # 5 envs x 2 episodes of 200 steps
    a, b = Pendulum(9, impl="kernel"), Pendulum(9, impl="torch")
    assert torch.equal(a.reset(seed=5), b.reset(seed=5))
    g = torch.Generator().manual_seed(0)
    for _ in range(450):
        u = torch.rand(9, 1, generator=g) * 6 - 3
        for x, y in zip(a.step(u)[:4], b.step(u)[:4]):
            assert torch.equal(x, y)
    assert a.pop_episode_stats() == b.pop_episode_stats()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_pendulum_matches_host_build():
    from msrl.envs.native import Pendulum

    host, gpu = Pendulum(64, impl="kernel"), Pendulum(64, device="cuda", impl="kernel")
    assert torch.equal(host.reset(seed=3), gpu.reset(seed=3).cpu())
    g = torch.Generator().manual_seed(0)
    for _ in range(250):
        u = torch.rand(64, 1, generator=g) * 6 - 3
        gpu.load_state_dict(host.state_dict())  # compare one step at a time
        h, d = host.step(u), gpu.step(u.cuda())
        torch.testing.assert_close(h[0], d[0].cpu(), rtol=0, atol=1e-5)
        torch.testing.assert_close(h[1], d[1].cpu(), rtol=1e-5, atol=1e-5)
        assert torch.equal(h[3], d[3].cpu())


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
def test_host_kernels_share_torchs_openmp_runtime():
    """One OpenMP runtime in the process: the host build's threads are torch's intra-op threads
    (``torch.set_num_threads`` sets both), not a second pool competing for the cores."""
    load_kernels(CartPole.KERNEL_SOURCE)
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "gomp" in line.rsplit("/", 1)[-1]}
    assert len(runtimes) == 1, runtimes


def test_cupy_set_up_failures_name_the_fix(tmp_path, monkeypatch):
    """CuPy present but NVRTC cannot find the CUDA headers (CuPy 14 without [ctk] or CUDA_PATH):
    one KernelCompileError naming the fix, not CuPy's raw RuntimeError."""
    import sys
    import types

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def raw_module(**kwargs):
        raise RuntimeError("Failed to find CUDA headers")

    fake = types.ModuleType("cupy")
    fake.RawModule = raw_module
    fake.cuda = types.SimpleNamespace(Device=Device, compiler=types.SimpleNamespace(CompileException=type("CE", (Exception,), {})))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = 1; }\n')
    with pytest.raises(KernelCompileError, match=r'Failed to find CUDA headers; missing CUDA headers or NVRTC: pip install -e "\.\[gpu\]"'):
        DeviceKernelModule(src, torch.device("cuda:0"))
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    with pytest.raises(KernelCompileError, match=r'needs CuPy: pip install -e "\.\[gpu\]"'):
        DeviceKernelModule(src, torch.device("cuda:0"))


def test_tag_kernels_declare_the_block_size_they_are_launched_with():
    import re

    from msrl.envs.native.tag import Tag

    source = Tag.KERNEL_SOURCE.read_text()
    kernels = re.findall(r'extern "C" __global__ void (__launch_bounds__\((\d+)\) )?(\w+)\(', source)
    assert kernels and all(bound == str(Tag.MAX_BLOCK) for _, bound, _ in kernels), kernels
    assert set(parse_kernels(source)) == {name for _, _, name in kernels}  # the launcher still reads them


def test_the_checker_compares_inexact_implementations_step_by_step():
    from msrl.envs.native.check import TOLERANCES

    reports = {r.impl: r for r in check_cartpole(num_envs=2, steps=50, seed=1)}
    assert reports["kernel"].mode == "trajectory" and TOLERANCES[("kernel", "cpu")] == 0
    assert reports["torch"].mode == "step" and TOLERANCES[("torch", "cpu")] > 0
    assert TOLERANCES[("kernel", "cuda")] > 0  # so on a GPU the kernel is checked step by step


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cupy_without_a_device_imports_and_the_gpu_build_says_why_it_cannot_run():
    cupy = pytest.importorskip("cupy")  # the test extra installs cupy-cuda12x: it imports without a device
    assert cupy.__version__
    from msrl.envs.native.cartpole import CartPole

    with pytest.raises(KernelCompileError, match=r"cannot build cartpole.cu for cuda:0 with CuPy: .*check nvidia-smi"):
        DeviceKernelModule(CartPole.KERNEL_SOURCE, torch.device("cuda:0"))
