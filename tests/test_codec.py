"""The boundary codec: dtype + shape + raw bytes, round trips exact, malformed messages refused."""

import pickle

import pytest
import torch
from tensordict import TensorDict

from msrl.runtime.transports.codec import DTYPES, CodecError, decode, encode


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, TensorDict):
        return isinstance(b, TensorDict) and a.batch_size == b.batch_size and set(a.keys()) == set(b.keys()) \
            and all(_equal(a[k], b[k]) for k in a.keys())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_round_trips_bitwise(dtype):
    x = (torch.randn(3, 5, dtype=torch.float64) * 100).to(dtype)
    assert _equal(decode(encode(x)), x)


def test_nested_values_round_trip():
    td = TensorDict({"obs": torch.randn(4, 2, 3), "nested": TensorDict({"a": torch.arange(8).view(4, 2)}, [4, 2])}, [4, 2])
    value = {
        "td": td,
        "weights": {"w": torch.randn(2, 2).t(), "b": torch.zeros(0)},  # non-contiguous; empty
        "scalar": torch.tensor(3.5),
        "meta": [1, 2.5, True, None, "x", float("nan")],
        "pair": (torch.tensor([True, False]), -7),
    }
    out = decode(encode(value))
    assert _equal(out, value)
    assert out["td"]["nested"]["a"].tolist() == td["nested"]["a"].tolist()


def test_decoded_tensors_own_their_memory():
    x = torch.arange(4.0)
    msg = encode(x)
    y = decode(msg)
    y += 1
    msg.zero_()
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0] and x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_no_pickle_in_the_message():
    msg = encode({"w": torch.ones(2)}).numpy().tobytes()
    assert msg.startswith(b"MSRL") and b"pickle" not in msg
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(msg)


@pytest.mark.parametrize(
    "value, match",
    [
        (object(), r"value: a object cannot cross"),
        ({"a": [1, {2: 3}]}, r"value.a\[1\]: dict keys must be strings"),
        (torch.ones(2, dtype=torch.uint16), "dtype torch.uint16"),
        (torch.eye(2).to_sparse(), "sparse"),
    ],
)
def test_unsupported_values_are_named(value, match):
    with pytest.raises(CodecError, match=match):
        encode(value)


def test_malformed_messages_are_refused_clearly():
    good = encode({"x": torch.arange(10)})
    cases = {
        "shorter than": good[:3],
        "not b'MSRL'": torch.cat([torch.tensor(list(b"XXXX"), dtype=torch.uint8), good[4:]]),
        "truncated": good[:12],
        "outside the": good[:-8],
    }
    for match, msg in cases.items():
        with pytest.raises(CodecError, match=match):
            decode(msg)
    wrong_version = good.clone()
    wrong_version[4] = 9
    with pytest.raises(CodecError, match="version 9"):
        decode(wrong_version)
    with pytest.raises(CodecError, match="uint8"):
        decode(torch.zeros(3))
    # a header that lies about the byte count of a shape
    import json
    import struct

    header = json.dumps({"t": "tensor", "dtype": "float32", "shape": [1000000], "off": 0, "n": 8}).encode()
    msg = struct.pack("<4sBI", b"MSRL", 1, len(header)) + header + b"\0" * 8
    with pytest.raises(CodecError, match="needs 4000000 bytes"):
        decode(msg)
    header = b"{not json"
    with pytest.raises(CodecError, match="not JSON"):
        decode(struct.pack("<4sBI", b"MSRL", 1, len(header)) + header)
    torch.manual_seed(0)
    for _ in range(50):  # random bytes never crash or allocate: a CodecError every time
        with pytest.raises(CodecError):
            decode(torch.randint(0, 256, (64,), dtype=torch.uint8))


def test_decode_to_a_device():
    out = decode(encode(TensorDict({"a": torch.ones(2)}, [2])), device="cpu")
    assert out.device == torch.device("cpu") and out["a"].device == torch.device("cpu")


