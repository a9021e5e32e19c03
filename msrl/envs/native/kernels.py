"""The CUDA C kernels of native envs, and their two builds (DESIGN.md §4): what a fragment on the
``cuda_kernel`` backend (``fragments/cuda_kernel.py``) steps its native env with.

The same ``.cu`` source runs in two builds:

* **GPU** -- compiled with CuPy (NVRTC) into a cached module and launched on the memory of the
  torch tensors (``cupy.asarray`` over ``__cuda_array_interface__``: no copies), one block per
  env and one thread per agent, or one thread per env for single-agent envs.
* **Host** -- compiled by ``g++ -O3 -fopenmp`` through ``msrl/envs/native/cuda_host_shim.h``, which maps
  the CUDA built-ins to loops over blocks (OpenMP across blocks) and threads, and loaded with
  ctypes; the kernels then run on CPU tensors. This is what runs and is tested on machines
  without a GPU. The library links ``libgomp.so.1``, which resolves to the OpenMP runtime torch
  already loaded: the kernels share torch's thread pool, and ``torch.set_num_threads`` sets how
  many threads they use.

Sizes (envs, agents) are kernel arguments, so a new number of envs never recompiles. Compiled
modules are cached: in memory per process, and host builds on disk under
``$MSRL_CACHE_DIR`` (default ``~/.cache/msrl/kernels``) keyed by a hash of source, shim and flags.

Fragment programs call component methods exactly as ``torch_graph`` does; a native env built
in a ``cuda_kernel`` fragment runs its ``reset``/``step`` through these kernels instead of its
torch reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import threading
from typing import Any, Sequence

import torch

from msrl.device import record_foreign
from msrl.errors import MsrlError

__all__ = [
    "KernelCompileError",
    "KernelSignature",
    "KernelModule",
    "LaunchSequence",
    "Slot",
    "HostKernelModule",
    "DeviceKernelModule",
    "load_kernels",
    "parse_kernels",
    "nvcc_compile",
    "SHIM",
    "HOST_FLAGS",
]

SHIM = pathlib.Path(__file__).with_name("cuda_host_shim.h")
#: g++ flags of the host build; ``-ffp-contract=off`` keeps a*b+c unfused, as gymnasium's
#: NumPy/Python arithmetic is.
HOST_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off")
#: NVRTC options of the GPU build (``--fmad=false``: the same unfused arithmetic).
DEVICE_FLAGS = ("--std=c++17", "--fmad=false")


class KernelCompileError(MsrlError, RuntimeError):
    """A kernel source that does not compile, or no compiler to compile it with."""


_CTYPES = {
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


@dataclasses.dataclass(frozen=True)
class KernelSignature:
    """A ``extern "C" __global__ void name(params)`` kernel found in a source.

    Attributes:
        name: kernel name; ``params``: ``(type, name, is_pointer)`` per parameter, the type
            of a pointer being its full C type (``"const long long *"``).
    """

    name: str
    params: tuple[tuple[str, str, bool], ...]


_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)', re.S)


def parse_kernels(source: str) -> dict[str, KernelSignature]:
    """Finds the kernels of a CUDA C source.

    Raises:
        KernelCompileError: a parameter type the launcher cannot pass (valid: pointers, and
            ``int``, ``unsigned int``, ``long long``, ``unsigned long long``, ``float``, ``double``).
    """
    out = {}
    for m in _KERNEL_RE.finditer(source):
        params = []
        for raw in m.group(2).split(","):
            raw = " ".join(raw.replace("__restrict__", "").split())
            if not raw:
                continue
            pointer = "*" in raw
            decl = raw.replace("*", " * ").split()
            pname = decl[-1]
            if pointer:  # keep the C pointer type, e.g. "const long long *"
                ptype = " ".join(decl[:-1])
            else:
                ptype = " ".join(t for t in decl[:-1] if t != "const")
            if not pointer and ptype not in _CTYPES:
                raise KernelCompileError(
                    f"kernel {m.group(1)}: parameter {raw!r} has type {ptype!r}; scalar types: {', '.join(_CTYPES)}"
                )
            params.append((ptype, pname, pointer))
        out[m.group(1)] = KernelSignature(m.group(1), tuple(params))
    return out


class KernelModule:
    """Compiled kernels of one source; ``launch(name, grid, block, *args)`` runs one.

    Tensor arguments must be contiguous and on the module's device; scalars are Python numbers.
    """

    signatures: dict[str, KernelSignature]

    def launch(self, name: str, grid: int, block: int, *args: Any) -> None:
        """Runs kernel ``name`` over ``grid`` blocks of ``block`` threads.

        Args:
            args: the kernel's parameters in order: tensors for pointers, numbers for scalars.

        Raises:
            KeyError, TypeError, ValueError: see :meth:`_check`.
        """
        raise NotImplementedError

    def launch_unchecked(self, name: str, grid: int, block: int, *args: Any) -> None:
        """:meth:`launch` without argument checks (see :meth:`HostKernelModule.launch_unchecked`)."""
        self.launch(name, grid, block, *args)

    def sequence(self, launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> "LaunchSequence":
        """Prepares launches that run together, in order, at each call of the result: the
        arguments are checked and converted once, so a call costs one foreign call on the host
        (instead of one per launch) and no argument conversion on a GPU.

        Args:
            launches: ``(name, grid, block, args)`` per launch; an argument is a tensor (bound
                by address: keep it allocated and update it in place), a number, or a
                :class:`Slot`, a placeholder bound at each call (per-step outputs, a seed).

        Raises:
            KeyError, TypeError, ValueError: as :meth:`launch`, for the fixed arguments.
        """
        return _CallbackSequence(self, launches)

    def _convert_arg(self, param: tuple[str, str, bool], value: Any) -> Any:
        """A launch argument in the form :meth:`_run_prepared` passes on (as given, here)."""
        return value

    def _run_prepared(self, launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> None:
        """Runs launches whose arguments :meth:`_convert_arg` converted."""
        for name, grid, block, args in launches:
            self.launch_unchecked(name, grid, block, *args)

    def _prepare(self, launches: Sequence[tuple[str, int, int, Sequence[Any]]], device: torch.device) -> dict[str, list]:
        """Checks a sequence's fixed arguments; returns where each slot is used."""
        slots: dict[str, list] = {}
        types: dict[str, str] = {}
        for k, (name, _grid, _block, args) in enumerate(launches):
            sig = self._check(name, args, device, allow_slots=True)
            for j, ((ptype, pname, pointer), a) in enumerate(zip(sig.params, args)):
                if isinstance(a, Slot):
                    if a.pointer != pointer:
                        raise TypeError(f"kernel {name}: slot {a.name!r} is a {'tensor' if a.pointer else 'number'}, "
                                        f"parameter {pname} takes a {'pointer' if pointer else 'number'}")
                    if not pointer and types.setdefault(a.name, ptype) != ptype:
                        raise TypeError(f"kernel {name}: slot {a.name!r} is passed as {types[a.name]} elsewhere, "
                                        f"parameter {pname} takes {ptype}")
                    slots.setdefault(a.name, []).append((k, j))
        return slots

    def _check(self, name: str, args: Sequence[Any], device: torch.device, allow_slots: bool = False) -> KernelSignature:
        sig = self.signatures.get(name)
        if sig is None:
            raise KeyError(f"no kernel {name!r}; kernels: {sorted(self.signatures)}")
        if len(args) != len(sig.params):
            raise TypeError(f"kernel {name} takes {len(sig.params)} arguments, got {len(args)}")
        for (_ptype, pname, pointer), a in zip(sig.params, args):
            if allow_slots and isinstance(a, Slot):
                continue
            if pointer:
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"kernel {name}: {pname} must be a tensor, got {type(a).__name__}")
                if not a.is_contiguous():
                    raise ValueError(f"kernel {name}: {pname} must be contiguous")
                if a.device.type != device.type:
                    raise ValueError(f"kernel {name}: {pname} is on {a.device}, the module runs on {device}")
        return sig


