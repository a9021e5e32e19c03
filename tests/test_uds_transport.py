"""The Unix-socket transport of asynchronous boundaries between processes of one machine
(cluster/uds_transport.py) under misuse and faults: connections without the token or from a
stranger, oversized and fuzzed frames, ignored credits (each refused with its reason while the
server serves the legitimate producer), the socket's private directory and no TCP listener,
a value larger than the socket's buffer, coalesced ``latest`` versions, reconnection after the
consumer restarts. Its semantics suite is tests/test_async_channels.py's (transport ``uds``)."""

import contextlib
import dataclasses
import os
import secrets
import socket
import stat
import struct
import threading
import time

import pytest
import torch

from msrl.graph import NodeKind
from msrl.graph.fragmented import Boundary
from msrl.runtime.asynchronous import AsyncEndpoint, Mailbox

pytest.importorskip("grpc")

from msrl.cluster.grpc_transport import ITEM, LATEST, encode_frame  # noqa: E402
from msrl.cluster.streams import ProcessTransport  # noqa: E402
from msrl.cluster.uds_transport import REFUSED, UdsServer, encode_hello  # noqa: E402
from msrl.runtime.transports.codec import encode  # noqa: E402
from msrl.runtime.transports.kinds import STREAM_KINDS  # noqa: E402

TRAJ, WEIGHTS = "train_step/b0:traj", "train_step/b1:w"


def fifo(src_r=2, dst_r=1, pattern=NodeKind.GATHER, capacity=1):
    return Boundary(TRAJ, "train_step", "traj", NodeKind.PUT, "actor", "learner", src_r, dst_r, "sharded", 0, False,
                    pattern=pattern, channel="fifo", capacity=capacity)


def latest(src_r=1, dst_r=1, pattern=NodeKind.SEND):
    return Boundary(WEIGHTS, "train_step", "w", NodeKind.PUT, "learner", "actor", src_r, dst_r, "replicated", None,
                    False, pattern=pattern, channel="latest")


@pytest.fixture
def served():
    """A learner's Unix-socket server (a fifo from 2 actors, capacity 2, frames up to 64 KiB)
    and a legitimate producer."""
    bs = [fifo(capacity=2), latest()]
    mailbox = Mailbox({TRAJ: 2}, timeout_s=120)
    token = secrets.token_urlsafe(16)
    server = UdsServer(bs, "learner", 0, mailbox, token, max_message=1 << 16)
    good = ProcessTransport(bs, "actor", 0, {("learner", 0): server.address}, token, timeout_s=120)
    actor = AsyncEndpoint(bs, "actor", 0, Mailbox({}), good)
    yield server, token, actor, mailbox
    good.close()
    server.stop()