def test_corrupted_bytes_give_a_codec_error_or_a_value_never_another_exception():
    good = encode({"obs": TensorDict({"a": torch.randn(3, 2)}, [3]), "n": 4, "w": [torch.ones(2, dtype=torch.int64)]})
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        msg = good.clone()
        i = int(torch.randint(0, msg.numel(), (1,), generator=gen))
        msg[i] = int(torch.randint(0, 256, (1,), generator=gen))
        try:
            decode(msg)
        except CodecError:
            pass


def test_parts_carry_the_same_value_as_one_message():
    from msrl.runtime.transports.codec import decode_parts, encode_parts, payload_size

    value = {"obs": torch.randn(3, 4), "td": TensorDict({"a": torch.arange(6).view(2, 3)}, [2]), "k": 7, "none": None}
    head, payload = encode_parts(value)
    assert payload_size(head) == payload.numel() == 3 * 4 * 4 + 6 * 8
    assert torch.equal(torch.cat([head, payload]), encode(value))  # the same bytes, split
    padded = torch.cat([head, torch.zeros(40, dtype=torch.uint8)])  # a channel's buffer may pad the head
    out = decode_parts(padded, payload.clone())
    assert torch.equal(out["obs"], value["obs"]) and torch.equal(out["td"]["a"], value["td"]["a"])
    assert out["k"] == 7 and out["none"] is None
    empty_head, empty = encode_parts({"n": 1})
    assert empty.numel() == 0 and payload_size(empty_head) == 0 and decode_parts(empty_head, empty) == {"n": 1}


def test_a_head_claiming_a_huge_payload_is_refused_before_allocation():
    import json
    import struct

    from msrl.runtime.transports.codec import decode_parts, encode_parts, payload_size

    _, payload = encode_parts(torch.zeros(4))
    # a head whose tensor claims 2**40 bytes, as a corrupt or hostile peer might send
    header = json.dumps({"t": "tensor", "dtype": "uint8", "shape": [1 << 40], "off": 0, "n": 1 << 40}).encode()
    forged = torch.frombuffer(bytearray(struct.pack("<4sBI", b"MSRL", 1, len(header)) + header), dtype=torch.uint8)
    with pytest.raises(CodecError, match="a payload of 1099511627776 bytes"):
        payload_size(forged, limit=1 << 30)
    with pytest.raises(CodecError, match="outside the 16-byte payload"):
        decode_parts(forged, payload)


def test_tensors_are_aligned_and_can_be_decoded_in_place():
    from msrl.runtime.transports.codec import ALIGN, _parse_head

    value = {"flag": torch.tensor([True, False, True]), "x": torch.randn(3), "i": torch.arange(5),
             "td": TensorDict({"c": torch.randn(2, 2, dtype=torch.complex128)}, [2]), "n": 1}
    msg = encode(value)
    header, start = _parse_head(msg)
    assert start % ALIGN == 0
    offsets = [header["items"][k]["off"] for k in ("flag", "x", "i")] + [header["items"]["td"]["items"]["c"]["off"]]
    assert all((start + o) % ALIGN == 0 for o in offsets)
    out = decode(msg, copy=False)
    assert _equal(out, value)
    lo, hi = msg.data_ptr(), msg.data_ptr() + msg.numel()
    assert all(lo <= t.data_ptr() < hi for t in (out["x"], out["i"], out["flag"], out["td"]["c"]))  # views, no copies
    owned = decode(msg)
    assert all(not lo <= t.data_ptr() < hi for t in (owned["x"], owned["i"]))


def test_a_cached_header_still_reads_each_payload_and_checks_its_size():
    first, second = encode({"w": torch.zeros(4)}), encode({"w": torch.ones(4)})
    assert decode(first)["w"].tolist() == [0.0] * 4
    assert decode(second)["w"].tolist() == [1.0] * 4  # same header, its own payload
    with pytest.raises(CodecError, match="outside the"):
        decode(second[:-4])


