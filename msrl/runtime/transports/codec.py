"""The value codec of boundaries between processes: dtype + shape + raw bytes, never pickle.

A value at a boundary is a tensor, a TensorDict, ``None``, a Python scalar or string, or a dict
(string keys), list or tuple of those, nested. :func:`encode` turns it into one contiguous
``uint8`` tensor (what torch.distributed and a gRPC stream carry) and :func:`decode` turns such a
buffer back into an equal value that owns its memory::

    b"MSRL" | version (1 byte) | header length (uint32, little endian) | header (UTF-8 JSON) | payload

The header describes the value's structure; each tensor leaf records its dtype, shape, and the
offset and length of its raw bytes in the payload. Decoding checks every field against the buffer
before touching it, so a truncated, corrupt or hostile message is a :class:`CodecError` naming what
is wrong, never a crash, a huge allocation or code execution.
"""

from __future__ import annotations

import ctypes
import json
import struct
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from msrl.errors import MsrlError

__all__ = ["CodecError", "encode", "decode", "encode_parts", "decode_parts", "payload_size", "MAGIC", "VERSION",
           "MAX_MESSAGE"]

MAGIC = b"MSRL"
VERSION = 1
_PREFIX = struct.Struct("<4sBI")
#: The payload starts, and every tensor's bytes start, at a multiple of this many bytes from the
#: message's start (the header is padded with spaces, tensors with zero bytes), so a decoder can
#: view a tensor in the received buffer without copying it (``decode(..., copy=False)``).
ALIGN = 16

#: The largest dimension (and element count) a header may declare: far above any real value,
#: far below what overflows torch's size arithmetic.
MAX_DIM = 1 << 40
#: The most dimensions a tensor or a TensorDict batch may declare.
MAX_NDIM = 32
#: The default largest message of a boundary between processes (bytes; 1 GiB): the most a
#: receiver allocates for one value (``cluster.max_message_mb`` sets a job's limit).
MAX_MESSAGE = 1 << 30

#: The tensor dtypes a boundary carries, by their names in the header.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}


class CodecError(MsrlError, ValueError):
    """A value the codec cannot carry, or a buffer that is not a well-formed message."""


