"""A full disk as a named condition: ``ENOSPC`` (no space left) and ``EDQUOT`` (the user's quota) on any path that
writes (the run directory, checkpoints, Redis's append-only file, staging, the weights). One test, one wording:
what failed, where, and how much space its filesystem has left."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# how redis-server and other programs say it in their logs (redis-server exits on a failed AOF write with
# appendfsync always: "Short write while writing to the AOF file", then "Can't recover from AOF write error")
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "Short write while writing to the AOF file")


def is_disk_full(e: BaseException | str | None) -> bool:
    """An ``OSError`` with ENOSPC/EDQUOT (also when wrapped as another exception's cause or context), or a message
    that says so."""
    seen = 0
    while isinstance(e, BaseException) and seen < 8:
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(w in str(e) for w in DISK_FULL_WORDS) or "ENOSPC" in str(e) or "EDQUOT" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return isinstance(e, str) and (any(w in e for w in DISK_FULL_WORDS) or "ENOSPC" in e or "EDQUOT" in e)


def free_bytes(path: str | os.PathLike | None) -> int | None:
    """Bytes free for this user on the filesystem of ``path`` (its nearest existing ancestor); None if unknown."""
    if path is None:
        return None
    p = Path(path)
    for q in (p, *p.parents):
        try:
            return shutil.disk_usage(q).free
        except OSError:
            continue
    return None


def size_text(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def describe(path: str | os.PathLike | None, e: BaseException | None = None) -> str:
    """``disk full (ENOSPC) writing <path>: 12.0 KiB free on its filesystem``."""
    code = "EDQUOT, the quota" if isinstance(e, OSError) and e.errno == errno.EDQUOT else "ENOSPC"
    where = f" writing {path}" if path is not None else ""
    return f"disk full ({code}){where}: {size_text(free_bytes(path))} free on its filesystem"


class SpaceWatch:
    """Whether space came back on the filesystem of ``path`` since a write failed there: more free than at the
    failure by ``margin`` bytes, or at least ``enough`` free."""

    def __init__(self, path: str | os.PathLike, margin: int = 256 << 10, enough: int = 64 << 20):
        self.path, self.margin, self.enough = path, margin, enough
        self.at_failure = free_bytes(path) or 0

    def back(self) -> bool:
        now = free_bytes(self.path)
        return now is not None and (now >= self.at_failure + self.margin or now >= self.enough)
