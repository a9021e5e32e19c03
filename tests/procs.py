"""The process table read from ``/proc``, for tests that look at their own run's processes
(never at the whole machine's: other jobs may run beside the tests); the processes a test starts,
tied to it (:func:`popen`, :func:`stop_tree`); waiting for an event with a generous deadline
(:func:`wait_for`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from typing import Any, Callable, Iterator

#: how long a test waits for an event of a run it started (a row, a file, a replica's pid):
#: generous, for a machine that other jobs keep busy; no test fails for being slow before this
EVENT_TIMEOUT_S = 900.0


def process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> ``(parent pid, command line)`` of every live process readable in ``/proc``;
    processes that end while being read are left out. The command line's arguments are
    separated by NUL bytes, as in ``/proc/<pid>/cmdline``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry)] = (ppid, cmd)
    return out


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` in the process tree."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in process_table().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def kill_tree(root: int) -> None:
    """SIGKILLs ``root`` and every live process below it (read before the first signal, so
    that children re-parented by a dying parent are still found)."""
    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _die_with_parent(sig: int, sigint_ignored: bool = False) -> Callable[[], None]:
    def tie() -> None:  # runs in the child before exec
        import ctypes

        if sigint_ignored:  # as a background job of a non-interactive shell starts (`cmd &`, nohup)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG (Linux)
        except (OSError, AttributeError):
            pass
    return tie


def popen(cmd: list[str], death_signal: int = signal.SIGINT, sigint_ignored: bool = False,
          **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)`` for a process a test starts: it gets ``death_signal`` when
    the test process dies (even SIGKILLed: ``PR_SET_PDEATHSIG``; SIGINT lets ``msrl train`` stop
    its replicas as after Ctrl-C); the test stops it and everything below it with :func:`stop_tree`.
    ``sigint_ignored``: it starts with SIGINT ignored, as a background job of a script does."""
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent(death_signal, sigint_ignored), **kw)


def stop_tree(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGKILLs a process a test started and every process below it, if it still runs; reaps it."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


def run(cmd: list[str], timeout: float = EVENT_TIMEOUT_S, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` whose process tree is stopped
    (:func:`stop_tree`) when it outlasts ``timeout`` or the test is interrupted; raises
    ``subprocess.TimeoutExpired`` then."""
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop_tree(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def wait_for(done: Callable[[], Any], what: str, timeout: float = EVENT_TIMEOUT_S, poll: float = 0.1,
             alive: subprocess.Popen | None = None) -> Any:
    """Waits until ``done()`` is true and returns its value; fails naming ``what`` never happened
    when ``timeout`` passes, or at once when the process ``alive`` ended first (with its stderr's end
    when it was piped)."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if alive is not None and alive.poll() is not None:
            err = alive.stderr.read()[-2000:] if alive.stderr is not None else ""
            raise AssertionError(f"{what} never happened: the process ended first (exit {alive.returncode}) {err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened within {timeout:.0f} s")
        time.sleep(poll)


#: where `ray start` tells ray.init() of its cluster: Ray's temp folder, under TMPDIR where it is
#: set (as Ray reads it on Linux, when no RAY_TMPDIR is given to the test's children)
RAY_ADDRESS_FILE = pathlib.Path(os.environ.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"


@contextlib.contextmanager
def ray_address_file_kept() -> Iterator[None]:
    """Restores Ray's address file as it was, for a test that starts (and stops) a Ray head: a
    file left naming a stopped head would send a later ``ray.init()`` of this machine to it."""
    before = RAY_ADDRESS_FILE.read_text() if RAY_ADDRESS_FILE.is_file() else None
    try:
        yield
    finally:
        now = RAY_ADDRESS_FILE.read_text() if RAY_ADDRESS_FILE.is_file() else None
        if now != before:
            if before is None:
                RAY_ADDRESS_FILE.unlink(missing_ok=True)
            else:
                RAY_ADDRESS_FILE.write_text(before)


def tcp_listeners(pid: int) -> list[str]:
    """The local addresses (hex, as ``/proc/net/tcp{,6}`` writes them: ``0100007F`` is
    127.0.0.1) of the TCP sockets process ``pid`` listens on, read from ``/proc/<pid>/net``: the
    tables of that process's own network namespace (a node of tests/test_multinode.py's cluster
    has its own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    out.append(fields[1].rsplit(":", 1)[0])
    return out


def ray_log_lines(output: str) -> list[str]:
    """The lines of a run's terminal output that Ray's C++ logger wrote (they belong in Ray's log
    folder, not on the user's terminal: :class:`msrl.run.supervisor.StderrFilter`)."""
    from msrl.run.supervisor import StderrFilter

    return [line for line in output.splitlines() if StderrFilter.RAY_MESSAGE.match(line.encode())]