def _raw(server, frames, token, producer="actor/1", hello=None, wait_s=300.0):
    """Connects to ``server``, greets with ``token`` and ``producer`` (or the raw ``hello``
    body), sends ``frames`` (each length-prefixed), and, while the server's thread pumps, reads
    until the server closes the stream or ``wait_s`` pass (generous: a refusal is awaited on a
    busy machine; short where a stream may stay open); returns the REFUSED reason (``None``:
    not refused)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.path)
    body = hello if hello is not None else encode_hello(token, producer)
    data = struct.pack("<I", len(body)) + body + b"".join(struct.pack("<I", len(f)) + f for f in frames)
    sock.sendall(data)
    sock.settimeout(0.05)
    got, deadline = b"", time.monotonic() + wait_s
    while time.monotonic() < deadline:
        server.pump(0.05)
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    sock.close()
    at = 0
    while at + 4 <= len(got):
        (n,) = struct.unpack_from("<I", got, at)
        body = got[at + 4:at + 4 + n]
        if len(body) >= 6 and body[5] == REFUSED:
            return body[6:].decode()
        at += 4 + n
    return None


def _still_serves(actor, mailbox, marker):
    actor.put(TRAJ, torch.tensor([marker]))
    assert int(mailbox.take(TRAJ, 0).value) == marker


def _msg(x=1):
    return encode(torch.tensor([x])).numpy().tobytes()


def test_the_socket_is_private_and_nothing_listens_on_the_network(served):
    server, *_ = served
    mode = os.stat(os.path.dirname(server.path)).st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700  # no other user can reach the socket
    assert server.address == f"unix:{server.path}" and stat.S_ISSOCK(os.stat(server.path).st_mode)
    server.stop()
    assert not os.path.exists(os.path.dirname(server.path))  # removed with its directory


def test_a_stream_without_the_token_or_from_a_stranger_is_refused(served):
    server, token, actor, mailbox = served
    frame = encode_frame(ITEM, 0, 1, 0, {}, _msg())
    assert "missing or wrong job token" in _raw(server, [frame], "x" * len(token))
    assert "missing or wrong job token" in _raw(server, [frame], "")
    assert "producer 'actor/7' sends on no boundary" in _raw(server, [frame], token, "actor/7")
    assert "producer 'learner/0' sends on no boundary" in _raw(server, [frame], token, "learner/0")
    assert "a malformed greeting" in _raw(server, [frame], token, hello=b"MSRA\x01\x05" + b"\xff" * 8)
    assert mailbox.queued() == 0  # nothing of theirs was delivered
    assert len(server.rejected) == 5
    _still_serves(actor, mailbox, 5)


def test_an_oversized_frame_is_refused_before_it_is_read(served):
    """A declared length over the limit refuses the stream before the bytes are buffered."""
    server, token, actor, mailbox = served
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.path)
    hello = encode_hello(token, "actor/1")
    sock.sendall(struct.pack("<I", len(hello)) + hello + struct.pack("<I", 1 << 30) + b"x" * 100)
    deadline = time.monotonic() + 300
    while not server.rejected and time.monotonic() < deadline:
        server.pump(0.05)
    sock.close()
    assert "a message of 1073741824 bytes declared; the limit is 65536" in server.rejected[-1][1]
    _still_serves(actor, mailbox, 6)


def test_a_producer_ignoring_its_credits_is_cut_off(served):
    server, token, actor, mailbox = served
    why = _raw(server, [encode_frame(ITEM, 0, 1, 0, {}, _msg())] * 3, token)
    assert "more than 2 items in flight" in why
    _still_serves(actor, mailbox, 7)


def test_frames_of_the_wrong_type_or_replica_are_refused(served):
    server, token, actor, mailbox = served
    assert "a LATEST frame on fifo boundary" in _raw(server, [encode_frame(LATEST, 0, 1, 1, {}, _msg())], token)
    assert "a frame of replica 0 on the stream of replica 1" in _raw(server, [encode_frame(ITEM, 0, 0, 0, {}, _msg())],
                                                                      token)
    _still_serves(actor, mailbox, 9)


def test_fuzzed_frames_are_refused_and_the_server_keeps_serving(served):
    """hypothesis: random bytes, truncated and bit-flipped real frames, frames naming other
    boundaries, types, replicas or slots. Each bad stream is refused with its reason (a frame
    that happens to be well-formed is delivered); the legitimate producer is served after each."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server, token, actor, mailbox = served
    real = encode_frame(ITEM, 0, 1, 0, {1: 3}, encode({"x": torch.arange(6.0)}).numpy().tobytes())
    frames = st.one_of(
        st.binary(max_size=200),
        st.integers(min_value=0, max_value=len(real) - 1).map(lambda n: real[:n]),
        st.tuples(st.integers(min_value=0, max_value=len(real) - 1), st.integers(min_value=0, max_value=255)).map(
            lambda p: real[:p[0]] + bytes([p[1]]) + real[p[0] + 1:]),
        st.tuples(st.sampled_from([0, 1, 2, 3, 9]), st.integers(min_value=0, max_value=70000),
                  st.integers(min_value=0, max_value=3), st.dictionaries(st.integers(0, 5), st.integers(0, 2**64 - 1),
                                                                           max_size=3)).map(
            lambda t: encode_frame(t[0], t[1] % 65536, t[2], 0, t[3], _msg())),
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames)
    def fuzz(frame):
        n = len(server.rejected)
        why = _raw(server, [frame], token, wait_s=2.0)  # a frame may be whole, or wait for its rest
        assert why is None or (why.endswith(server.rejected[-1][1]) and len(server.rejected) == n + 1)
        mailbox.drop_queued()  # a well-formed frame was delivered: make room
        _still_serves(actor, mailbox, 8)

    fuzz()
    assert server.rejected and all(why.startswith("bad frame from actor/1") for _, why in server.rejected)


