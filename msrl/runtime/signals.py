"""Signals held across a short critical section of the driver (a checkpoint's write, the
start of the replicas' calls), then acted on as their handlers would have acted."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["signals_deferred"]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Holds ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` until the block ends, then acts on the first
    that came as its handler would have: a Ctrl-C during a checkpoint write stops the run after
    the write, with that checkpoint kept; one while the driver starts the replicas' calls is
    raised once every call it started is held, so that none is dropped unread. The handlers in
    place before the block are put back as they were (the process is left as it was found).
    Outside the main thread (where Python runs signal handlers) and for a signal that is
    ignored, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s, handler in before.items():
        if handler is not signal.SIG_IGN and handler is not None:
            signal.signal(s, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not signal.SIG_IGN and handler is not None:
                signal.signal(s, handler)
        if held:
            signum, frame = held[0]
            handler = before[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: what the signal does by default, now
                signal.raise_signal(signum)
