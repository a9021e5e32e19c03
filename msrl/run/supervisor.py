"""The process that watches a Ray run's driver: ``msrl train`` on the command line, with
``runtime: ray``, forks once the config is valid. The child trains (it is the Ray driver); the
parent, the process the user started, only waits for it:

* Ray can end its driver without a word: when this machine's raylet dies, Ray's core worker in
  the driver terminates the process at once (``The connection to the plasma store is failed.
  Terminate the process.``, exit status 1), so no Python code of the driver runs. The parent
  then says what happened in one line -- ``msrl: error: the Ray cluster of this run stopped
  (...); the last checkpoint is at env step S; resume with msrl train --resume RUN`` -- and exits
  with :data:`~msrl.run.outcome.EXIT_LOST`; Ray's own logs stay in Ray's log folder.
* Whatever ended the driver (a SIGKILL, the OOM killer, Ray), no process of the run outlives it:
  the parent is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so the driver's orphaned
  processes (Ray's GCS, raylet, dashboard and runtime-env agents, replicas) become its children,
  and it stops every one of them.
* Ray's own log lines stay in Ray's log folder: the driver's C++ core worker copies every error it
  logs to the process's standard error as well (``[... E ...] core_worker.cc:609: :info_message:
  Attempting to recover 2 lost objects ...`` and a 20-line object-store dump when a node dies),
  on purpose (ray-project/ray#18577). The driver's file descriptor 2 is therefore a socket to the
  parent, which passes every write on to the terminal except the messages Ray's logger wrote
  (:class:`StderrFilter`); the driver's Python ``sys.stderr`` (warnings, tracebacks, the progress
  bar, msrl's lines) writes to the terminal itself, so it still sees a terminal.
* Signals: the driver runs in a process group of its own, so Ctrl-C at the terminal reaches the
  parent alone, which passes it on as one ``SIGINT`` (the driver stops as after any Ctrl-C,
  checkpoint kept, the resume hint printed); ``SIGTERM``/``SIGHUP`` to the parent are passed on
  as ``SIGINT`` too, and the driver acts on it even when ``msrl train`` started with SIGINT
  ignored (a background job of a non-interactive shell): the command takes SIGINT back first
  (:func:`msrl.run.cli.main`), so a ``SIGINT`` to the parent is passed on as well. If the
  parent itself is killed, the driver gets ``SIGINT`` (``PR_SET_PDEATHSIG``).

The driver tells the parent what it knows as it learns it (:func:`report`: the run directory,
the pids of the Ray it started), one JSON object per line on a pipe, and its exit status last.
Only Linux has the two ``prctl`` calls; elsewhere ``msrl train`` runs unsupervised. The Python
API (:func:`msrl.train`) never forks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

__all__ = ["supervised", "report", "available", "StderrFilter"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: seconds the run's leftover processes get to end after SIGTERM before SIGKILL
GRACE_S = 5.0

#: the write end of the pipe to the parent, in a supervised driver (``None`` elsewhere)
_channel: int | None = None


def _prctl(option: int, value: int) -> bool:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def available() -> bool:
    """Whether this platform can supervise (Linux: ``fork`` and the two ``prctl`` options)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def report(**facts: Any) -> None:
    """Tells the supervising parent ``facts`` (JSON-able), if this process is a supervised driver."""
    if _channel is None:
        return
    try:
        os.write(_channel, (json.dumps(facts) + "\n").encode())
    except OSError:  # the parent is gone: the driver goes on (it gets SIGINT)
        pass