def test_a_value_larger_than_the_socket_buffer_does_not_wait_for_the_consumer():
    """A 16 MiB item: ``put`` returns while the consumer is busy (the writer thread sends what the
    kernel cannot hold), and the consumer reads it whole when it takes it."""
    bs = [fifo(src_r=1, dst_r=1, pattern=NodeKind.SEND, capacity=2)]
    token = secrets.token_urlsafe(16)
    mailbox = Mailbox({TRAJ: 2}, timeout_s=120)
    server = UdsServer(bs, "learner", 0, mailbox, token, max_message=1 << 26)
    transport = ProcessTransport(bs, "actor", 0, {("learner", 0): server.address}, token, timeout_s=120)
    try:
        actor = AsyncEndpoint(bs, "actor", 0, Mailbox({}), transport)
        big = torch.arange(4 << 20, dtype=torch.float32)
        t0 = time.monotonic()
        actor.put(TRAJ, big)
        actor.put(TRAJ, big + 1)
        assert time.monotonic() - t0 < 60  # nobody read yet: a put that waited would wait for ever
        assert torch.equal(mailbox.take(TRAJ, 0).value, big)
        assert torch.equal(mailbox.take(TRAJ, 0).value, big + 1)
    finally:
        transport.close()
        server.stop()


@contextlib.contextmanager
def _weights_link(max_message):
    """A learner publishing a ``latest`` slot to an actor's Unix-socket server: yields the
    learner's endpoint, the actor's reading endpoint and the learner's transport."""
    bs = [latest()]
    token = secrets.token_urlsafe(16)
    mailbox = Mailbox({}, timeout_s=120)
    server = UdsServer(bs, "actor", 0, mailbox, token, max_message=max_message)
    transport = ProcessTransport(bs, "learner", 0, {("actor", 0): server.address}, token)
    try:
        yield AsyncEndpoint(bs, "learner", 0, Mailbox({}), transport), AsyncEndpoint(bs, "actor", 0, mailbox, None), transport
    finally:
        transport.close()
        server.stop()


def test_latest_versions_are_coalesced_while_the_consumer_does_not_read():
    """A slot published 200 times (64 KiB each) to a consumer that reads nothing meanwhile: the
    producer never waits, and what it holds stays bounded (an unsent version is replaced); the
    consumer then reads the newest."""
    with _weights_link(1 << 20) as (learner, reader, transport):
        t0 = time.monotonic()
        for v in range(200):
            learner.put(WEIGHTS, torch.full((1 << 14,), float(v)))
        assert time.monotonic() - t0 < 60  # nobody reads: a put that waited would wait for ever
        stream = next(iter(transport._streams.values()))
        assert sum(1 for e in stream.pending if e[0] == "latest") <= 2
        deadline = time.monotonic() + 300
        while float(reader.get(WEIGHTS)[0]) != 199 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.read_versions[WEIGHTS] == 200


def test_a_latest_value_on_the_wire_is_read_whole_by_the_next_get():
    """Weights larger than the socket's buffer (16 MiB; Pong's Nature CNN is 6.8 MB): once the
    producer has published a version, the consumer's next ``get`` returns it, though it arrives
    over many reads of the socket, not the version before (read a buffer per ``get``, A3C's
    actors on Pong acted with weights 6-7 versions old)."""
    with _weights_link(1 << 26) as (learner, reader, _):
        big = torch.arange(4 << 20, dtype=torch.float32)
        for v in range(4):
            learner.put(WEIGHTS, big + v)
            assert torch.equal(reader.get(WEIGHTS), big + v)
            assert reader.read_versions[WEIGHTS] == v + 1


