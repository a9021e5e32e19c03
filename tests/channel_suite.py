"""Runs one function per fragment replica over a transport: ``local`` (threads, LocalHub) or
``dist`` (one spawned process per replica, a Gloo process group, DistEndpoint; ``split_payload``:
every value as a header plus a payload message, the protocol of GPU-to-GPU boundaries;
``shm``: all-reduces through a shared-memory ShmGroup, as replicas on one machine do). Used by
tests/test_channels.py so both runtimes pass the same channel-semantics tests."""

from __future__ import annotations

import os
import tempfile
import threading
import traceback

import torch
import torch.multiprocessing as mp

from msrl.runtime.channels import LocalHub


def _dist_worker(rank, world, init_file, scenarios, q, split_payload=False, cuda=False, shm=False):
    import torch.distributed as dist

    from msrl.runtime.transports.dist import DistEndpoint

    torch.set_num_threads(1)
    try:
        if cuda:  # one GPU per process; payloads and all-reduces over NCCL
            torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                                rank=rank, world_size=world)
        for idx, (boundaries, fns) in enumerate(scenarios):
            keys = sorted(fns)
            ranks = {k: i for i, k in enumerate(keys)}
            # every rank creates every group, in the same order (new_group is collective)
            pgs = {f: dist.new_group(sorted(ranks[k] for k in keys if k[0] == f)) for f in sorted({f for f, _ in keys})}
            if rank < len(keys):
                frag, rep = keys[rank]
                try:
                    device = f"cuda:{rank}" if cuda else "cpu"
                    devices = {f: ("cuda" if cuda else "cpu") for f, _ in keys}
                    local = None
                    mates = [k for k in keys if k[0] == frag]
                    if shm and len(mates) > 1:
                        from msrl.runtime.transports.shm import ShmGroup

                        local = ShmGroup(f"{os.path.basename(init_file)}-{idx}-{frag}", mates.index((frag, rep)),
                                         len(mates), barrier=lambda g=pgs[frag]: dist.barrier(group=g))
                    comm = DistEndpoint(boundaries, frag, rep, ranks, pgs.get(frag), device, devices,
                                    split_payload=split_payload, local_group=local)
                    out = fns[keys[rank]](comm)
                    comm.flush()
                    comm.close()
                    q.put((idx, keys[rank], out, None))
                except BaseException as e:  # noqa: BLE001
                    q.put((idx, keys[rank], None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put((-1, rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_local(boundaries, fns, timeout=300.0):
    """``fns``: ``(fragment, replica) -> fn(comm)``; runs them as threads over a LocalHub.
    Returns ``(fragment, replica) -> result``; re-raises the first failure."""
    keys = sorted(fns)
    frags: dict[str, int] = {}
    for f, _ in keys:
        frags[f] = frags.get(f, 0) + 1
    hub = LocalHub(boundaries, frags)
    out, errs = {}, []

    def wrap(k):
        try:
            out[k] = fns[k](hub.endpoint(*k))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            hub.close(str(e))

    ts = [threading.Thread(target=wrap, args=(k,)) for k in keys]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if errs:
        raise errs[0]
    return out


def run_dist(scenarios, timeout=600.0, split_payload=False, cuda=False, shm=False):
    """Runs every scenario ``(boundaries, fns)`` in one world of spawned processes (as many as
    the largest scenario has replicas; one Gloo process group, scenarios one after another,
    module-level ``fns``). Returns one ``(fragment, replica) -> result`` dict per scenario."""
    world = max(len(fns) for _, fns in scenarios)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.remove(init_file)
    procs = [ctx.Process(target=_dist_worker, args=(r, world, init_file, scenarios, q, split_payload, cuda, shm)) for r in range(world)]
    for p in procs:
        p.start()
    outs: list[dict] = [{} for _ in scenarios]
    try:
        for _ in range(sum(len(fns) for _, fns in scenarios)):
            idx, k, v, err = q.get(timeout=timeout)
            if err:
                raise RuntimeError(f"scenario {idx}, replica {k}: {err}")
            outs[idx][k] = v
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return outs


def run_threads(fns, timeout=300.0):
    """Runs ``fns`` (key -> fn()) on threads; returns key -> result; re-raises the first
    failure; fails when one is still running after ``timeout`` s."""
    out, errs = {}, []

    def wrap(k, f):
        try:
            out[k] = f()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(k, f), daemon=True) for k, f in fns.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if errs:
        raise errs[0]
    assert all(not t.is_alive() for t in ts), "a replica hung"
    return out