@dataclasses.dataclass(frozen=True)
class Slot:
    """A placeholder argument of a :meth:`KernelModule.sequence`, bound by name at each call.

    Attributes:
        name: the keyword the sequence is called with; pointer: True for a tensor, False for
            a number.
    """

    name: str
    pointer: bool = True


class LaunchSequence:
    """Prepared kernel launches (see :meth:`KernelModule.sequence`); ``seq(**slots)`` runs them.

    Slots keep their last binding; every slot must be bound before the first call.
    """

    def __call__(self, **bound: Any) -> None:
        raise NotImplementedError

    def _unknown(self, bound: dict[str, Any]) -> list:
        self._unbound(self._slots, bound, set())
        return []

    @staticmethod
    def _unbound(slots: dict[str, Any], bound: dict[str, Any], seen: set[str]) -> None:
        unknown = sorted(set(bound) - set(slots))
        if unknown:
            raise TypeError(f"unknown slots {unknown}; this sequence's slots: {sorted(slots)}")
        seen.update(bound)
        missing = sorted(set(slots) - seen)
        if missing:
            raise TypeError(f"slots {missing} were never bound")


class _CallbackSequence(LaunchSequence):
    """A sequence run launch by launch by its module (:meth:`KernelModule._run_prepared`), with
    each argument converted once (:meth:`KernelModule._convert_arg`): the fixed ones when
    prepared, a slot's value once per call that binds it."""

    def __init__(self, module: KernelModule, launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> None:
        device = getattr(module, "device", torch.device("cpu"))
        self._module = module
        self._slots = module._prepare(launches, device)
        self._launches = []
        self._param: dict[str, tuple[str, str, bool]] = {}
        for name, grid, block, args in launches:
            sig = module.signatures[name]
            converted = []
            for param, a in zip(sig.params, args):
                if isinstance(a, Slot):
                    self._param[a.name] = param
                    converted.append(None)
                else:
                    converted.append(module._convert_arg(param, a))
            self._launches.append((name, grid, block, converted))
        self._seen: set[str] = set()

    def __call__(self, **bound: Any) -> None:
        if len(self._seen) < len(self._slots):
            self._unbound(self._slots, bound, self._seen)
        for name, value in bound.items():
            uses = self._slots.get(name) or self._unknown(bound)
            converted = self._module._convert_arg(self._param[name], value)
            for k, j in uses:
                self._launches[k][3][j] = converted
        try:
            self._module._run_prepared(self._launches)
        finally:
            # drop this call's slot views once launched (stream-ordered): kept, they would hold
            # the previous step's outputs alive until the next call (GBs for a large Tag)
            for uses in self._slots.values():
                for k, j in uses:
                    self._launches[k][3][j] = None


class _HostSequence(LaunchSequence):
    """A host sequence: argument vectors built once, one ctypes call per run."""

    def __init__(self, module: "HostKernelModule", launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> None:
        self._slots = module._prepare(launches, torch.device("cpu"))
        self._seen: set[str] = set()
        self._keep: list[Any] = []  # tensors and scalar cells the vectors point into
        self._scalar: dict[str, ctypes._SimpleCData] = {}
        argvs = []
        for name, _grid, _block, args in launches:
            sig = module.signatures[name]
            argv = (ctypes.c_void_p * max(1, len(args)))()
            for j, ((ptype, _n, pointer), a) in enumerate(zip(sig.params, args)):
                if isinstance(a, Slot):
                    if not pointer:
                        cell = self._scalar.setdefault(a.name, _CTYPES[ptype]())
                        argv[j] = ctypes.addressof(cell)
                elif pointer:
                    self._keep.append(a)
                    argv[j] = a.data_ptr()
                else:
                    cell = _CTYPES[ptype](a)
                    self._keep.append(cell)
                    argv[j] = ctypes.addressof(cell)
            argvs.append(argv)
        self._keep.append(argvs)
        n = len(launches)
        self._argvs = argvs
        ids = (ctypes.c_int * n)(*[module._index[name] for name, *_ in launches])
        grids = (ctypes.c_int * n)(*[g for _, g, _, _ in launches])
        blocks = (ctypes.c_int * n)(*[b for _, _, b, _ in launches])
        table = (ctypes.c_void_p * n)(*[ctypes.addressof(a) for a in argvs])
        self._keep += [ids, grids, blocks, table]
        addr = [ctypes.addressof(a) for a in (ids, grids, blocks, table)]
        self._call = lambda: module._run(n, *addr)  # noqa: E731

    def __call__(self, **bound: Any) -> None:
        if len(self._seen) < len(self._slots):
            self._unbound(self._slots, bound, self._seen)
        # recorded as one foreign call (a replay binds the same tensors and scalars again)
        record_foreign(self._run_bound, bound)

    def _run_bound(self, bound: dict[str, Any]) -> None:
        for name, value in bound.items():
            cell = self._scalar.get(name)
            if cell is not None:
                cell.value = value
                continue
            uses = self._slots.get(name) or self._unknown(bound)
            ptr = value.data_ptr()
            for k, j in uses:
                self._argvs[k][j] = ptr
        self._call()


class HostKernelModule(KernelModule):
    """The host build: g++ through the shim, loaded with ctypes.

    Raises:
        KernelCompileError: no ``g++`` on PATH (install it, e.g. ``apt-get install g++``), or
            the source does not compile (the compiler's message is included).
    """

    def __init__(self, source_path: pathlib.Path) -> None:
        source = source_path.read_text()
        self.signatures = parse_kernels(source)
        cxx = os.environ.get("CXX") or shutil.which("g++")
        if cxx is None:
            raise KernelCompileError("no C++ compiler found to build kernels for the host: install g++ or set $CXX")
        wrappers = []
        for sig in self.signatures.values():
            decl = ", ".join(f"{'void*' if p else t} {n}" for t, n, p in sig.params)
            call = ", ".join(f"({t}){n}" if p else n for t, n, p in sig.params)
            wrappers.append(
                f'extern "C" void msrl_launch_{sig.name}(int msrl_grid, int msrl_block{", " if decl else ""}{decl}) {{\n'
                f"    msrl_host_launch(msrl_grid, msrl_block, [&]() {{ {sig.name}({call}); }});\n}}\n"
            )
            # the same launch from an argument vector (pointers by value, numbers by address),
            # for sequences: unpacked into locals first, so the kernel body sees plain values
            unpack = "".join(
                f"    {'void*' if p else t} {n} = {'msrl_argv[%d]' % j if p else '*(const %s*)msrl_argv[%d]' % (t, j)};\n"
                for j, (t, n, p) in enumerate(sig.params)
            )
            wrappers.append(
                f"static void msrl_argv_{sig.name}(int msrl_grid, int msrl_block, void* const* msrl_argv) {{\n{unpack}"
                f"    msrl_launch_{sig.name}(msrl_grid, msrl_block{', ' if sig.params else ''}"
                f"{', '.join(n for _, n, _ in sig.params)});\n}}\n"
            )
        names = list(self.signatures)
        wrappers.append(
            "typedef void (*msrl_argv_fn)(int, int, void* const*);\n"
            f"static const msrl_argv_fn msrl_table[] = {{{', '.join('msrl_argv_' + n for n in names) or '0'}}};\n"
            'extern "C" void msrl_run_sequence(int n, const int* ids, const int* grids, const int* blocks,\n'
            "                                  void* const* const* argvs) {\n"
            "    for (int i = 0; i < n; ++i) msrl_table[ids[i]](grids[i], blocks[i], argvs[i]);\n}\n"
        )
        unit = f'#include "{SHIM}"\n#include "{source_path.resolve()}"\n\n' + "\n".join(wrappers)
        headers = "".join(h.read_text() for h in _local_includes(source_path))
        key = hashlib.sha256((unit + source + headers + SHIM.read_text() + " ".join(HOST_FLAGS) + cxx).encode()).hexdigest()[:20]
        cache = pathlib.Path(os.environ.get("MSRL_CACHE_DIR", pathlib.Path.home() / ".cache" / "msrl" / "kernels"))
        cache.mkdir(parents=True, exist_ok=True)
        lib = cache / f"{source_path.stem}-{key}.so"
        if not lib.is_file():
            src = cache / f"{source_path.stem}-{key}.cpp"
            src.write_text(unit)
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")
            proc = subprocess.run([cxx, *HOST_FLAGS, str(src), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelCompileError(f"host build of {source_path.name} failed:\n{proc.stderr[-4000:]}")
            os.replace(tmp, lib)
        self._lib = ctypes.CDLL(str(lib))
        self._fns = {}
        for sig in self.signatures.values():
            fn = getattr(self._lib, f"msrl_launch_{sig.name}")
            fn.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p if p else _CTYPES[t] for t, _, p in sig.params]
            fn.restype = None
            self._fns[sig.name] = fn
        self._index = {n: i for i, n in enumerate(self.signatures)}
        self._run = self._lib.msrl_run_sequence
        self._run.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4
        self._run.restype = None

    def sequence(self, launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> LaunchSequence:
        """See :meth:`KernelModule.sequence`: one ctypes call runs every launch."""
        return _HostSequence(self, launches)

    def launch(self, name: str, grid: int, block: int, *args: Any) -> None:
        """Runs kernel ``name`` over ``grid`` blocks of ``block`` threads on CPU tensors.

        Raises:
            KeyError, TypeError, ValueError: unknown kernel, wrong argument count or kind, a
                non-contiguous tensor or one on another device.
        """
        self._check(name, args, torch.device("cpu"))
        self.launch_unchecked(name, grid, block, *args)

    def launch_unchecked(self, name: str, grid: int, block: int, *args: Any) -> None:
        """:meth:`launch` without argument checks, for callers whose tensors are known good
        (a native env's own state): saves ~10 us per launch."""
        record_foreign(self._fns[name], grid, block, *[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])


def _local_includes(source_path: pathlib.Path) -> list[pathlib.Path]:
    """Files a source pulls in with ``#include "name"`` from its own folder (for cache keys)."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source_path.read_text(), re.M)
    return [source_path.parent / n for n in names if (source_path.parent / n).is_file()]


def keyed_source(source_path: pathlib.Path) -> str:
    """The source NVRTC compiles, headed by one comment line per local header with its hash:
    CuPy's on-disk kernel cache keys on the source text (not on included files), so editing a
    header alone must change the text, or stale kernels would be reused."""
    lines = [f"// msrl header {h.name} sha256={hashlib.sha256(h.read_bytes()).hexdigest()}"
             for h in _local_includes(source_path)]
    source = source_path.read_text()  # the hashes go last: NVRTC's line numbers stay the file's
    return source + ("\n" if lines and not source.endswith("\n") else "") + "".join(line + "\n" for line in lines)


def _cupy_stream(cupy: Any, torch_stream: Any, device_index: int) -> Any:
    """CuPy's view of a torch CUDA stream: ``Stream.from_external`` (the CUDA stream protocol,
    CuPy >= 14, where ``ExternalStream`` is deprecated) or ``ExternalStream`` on older CuPy."""
    from_external = getattr(getattr(cupy.cuda, "Stream", None), "from_external", None)
    if from_external is not None:
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, device_index)


class DeviceKernelModule(KernelModule):
    """The GPU build: NVRTC through CuPy; launches on torch CUDA tensors without copies.

    Raises:
        KernelCompileError: CuPy is not installed, or NVRTC rejects the source.
    """

    def __init__(self, source_path: pathlib.Path, device: torch.device) -> None:
        source = source_path.read_text()
        self.signatures = parse_kernels(source)
        self.device = device
        # the tensors' GPU: torch's current device when the device names no index
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            import cupy
        except ImportError as e:
            raise KernelCompileError('the GPU build of kernels needs CuPy: pip install -e ".[gpu]" '
                                     '(cupy-cuda12x[ctk]: CuPy with the CUDA headers NVRTC needs)') from e
        self._cupy = cupy
        try:
            with cupy.cuda.Device(self.device_index):
                options = (*DEVICE_FLAGS, f"-I{source_path.resolve().parent}")
                self._module = cupy.RawModule(code=keyed_source(source_path), options=options, name_expressions=None)
                self._kernels = {n: self._module.get_function(n) for n in self.signatures}
        except cupy.cuda.compiler.CompileException as e:
            raise KernelCompileError(f"NVRTC build of {source_path.name} failed:\n{e}") from e
        except Exception as e:  # noqa: BLE001 - CuPy's set-up errors come as RuntimeError, OSError, CUDARuntimeError
            raise KernelCompileError(
                f"cannot build {source_path.name} for {device} with CuPy: {type(e).__name__}: {' '.join(str(e).split())}; "
                'missing CUDA headers or NVRTC: pip install -e ".[gpu]" (cupy-cuda12x[ctk]) or set CUDA_PATH; '
                "no driver or device: check nvidia-smi"
            ) from e

    def launch(self, name: str, grid: int, block: int, *args: Any) -> None:
        """Runs kernel ``name`` on the current torch CUDA stream."""
        sig = self._check(name, args, self.device)
        self._run_prepared([(name, grid, block, [self._convert_arg(p, a) for p, a in zip(sig.params, args)])])

    def launch_unchecked(self, name: str, grid: int, block: int, *args: Any) -> None:
        """:meth:`launch` without argument checks."""
        sig = self.signatures[name]
        self._run_prepared([(name, grid, block, [self._convert_arg(p, a) for p, a in zip(sig.params, args)])])

    def _convert_arg(self, param: tuple[str, str, bool], value: Any) -> Any:
        """A CuPy view of a tensor (zero-copy, through ``__cuda_array_interface__``), or a CuPy
        scalar of the parameter's C type."""
        cupy, (ptype, _name, pointer) = self._cupy, param
        if pointer:
            return cupy.asarray(value)
        return {"int": cupy.int32, "unsigned int": cupy.uint32, "long long": cupy.int64, "unsigned long long": cupy.uint64,
                "float": cupy.float32, "double": cupy.float64}[ptype](value)

    def _run_prepared(self, launches: Sequence[tuple[str, int, int, Sequence[Any]]]) -> None:
        """Launches in order on torch's current stream, so kernels are ordered with the
        surrounding torch ops."""
        cupy = self._cupy
        stream = _cupy_stream(cupy, torch.cuda.current_stream(self.device), self.device_index)
        with cupy.cuda.Device(self.device_index), stream:
            for name, grid, block, args in launches:
                self._kernels[name]((grid,), (block,), tuple(args))


_cache: dict[tuple[str, str], KernelModule] = {}
_lock = threading.Lock()


def load_kernels(source_path: str | pathlib.Path, device: str | torch.device = "cpu") -> KernelModule:
    """The compiled kernels of ``source_path`` for ``device`` (cached per process).

    Args:
        source_path: a ``.cu`` file.
        device: ``cpu`` for the host build, ``cuda[:k]`` for the GPU build.

    Raises:
        KernelCompileError: see :class:`HostKernelModule` and :class:`DeviceKernelModule`.
    """
    path = pathlib.Path(source_path)
    dev = torch.device(device)
    key = (str(path.resolve()), str(dev))
    with _lock:
        if key not in _cache:
            _cache[key] = HostKernelModule(path) if dev.type == "cpu" else DeviceKernelModule(path, dev)
        return _cache[key]


def nvcc_compile(source_path: str | pathlib.Path, arch: str, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Compiles a ``.cu`` file for a GPU architecture with ``nvcc`` (a CI check; no GPU needed).

    Args:
        arch: e.g. ``"sm_80"``, ``"sm_90"``.

    Returns:
        the cubin's path.

    Raises:
        KernelCompileError: no ``nvcc`` on PATH, or the compile fails.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise KernelCompileError("nvcc not found on PATH")
    path = pathlib.Path(source_path)
    out = pathlib.Path(out_dir) / f"{path.stem}.{arch}.cubin"
    proc = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "--fmad=false", "-std=c++17", str(path), "-o", str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelCompileError(f"nvcc -arch={arch} {path.name} failed:\n{proc.stderr[-4000:]}")
    return out