def test_a_producer_stalled_mid_frame_costs_a_get_its_deadline_and_the_newest_whole_version(monkeypatch):
    """A producer that sends part of a ``latest`` frame and stops: ``get`` reads on for at most
    ``LATEST_WIRE_S``, then returns the newest whole version it has."""
    monkeypatch.setattr("msrl.runtime.asynchronous.LATEST_WIRE_S", 0.2)
    bs = [latest()]
    token = secrets.token_urlsafe(16)
    mailbox = Mailbox({}, timeout_s=120)
    server = UdsServer(bs, "actor", 0, mailbox, token, max_message=1 << 20)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(server.path)
        hello = encode_hello(token, "learner/0")
        whole = encode_frame(LATEST, 0, 0, 1, {}, _msg(7))
        cut = encode_frame(LATEST, 0, 0, 2, {}, _msg(8))
        sock.sendall(struct.pack("<I", len(hello)) + hello + struct.pack("<I", len(whole)) + whole
                     + struct.pack("<I", len(cut)) + cut[: len(cut) // 2])
        reader = AsyncEndpoint(bs, "actor", 0, mailbox, None)
        assert int(reader.get(WEIGHTS)) == 7  # the first version: waited for
        assert server.partial()  # the second is half here
        assert int(reader.get(WEIGHTS)) == 7 and reader.read_versions[WEIGHTS] == 1
        sock.sendall(cut[len(cut) // 2:])
        deadline = time.monotonic() + 300
        while int(reader.get(WEIGHTS)) != 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.read_versions[WEIGHTS] == 2 and not server.partial()
    finally:
        sock.close()
        server.stop()


def test_a_producer_reconnects_after_its_consumer_restarts(tmp_path):
    """The learner's server goes away and comes back on the same socket path: the producer's
    in-flight item is dropped and counted, its stream reopens, and later items arrive."""
    bs = [fifo(src_r=1, dst_r=1, pattern=NodeKind.SEND, capacity=2)]
    token = secrets.token_urlsafe(16)
    path = str(tmp_path / "s")
    first = Mailbox({TRAJ: 2}, timeout_s=120)
    server = UdsServer(bs, "learner", 0, first, token, 1 << 20, path=path)
    transport = ProcessTransport(bs, "actor", 0, {("learner", 0): server.address}, token, timeout_s=120, reconnect_s=20)
    actor = AsyncEndpoint(bs, "actor", 0, Mailbox({}), transport)
    try:
        actor.put(TRAJ, torch.tensor([1]))
        assert int(first.take(TRAJ, 0).value) == 1
        actor.put(TRAJ, torch.tensor([2]))  # in flight when the server goes
        server.stop()
        second = Mailbox({TRAJ: 2}, timeout_s=120)
        server = UdsServer(bs, "learner", 0, second, token, 1 << 20, path=path)
        actor.put(TRAJ, torch.tensor([3]))  # finds the stream broken, reconnects
        assert transport.reconnects == 1 and transport.dropped == 1
        assert int(second.take(TRAJ, 0).value) == 3
    finally:
        transport.close()
        server.stop()


def test_a_waiting_consumer_is_woken_by_a_value_from_another_thread():
    """A consumer pumping its socket wakes at once when a value arrives another way (a gRPC
    server's thread delivering from a producer on another machine), not after its poll."""
    bs = [fifo(src_r=1, dst_r=1, pattern=NodeKind.SEND)]
    mailbox = Mailbox({TRAJ: 1}, timeout_s=120)
    server = UdsServer(bs, "learner", 0, mailbox, "t", 1 << 20)
    try:
        import msrl.runtime.asynchronous as a

        old, a._POLL_S = a._POLL_S, 600.0  # a pump that would wait 600 s unless woken
        t = threading.Timer(0.2, lambda: mailbox.deliver(TRAJ, 0, a.Item(torch.tensor([4]))))
        t.start()
        t0 = time.monotonic()
        assert int(mailbox.take(TRAJ, 0).value) == 4
        assert time.monotonic() - t0 < 300
    finally:
        a._POLL_S = old
        server.stop()


def test_a_slow_greeting_delays_no_other_producer_and_is_refused_at_its_deadline(served):
    """A same-user process connects and dribbles a greeting (it declares 4096 bytes and sends one
    every half second): the legitimate producer, connecting after it, is greeted and served at
    once; the dribbler is refused when its greeting's 5 s are up. (Read one at a time, with a
    deadline per read, the dribbler held every other connection for as long as it dribbled.)"""
    from procs import wait_for

    server, token, actor, mailbox = served
    dribbler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dribbler.connect(server.path)
    dribbler.sendall(struct.pack("<I", 4096) + encode_hello(token, "actor/1")[:11])
    stop = threading.Event()

    def dribble():
        while not stop.wait(0.5):
            try:
                dribbler.send(b"x")
            except OSError:
                return

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    try:
        _still_serves(actor, mailbox, 5)  # actor/0's first put: its connection, greeted beside the dribbler's
        wait_for(lambda: any(why == "no complete greeting within 5 s" for _, why in server.rejected),
                 "the dribbling greeting refused at its deadline", timeout=300)
        _still_serves(actor, mailbox, 6)
    finally:
        stop.set()
        t.join(10)
        dribbler.close()


@pytest.mark.parametrize("kind", ["unix", "grpc"])
def test_a_replaced_consumer_is_dropped_without_waiting_and_its_replacement_gets_the_newest_slot_value(kind):
    """Over each stream kind of the registry: an elastic job's learner (``latest`` weights to actor 0, which queues trajectories to
    it): actor 0's process goes; the learner's publications to it are dropped and counted, never
    waited on (no reconnection for ``reconnect_s``); its end is noted in the learner's mailbox
    after its last whole item (``received``, ``ended``), by the mailbox's poll alone (the learner
    idle, as its heartbeat reads it between chunks); a replacement actor 0 greets the
    learner's server with its own server's address, and the learner's stream reopens there with
    the newest weights at once; later publications reach it, and its items reach the learner."""
    from procs import wait_for

    bs = [fifo(src_r=1, dst_r=1, pattern=NodeKind.SEND, capacity=2), latest()]
    token = secrets.token_urlsafe(16)
    inbox = Mailbox({TRAJ: 2}, timeout_s=120)
    stream_kind = next(k for k in STREAM_KINDS if k.name == kind)

    def serve(fragment, mailbox):
        return stream_kind.server(bs, fragment, 0, mailbox, token, 1 << 20, None, "127.0.0.1", "msrl-test-")

    learner_server = serve("learner", inbox)

    def actor(reply=None):
        mailbox = Mailbox({}, timeout_s=120)
        server = serve("actor", mailbox)
        transport = ProcessTransport(bs, "actor", 0, {("learner", 0): learner_server.address}, token, timeout_s=120)
        if reply:
            transport.reply = {kind: server.address}
        return AsyncEndpoint(bs, "actor", 0, mailbox, transport), server

    first, first_server = actor()
    to_actors = ProcessTransport(bs, "learner", 0, {("actor", 0): first_server.address}, token, timeout_s=120,
                                 reconnect_s=600)
    to_actors.elastic = {("actor", 0)}
    learner_server.on_rejoin = to_actors.rejoin
    learner = AsyncEndpoint(bs, "learner", 0, inbox, to_actors)
    second = second_server = None
    try:
        learner.put(WEIGHTS, torch.tensor([1.0]))
        assert float(first.get(WEIGHTS)) == 1.0
        first.put(TRAJ, torch.tensor([7]))
        first.transport.flush()
        assert int(learner.get(TRAJ)) == 7
        first.transport.close()  # the actor's process goes: its streams end, its server stops
        first_server.stop()
        # publications to the gone consumer: dropped once its stream is known broken (at once on a
        # Unix socket, when gRPC notices on its own), never waited on
        newest, slowest, deadline = 1.0, 0.0, time.monotonic() + 120
        while to_actors.dropped < 1 and time.monotonic() < deadline:
            newest += 1
            t0 = time.monotonic()
            learner.put(WEIGHTS, torch.tensor([newest]))
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.02)
        assert slowest < 60 and to_actors.reconnects == 0 and to_actors.dropped >= 1
        deadline = time.monotonic() + 120
        while "actor/0" not in inbox.counts()["ended"] and time.monotonic() < deadline:
            # what an idle consumer's heartbeat does (the Unix server is read by a pump; gRPC's
            # serves on its own threads and needs none)
            inbox.poll()
            time.sleep(0.05)
        assert inbox.counts() == {"received": {f"{TRAJ}|0": 1}, "ended": ["actor/0"]}
        second, second_server = actor(reply=True)
        second.transport.open_all()  # its greeting names its server: the learner's stream reopens there
        assert float(second.get(WEIGHTS)) == newest  # the newest weights, sent at once
        assert inbox.counts()["ended"] == []
        learner.put(WEIGHTS, torch.tensor([newest + 1]))
        wait_for(lambda: float(second.get(WEIGHTS)) == newest + 1, "the next publication at the replacement",
                 timeout=120, poll=0.02)  # a slot's newest, delivered on the transport's own time
        second.put(TRAJ, torch.tensor([8]))
        second.transport.flush()
        assert int(learner.get(TRAJ)) == 8 and inbox.counts()["received"] == {f"{TRAJ}|0": 2}
    finally:
        for x in (second, first):
            if x is not None:
                x.transport.close()
        to_actors.close()
        for s in (second_server, first_server, learner_server):
            if s is not None:
                s.stop()


def test_the_transport_registry_picks_a_unix_socket_on_one_machine_and_grpc_across():
    """``msrl/runtime/transports/kinds.py``: a consumer starts the server of each kind its
    producers need (a Unix socket for those on its machine, gRPC for the others; gRPC alone when
    the job says ``cluster.boundary_transport=grpc``), a producer dials the first kind that serves
    its pair, and a stream's kind follows from its address."""
    from msrl.runtime.transports import kinds as transports

    auto, grpc_only = transports.stream_kinds_for("auto"), transports.stream_kinds_for("grpc")
    names = lambda kinds: [k.name for k in kinds]  # noqa: E731
    assert names(transports.kinds_needed(auto, [True, True])) == ["unix"]
    assert names(transports.kinds_needed(auto, [True, False])) == ["unix", "grpc"]
    assert names(transports.kinds_needed(grpc_only, [True])) == ["grpc"]
    both = {"unix": "unix:/tmp/x/s", "grpc": "10.0.0.1:5000"}
    assert transports.pick(auto, both, same_node=True) == "unix:/tmp/x/s"
    assert transports.pick(auto, both, same_node=False) == "10.0.0.1:5000"
    assert transports.pick(grpc_only, both, same_node=True) == "10.0.0.1:5000"
    with pytest.raises(KeyError, match="no transport serves this pair"):
        transports.pick(auto, {"unix": "unix:/tmp/x/s"}, same_node=False)
    with pytest.raises(ValueError, match="cluster.boundary_transport must be one of auto, grpc, got 'carrier-pigeon'"):
        transports.stream_kinds_for("carrier-pigeon")
    with pytest.raises(ValueError, match="cluster.boundary_transport must be one of auto, grpc, got 'unix'"):
        transports.stream_kinds_for("unix")  # serves one machine only: not a choice alone
    made = []
    fake = [dataclasses.replace(k, stream=lambda t, target, n=k.name: made.append((n, target))) for k in transports.STREAM_KINDS]
    try:
        transports.STREAM_KINDS, saved = tuple(fake), transports.STREAM_KINDS
        transports.open_stream(None, "unix:/tmp/x/s")
        transports.open_stream(None, "10.0.0.1:5000")
    finally:
        transports.STREAM_KINDS = saved
    assert made == [("unix", "unix:/tmp/x/s"), ("grpc", "10.0.0.1:5000")]


def test_the_configs_transport_choices_are_the_registrys():
    """One registry of transports: the values ``cluster.sync_transport``,
    ``cluster.boundary_transport`` and ``cluster.intra_node`` accept are read from it, in the
    schema and in :class:`~msrl.cluster.options.RayOptions` alike, and a link kind that serves
    only some pairs is chosen with one that serves every pair."""
    import typing

    from msrl.cluster.options import RayOptions
    from msrl.config.schema import ClusterConfig
    from msrl.runtime.transports import kinds as registry

    fields = ClusterConfig.model_fields
    assert typing.get_args(fields["sync_transport"].annotation) == registry.SYNC_TRANSPORTS == ("auto", "unix", "gloo")
    assert typing.get_args(fields["boundary_transport"].annotation) == registry.BOUNDARY_TRANSPORTS == ("auto", "grpc")
    assert typing.get_args(fields["intra_node"].annotation) == registry.INTRA_NODE == ("shm", "gloo")
    assert [k.name for k in registry.link_kinds_for("unix")] == ["unix", "gloo"]
    assert [k.name for k in registry.link_kinds_for("gloo")] == ["gloo"]
    for key, bad in (("sync_transport", "tcp"), ("boundary_transport", "unix"), ("intra_node", "nccl")):
        with pytest.raises(ValueError, match=f"cluster.{key} must be"):
            RayOptions(**{key: bad})