def _describe(value: Any, chunks: list[torch.Tensor], offset: list[int], path: str,
              to: torch.device | None = None, offsets: list[int] | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise CodecError(f"{path}: tensors of dtype {value.dtype} cannot cross a boundary; dtypes: {', '.join(DTYPES)}")
        if value.layout is not torch.strided:
            raise CodecError(f"{path}: {value.layout} tensors cannot cross a boundary; make them dense")
        flat = value.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
        target = to if to is not None else torch.device("cpu")
        raw = flat.to(target).view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=target)
        pad = -offset[0] % ALIGN if raw.numel() else 0
        if pad:  # every tensor's bytes start ALIGN-aligned: a receiver may view them in place
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=target))
            offset[0] += pad
        node = {"t": "tensor", "dtype": name, "shape": list(value.shape), "off": offset[0], "n": raw.numel()}
        if offsets is not None:
            offsets.append(offset[0])
        chunks.append(raw)
        offset[0] += raw.numel()
        return node
    if isinstance(value, TensorDictBase):
        items = {k: _describe(v, chunks, offset, f"{path}.{k}", to, offsets) for k, v in value.items()}
        return {"t": "td", "batch": list(value.batch_size), "items": items}
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": value}
    if isinstance(value, float):
        return {"t": "float", "v": value}
    if isinstance(value, str):
        return {"t": "str", "v": value}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise CodecError(f"{path}: dict keys must be strings to cross a boundary, got {bad[0]!r}")
        return {"t": "dict", "items": {k: _describe(v, chunks, offset, f"{path}.{k}", to, offsets) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {"t": kind, "items": [_describe(v, chunks, offset, f"{path}[{i}]", to, offsets) for i, v in enumerate(value)]}
    raise CodecError(
        f"{path}: a {type(value).__name__} cannot cross a boundary; values are tensors, TensorDicts, None, "
        "numbers, strings, and dicts/lists/tuples of them"
    )


def encode(value: Any, min_size: int = 0) -> torch.Tensor:
    """One message holding ``value``.

    A channel sends values of one structure over and over: the first message of a structure
    (its keys, dtypes, shapes and scalars) is described, checked and its header written; later
    ones reuse that header and copy each tensor's bytes into place (bitwise the same message).

    Args:
        value: tensors (any device; copied to the host), TensorDicts, ``None``, ``bool``/``int``/
            ``float``/``str``, and dicts with string keys, lists and tuples of them.
        min_size: pad the message with zero bytes to at least this many bytes (a channel's
            fixed buffer size), in the same copy.

    Returns:
        a contiguous 1-D ``uint8`` CPU tensor.

    Raises:
        CodecError: a leaf of another type (named by its path, e.g. ``value.obs[2]``), a
            non-string dict key, a sparse tensor or an unsupported dtype.
    """
    leaves: list[torch.Tensor] = []
    try:
        key = _signature(value, leaves)
        layout = _LAYOUTS.get(key)
    except _Unkeyed:  # a leaf the cache does not key: the full path names what is wrong
        key = layout = None
    if layout is None:
        offsets: list[int] = []
        head, chunks = _head(value, None, offsets)
        size = head.numel() + sum(c.numel() for c in chunks)
        if key is not None:
            if len(_LAYOUTS) >= _MAX_PLANS:
                _LAYOUTS.clear()
            _LAYOUTS[key] = (head.numpy().tobytes(), tuple(offsets), size)
        if size < min_size:
            chunks.append(torch.zeros(min_size - size, dtype=torch.uint8))
        return torch.cat([head, *chunks]) if chunks else head
    head_bytes, offsets_, size = layout
    out = torch.zeros(max(size, min_size), dtype=torch.uint8)
    base, h = out.data_ptr(), len(head_bytes)
    ctypes.memmove(base, head_bytes, h)
    for t, off in zip(leaves, offsets_):  # offsets within the payload, which follows the head
        n = t.numel() * t.element_size()
        if n:
            t = _dense_host(t)
            ctypes.memmove(base + h + off, t.data_ptr(), n)
    return out


class _Unkeyed(Exception):
    """A value :func:`_signature` does not key (the full encode path raises what is wrong)."""


#: a value's structure (see :func:`_signature`) -> (its message's head bytes, each tensor
#: leaf's offset in the payload in traversal order, the message's size)
_LAYOUTS: dict[Any, tuple[bytes, tuple[int, ...], int]] = {}


def _signature(value: Any, leaves: list[torch.Tensor]) -> Any:
    """A hashable key of everything :func:`_describe` writes into a header -- structure, keys,
    dtypes, shapes, layouts, scalar values (floats by their bits) -- appending the tensor leaves
    to ``leaves`` in the order :func:`_describe` visits them.

    Raises:
        _Unkeyed: a leaf of another type.
    """
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return (value.dtype, value.layout, tuple(value.shape))
    if isinstance(value, TensorDictBase):
        return ("td", tuple(value.batch_size), tuple((k, _signature(v, leaves)) for k, v in value.items()))
    if value is None:
        return None
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", int(value))
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, str):
        return ("str", str(value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _signature(v, leaves)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("list" if isinstance(value, list) else "tuple", tuple(_signature(v, leaves) for v in value))
    raise _Unkeyed


def _dense_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous, its conjugate and negative bits resolved: what its bytes
    in a message are (``t`` itself when it is already so)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t


def encode_parts(value: Any, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` as a head (prefix + header) and a payload (the tensors' raw bytes), for
    transports that move the payload device to device (NCCL) and only the head through the host.

    Args:
        value: as for :func:`encode`.
        device: where the payload is assembled (default: the CPU); tensors elsewhere are copied there.

    Returns:
        ``(head, payload)``: 1-D ``uint8`` tensors, the head on the CPU, the payload on ``device``
        (``payload_size(header)`` bytes; ``torch.cat([head, payload.cpu()])`` is :func:`encode`'s message).

    Raises:
        CodecError: as :func:`encode`.
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    head, chunks = _head(value, target)
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=target)
    return head, payload


def _head(value: Any, to: torch.device | None,
          offsets: list[int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    chunks: list[torch.Tensor] = []
    header = json.dumps(_describe(value, chunks, [0], "value", to, offsets), separators=(",", ":")).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % ALIGN)  # the payload starts aligned
    head = torch.frombuffer(bytearray(_PREFIX.pack(MAGIC, VERSION, len(header)) + header), dtype=torch.uint8)
    return head, chunks


def _fail(what: str) -> CodecError:
    return CodecError(f"malformed message: {what}")


#: A compiled header: builds the value from a payload (1-D, contiguous), the payload as a numpy
#: array (``None`` where there is none: a payload on another device, or tensors copied out), a
#: device (``None``: where the payload is) and whether tensors are copied out of the payload
#: (``True``) or viewed in it.
Plan = Callable[[torch.Tensor, "np.ndarray | None", "torch.device | None", bool], Any]

#: numpy's dtype of each carried torch dtype (bfloat16 has none: it is decoded with torch ops)
_NUMPY = {d: torch.empty(0, dtype=d).numpy().dtype for d in DTYPES.values() if d is not torch.bfloat16}


def _compile(node: Any, depth: int) -> Plan:
    """Checks one header entry (and its children) and returns the function that builds its
    value; every check that does not depend on the payload happens here, once per header."""
    if depth > 64:
        raise _fail("nested deeper than 64 levels")
    if not isinstance(node, dict) or not isinstance(node.get("t"), str):
        raise _fail(f"a header entry is {type(node).__name__}, not an object with a type")
    t = node["t"]
    if t == "tensor":
        return _compile_tensor(node)
    if t == "td":
        items, batch = node.get("items"), node.get("batch")
        if not isinstance(items, dict) or not isinstance(batch, list):
            raise _fail("a TensorDict entry without items or batch size")
        if not _is_shape(batch):
            raise _fail(f"bad TensorDict batch size {batch!r}")
        parts = {k: _compile(v, depth + 1) for k, v in items.items()}
        # entries of a shape checked here skip TensorDict's per-message checks
        checked = _new_unsafe is not None and all(_leading(v, batch) for v in items.values())
        size = torch.Size(batch)

        def build_td(payload: torch.Tensor, arr: np.ndarray | None, device: torch.device | None, copy: bool) -> Any:
            built = {k: f(payload, arr, device, copy) for k, f in parts.items()}
            if checked:
                return _new_unsafe(built, batch_size=size, device=device)
            try:
                return TensorDict(built, batch_size=batch, device=device)
            except (RuntimeError, ValueError, TypeError) as e:  # TypeError: an item TensorDict cannot hold
                raise _fail(f"TensorDict of batch size {batch}: {e}") from None

        return build_td
    if t == "none":
        return lambda payload, arr, device, copy: None
    if t in ("bool", "int", "float", "str"):
        v = node.get("v")
        ok = {"bool": bool, "int": int, "float": (int, float), "str": str}[t]
        if not isinstance(v, ok) or (t == "int" and isinstance(v, bool)):
            raise _fail(f"a {t} entry holds {v!r}")
        v = float(v) if t == "float" else v
        return lambda payload, arr, device, copy: v
    if t == "dict":
        items = node.get("items")
        if not isinstance(items, dict):
            raise _fail("a dict entry without items")
        fields = [(k, _compile(v, depth + 1)) for k, v in items.items()]
        return lambda payload, arr, device, copy: {k: f(payload, arr, device, copy) for k, f in fields}
    if t in ("list", "tuple"):
        items = node.get("items")
        if not isinstance(items, list):
            raise _fail(f"a {t} entry without items")
        elements = [_compile(v, depth + 1) for v in items]
        if t == "list":
            return lambda payload, arr, device, copy: [f(payload, arr, device, copy) for f in elements]
        return lambda payload, arr, device, copy: tuple(f(payload, arr, device, copy) for f in elements)
    raise _fail(f"unknown entry type {t!r}")


#: TensorDict's constructor without its checks (tensordict >= 0.6), for entries checked once per header
_new_unsafe = getattr(TensorDict, "_new_unsafe", None)


def _leading(node: Any, batch: list[int]) -> bool:
    """Whether a (compiled, so well-formed) header entry is a tensor or a TensorDict whose
    shape starts with ``batch``."""
    if node["t"] == "tensor":
        shape = node["shape"]
    elif node["t"] == "td":
        shape = node["batch"]
    else:
        return False
    return len(shape) >= len(batch) and shape[:len(batch)] == batch


def _is_shape(shape: Any) -> bool:
    """Whether ``shape`` is a list of at most :data:`MAX_NDIM` ints in ``[0, MAX_DIM]`` whose
    non-zero ones multiply to at most ``MAX_DIM``."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        return False
    numel = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_DIM:
            return False
        numel *= max(d, 1)
        if numel > MAX_DIM:
            return False
    return True


def _compile_tensor(node: dict[str, Any]) -> Plan:
    dtype = DTYPES.get(node.get("dtype"))  # type: ignore[arg-type]
    shape, off, n = node.get("shape"), node.get("off"), node.get("n")
    if dtype is None:
        raise _fail(f"unknown dtype {node.get('dtype')!r}")
    if not _is_shape(shape):
        raise _fail(f"bad shape {shape!r}")
    if not (isinstance(off, int) and isinstance(n, int) and 0 <= off <= MAX_DIM and 0 <= n <= MAX_DIM):
        raise _fail(f"bad tensor bytes [{off!r}, +{n!r})")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = dtype.itemsize
    if numel * itemsize != n:
        raise _fail(f"shape {shape} of {node['dtype']} needs {numel * itemsize} bytes, the header says {n}")
    end = off + n
    npdtype = _NUMPY.get(dtype)
    tshape = tuple(shape)

    def build_tensor(payload: torch.Tensor, arr: np.ndarray | None, device: torch.device | None,
                     copy: bool) -> torch.Tensor:
        if end > payload.numel():
            raise _fail(f"tensor bytes [{off}, {off}+{n}) outside the {payload.numel()}-byte payload")
        if not n:
            out = torch.empty(shape, dtype=dtype)
        elif (copy or off % itemsize) and payload.device.type == "cpu":  # one copy into memory torch owns
            out = torch.empty(tshape, dtype=dtype)
            ctypes.memmove(out.data_ptr(), payload.data_ptr() + off, n)
        elif arr is not None and npdtype is not None and not copy:  # numpy's views cost less than torch's
            out = torch.from_numpy(arr[off:end].view(npdtype).reshape(tshape))
        else:
            raw = payload[off:end]
            if copy or raw.storage_offset() % itemsize:
                raw = raw.clone()
            out = raw.view(dtype).view(shape)
        if device is None or out.device == device:
            return out
        # from pinned host memory (a receive buffer staged for a GPU consumer) the copy does not block
        return out.to(device, non_blocking=out.device.type == "cpu" and device.type == "cuda" and out.is_pinned())

    return build_tensor


#: header bytes -> its compiled :data:`Plan`: a channel carries values of one structure over
#: and over, so its header is parsed and checked once
_PLANS: dict[bytes, Plan] = {}
_MAX_PLANS = 256


def _plan(header: bytes) -> Plan:
    plan = _PLANS.get(header)
    if plan is None:
        parsed = _json(header)
        plan = _compile(parsed, 0)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[header] = plan
    return plan


def _header_bytes(message: torch.Tensor) -> tuple[bytes, int]:
    """The raw header of a message (or of a head, possibly padded) and where its payload starts."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise _fail(f"expected a 1-D uint8 buffer, got {message.dtype} of shape {tuple(message.shape)}")
    message = message.cpu()
    if message.numel() < _PREFIX.size:
        raise _fail(f"{message.numel()} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack(message[:_PREFIX.size].numpy().tobytes())
    if magic != MAGIC:
        raise _fail(f"starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise _fail(f"codec version {version}; this msrl reads version {VERSION}")
    if _PREFIX.size + hlen > message.numel():
        raise _fail(f"header of {hlen} bytes runs past the {message.numel()}-byte message (truncated?)")
    return message[_PREFIX.size:_PREFIX.size + hlen].numpy().tobytes(), _PREFIX.size + hlen


def _json(header: bytes) -> Any:
    """The parsed header; any failure (not UTF-8, not JSON, nested too deep for the parser, an
    integer of too many digits) is a :class:`CodecError`."""
    try:
        return json.loads(header.decode())
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and ints over Python's digit limit
        raise _fail(f"header is not JSON: {str(e)[:200]}") from None
    except RecursionError:
        raise _fail("header nested too deep to parse") from None


def _parse_head(message: torch.Tensor) -> tuple[Any, int]:
    """The header of a message (or of a head, possibly padded) and where its payload starts."""
    header, start = _header_bytes(message)
    return _json(header), start


def decode(message: torch.Tensor | bytes | bytearray, device: torch.device | str | None = None,
           copy: bool = True) -> Any:
    """The value :func:`encode` put into ``message``.

    Args:
        message: a 1-D ``uint8`` tensor (or bytes, or a bytearray) as :func:`encode` returned it.
        device: where the decoded tensors go (default: the CPU).
        copy: copy every tensor out of ``message`` (default). ``False``: CPU tensors are views of
            ``message`` where their bytes are aligned for their dtype (every tensor of a
            message :func:`encode` wrote), for a caller that owns ``message`` and drops it.

    Returns:
        the value; with ``copy``, tensors and TensorDicts own their memory (a receiver may
        modify them).

    Raises:
        CodecError: not a message (wrong magic or version), truncated, or a header that does not
            describe the payload (bad JSON, unknown dtype, bytes out of range, a shape that does
            not match its byte count).
    """
    if isinstance(message, (bytes, bytearray)):
        if not message:
            message = torch.empty(0, dtype=torch.uint8)
        else:  # a bytearray the caller hands over (``copy=False``) is viewed, not copied
            message = torch.frombuffer(message if isinstance(message, bytearray) and not copy else bytearray(message),
                                       dtype=torch.uint8)
    header, start = _header_bytes(message)
    payload = message.cpu().contiguous()[start:]
    return _plan(header)(payload, None if copy else payload.numpy(), torch.device(device) if device is not None else None,
                         copy)


def payload_size(head: torch.Tensor, limit: int = MAX_MESSAGE) -> int:
    """The payload bytes a head's header describes (what a receiver allocates before the payload).

    Raises:
        CodecError: a malformed head, or a payload over ``limit`` bytes.
    """
    header, _ = _parse_head(head)
    size, stack, seen = 0, [header], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > 1_000_000:
            raise _fail("a header of more than a million entries")
        if isinstance(node, dict):
            if node.get("t") == "tensor":
                off, n = node.get("off"), node.get("n")
                if not (isinstance(off, int) and isinstance(n, int) and off >= 0 and n >= 0):
                    raise _fail(f"bad tensor bytes [{off!r}, +{n!r})")
                size = max(size, off + n)
            items = node.get("items")
            if isinstance(items, dict):
                stack.extend(items.values())
            elif isinstance(items, list):
                stack.extend(items)
    if size > limit:
        raise _fail(f"a payload of {size} bytes (at most {limit})")
    return size


def decode_parts(head: torch.Tensor, payload: torch.Tensor, device: torch.device | str | None = None) -> Any:
    """The value :func:`encode_parts` split into ``head`` and ``payload``.

    Args:
        head: the head (on the CPU; trailing padding allowed).
        payload: the payload, on any device (decoded tensors are sliced from it there, then
            moved to ``device``).
        device: where the decoded tensors go (default: the payload's device).

    Returns:
        the value; its tensors own their memory.

    Raises:
        CodecError: as :func:`decode`.
    """
    header, _ = _header_bytes(head)
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise _fail(f"expected a 1-D uint8 payload, got {payload.dtype} of shape {tuple(payload.shape)}")
    return _plan(header)(payload.contiguous(), None, torch.device(device) if device is not None else payload.device, True)
