"""Bounded state staging to a node-local directory: chunked, checksummed, manifest-last, no pickle.

Why: a GPU leaving the training role must put its weights and optimizer state somewhere while vLLM takes the
device, and host RAM must not blow up (a 30B model's Adam state is hundreds of GB per node). So state passes
through a **fixed pool of chunk buffers** (``buffer_mb`` in total) to node-local disk (NVMe on clusters):

- the producer (the caller's thread) copies the next ``chunk_mb`` of the tensor byte stream into a free pool
  buffer (blocking while the pool is empty, which is what bounds memory); a tensor already in
  host memory is written straight from its own memory (no copy), a pool slot still bounding the writes in flight
  (the caller must not modify tensors during :meth:`Stager.stage`, which returns only when all is written);
- ``writer_threads`` asynchronous writer threads checksum and ``pwrite`` full buffers at their offsets and
  return them to the pool (zlib's CRC and ``pwrite`` release the GIL, so two writers use two cores);
- the manifest (``manifest.json``: tensor names, dtypes, shapes, byte offsets; chunk offsets, lengths and
  checksums; free-form JSON ``meta``) is written last, to a temporary name, and renamed into place atomically.
  A snapshot without a manifest does not exist, so a crash mid-write never yields a half snapshot;
- an OS error while writing (``ENOSPC`` on a full disk, ``EDQUOT``, ``EIO``, ``EFBIG``) raises
  :class:`StagingError` naming the snapshot and the error (symbolic errno first); the partial snapshot directory
  is removed, and the buffers and writer threads of that call are released, so the stager stays usable.

Layout of a snapshot ``<dir>/<name>/``: ``data.bin`` (all tensors back to back) and ``manifest.json``.
Restore reads chunk by chunk through one buffer, verifies each checksum (and the file length) and only then
copies bytes into the destination tensors: a corrupted or truncated chunk raises :class:`StagingError` naming
the file and the chunk, and nothing of that chunk is loaded. :class:`Prefetch` runs a restore on a thread, so a
deferred optimizer restore overlaps forward and backward.

Checksum (recorded in the manifest): xxh3-64 when the ``xxhash`` package is installed (``auto``, the default),
else zlib's CRC-32; ``blake2b`` on request. The checksum is most of staging's own CPU cost, so its speed decides
the throughput against a plain write when cores are busy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from dynaresize import atomic
from dynaresize.background import Background
from dynaresize.disk import DISK_FULL_ERRNOS, free_bytes, size_text
from typing import Any, Callable, Collection

import torch

MANIFEST = "manifest.json"
DATA = "data.bin"
FORMAT = 1


class StagingError(RuntimeError):
    """A snapshot that is missing, incomplete, corrupted or does not match what the caller expects, or one that
    could not be written (the message names the snapshot and the OS error, e.g. ``ENOSPC``)."""


class _WriterFailed(Exception):
    """Internal: a writer thread failed; the producer stops and the writer's error is raised."""


def os_error_text(e: OSError, where: str | os.PathLike | None = None) -> str:
    """``ENOSPC (No space left on device) on <file>``: the symbolic errno first, so logs and events can be grepped.
    ``where``: the file or folder being written, for an error that names none (a write to an open file)."""
    name = errno.errorcode.get(e.errno, f"errno {e.errno}") if e.errno is not None else type(e).__name__
    text = f"{name} ({e.strerror or e})"
    text = f"{text} on {e.filename}" if e.filename else text
    path = e.filename or where
    if e.errno in DISK_FULL_ERRNOS:  # a full disk: how much its filesystem has left
        text += f", a full disk ({size_text(free_bytes(path))} free on its filesystem)" if path else ", a full disk"
    return text


def default_dir(job_id: str) -> Path:
    """``$SLURM_TMPDIR/dynaresize-<job>`` on Slurm (node-local), else ``<tempdir>/dynaresize-<job>``."""
    base = os.environ.get("SLURM_TMPDIR") or tempfile.gettempdir()
    return Path(base) / f"dynaresize-{job_id}"


try:  # xxh3 is several times faster than CRC-32 (the checksum is most of staging's own CPU cost)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - optional
    _xxhash = None

ALGORITHMS = ("xxh3", "crc32", "blake2b")


def resolve_checksum(algo: str) -> str:
    """``auto`` -> ``xxh3`` when the xxhash package is installed, else ``crc32``."""
    if algo == "auto":
        return "xxh3" if _xxhash is not None else "crc32"
    return algo


