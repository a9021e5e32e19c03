"""Central inference with dynamic batching, the runtime side (SEED RL, Espeholt et al. 2020,
section 3; the graph side is :mod:`msrl.frontend.serving`).

The server replica's generated ``train_step`` calls ``comm.serve(self, _msrl_served)``; the
endpoint hands it to this replica's :class:`InferenceServer`, which

1. runs ``_msrl_served`` once per client replica, each in its own thread, on a *view* of the
   trainer: the served role (``actor``) answers through the :class:`Batcher`, each sharded role
   (``buffer``) is that client's shard of a :class:`ShardedComponent`, and the endpoint is
   a :class:`ClientEndpoint` that reads and writes that client's own ``fifo`` queues;
2. runs the batches in the calling thread meanwhile: a batch closes when ``max_batch``
   requests wait (or every client still in its run waits), or when the oldest has waited
   ``timeout_ms``; its requests are ordered by client and concatenated along the env axis, the
   served method runs once, and its results are split back by rows;
3. returns the first client's live-out values (control values: the same in every run) once
   every run ended, and copies the control attributes the runs wrote back into the trainer.

With ``max_batch`` = every client and no deadline, every batch holds every client's request
of the same step in client order: exactly the lockstep collective's batch, so the job
computes what ``single`` computes, bit for bit.

In an elastic job (:mod:`msrl.runtime.elastic`) a lost client replica is replaced alone: its
run's takes and puts carry the client's generation, and when the driver raises it
(:meth:`~msrl.runtime.asynchronous.Mailbox.redo`: the lost process's queued items dropped) the
run raises :class:`~msrl.runtime.channels.ProducerReplaced` at its next take or put, its buffer shards go
back to the ``state_dict()`` they had at the run's start, and the run starts again, serving the
replacement's fresh episodes (:attr:`InferenceServer.runs_done` tells the driver what the
replacement owes).

Statistics per ``train_step`` (:meth:`InferenceServer.pop_stats`): the requests in each batch
and each request's latency (seconds from the client's call until its rows' results are
ready), reported as ``inference/*`` metrics.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from tensordict import TensorDictBase

from msrl.runtime.channels import ChannelClosed, ProducerReplaced
from msrl.runtime.endpoint import Endpoint
from msrl.runtime.generators import BATON
from msrl.runtime.patterns import concat

__all__ = ["Batcher", "ClientEndpoint", "ShardedComponent", "InferenceServer", "batch_args", "split_rows", "inference_metrics"]


def _rows(value: Any) -> int | None:
    """The env rows (axis 0) of the first tensor in ``value``, or ``None`` without one."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    if isinstance(value, TensorDictBase):
        return value.batch_size[0] if value.batch_dims else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            n = _rows(v)
            if n is not None:
                return n
    return None


