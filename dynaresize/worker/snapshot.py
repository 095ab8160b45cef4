"""In-memory snapshots of a trainer's state (``faults.snapshot_every``): what a lost trainer is rebuilt from.

Every ``snapshot_every`` optimizer steps each trainer copies what a disk checkpoint holds for it (``stage_state``:
its ZeRO partitions, fp32 master and Adam moments per parameter group with their step; rank 0 also the weights)
into one flat host buffer, and sends that buffer to its **peer**, the next trainer in ring order
(:func:`peer_of`), point to point over the world group built at start-up (the communicator the weight versions and
the ZeRO reshard already use; no process group is created). It receives its ring predecessor's buffer the same way.
So every partition lives on two ranks and no single loss takes both copies; the weights live on rank 0 and rank 1.

The copy and the transfer run on one background thread per snapshot, beside the next step's forward and backward:
nothing a forward or backward touches changes until the next optimizer step, and every command that may change
the state (an optimizer step, a switch, a restore) first waits for the copy (:meth:`Snapshots.settle`). Bounded:
two snapshots (own copy and peer's copy each): the two newest complete ones, of which the older is dropped when the
next one starts (then: the newest complete plus the one being made); a new one waits for the last transfer to end
first. The older one is there for a loss early in a step, when the batch a resume at the newest would train first
is not generated yet (:mod:`dynaresize.job.snapshots`).

When a trainer is lost, the coordinator asks the survivors what they hold (``snapshot_held``) and has them write
the snapshot of one step as a checkpoint of that step (``materialize_snapshot``): each partition by the rank that
holds a copy, in the layout and format ``stage_state`` writes (:mod:`dynaresize.job.checkpoint_files`), so a
restart restores it through the one restore path. A switch drops what a rank holds (its partitions belong to the
old trainer count); snapshots come back at the next step.

Unverified here: NCCL (the world group's point-to-point sends from a second thread, as for the weight transport; each
chunk through a device bucket, the path gloo skips);
a single trainer has no peer (its snapshot would need a rollout rank to post a receive: not built), so snapshots
need two trainers or more.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("dynaresize.worker")

SNAP_TAG_BASE = 1 << 28  # p2p tags of snapshots (weight versions use 1 << 20 + version): SNAP_TAG_BASE + step
ALIGN = 64  # each tensor starts at a multiple of this in the flat buffer (any dtype may view it)


def peer_of(rank: int, n_train: int) -> int | None:
    """Where trainer ``rank`` sends its snapshot: the next trainer in ring order (None: a single trainer has none)."""
    return None if n_train < 2 or rank >= n_train else (rank + 1) % n_train


def source_of(rank: int, n_train: int) -> int | None:
    """Whose snapshot trainer ``rank`` holds: its predecessor in ring order (the rank that sends to it)."""
    return None if n_train < 2 or rank >= n_train else (rank - 1) % n_train


def holder_of(rank: int, n_train: int) -> int | None:
    """The peer holding trainer ``rank``'s second copy (the same rule as :func:`peer_of`)."""
    return peer_of(rank, n_train)


@dataclass
class Snap:
    """One trainer's snapshot: a flat byte buffer and what it holds (names, dtypes, shapes, offsets; meta)."""

    rank: int  # whose state it is
    step: int  # the step it was taken before (= the policy version: optimizer steps taken)
    n_train: int
    buf: torch.Tensor  # uint8, every tensor at its offset
    index: dict[str, Any] = field(default_factory=dict)  # {"optim": [...], "weights": [...], "partitions": [...]}

    def tensors(self, what: str) -> dict[str, torch.Tensor]:
        """The ``optim`` or ``weights`` tensors, views into the buffer, in the order they were taken."""
        out = {}
        for name, dtype, shape, off, n in self.index.get(what, []):
            out[name] = self.buf[off:off + n].view(getattr(torch, dtype)).view(shape)
        return out

    @property
    def has_weights(self) -> bool:
        return bool(self.index.get("weights"))

    def summary(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "n_train": self.n_train, "weights": self.has_weights}

    def meta(self, rank: int | None = None) -> dict[str, Any]:
        """The staged snapshot's meta, as ``stage_state`` writes it (``rank`` for a weights copy written for another)."""
        return {"rank": self.rank if rank is None else rank, "version": self.step, "n_train": self.n_train}