def test_encode_pads_to_a_channel_size_in_one_go():
    value = {"w": torch.arange(3.0)}
    plain = encode(value)
    padded = encode(value, min_size=plain.numel() + 100)
    assert padded.numel() == plain.numel() + 100 and torch.equal(padded[:plain.numel()], plain)
    assert not padded[plain.numel():].any() and decode(padded)["w"].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(encode(value, min_size=3), plain)  # never truncated


def _message_with_header(header: bytes, payload: bytes = b"") -> bytes:
    import struct

    header += b" " * (-(9 + len(header)) % 16)
    return struct.pack("<4sBI", b"MSRL", 1, len(header)) + header + payload


@pytest.mark.parametrize("header", [
    b'{"t":"tensor","dtype":"float32","shape":[0,1180591620717411303424],"off":0,"n":0}',  # [0, 2**70]
    b'{"t":"tensor","dtype":"float32","shape":[1099511627776,1099511627776,0],"off":0,"n":0}',  # [2**40, 2**40, 0]
    b'{"t":"int","v":' + b"9" * 5000 + b"}",  # over Python's int-from-string digit limit
    b"[" * 100_000 + b"]" * 100_000,  # nested past the JSON parser's recursion limit
    b'{"t":"td","batch":[-5],"items":{}}',
    b'{"t":"td","batch":[true],"items":{}}',
    b'{"t":"tensor","dtype":"float32","shape":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33],"off":0,"n":0}',
])
def test_hostile_headers_are_codec_errors(header):
    """Headers that used to escape as TypeError, RuntimeError, ValueError or RecursionError, or
    to decode (a negative batch size), are refused as CodecError."""
    with pytest.raises(CodecError):
        decode(_message_with_header(header))


def _header_strategy():
    from hypothesis import strategies as st

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                          st.floats(allow_nan=False), st.text(max_size=8))
    dtype = st.sampled_from([*DTYPES, "float99", "", "object"])
    shape = st.lists(st.one_of(st.integers(min_value=-3, max_value=8), st.integers(min_value=2**30, max_value=2**72)),
                     max_size=6)
    tensor = st.fixed_dictionaries({"t": st.just("tensor"), "dtype": dtype, "shape": shape,
                                    "off": st.integers(min_value=-4, max_value=2**70),
                                    "n": st.integers(min_value=-4, max_value=2**70)})
    json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c, max_size=3)),
                              max_leaves=10)
    node = st.recursive(
        st.one_of(tensor, st.fixed_dictionaries({"t": st.sampled_from(["none", "int", "float", "str", "bool", "x"]),
                                                 "v": json_value})),
        lambda c: st.one_of(
            st.fixed_dictionaries({"t": st.sampled_from(["dict", "list", "tuple", "td"]),
                                   "items": st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c, max_size=3)),
                                   "batch": st.lists(st.integers(min_value=-2, max_value=2**41), max_size=3)}),
            json_value),
        max_leaves=8)
    return node


