"""Atomic file writes: a reader sees the old content or the new one, never a part, and a crash leaves no temp file
that a later write trips over.

The content goes to a temp file in the same directory (``.<name>.<random>.tmp``: the same file system, so the
rename is atomic), is flushed and fsynced, is renamed over the target (``os.replace``), and the directory is
fsynced so the rename itself survives a power loss. On any error while writing (a full disk, an exception in the
caller's block) the temp file is removed and the old file, if any, is left as it was.

    from dynaresize import atomic

    atomic.write_json(run_dir / "launch.json", {"n_train": 2})
    atomic.write_text(path, text, mode=0o600)         # created with that mode: never briefly world-readable
    with atomic.open_atomic(path) as f:               # streamed (bytes)
        f.write(chunk)
"""

from __future__ import annotations

import json
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # a directory that cannot be opened (some network file systems): the rename is done anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def open_atomic(path: str | Path, *, fsync: bool = True, mode: int | None = None) -> Iterator[IO[bytes]]:
    """A binary file that becomes ``path`` when the block ends without an exception. ``fsync=False``: no fsync of
    the file or the directory (still atomic for readers, not durable across a power loss). ``mode``: exact
    permissions (default: 0o666 less the umask, as ``open`` gives)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def write_bytes(path: str | Path, data: bytes, *, fsync: bool = True, mode: int | None = None) -> Path:
    with open_atomic(path, fsync=fsync, mode=mode) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, *, fsync: bool = True, mode: int | None = None) -> Path:
    return write_bytes(path, text.encode(), fsync=fsync, mode=mode)


def write_json(path: str | Path, obj: Any, *, fsync: bool = True, mode: int | None = None, **dumps: Any) -> Path:
    """``obj`` as JSON (``dumps``: ``json.dumps`` options), then a newline."""
    return write_text(path, json.dumps(obj, **dumps) + "\n", fsync=fsync, mode=mode)