def supervised(work: Callable[[], int]) -> int:
    """Runs ``work`` (returns an exit status) in a forked child and supervises it (see the module
    docstring); returns the status ``msrl train`` exits with. Where supervising is not
    available, runs ``work`` here."""
    global _channel
    if not available() or not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
        return work()
    read_fd, write_fd = os.pipe()
    try:
        terminal = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (an embedding host's stream): left as it is
        terminal = None
    if terminal is not None:  # what the driver's C++ code writes to fd 2, one write per message
        err_read, err_write = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end, option in ((err_write, socket.SO_SNDBUF), (err_read, socket.SO_RCVBUF)):
            end.setsockopt(socket.SOL_SOCKET, option, STDERR_WRITE_MAX)
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the parent's hand-over is installed
    pid = os.fork()
    if pid == 0:  # the driver
        # SIGINT is the parent's hand-over (a SIGTERM or SIGHUP to the parent arrives as one), so the
        # driver acts on it even when it started ignored: a background job of a non-interactive
        # shell (`msrl train ... &`, nohup) inherits SIGINT as SIG_IGN, and a SIGTERM then did nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(read_fd)
        _channel = write_fd
        if terminal is not None:
            _stderr_through(err_read, err_write)
        os.setpgid(0, 0)  # the terminal's signals go to the parent, which passes them on once
        _prctl(_PR_SET_PDEATHSIG, signal.SIGINT)
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGINT)
        status = 1
        try:
            status = work()
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - printed as Python would, then the status says so
            import traceback

            traceback.print_exc()
        finally:
            report(exit=status)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_fd)
    pump = None
    if terminal is not None:
        err_write.close()
        pump = threading.Thread(target=_pump, args=(err_read, terminal), name="msrl-stderr", daemon=True)
        pump.start()
    from msrl.runtime.startup import resume_gc

    resume_gc()  # the parent only waits: its start-up is over
    return _watch(pid, read_fd, pump, sigint_ignored=before is signal.SIG_IGN)


def _stderr_through(reader: socket.socket, writer: socket.socket) -> None:
    """In the driver: file descriptor 2 becomes ``writer``, the socket to the parent (what C++
    code, Ray's core worker above all, writes there), while Python's ``sys.stderr`` keeps writing
    to the original standard error (a terminal stays a terminal to the progress bar)."""
    reader.close()
    sys.stderr.flush()
    original = os.dup(2)
    os.dup2(writer.fileno(), 2)
    writer.close()
    old = sys.stderr
    sys.stderr = open(original, "w", buffering=1, encoding=getattr(old, "encoding", None) or "utf-8",
                      errors=getattr(old, "errors", None) or "backslashreplace", closefd=True)


class StderrFilter:
    """Judges what a Ray driver's file descriptor 2 carried, one write at a time, and says which
    writes the user's terminal should see: every one but the messages Ray's C++ logger wrote
    (each also in Ray's log folder: the driver's ``python-core-driver-*.log``).

    Ray's logger writes a message, with every line of it (a multi-line message such as the object
    store's dump), in one ``write``, beginning with its prefix (``[2026-11-28 10:55:16,123 E 4242
    4250] core_worker.cc:609: ``). The driver's file descriptor 2 is a ``SOCK_SEQPACKET`` socket,
    which keeps each write whole and apart from the others, so a write is judged as a whole and
    nothing else is ever dropped with it.
    """

    #: the prefix of a message of Ray's C++ logger (spdlog: date, time,ms, level, pid, tid, file:line)
    RAY_MESSAGE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z] \d+ \d+\] \S+:\d+: ")

    def __init__(self) -> None:
        #: the number of writes kept off the terminal so far
        self.dropped = 0

    def keep(self, write: bytes) -> bool:
        """Whether the terminal should see ``write`` (the bytes of one ``write`` call)."""
        if self.RAY_MESSAGE.match(write):
            self.dropped += 1
            return False
        return True


#: the largest write the driver's file descriptor 2 takes whole (the socket's send buffer is asked
#: for this much; the kernel may grant less, and a larger write fails with ``EMSGSIZE``)
STDERR_WRITE_MAX = 4 << 20


