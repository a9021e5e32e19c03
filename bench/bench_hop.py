"""One hop of an asynchronous boundary between two processes of this machine: a ``fifo`` item
(a 13.5 KB trajectory, the main job's at 16 envs) and its credit, over the gRPC transport and
over the Unix-socket transport (``cluster.boundary_transport=grpc`` / ``auto``), on an idle
machine and with two more processes spinning on its cores. Capacity 1: the producer's next
``put`` waits for the credit of its last item, so the time per item is the round trip.

Reported per transport: microseconds per item, and CPU per item (producer + consumer
processes, every thread: gRPC's included). The floor: the same exchange on a bare Unix socket
(length-prefixed bytes, no msrl).

    python bench/bench_hop.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import socket
import struct
import time

N_DEFAULT = 3000
PAYLOAD = 3375  # float32 elements: 13.5 KB


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _boundaries():
    from msrl.graph import NodeKind
    from msrl.graph.fragmented import Boundary

    return [Boundary("train_step/b0:traj", "train_step", "traj", NodeKind.PUT, "actor", "learner", 1, 1, "sharded", 0,
                     False, pattern=NodeKind.SEND, channel="fifo", capacity=1)]


def _consumer(kind: str, n: int, q) -> None:
    import torch

    torch.set_num_threads(1)
    from msrl.runtime.asynchronous import Mailbox

    bs = _boundaries()
    mailbox = Mailbox({bs[0].name: 1})
    if kind == "grpc":
        from msrl.cluster.grpc_transport import BoundaryServer

        server = BoundaryServer(bs, "learner", 0, mailbox, "token")
    else:
        from msrl.cluster.uds_transport import UdsServer

        server = UdsServer(bs, "learner", 0, mailbox, "token", 1 << 26)
    q.put(server.address)
    mailbox.take(bs[0].name, 0)
    c0 = _cpu()
    for _ in range(n - 1):
        mailbox.take(bs[0].name, 0)
    q.put(("consumer_cpu", _cpu() - c0))
    time.sleep(0.5)
    server.stop()


def _producer(address: str, n: int, q) -> None:
    import torch

    torch.set_num_threads(1)
    from msrl.cluster.streams import ProcessTransport
    from msrl.runtime.asynchronous import Item

    bs = _boundaries()
    t = ProcessTransport(bs, "actor", 0, {("learner", 0): address}, "token", hold=True)
    v = torch.zeros(PAYLOAD)
    t.send_item(bs[0], 0, 0, Item(v))
    t.flush()
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n - 1):
        t.send_item(bs[0], 0, 0, Item(v))
        t.flush()
    q.put(("us_per_item", 1e6 * (time.perf_counter() - t0) / (n - 1)))
    q.put(("producer_cpu", _cpu() - c0))
    t.close()


def _bare_consumer(path: str, n: int, q) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    q.put(path)
    c, _ = s.accept()
    buf = bytearray()
    c0 = None
    for i in range(n):
        while True:
            if len(buf) >= 4:
                (m,) = struct.unpack_from("<I", buf)
                if len(buf) >= 4 + m:
                    del buf[:4 + m]
                    break
            buf += c.recv(1 << 20)
        if i == 0:
            c0 = _cpu()
        c.sendall(b"CRED")
    q.put(("consumer_cpu", _cpu() - c0))


def _bare_producer(path: str, n: int, q) -> None:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    msg = struct.pack("<I", 4 * PAYLOAD) + bytes(4 * PAYLOAD)
    c.sendall(msg)
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(n - 1):
        assert c.recv(4) == b"CRED"
        c.sendall(msg)
    c.recv(4)
    q.put(("us_per_item", 1e6 * (time.perf_counter() - t0) / (n - 1)))
    q.put(("producer_cpu", _cpu() - c0))


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def hop(kind: str, n: int, busy: int) -> dict[str, float]:
    """Microseconds and CPU milliseconds per item over ``kind`` (``grpc``, ``uds``, ``bare``)
    with ``busy`` spinning processes beside the two ends."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(busy)]
    for p in spinners:
        p.start()
    q = ctx.Queue()
    if kind == "bare":
        path = f"/tmp/msrl-bench-hop-{os.getpid()}"
        if os.path.exists(path):
            os.unlink(path)
        cons = ctx.Process(target=_bare_consumer, args=(path, n, q))
        cons.start()
        prod = ctx.Process(target=_bare_producer, args=(q.get(timeout=60), n, q))
    else:
        cons = ctx.Process(target=_consumer, args=(kind, n, q))
        cons.start()
        prod = ctx.Process(target=_producer, args=(q.get(timeout=60), n, q))
    prod.start()
    out = dict(q.get(timeout=300) for _ in range(3))
    prod.join()
    cons.join()
    stop.set()
    for p in spinners:
        p.join()
    if kind == "bare":
        os.unlink(path)
    return {"us": out["us_per_item"], "cpu_ms": 1e3 * (out["producer_cpu"] + out["consumer_cpu"]) / (n - 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=N_DEFAULT)
    args = p.parse_args()
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"{args.items} items of {4 * PAYLOAD} bytes, capacity 1")
    print("| transport | idle: us per item | idle: CPU ms per item | 2 cores busy: us per item | "
          "2 cores busy: CPU ms per item |")
    print("| --- | --- | --- | --- | --- |")
    for kind, name in (("grpc", "gRPC (cluster.boundary_transport=grpc)"), ("uds", "Unix socket (auto, one machine)"),
                       ("bare", "floor: bare Unix socket, no msrl")):
        idle, busy = hop(kind, args.items, 0), hop(kind, args.items, 2)
        print(f"| {name} | {idle['us']:.0f} | {idle['cpu_ms']:.3f} | {busy['us']:.0f} | {busy['cpu_ms']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
