"""The process table read from ``/proc``, for tests that look at their own run's processes
(never at the whole machine's: other jobs may run beside the tests)."""

from __future__ import annotations

import os


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
