"""Process trees read from /proc (Linux): what the fault tests and tools/chaos.py signal."""

from __future__ import annotations

import os


def children() -> dict[int, list[int]]:
    """Parent pid -> its child pids, for every process visible now."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids
