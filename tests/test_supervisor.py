"""The supervising parent of ``msrl train`` (:mod:`msrl.run.supervisor`) keeps Ray's own C++ log
lines, which Ray's core worker copies to the driver's standard error, off the user's terminal,
and passes everything else on; the driver's Python ``sys.stderr`` still sees the terminal."""

from __future__ import annotations

import os
import pathlib
import pty
import select
import subprocess
import sys
import textwrap
import time

from procs import EVENT_TIMEOUT_S

from msrl.run.supervisor import StderrFilter

ROOT = pathlib.Path(__file__).resolve().parents[1]

RAY_ERROR = (b"[2026-11-28 10:55:16,123 E 4242 4250] core_worker.cc:609: :info_message: Attempting to "
             b"recover 2 lost objects by resubmitting their tasks or setting a new primary location\n")
DUMP = (b"[2026-11-28 10:55:16,200 E 4242 4250] core_worker.cc:700: plasma store state:\n"
        b"========== Plasma store: =================\n"
        b"Current usage: 0 / 2.1 GB\n"
        b"- num bytes created total: 12345\n")
C10_WARNING = b"[W1128 10:55:16.123456789 ProcessGroupGloo.cpp:727] Warning: a torch warning\n"


def test_ray_messages_are_dropped_whole_and_nothing_else():
    judge = StderrFilter()
    assert not judge.keep(RAY_ERROR)
    assert not judge.keep(DUMP)  # the dump's lines came in the same write as Ray's prefix
    for other in (b"a line of the user's C code\n", C10_WARNING,
                  b"Traceback (most recent call last):\n  File \"x.py\", line 1\n",
                  b"msrl: error: the Ray cluster of this run stopped\n", b"no newline at the end",
                  b"Plasma store: a user's own line that names Ray's words\n" + RAY_ERROR):
        assert judge.keep(other), other
    assert judge.dropped == 2


SCRIPT = textwrap.dedent("""
    import os, sys
    from msrl.run.supervisor import supervised

    def work():
        os.write(2, RAY_ERROR)
        os.write(2, DUMP)
        os.write(2, b"C-level line kept\\n")
        os.write(2, b"x" * 200000 + b"\\n")  # more than a pipe holds
        print("python line kept; a terminal:", sys.stderr.isatty(), file=sys.stderr)
        return 7

    sys.exit(supervised(work))
""")


def test_the_driver_keeps_its_terminal_and_ray_lines_stay_off_it():
    """A supervised driver, its standard error a terminal (a pseudo-terminal here): Python's
    ``sys.stderr`` is still a terminal, C-level lines are passed on, Ray's are not."""
    script = f"RAY_ERROR = {RAY_ERROR!r}\nDUMP = {DUMP!r}\n" + SCRIPT
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=follower, stdout=subprocess.DEVNULL,
                            cwd=ROOT)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every writer of the terminal is gone
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=EVENT_TIMEOUT_S) == 7
    finally:
        proc.kill()
        os.close(leader)
    text = seen.replace(b"\r\n", b"\n")
    assert b"C-level line kept\n" in text
    assert b"x" * 200000 + b"\n" in text
    assert b"python line kept; a terminal: True\n" in text
    assert b"core_worker.cc" not in text and b"Plasma store" not in text, text