def _pump(reader: socket.socket, out_fd: int) -> None:
    """The parent's thread: passes the writes the driver's file descriptor 2 carries on to
    ``out_fd``, without Ray's own log messages (:class:`StderrFilter`), until every writer has
    closed its end."""
    judge = StderrFilter()
    try:
        while write := reader.recv(STDERR_WRITE_MAX):
            if judge.keep(write):
                _write_all(out_fd, write)
    except OSError:
        pass
    finally:
        reader.close()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _watch(pid: int, read_fd: int, pump: threading.Thread | None = None, sigint_ignored: bool = False) -> int:
    """The parent: waits for the driver ``pid``, stops whatever of the run is left, and says
    what happened when the driver ended without a word. ``SIGTERM`` and ``SIGHUP`` are passed on
    as ``SIGINT``; ``SIGINT`` too, unless ``msrl train`` started with it ignored (it stays ignored)."""
    def pass_on(signum: int, frame: Any) -> None:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP) if sigint_ignored else (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, pass_on)
    facts: dict[str, Any] = {}
    buffer = b""
    os.set_blocking(read_fd, False)
    status = None
    while status is None:
        try:
            done, raw = os.waitpid(pid, 0)
        except ChildProcessError:
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
        if done == pid:
            status = raw
    try:
        while chunk := os.read(read_fd, 65536):
            buffer += chunk
    except (BlockingIOError, OSError):
        pass
    os.close(read_fd)
    for line in buffer.decode(errors="replace").splitlines():
        try:
            facts.update(json.loads(line))
        except ValueError:
            continue
    ray_gone = _ray_gone(facts.get("ray") or {})  # before the leftovers are stopped
    _stop_leftovers()
    if pump is not None:  # the driver's last C++ lines reach the terminal before msrl's
        pump.join(timeout=10.0)
    if "exit" in facts:  # the driver ended as msrl ends: it said what happened
        return int(facts["exit"])
    code = os.waitstatus_to_exitcode(status) if status is not None else 1
    if code < 0:
        what = f"the training process (pid {pid}) was ended by {signal.Signals(-code).name}"
    elif ray_gone:
        said = _ray_last_word(facts.get("ray") or {}, pid)
        what = f"the Ray cluster of this run stopped ({ray_gone}{'; Ray: ' + said if said else ''})"
    else:
        what = f"the training process (pid {pid}) ended without a word (exit status {code})"
    import pathlib

    from msrl.run.outcome import EXIT_LOST, lost_message

    run_dir = facts.get("run_dir")
    message, _, _ = lost_message(pathlib.Path(run_dir) if run_dir else None, what)
    print(f"msrl: error: {message}", file=sys.stderr)
    return EXIT_LOST


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ray_gone(ray_facts: dict[str, Any]) -> str:
    """Which of the Ray processes the driver started is gone (``""``: none, or none known): the
    raylet first (the GCS ends with the driver, whatever ended the driver)."""
    pids = ray_facts.get("pids") or {}
    for kind in ("raylet", "gcs_server"):
        gone = [p for p in pids.get(kind, []) if not _alive(int(p))]
        if gone:
            return f"its {kind} (pid {gone[0]}) is gone"
    return ""


def _ray_last_word(ray_facts: dict[str, Any], pid: int) -> str:
    """The last warning or error the driver's Ray core worker logged (its log file, in Ray's
    log folder), without the log's prefix; ``""`` if none is found."""
    import glob

    logs = ray_facts.get("logs_dir")
    if not logs:
        return ""
    for path in glob.glob(os.path.join(logs, f"python-core-driver-*_{pid}.log")):
        try:
            with open(path, errors="replace") as f:
                lines = f.readlines()[-200:]
        except OSError:
            continue
        for line in reversed(lines):
            head, _, text = line.partition("] ")
            if any(f" {level} " in head for level in ("W", "E", "C")) and text.strip():
                text = text.strip().split(": ", 1)[-1]  # drop "file.cc:123: "
                return text[:200]
    return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop_leftovers() -> None:
    """SIGTERMs every process left below this one (the driver's orphans, re-parented here),
    SIGKILLs what still runs after :data:`GRACE_S`, and reaps them."""
    me = os.getpid()
    left = _descendants(me)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (GRACE_S if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            _reap()
            left = [p for p in _descendants(me) if _alive(p)]
            if not left:
                break
            time.sleep(0.05)
        if not left:
            break
    _reap()


def _reap() -> None:
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            return
