"""The one owner of a Ray job's replica actors and their health (as RLlib's
``FaultTolerantActorManager`` owns its workers).

:class:`ReplicaGroup` starts one actor per fragment replica in its placement-group bundle, calls
them (every replica, or one) and collects the results, watches their heartbeats
(:class:`~msrl.cluster.watchdog.Watchdog`), and turns the first failure into one error: a
replica's own exception re-raised, or a :class:`~msrl.runtime.replica.ReplicaDied` naming the
replica whose process died or hung, after every replica is killed -- a peer's death shows first as
a failed boundary in a live replica, and the group names the dead one, not the one that noticed.
Placement (the placement group: :class:`msrl.cluster.ray_runtime.RayJob`) and the process group
(set up through :meth:`ReplicaGroup.call_each`) are not its business.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from msrl.runtime.replica import ReplicaDied
from msrl.runtime.signals import signals_deferred
from msrl.runtime.transports.shm import pid_alive

__all__ = ["ReplicaGroup", "StandIn", "process_running"]


class StandIn:
    """What a ``replace`` callback of :meth:`ReplicaGroup.wait` returns for a lost replica that
    is not replaced now (its bundle has no live node) while the job runs on without it: its
    result is ``result``, and ``extras`` (``replica index -> futures``) are calls of other
    replicas doing its share, whose results are appended to theirs (lists: a chunk's records).

    Args:
        result: the lost replica's result in the call (``[]`` for a chunk: no records).
        extras: replica index -> the futures of the extra calls it runs.
    """

    def __init__(self, result: Any, extras: Mapping[int, Sequence[Any]] | None = None) -> None:
        self.result = result
        self.extras = {i: list(fs) for i, fs in (extras or {}).items()}


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie waiting for its parent to
    reap it has exited)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ReplicaGroup:
    """A job's replica actors, one per ``(fragment, replica)`` key, and their health.

    Args:
        keys: ``(fragment, replica)`` of every replica, in replica order (bundle ``i`` holds
            replica ``keys[i]``).
        roles: fragment -> the roles it holds (named in a death's error).
        on_lost: called with the :class:`ReplicaDied` of a dead or hung replica while the other
            replicas still live (before they are killed), to complete it (the job's env steps).

    Attributes:
        actors: the actor handles, in replica order (empty once killed).
        watchdog: the heartbeats' :class:`~msrl.cluster.watchdog.Watchdog`, once :meth:`watch`
            was called.
    """

    #: how long :meth:`kill` waits for this node's replica processes to end (seconds)
    KILL_WAIT_S = 10.0

    def __init__(self, keys: Sequence[tuple[str, int]], roles: Mapping[str, Sequence[str]],
                 on_lost: Callable[[ReplicaDied], None] | None = None) -> None:
        self.keys = list(keys)
        self.roles = dict(roles)
        self.on_lost = on_lost
        self.actors: list[Any] = []
        self.watchdog: Any = None
        self.peers: dict[tuple[str, int], Mapping[str, Any]] = {}
        self._local_pids: list[int] = []
        #: replicas lost and not replaced for want of room, the job running on without them (their
        #: replacement actors wait for a bundle): not probed by :meth:`dead_replica`
        self.absent: Mapping[tuple[str, int], Any] = {}
        #: calls a :meth:`wait` left behind when it raised (a replica's failure, Ctrl-C): held
        #: until :meth:`kill` reads their ends, so that Ray never reports one as an unhandled
        #: error on the driver's stderr when its reference is dropped
        self._abandoned: list[Any] = []

    def start(self, actor_class: type, placement_group: Any, options_of: Callable[[tuple[str, int]], Mapping[str, Any]],
              args_of: Callable[[tuple[str, int]], Sequence[Any]]) -> None:
        """Starts one ``actor_class`` actor per key, replica ``i`` in bundle ``i`` of
        ``placement_group``, with Ray options ``options_of(key)`` (its bundle's CPUs and GPUs)
        and constructor arguments ``args_of(key)``."""
        import ray

        self._start = (ray.remote(actor_class), placement_group, options_of, args_of)
        self.actors = [self._start_one(i) for i in range(len(self.keys))]

    def _start_one(self, i: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote, placement_group, options_of, args_of = self._start
        return remote.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=i),
            **options_of(self.keys[i]),
        ).remote(*args_of(self.keys[i]))

    def replace(self, key: tuple[str, int]) -> Any:
        """Kills replica ``key``'s actor (if it still runs), waits until its process on this node
        is gone, and starts a new one in its bundle (as :meth:`start` did); returns its handle.
        The watchdog forgets the old one's heartbeats."""
        import ray

        i = self.keys.index(key)
        try:
            ray.kill(self.actors[i])
        except Exception:  # noqa: BLE001 - already dead
            pass
        old = self.peers.get(key, {})
        deadline = time.monotonic() + self.KILL_WAIT_S
        while old.get("pid") in self._local_pids and process_running(old["pid"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.actors[i] = self._start_one(i)
        return self.actors[i]

    def relocate(self, key: tuple[str, int], info: Mapping[str, Any], node_id: str) -> None:
        """Notes the new process of replica ``key`` (its :meth:`~msrl.cluster.replica_actor.ReplicaActor.info`)."""
        old = self.peers.get(key, {})
        if old.get("pid") in self._local_pids:
            self._local_pids.remove(old["pid"])
        self.peers[key] = dict(info)
        if info["node_id"] == node_id:
            self._local_pids.append(info["pid"])
        if self.watchdog is not None:
            self.watchdog.replaced(key, info["pid"])

    def locate(self, peers: Mapping[tuple[str, int], Mapping[str, Any]], node_id: str) -> None:
        """Notes which replica processes run on this node (``node_id``): :meth:`kill` waits for
        them. ``peers``: each key's :meth:`~msrl.cluster.replica_actor.ReplicaActor.info`."""
        self.peers = dict(peers)
        self._local_pids = [p["pid"] for p in peers.values() if p["node_id"] == node_id]

    def watch(self, job_id: str, timeout_s: float | None) -> None:
        """Watches the replicas' heartbeats from now on (after :meth:`locate`): a replica silent
        for ``timeout_s`` is hung (``None``: never)."""
        from msrl.cluster.watchdog import Watchdog

        peers = self.peers
        self.watchdog = Watchdog(job_id, self.keys, [peers[k]["pid"] for k in self.keys], self.roles, timeout_s)

    # -- calls ------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, replace: Callable[[ReplicaDied], Any] | None = None,
             skip: Sequence[tuple[str, int]] = ()) -> list[Any]:
        """``method(*args)`` on every replica but those in ``skip`` (their results ``None``);
        the results in replica order (see :meth:`wait`, and its ``replace``: a lost replica's
        stand-in call)."""
        return self.wait(lambda: [None if k in skip else getattr(a, method).remote(*args) for k, a in zip(self.keys, self.actors)],
                         replace=replace)

    def submit(self, key: tuple[str, int], method: str, *args: Any) -> Any:
        """``method(*args)`` on replica ``key``; its future, waited for by the caller (a
        replacement's set-up: its failure is the caller's, not the group's)."""
        return getattr(self.actors[self.keys.index(key)], method).remote(*args)

    def done(self, future: Any) -> bool:
        """Whether ``future`` (a call :meth:`submit` made) has ended, with a result or an error; never waits."""
        import ray

        ready, _ = ray.wait([future], timeout=0)
        return bool(ready)

    def call_each(self, method: str, args: Sequence[Sequence[Any]], keys: Sequence[tuple[str, int]] | None = None) -> list[Any]:
        """``method(*args[i])`` on replica ``keys[i]`` (every replica when ``keys`` is ``None``)."""
        actor_of = dict(zip(self.keys, self.actors))
        keys = self.keys if keys is None else list(keys)
        return self.wait(lambda: [getattr(actor_of[k], method).remote(*a) for k, a in zip(keys, args)])

    def call_one(self, key: tuple[str, int], method: str, *args: Any) -> Any:
        """``method(*args)`` on replica ``key``."""
        return self.call_each(method, [args], [key])[0]

    def wait(self, futures: Sequence[Any] | Callable[[], Sequence[Any]],
             replace: Callable[[ReplicaDied], Any] | None = None) -> list[Any]:
        """Every future's result (a ``None`` future: result ``None``). ``futures``: the calls'
        futures, or a function that starts the calls and returns them: a Ctrl-C (``SIGINT``,
        ``SIGTERM``, ``SIGHUP``) while it runs waits until each future it made is held
        (:func:`~msrl.runtime.signals.signals_deferred`), so that a call started before the
        Ctrl-C is never dropped unread. A call this wait leaves behind when it raises (a Ctrl-C,
        a failure) is read by :meth:`kill`: Ray never prints its error as unhandled. On the first failure
        every replica is killed and the failure raised: a replica's own exception as it raised
        it, or :class:`ReplicaDied` naming the replica whose process died or hung
        (:attr:`watchdog`).

        ``replace`` (with one future per replica, in replica order): called with the
        :class:`ReplicaDied` of a replica that died or hung while the others run; a future it
        returns (the replacement's call) stands for the lost one's and the others are left
        running; a :class:`StandIn`: the lost one's result is its ``result`` and its ``extras``
        run too, their results appended to their replicas'; ``None``: the failure stops every
        replica, as above."""

        order: dict[Any, int] = {}  # every call of this wait (extras too) -> its replica's index
        pending: list[Any] = []
        results: list[Any] = []
        tails: dict[Any, Any] = {}  # an extra call's future -> its result, appended at the end
        extra: set[Any] = set()

        def stand_in(i: int, again: Any) -> None:
            pending[:] = [f for f in pending if order[f] != i]  # every call of the lost one (extras too)
            finished = results[i] is not None  # its own call ended before: what follows is a tail
            if isinstance(again, StandIn):
                if not finished:
                    results[i] = again.result
                for j, fs in again.extras.items():
                    for f in fs:
                        pending.append(f)
                        order[f] = j
                        extra.add(f)
            else:
                pending.append(again)
                order[again] = i
                if finished:
                    extra.add(again)

        try:
            with signals_deferred():  # a Ctrl-C while the calls start: raised once every one is held
                futures = futures() if callable(futures) else futures
                order.update((f, i) for i, f in enumerate(futures) if f is not None)
                pending.extend(order)
            results.extend([None] * len(futures))
            self._wait_all(pending, order, results, tails, extra, stand_in, replace, futures)
        except BaseException:  # every call, ended or not: one taken off ``pending`` may be unread
            self._abandoned.extend(order)
            raise
        for f, tail in tails.items():  # in submission order per replica: a replica runs its calls in order
            i = order[f]
            results[i] = list(results[i] or []) + list(tail)
        return results

    def _wait_all(self, pending: list[Any], order: dict[Any, int], results: list[Any], tails: dict[Any, Any],
                  extra: set[Any], stand_in: Callable[[int, Any], None], replace: Callable[[ReplicaDied], Any] | None,
                  futures: Sequence[Any]) -> None:
        """:meth:`wait`'s loop: takes the ended calls off ``pending`` (in place) until none is left."""
        import ray

        while pending:
            done, rest = ray.wait(pending, num_returns=1, timeout=1.0 if self.watchdog is not None else None)
            pending[:] = rest
            if not done:
                hung = self.watchdog.hung()
                if hung is not None:
                    again = replace(hung) if replace is not None else None
                    if again is None:
                        raise self._lost(hung)
                    stand_in(self.keys.index((hung.fragment, hung.replica)), again)
                continue
            try:
                if done[0] in extra:
                    tails[done[0]] = ray.get(done[0])
                else:
                    results[order[done[0]]] = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                # a peer's death shows first as a failed boundary in a live replica ("connection
                # closed by peer"): name the dead replica, not the one that noticed
                dead = self.dead_replica()
                if dead is not None:
                    raise self._lost(dead) from None
                self.kill()
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise cause from None
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                # a dead actor, or a finished call's result lost with its node's object store
                # (a large result lives there until fetched): that replica is lost either way
                i = order[done[0]]
                dead = self.died(self.keys[i]) if len(futures) == len(self.keys) else self.dead_replica()
                again = replace(dead) if replace is not None and dead is not None else None
                if again is None:
                    raise self._lost(dead or ReplicaDied("the process of a replica died")) from None
                stand_in(i, again)

    # -- health -----------------------------------------------------------------------------
    def died(self, key: tuple[str, int]) -> ReplicaDied:
        """The error naming replica ``key``'s process as dead."""
        frag, r = key
        return ReplicaDied(f"the process of fragment {frag} replica {r} died", frag, r, self.roles.get(frag, ()))

    def dead_replica(self, timeout_s: float = 5.0) -> ReplicaDied | None:
        """The first replica whose process is gone (``None`` when none is found within
        ``timeout_s`` in all). A probe of a live replica still running its iterations waits
        behind them (one thread per actor); a dead one's fails as soon as Ray knows."""
        import ray

        live = [(k, a) for k, a in zip(self.keys, self.actors) if k not in self.absent]
        probes = [a.pid.remote() for _, a in live]
        key_of = dict(zip(probes, [k for k, _ in live]))
        pending, deadline = probes, time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break  # the rest are busy, not dead
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError:
                return self.died(key_of[ready[0]])
            except Exception:  # noqa: BLE001 - answered with an error: alive
                continue
        return None

    def _lost(self, cause: ReplicaDied) -> ReplicaDied:
        if self.on_lost is not None:
            self.on_lost(cause)
        self.kill()
        return cause

    def close(self, timeout_s: float, skip: Sequence[tuple[str, int]] = ()) -> None:
        """Asks every replica but those in ``skip`` (not started: waiting for a node with room)
        to close (its envs, process group, servers), waiting up to ``timeout_s`` in all; a dead
        or stuck replica is left to :meth:`kill`."""
        import ray

        if not self.actors:
            return
        try:
            ray.get([a.close.remote() for k, a in zip(self.keys, self.actors) if k not in skip], timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead replica has nothing left to close
            pass

    def kill(self) -> None:
        """Kills every replica and waits (up to :attr:`KILL_WAIT_S`) until this node's replica
        processes are gone: ``ray.kill`` only asks, and a restarted job's new replicas must not
        meet the old ones' sockets or shared memory."""
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        abandoned, self._abandoned = list(dict.fromkeys(self._abandoned)), []  # once each: ray.wait refuses repeats
        if abandoned:  # their ends read (the actors are gone: within moments), so Ray reports none as unhandled
            try:
                ended, _ = ray.wait(abandoned, num_returns=len(abandoned), timeout=self.KILL_WAIT_S)
            except Exception:  # noqa: BLE001 - the raylet itself gone (its socket reset): no end left to read,
                ended = []  # and the run's own error, not this one, is what its user must see
            for f in ended:
                try:
                    ray.get(f, timeout=0)
                except Exception:  # noqa: BLE001 - an error is the expected end of an abandoned call
                    pass
        deadline = time.monotonic() + self.KILL_WAIT_S
        pids = [p for p in self._local_pids if process_running(p)]
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = [p for p in pids if process_running(p)]
        self._local_pids = []