def _checksum(algo: str, data) -> str:
    if algo == "xxh3":
        if _xxhash is None:
            raise StagingError("checksum xxh3 needs the xxhash package (pip install xxhash)")
        return _xxhash.xxh3_64_hexdigest(data)
    if algo == "crc32":
        return f"{zlib.crc32(data):08x}"
    if algo == "blake2b":
        return hashlib.blake2b(data, digest_size=16).hexdigest()
    raise StagingError(f"unknown checksum algorithm {algo!r} (allowed: auto, {', '.join(ALGORITHMS)})")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StagingError(f"manifest names an unknown dtype {name!r}")
    return dt


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class StagedSnapshot:
    """A snapshot :meth:`Stager.stage` wrote (a rank answers ``stage_state`` with its snapshots in a
    :class:`dynaresize.contract.protocol.StageResult`)."""

    path: Path  # snapshot directory
    bytes: int
    seconds: float
    chunks: int


class Stager:
    """Writes and reads snapshots under ``root`` through a pool of ``buffer_mb`` MiB of chunk buffers."""

    def __init__(self, root: str | Path, buffer_mb: int = 64, chunk_mb: int = 8, writer_threads: int = 2,
                 checksum: str = "auto", fsync: bool = False, pin: bool = False, zero_copy_host: bool = True):
        self.root = Path(root)
        self.chunk = min(chunk_mb, buffer_mb) << 20
        n = max(1, (buffer_mb << 20) // self.chunk)
        self.buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=pin) for _ in range(n)]
        self.writer_threads = max(1, writer_threads)
        self.algo = resolve_checksum(checksum)
        _checksum(self.algo, b"")  # fails early on an unknown or unavailable algorithm
        self.fsync = fsync
        self.zero_copy_host = zero_copy_host  # CPU tensors are written from their own memory (no pool copy)

    @property
    def buffer_bytes(self) -> int:
        return len(self.buffers) * self.chunk

    # -- write ----------------------------------------------------------------------------------------------

    def stage(self, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> StagedSnapshot:
        """Write ``tensors`` (any device) as snapshot ``name``; returns when the manifest is in place.

        Any OS error on the way (a full disk, a quota, an I/O error, a file too large) raises :class:`StagingError`
        naming the snapshot and the error; the partial snapshot directory is then removed (no manifest ever
        exists for it, and an older snapshot of the same name is gone too: its manifest is removed first). The
        pool buffers and writer threads of a failed call are released, so the stager stays usable."""
        t0 = time.perf_counter()
        snap = self.root / name
        try:
            return self._stage(snap, name, tensors, meta, t0)
        except BaseException as e:
            shutil.rmtree(snap, ignore_errors=True)  # a failed snapshot leaves nothing behind, manifest least of all
            if isinstance(e, OSError):
                raise StagingError(f"staging snapshot {snap} failed: {os_error_text(e, snap)}; "
                                   "the partial snapshot was removed") from e
            raise

    def _stage(self, snap: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None,
               t0: float) -> StagedSnapshot:
        snap.mkdir(parents=True, exist_ok=True)
        (snap / MANIFEST).unlink(missing_ok=True)  # an old manifest must never describe new data
        free: queue.Queue = queue.Queue()
        for b in self.buffers:
            free.put(b)
        jobs: queue.Queue = queue.Queue(maxsize=len(self.buffers))
        errors: list[BaseException] = []
        data_path = snap / DATA
        fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        def writer() -> None:
            while True:
                job = jobs.get()
                if job is None:
                    return
                buf, view, off, n, rec = job
                try:
                    if not errors:  # after a failure the queue is drained without writing
                        rec["checksum"] = _checksum(self.algo, view)  # in the writer: checksums of chunks run in parallel
                        done = 0
                        while done < n:
                            w = os.pwrite(fd, view[done:], off + done)
                            if w <= 0:  # no progress and no error: treat as a full device, never spin
                                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(data_path))
                            done += w
                except OSError as e:
                    if e.filename is None:
                        e.filename = str(data_path)
                    errors.append(e)
                except BaseException as e:  # noqa: BLE001 - handed to the producer
                    errors.append(e)
                finally:
                    free.put(buf)

        threads = [threading.Thread(target=writer, daemon=True, name=f"stage-writer-{i}") for i in range(self.writer_threads)]
        for th in threads:
            th.start()
        entries, chunks, offset = [], [], 0
        try:
            buf, fill = free.get(), 0

            def submit(token: torch.Tensor, view: memoryview, n: int) -> None:
                nonlocal offset
                if errors:  # a writer failed: stop producing (its error is raised below)
                    raise _WriterFailed
                rec = {"offset": offset, "length": n, "checksum": None}
                chunks.append(rec)
                jobs.put((token, view, offset, n, rec))
                offset += n

            def flush() -> None:
                nonlocal buf, fill
                submit(buf, memoryview(buf.numpy())[:fill], fill)
                buf, fill = free.get(), 0

            for tname, t in tensors.items():
                src = _bytes_of(t)
                entries.append({"name": tname, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "offset": offset + fill, "nbytes": src.numel()})
                host = self.zero_copy_host and src.device.type == "cpu"
                whole = memoryview(src.numpy()) if host and src.numel() else None
                pos = 0
                while pos < src.numel():
                    if whole is not None and fill == 0 and src.numel() - pos >= self.chunk:
                        # host memory already: write straight from the tensor (it is not modified during stage());
                        # the pool slot still bounds the writes in flight
                        submit(buf, whole[pos:pos + self.chunk], self.chunk)
                        buf = free.get()
                        pos += self.chunk
                        continue
                    k = min(self.chunk - fill, src.numel() - pos)
                    buf[fill:fill + k].copy_(src[pos:pos + k])  # device -> host (pinned on GPUs), or a tail piece
                    fill += k
                    pos += k
                    if fill == self.chunk:
                        flush()
            if fill:
                flush()
            free.put(buf)
        except _WriterFailed:
            pass
        finally:
            for _ in threads:
                jobs.put(None)  # never blocks for long: the writers drain the queue even after a failure
            for th in threads:
                th.join()
            try:
                if self.fsync and not errors:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if errors:
            raise errors[0]
        manifest = {"format": FORMAT, "name": name, "checksum": self.algo, "chunk_bytes": self.chunk, "total_bytes": offset,
                    "tensors": entries, "chunks": chunks, "meta": meta or {}}
        # atomic: the manifest is either complete or absent
        atomic.write_json(snap / MANIFEST, manifest, fsync=self.fsync, separators=(",", ":"))
        return StagedSnapshot(snap, offset, time.perf_counter() - t0, len(chunks))

    # -- read -----------------------------------------------------------------------------------------------

    def verify(self, name: str | Path) -> None:
        """Check every chunk's length and checksum without loading anything (raises :class:`StagingError`)."""
        _verify(self, Path(name) if Path(name).is_absolute() else self.root / name)

    def load(self, name: str | Path, into: dict[str, torch.Tensor] | None = None,
             verify_first: bool | None = None, names: Collection[str] | None = None,
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Read snapshot ``name`` (or a snapshot directory); verify every chunk before using its bytes.

        ``into`` gives destination tensors (same names, shapes and dtypes; any device); missing ones are allocated
        on the CPU. With ``verify_first`` (default: when ``into`` is given, i.e. live tensors) every chunk is
        verified in a first pass, so a bad snapshot leaves the destination untouched. ``names``: read only these
        tensors (and only the chunks they overlap, each verified), e.g. the fp32 masters of an optimizer snapshot
        without its Adam moments. Returns (tensors, meta).
        """
        if verify_first is None:
            verify_first = into is not None
        if verify_first:
            self.verify(name)
        snap = Path(name) if Path(name).is_absolute() else self.root / name
        man = read_manifest(snap)
        out: dict[str, torch.Tensor] = {}
        views: list[tuple[int, int, torch.Tensor]] = []  # (start, end, byte view) in stream coordinates
        for e in man["tensors"]:
            if names is not None and e["name"] not in names:
                continue
            shape, dt = tuple(e["shape"]), _dtype(e["dtype"])
            if into is not None and e["name"] in into:
                t = into[e["name"]]
                if tuple(t.shape) != shape or t.dtype != dt:
                    raise StagingError(f"{snap}: tensor {e['name']!r} is {dt}{list(shape)} in the snapshot, "
                                       f"the destination is {t.dtype}{list(t.shape)}")
            else:
                t = torch.empty(shape, dtype=dt)
            out[e["name"]] = t
            views.append((e["offset"], e["offset"] + e["nbytes"], t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)))
        path = snap / DATA
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StagingError(f"{path}: data file missing (manifest lists {len(man['chunks'])} chunks)") from None
        if size < man["total_bytes"]:
            raise StagingError(f"{path}: truncated: {size} bytes, manifest says {man['total_bytes']}"
                               f"{_first_short_chunk(man, size)}")
        def wanted(off: int, n: int) -> bool:
            return names is None or any(max(a, off) < min(b, off + n) for a, b, _ in views)

        for off, n, buf in _verified_chunks(path, man, self.chunk, wanted):
            for a, b, v in views:  # copy the verified chunk's bytes into every tensor it overlaps
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    v[lo - a:hi - a].copy_(buf[lo - off:hi - off])
        return out, man["meta"]


def _verified_chunks(path: Path, man: dict[str, Any], chunk: int, wanted: Callable[[int, int], bool] | None = None):
    """Read the data file chunk by chunk through one reused buffer; yield (offset, length, buffer) only for chunks
    whose checksum matches the manifest (a bad or short chunk, or a read error, raises StagingError naming it,
    before any use). A chunk reaching past the end of the file is reported before anything is allocated for it.
    ``wanted(offset, length)`` false: that chunk is skipped (neither read nor verified)."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise StagingError(f"{path}: data file missing (manifest lists {len(man['chunks'])} chunks)") from None
    except OSError as e:
        raise StagingError(f"{path}: cannot open: {os_error_text(e)}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        buf = torch.empty(max(1, min(chunk, size)), dtype=torch.uint8)  # one chunk: reads are bounded too
        for ci, c in enumerate(man["chunks"]):
            off, n = int(c["offset"]), int(c["length"])
            if wanted is not None and not wanted(off, n):
                continue
            if off + n > size:
                raise StagingError(f"{path}: chunk {ci} (offset {off}) truncated: the file has {max(0, size - off)} "
                                   f"of its {n} bytes ({size} bytes in all)")
            if n > buf.numel():
                buf = torch.empty(n, dtype=torch.uint8)
            mv = memoryview(buf.numpy())[:n]
            try:
                f.seek(off)
                got = f.readinto(mv)
            except OSError as e:
                raise StagingError(f"{path}: chunk {ci} (offset {off}) unreadable: {os_error_text(e)}") from e
            if got != n:
                raise StagingError(f"{path}: chunk {ci} (offset {off}) truncated: read {got} of {n} bytes")
            if _checksum(man["checksum"], mv) != c["checksum"]:
                raise StagingError(f"{path}: chunk {ci} (offset {off}, {n} bytes) fails its {man['checksum']} checksum: corrupted")
            yield off, n, buf


def _first_short_chunk(man: dict[str, Any], size: int) -> str:
    for ci, c in enumerate(man["chunks"]):
        if int(c["offset"]) + int(c["length"]) > size:
            return f" (chunk {ci} at offset {c['offset']} and every later one cut off)"
    return ""


def _verify(stager: "Stager", snap: Path) -> None:
    for _ in _verified_chunks(snap / DATA, read_manifest(snap), stager.chunk):
        pass


def verify_snapshot(snap: str | Path) -> dict[str, Any]:
    """Check a snapshot directory without a :class:`Stager` (no buffer pool): its manifest, then every chunk's
    length and checksum, streamed through one chunk-sized buffer (bounded memory). Returns the manifest; raises
    :class:`StagingError` naming the file and the first bad chunk."""
    snap = Path(snap)
    man = read_manifest(snap)
    chunk = max([int(c["length"]) for c in man["chunks"][:1]] + [1])
    for _ in _verified_chunks(snap / DATA, man, int(man.get("chunk_bytes") or chunk)):
        pass
    return man


def read_manifest(snap: str | Path) -> dict[str, Any]:
    """The manifest of a snapshot, checked for shape: keys, format, and a chunk table that tiles ``total_bytes``
    exactly (contiguous chunks, none longer than ``chunk_bytes``), so a damaged number is caught here."""
    path = Path(snap) / MANIFEST
    try:
        with open(path) as f:
            man = json.load(f)
    except FileNotFoundError:
        raise StagingError(f"{path}: no manifest (snapshot missing or never completed)") from None
    except ValueError as e:
        raise StagingError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise StagingError(f"{path}: unreadable: {os_error_text(e)}") from e
    if not isinstance(man, dict):
        raise StagingError(f"{path}: not a JSON object")
    for key in ("format", "checksum", "total_bytes", "tensors", "chunks", "meta"):
        if key not in man:
            raise StagingError(f"{path}: manifest lacks key {key!r}")
    if man["format"] != FORMAT:
        raise StagingError(f"{path}: manifest format {man['format']!r}, this reader knows {FORMAT}")
    limit = man.get("chunk_bytes")
    pos = 0
    for ci, c in enumerate(man["chunks"]):
        off, n = (c.get("offset"), c.get("length")) if isinstance(c, dict) else (None, None)
        if not (type(off) is int and type(n) is int and off == pos and n > 0 and (limit is None or n <= limit)):
            raise StagingError(f"{path}: chunk {ci} has offset {off!r} and length {n!r}: expected offset {pos} and a "
                               f"length of 1..{limit} bytes (damaged manifest)")
        pos += n
    if man["total_bytes"] != pos:
        raise StagingError(f"{path}: total_bytes {man['total_bytes']!r} but the chunks cover {pos} bytes (damaged manifest)")
    return man


class Prefetch(Background):
    """A restore running on a background thread (e.g. optimizer state needed only at the first step)."""

    def __init__(self, stager: Stager, name: str | Path, into: dict[str, torch.Tensor] | None = None):
        super().__init__(lambda: stager.load(name, into), "stage-prefetch")

    def result(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self._wait()