def batch_args(calls: Sequence[Any]) -> Any:
    """Requests' arguments combined into one call's: tensors (and TensorDicts) concatenated
    along axis 0 in order, containers element by element; any other argument (a control value,
    a constant) must be equal in every request.

    Raises:
        ValueError: a non-tensor argument differs between requests.
    """
    first = calls[0]
    if isinstance(first, (torch.Tensor, TensorDictBase)):
        return torch.cat(list(calls), dim=0)
    if isinstance(first, dict):
        return {k: batch_args([c[k] for c in calls]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(batch_args([c[i] for c in calls]) for i in range(len(first)))
    if any(c != first for c in calls[1:]):
        raise ValueError(f"central inference: the requests of one batch pass different non-tensor arguments "
                         f"({first!r} and others); only tensors with one row per env can be batched")
    return first


def split_rows(value: Any, sizes: Sequence[int]) -> list[Any]:
    """``value`` (a batched call's result) split along axis 0 into ``sizes`` rows each.

    Raises:
        TypeError: a result that is not a tensor, TensorDict or container of them.
    """
    if isinstance(value, (torch.Tensor, TensorDictBase)):
        return list(value.split(list(sizes), dim=0))
    if isinstance(value, dict):
        parts = {k: split_rows(v, sizes) for k, v in value.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(len(sizes))]
    if isinstance(value, (list, tuple)):
        parts_l = [split_rows(v, sizes) for v in value]
        return [type(value)(p[i] for p in parts_l) for i in range(len(sizes))]
    raise TypeError(f"central inference: a batched call returned a {type(value).__name__}; only tensors with one "
                    "row per env (or containers of them) can be split back to the env replicas")


@dataclasses.dataclass(eq=False)
class _Request:
    client: int
    method: str
    args: tuple
    kwargs: dict
    t0: float
    rows: int = 0
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class Batcher:
    """Collects the served role's calls of every client's run and runs them in batches.

    Args:
        component: the served component (the central ``actor``).
        clients: client replicas (each run makes at most one request at a time).
        max_batch: requests per batch (1..``clients``).
        timeout_s: the longest the oldest request waits for its batch to fill (``None``: until
            ``max_batch`` requests, or every client still running, wait).
        before_wait: called before a request waits (sends what the transport holds).

    Attributes:
        sizes: requests per batch run; ``latencies``: seconds from each request until its
            results were ready.
    """

    def __init__(self, component: Any, clients: int, max_batch: int, timeout_s: float | None,
                 before_wait: Callable[[], None] | None = None) -> None:
        self.component, self.clients = component, clients
        self.before_wait = before_wait
        self.max_batch, self.timeout_s = max_batch, timeout_s
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._running = clients
        self._failed: BaseException | None = None
        self.sizes: list[int] = []
        self.latencies: list[float] = []

    def call(self, client: int, method: str, args: tuple, kwargs: dict) -> Any:
        """A client run's ``role.method(*args, **kwargs)``: waits for its batch and returns its
        rows of the result.

        Raises:
            ChannelClosed: another run failed; the served method's own error, re-raised.
        """
        if self.before_wait is not None:
            self.before_wait()
        req = _Request(client, method, args, kwargs, time.perf_counter())
        with BATON.released(), self._cond:  # the batch runs in the server's thread meanwhile
            if self._failed is not None:
                raise ChannelClosed(f"central inference stopped: {self._failed}")
            self._pending.append(req)
            self._cond.notify_all()
            while not req.done:
                self._cond.wait(0.05)
                if self._failed is not None and not req.done:
                    raise ChannelClosed(f"central inference stopped: {self._failed}")
        if req.error is not None:
            raise req.error
        return req.result

    def leave(self) -> None:
        """A client's run ended: batches no longer wait for it."""
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Stops serving: every waiting and later request raises :class:`ChannelClosed`."""
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()

    def _ready(self) -> list[_Request] | None:
        """The next batch if one should close now (under the lock)."""
        if not self._pending:
            return None
        method = self._pending[0].method
        same = [r for r in self._pending if r.method == method]
        want = max(1, min(self.max_batch, self._running))
        late = self.timeout_s is not None and time.perf_counter() - self._pending[0].t0 >= self.timeout_s
        if len(same) < want and not late:
            return None
        batch = same[:self.max_batch]
        for r in batch:
            self._pending.remove(r)
        return sorted(batch, key=lambda r: r.client)

    def serve(self) -> None:
        """Runs batches until every client's run has ended or one failed (the calling thread)."""
        while True:
            with BATON.released(), self._cond:  # the clients' runs go on meanwhile
                while True:
                    if self._failed is not None or (self._running == 0 and not self._pending):
                        return
                    batch = self._ready()
                    if batch is not None:
                        break
                    wait = 0.05
                    if self._pending and self.timeout_s is not None:
                        wait = max(0.0, min(wait, self._pending[0].t0 + self.timeout_s - time.perf_counter()))
                    self._cond.wait(wait)
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        try:
            args = batch_args([r.args for r in batch])
            kwargs = batch_args([r.kwargs for r in batch])
            sizes = [_rows((r.args, r.kwargs)) or 0 for r in batch]
            out = getattr(self.component, batch[0].method)(*args, **kwargs)
            parts = split_rows(out, sizes) if len(batch) > 1 else [out]
        except Exception as e:  # noqa: BLE001 - raised in every requester's thread, at its call's line
            parts, error = [None] * len(batch), e
        else:
            error = None
        now = time.perf_counter()
        with self._cond:
            self.sizes.append(len(batch))
            for r, p in zip(batch, parts):
                r.result, r.error, r.done = p, error, True
                self.latencies.append(now - r.t0)
            self._cond.notify_all()


class _Served:
    """The served role as a client's run sees it: every method call is a batch request."""

    def __init__(self, batcher: Batcher, client: int) -> None:
        self._batcher, self._client = batcher, client

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._batcher.call(self._client, method, args, kwargs)


class ShardedComponent:
    """One component per client replica in the server replica (the central buffer, split as
    the env replicas split the envs): a client's run uses its own shard; a call outside the
    runs is made on every shard, its results concatenated along their env axes (as a gather of
    replicas concatenates them), client 0 first.

    Args:
        shards: the components, client 0 first.
        combine: method -> env axis of each of its results (from the
            :class:`~msrl.graph.fragmented.InferencePlan`); ``()`` for a method without results.
    """

    def __init__(self, shards: Sequence[Any], combine: Mapping[str, tuple[int, ...]]) -> None:
        self.shards = list(shards)
        self.combine = dict(combine)

    def state_dict(self) -> dict[str, Any]:
        """Every shard's state, client 0 first."""
        return {"shards": [s.state_dict() for s in self.shards]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output.

        Raises:
            KeyError: the state was not saved with as many shards (another number of env replicas).
        """
        saved = state.get("shards")
        if saved is None or len(saved) != len(self.shards):
            raise KeyError(f"a checkpoint of {0 if saved is None else len(saved)} buffer shards for "
                           f"{len(self.shards)} env replicas under central inference")
        for s, st in zip(self.shards, saved):
            s.load_state_dict(st)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or method not in self.combine:
            raise AttributeError(f"{type(self.shards[0]).__name__}.{method} is not called outside the rollout under "
                                 "central inference (the plan combines only the calls the trainer makes)")
        axes = self.combine[method]

        def call(*args: Any, **kwargs: Any) -> Any:
            outs = [getattr(s, method)(*args, **kwargs) for s in self.shards]
            if not axes:
                return outs[0]
            if len(axes) == 1 and not isinstance(outs[0], tuple):
                return concat(outs, axes[0])
            return tuple(concat([o[i] for o in outs], ax) for i, ax in enumerate(axes))

        return call


class _ClientQueues:
    """The asynchronous side of a :class:`ClientEndpoint`: the server replica's ``fifo`` queues
    to and from one client replica; ``generation``: the client's generation the run started
    under (:meth:`~msrl.runtime.asynchronous.Mailbox.redo`): a take or put once it changed
    raises :class:`~msrl.runtime.channels.ProducerReplaced` (nothing is sent to the replacement)."""

    def __init__(self, asynchronous: Any, client: int, cancel: threading.Event,
                 generation: tuple[tuple[str, int], int] | None = None) -> None:
        self.asynchronous, self.client, self.cancel = asynchronous, client, cancel
        self.generation = generation

    def get(self, name: str) -> Any:
        if self.generation is None:
            return self.asynchronous.take_from(name, self.client, self.cancel)
        return self.asynchronous.take_from(name, self.client, self.cancel, self.generation[1])

    def put(self, name: str, value: Any) -> None:
        self.asynchronous.mailbox.check(self.generation)
        self.asynchronous.put_to(name, self.client, value)


class ClientEndpoint(Endpoint):
    """The :class:`~msrl.runtime.endpoint.Endpoint` of one client's run of the served region: the
    server replica's endpoint narrowed to that client (every boundary of the served region is a
    ``fifo`` joining the server and the clients): ``get`` takes the oldest value the client put,
    ``put`` queues a value for the client alone; the ops are :class:`Endpoint`'s own (untimed:
    the client runs wait concurrently, inside the server's timed ``serve``). A served region
    holds no synchronous boundary (the partitioner's plan), so no value travels by
    ``_post``/``_take``.

    Args:
        comm: the server replica's endpoint; client: the client replica's index; cancel: set
            when the serve stops (a run waiting on a queue gives up); generation: ``(client
            key, its generation when the run started)`` where clients may be replaced
            (``None``: they are not).
    """

    def __init__(self, comm: Endpoint, client: int, cancel: threading.Event,
                 generation: tuple[tuple[str, int], int] | None = None) -> None:
        self.comm, self.client = comm, client
        self.fragment, self.replica, self.boundaries = comm.fragment, comm.replica, comm.boundaries
        self.asynchronous = _ClientQueues(comm.asynchronous, client, cancel, generation)

    def _fragment_size(self) -> int:
        return self.comm._fragment_size()


class InferenceServer:
    """Runs the served region of the server replica's ``train_step`` (see the module docstring).

    Args:
        plan: the job's :class:`~msrl.graph.fragmented.InferencePlan`.
        generators: one :class:`~msrl.runtime.generators.GlobalGenerators` per client: the
            global generator states its run draws from (``None``: runs hold none).
    """

    def __init__(self, plan: Any, generators: Sequence[Any] | None = None) -> None:
        self.plan = plan
        self.generators = list(generators) if generators is not None else []
        self._sizes: list[int] = []
        self._latencies: list[float] = []
        #: whether a lost client may be replaced alone (an elastic job): each run then keeps its
        #: shards' ``state_dict()`` from its start, to start again from there for the replacement
        self.replaceable = False
        #: client replica -> its runs of the served region completed since this server was made
        self.runs_done = [0] * plan.clients_count
        #: client replica -> the generation of it (:meth:`~msrl.runtime.asynchronous.Mailbox.redo`)
        #: its run in progress started under; ``None``: no run in progress
        self.running: list[int | None] = [None] * plan.clients_count
        #: runs started again for a replaced client
        self.redone = 0

    def client_states(self, mailbox: Any) -> dict[str, dict[str, Any]]:
        """What an elastic job's driver reads from the server's heartbeat: ``"client
        fragment/replica" -> {"runs": completed runs, "stale": a run is in progress under an
        older generation than ``mailbox``'s}`` -- once a replaced client's entry is not stale,
        its ``runs`` are final for the lost process (its replacement owes the rest). Read on
        another thread: plain reads only."""
        out = {}
        for i in range(self.plan.clients_count):
            running = self.running[i]
            gen = mailbox.generation.get((self.plan.clients, i), 0) if mailbox is not None else 0
            out[f"{self.plan.clients}/{i}"] = {"runs": self.runs_done[i], "stale": running is not None and running != gen}
        return out

    def _view(self, trainer: Any, client: int, batcher: Batcher) -> Any:
        view = copy.copy(trainer)
        view._components = dict(trainer._components)
        view._components[self.plan.role] = _Served(batcher, client)
        for role in self.plan.shard_roles:
            view._components[role] = trainer._components[role].shards[client]
        return view

    def serve(self, trainer: Any, fn: Callable[[Any, Any], tuple], comm: Any) -> tuple:
        """Runs ``fn`` once per client (threads) while serving their batches; returns the first
        client's result.

        Raises:
            the first error of a client's run (a peer's :class:`ChannelClosed` only when no run
            failed on its own).
        """
        plan = self.plan
        asynchronous = getattr(comm, "asynchronous", None)
        batcher = Batcher(trainer._components[plan.role], plan.clients_count, plan.max_batch,
                          None if plan.timeout_ms is None else plan.timeout_ms / 1000.0,
                          asynchronous.transport.flush if asynchronous is not None else None)
        cancel = threading.Event()
        rows = {attr: _client_rows(getattr(trainer, attr), plan.clients_count, attr) for attr in plan.sharded_state}

        def view_of(i: int) -> Any:  # client i's view, its own rows of the sharded state
            view = self._view(trainer, i, batcher)
            for attr, parts in rows.items():
                setattr(view, attr, parts[i])
            return view

        views = [view_of(i) for i in range(plan.clients_count)]
        results: list[Any] = [None] * len(views)
        errors: list[BaseException | None] = [None] * len(views)

        hold = BATON.held() is not None and self.generators
        BATON.shared = True  # client runs in threads of this process

        mailbox = getattr(asynchronous, "mailbox", None) if self.replaceable else None

        def attempt(i: int) -> bool:
            """One run for client ``i``; ``False``: the client is being replaced (the run's
            shards are back at its start, and it starts again for the replacement)."""
            key = (plan.clients, i)
            gen = mailbox.generation.get(key, 0) if mailbox is not None else None
            self.running[i] = gen
            shards = [trainer._components[r].shards[i] for r in plan.shard_roles] if mailbox is not None else []
            saved = [sh.state_dict() for sh in shards]
            try:
                results[i] = fn(views[i], ClientEndpoint(comm, i, cancel, (key, gen) if mailbox is not None else None))
                return True
            except ProducerReplaced:
                for sh, st in zip(shards, saved):
                    sh.load_state_dict(st)
                views[i] = view_of(i)
                self.redone += 1
                return False

        def run(i: int) -> None:
            try:
                with BATON.hold(self.generators[i]) if hold else contextlib.nullcontext():
                    while not attempt(i):
                        pass
                self.runs_done[i] += 1
            except BaseException as e:  # noqa: BLE001 - re-raised in the replica's thread
                errors[i] = e
                cancel.set()
                batcher.fail(e)
            finally:
                self.running[i] = None
                batcher.leave()

        threads = [threading.Thread(target=run, args=(i,), name=f"msrl-inference-client-{i}", daemon=True)
                   for i in range(len(views))]
        for t in threads:
            t.start()
        try:
            batcher.serve()
        except BaseException as e:
            cancel.set()
            batcher.fail(e)
            raise
        finally:
            with BATON.released():
                for t in threads:
                    t.join()
            self._sizes += batcher.sizes
            self._latencies += batcher.latencies
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, ChannelClosed)), failed[0])
        for attr in plan.state_writes:
            setattr(trainer, attr, getattr(views[0], attr))
        if not plan.sharded_outs:
            return results[0]
        # a value with one row per env: every client's rows, in client order (a gather's concatenation)
        return tuple(concat([r[k] for r in results], 0) if name in plan.sharded_outs else results[0][k]
                     for k, name in enumerate(plan.live_outs))

    def pop_stats(self) -> dict[str, list]:
        """``{"batch_sizes": [...], "latencies_s": [...]}`` since the last call."""
        out = {"batch_sizes": self._sizes, "latencies_s": self._latencies}
        self._sizes, self._latencies = [], []
        return out


def _client_rows(value: Any, clients: int, attr: str) -> list[Any]:
    """A trainer attribute with one row per env of every client, split into each client's rows
    (the env replicas hold equal numbers of envs, in client order).

    Raises:
        ValueError: its rows do not split evenly over the clients.
    """
    n = _rows(value)
    if n is None or n % clients:
        raise ValueError(f"central inference: self.{attr} has {n} rows, which do not split over {clients} env replicas")
    return split_rows(value, [n // clients] * clients)


def inference_metrics(stats: Mapping[str, Sequence[float]] | None) -> dict[str, float]:
    """One iteration's central inference statistics as ``metrics.csv`` columns:
    ``inference/batch_mean`` (requests per batch), ``inference/latency_p50_ms`` and
    ``inference/latency_p99_ms`` (a request's wait for its batch's results); ``{}`` without
    central inference or requests."""
    if not stats or not stats.get("latencies_s"):
        return {}
    lat = sorted(stats["latencies_s"])
    sizes = stats["batch_sizes"]

    def pct(q: float) -> float:
        return round(1000.0 * lat[min(len(lat) - 1, int(q * len(lat)))], 4)

    return {"inference/batch_mean": round(sum(sizes) / len(sizes), 4), "inference/latency_p50_ms": pct(0.5),
            "inference/latency_p99_ms": pct(0.99)}