def test_fuzzed_messages_decode_or_are_codec_errors():
    """hypothesis: random bytes, truncated and bit-flipped real messages, and generated headers
    (huge or negative shapes and offsets, unknown dtypes, wrong structures) never raise anything
    but CodecError and never allocate beyond the message (a tensor is a view or a copy of
    payload bytes the message holds)."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    real = encode({"td": TensorDict({"obs": torch.randn(4, 3)}, [4]), "w": [torch.arange(5), 2.5, "x"]}).numpy().tobytes()

    def check(message: bytes) -> None:
        try:
            value = decode(message)
        except CodecError:
            return
        for t in _tensors(value):
            assert t.numel() * t.element_size() <= len(message)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.binary(max_size=256),
        st.integers(min_value=0, max_value=len(real)).map(lambda n: real[:n]),
        st.tuples(st.integers(min_value=0, max_value=len(real) - 1), st.integers(min_value=0, max_value=255)).map(
            lambda p: real[:p[0]] + bytes([p[1]]) + real[p[0] + 1:]),
        _header_strategy().map(lambda h: _message_with_header(json.dumps(h).encode(), b"\0" * 64)),
    ))
    def fuzz(message):
        check(message)

    fuzz()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, TensorDict):
        return list(value.values(include_nested=True, leaves_only=True))
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _full_encode(value, min_size=0):
    """The message as the full (uncached) path writes it."""
    from msrl.runtime.transports import codec

    head, chunks = codec._head(value, None)
    size = head.numel() + sum(c.numel() for c in chunks)
    if size < min_size:
        chunks.append(torch.zeros(min_size - size, dtype=torch.uint8))
    return torch.cat([head, *chunks]) if chunks else head


def _values(seed):
    """Values of one structure per call (fresh tensor contents each time): every dtype, 0-d,
    empty, non-contiguous, conjugated, grad-requiring and bfloat16 leaves, nested containers."""
    g = torch.Generator().manual_seed(seed)
    base = {name: (torch.randn(3, 2, generator=g, dtype=torch.float64) * 50).to(d) for name, d in DTYPES.items()}
    return {
        "td": TensorDict({"obs": torch.randn(4, 2, 3, generator=g), "done": torch.rand(4, 2, generator=g) > 0.5,
                          "inner": TensorDict({"a": torch.randint(0, 9, (4, 2, 1), generator=g)}, [4, 2])}, [4, 2]),
        "dtypes": base,
        "zero_d": torch.tensor(float(seed)),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(3, 5, generator=g).t(),
        "conj": torch.randn(2, 2, dtype=torch.complex64, generator=g).conj(),
        "grad": torch.randn(3, generator=g, requires_grad=True),
        "scalars": [1, -0.0, 2.5, True, None, "s", (7, [0.0])],
    }


def test_the_cached_encode_writes_the_full_paths_message_bitwise():
    for seed in range(4):  # the first call describes the structure; later ones reuse its header
        value = _values(seed)
        for min_size in (0, 1 << 16):
            fast = encode(value, min_size)
            assert torch.equal(fast, _full_encode(value, min_size)), seed
            assert _equal(decode(fast), decode(_full_encode(value)))
    # a scalar of another value (even one == to the last: -0.0 and 0.0) is another header
    assert decode(encode({"x": 0.0}))["x"] == 0.0
    assert str(decode(encode({"x": -0.0}))["x"]) == "-0.0"
    assert decode(encode({"x": 1}))["x"] == 1 and type(decode(encode({"x": True}))["x"]) is bool
    # the same structure on another device type or of another dtype is another layout
    assert decode(encode({"w": torch.zeros(2, dtype=torch.int32)}))["w"].dtype == torch.int32
    assert decode(encode({"w": torch.zeros(2, dtype=torch.int64)}))["w"].dtype == torch.int64


def test_decoded_tensors_are_owned_resizable_torch_memory_unless_viewed():
    value = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "m": torch.tensor([True, False])}
    encode(value)
    out = decode(encode(value))  # the cached path, too, leaves the sender's tensors as they were
    torch.zeros(3).set_(value["w"].untyped_storage()).resize_(12)
    out["w"].resize_(12)  # its own storage, resizable as any tensor's
    assert out["w"][:6].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and out["m"].tolist() == [True, False]
    buf = bytearray(encode(value).numpy().tobytes())
    viewed = decode(buf, copy=False)  # a bytearray handed over is viewed in place
    assert _equal(viewed["w"], value["w"])
    at = bytes(buf).find(value["w"].numpy().tobytes())
    buf[at:at + 24] = bytes(24)  # the message's bytes of w, changed after decoding: the view shows it
    assert viewed["w"].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_tensordict_holding_what_no_tensordict_holds_is_a_codec_error():
    """A header whose TensorDict holds a tuple of TensorDicts (which no encoder writes: found by
    the fuzz test) is a CodecError, not tensordict's TypeError."""
    message = (b'MSRL\x01w\x00\x00\x00{"t" :"td" ,"items"  :{"":{"t" :"tuple" ,"items" :[{"t" :"td" ,"items"  :{},'
               b'"batch" :[]} ], "abcht ":[]}},"batch"  :[]}')
    with pytest.raises(CodecError, match="malformed message: TensorDict"):
        decode(message)