def _layout(groups: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, list], int]:
    index: dict[str, list] = {}
    off = 0
    for what, tensors in groups.items():
        rows = []
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            rows.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off, n])
            off += -(-n // ALIGN) * ALIGN
        index[what] = rows
    return index, off


def flatten(rank: int, step: int, n_train: int, groups: dict[str, dict[str, torch.Tensor]],
            partitions: list[dict]) -> Snap:
    """One buffer holding a copy of every tensor of ``groups`` (``optim``, ``weights``)."""
    index, total = _layout(groups)
    index["partitions"] = partitions
    snap = Snap(rank, step, n_train, torch.empty(total, dtype=torch.uint8), index)
    for what, tensors in groups.items():
        views = snap.tensors(what)
        for name, t in tensors.items():
            views[name].copy_(t.detach())
    return snap


class Snapshots:
    """A rank's own snapshot and the one it holds for its ring predecessor, and the one being made."""

    def __init__(self, rank: int, group=None, device: torch.device | str = "cpu", chunk_bytes: int = 8 << 20):
        self.rank, self.group, self.device = rank, group, torch.device(device)
        self.chunk_bytes = max(ALIGN, chunk_bytes)  # one transfer's size (staging.chunk_mb: a device bucket on NCCL)
        self._lock = threading.Lock()
        self.own: list[Snap] = []  # complete own snapshots, newest last (at most 2)
        self.held: list[Snap] = []  # complete copies of the predecessor's, newest last (at most 2)
        self._copied = threading.Event()
        self._copied.set()
        self._thread: threading.Thread | None = None
        self.errors = 0  # transfers that failed (a peer lost mid-transfer): the last complete copies stay
        # what they cost (logged at shutdown; tools/bench_recovery.py): snapshots taken, seconds the rank's main thread
        # spent on them (starting one, waiting for a copy or the last transfer), seconds of the background thread
        self.taken, self.main_s, self.background_s = 0, 0.0, 0.0

    def settle(self) -> None:
        """Wait until the snapshot being made has copied the live state (before anything changes it)."""
        if not self._copied.is_set():
            t0 = time.perf_counter()
            self._copied.wait()
            self.main_s += time.perf_counter() - t0

    def drop(self) -> None:
        """Forget what is held (a switch: the partitions belong to the old trainer count)."""
        self.settle()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        with self._lock:
            self.own, self.held = [], []

    def take(self, step: int, n_train: int, optim: dict[str, torch.Tensor], partitions: list[dict],
             weights: dict[str, torch.Tensor] | None) -> None:
        """Start snapshot ``step``: copy (``optim``, ``weights``: the live tensors) and exchange on a thread. The
        previous one's transfer must have ended (the bound: one complete plus one being made)."""
        if self._thread is not None:
            self._thread.join()
        with self._lock:  # the older of the two goes now: with the one being made, two at most
            self.own, self.held = self.own[-1:], self.held[-1:]
        self._copied.clear()
        groups = {"optim": optim, **({"weights": weights} if weights else {})}
        th = threading.Thread(target=self._make, args=(step, n_train, groups, partitions), daemon=True,
                              name=f"snapshot-{step}")
        self._thread = th
        th.start()

    def _make(self, step: int, n_train: int, groups, partitions) -> None:
        t0 = time.perf_counter()
        try:
            snap = flatten(self.rank, step, n_train, groups, partitions)
        except BaseException as e:  # noqa: BLE001 - never leave the main thread waiting
            log.warning("snapshot of step %d: copy failed: %s", step, e)
            self._copied.set()
            return
        self._copied.set()
        with self._lock:
            self.own = (self.own + [snap])[-2:]
        try:
            got = self._exchange(snap)
        except Exception as e:  # noqa: BLE001 - a peer lost mid-transfer: the coordinator sees the loss
            self.errors += 1
            log.warning("snapshot of step %d: exchange with the peer failed (%s); the last complete copies stay", step, e)
            return
        if got is not None:
            with self._lock:
                self.held = (self.held + [got])[-2:]
        self.background_s += time.perf_counter() - t0

    def _exchange(self, snap: Snap) -> Snap | None:
        """Send ``snap`` to the peer, receive the predecessor's: header (sizes), index (JSON), then the buffer in
        chunks of ``chunk_bytes``, each send and receive posted together (a ring: every rank does both). Each chunk
        goes through the communicator's device (gloo: the host buffer itself; NCCL: one device bucket each way)."""
        dst, src = peer_of(self.rank, snap.n_train), source_of(self.rank, snap.n_train)
        if dst is None or src is None:
            return None
        tag = SNAP_TAG_BASE + snap.step
        index = torch.frombuffer(bytearray(json.dumps(snap.index).encode()), dtype=torch.uint8)
        head = self._pair(torch.tensor([snap.step, index.numel(), snap.buf.numel()], dtype=torch.int64),
                          torch.empty(3, dtype=torch.int64), dst, src, tag)
        step, n_index, n_buf = (int(x) for x in head)
        if step != snap.step:
            raise RuntimeError(f"rank {src} sent the snapshot of step {step}, expected {snap.step}")
        idx = self._pair(index, torch.empty(n_index, dtype=torch.uint8), dst, src, tag)
        buf = torch.empty(n_buf, dtype=torch.uint8)
        c = self.chunk_bytes
        for off in range(0, max(snap.buf.numel(), n_buf), c):
            out = snap.buf[off:off + c] if off < snap.buf.numel() else None
            into = buf[off:off + c] if off < n_buf else None
            self._pair(out, into, dst, src, tag)
        return Snap(src, step, snap.n_train, buf, json.loads(bytes(idx.numpy()).decode()))

    def _pair(self, out: torch.Tensor | None, into: torch.Tensor | None, dst: int, src: int, tag: int):
        """Send ``out`` to ``dst`` and receive ``into`` from ``src`` at once (either may be None); returns ``into``."""
        dev = self.device
        ops = []
        if out is not None:
            ops.append(dist.isend(out.to(dev), dst=dst, group=self.group, tag=tag))
        got = None
        if into is not None:
            got = into if dev.type == "cpu" else torch.empty_like(into, device=dev)
            ops.append(dist.irecv(got, src=src, group=self.group, tag=tag))
        for op in ops:
            op.wait()
        if into is not None and got is not into:
            into.copy_(got)
        return into

    def held_summary(self) -> dict[str, Any]:
        """What this rank holds, complete: its own snapshot and its predecessor's (for ``snapshot_held``)."""
        with self._lock:
            return {"own": [x.summary() for x in self.own], "held": [x.summary() for x in self.held]}

    def of(self, rank: int, step: int) -> Snap | None:
        """The complete snapshot of trainer ``rank`` at ``step`` this rank holds (its own or its predecessor's)."""
        with self._lock:
            for s in self.own + self.held:
                if s.rank == rank and s.step == step:
                    return s
        return None

    def with_weights(self, step: int) -> Snap | None:
        with self._lock:
            for s in self.own + self.held:
                if s.step == step and s.has_weights:
                    return s
        return None

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.buf.numel() for s in self.own + self.held)
