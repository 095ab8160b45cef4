"""The barrier-free schedule's weight transport over the communicators (``pipeline.weights_transport: comm``).

A new policy version goes from trainer dp-rank 0 (global rank 0, a trainer in every split) to each rollout rank
that asked for it, point to point over the world group built at start-up (gloo here, NCCL on GPUs), into a second
buffer on the receiver while it keeps decoding with the old one; the generate that asks for the version installs
it. No process group is created for it (``comm.groups.created_after_startup()`` stays 0).

- rank 0, :class:`WeightSender`: at its optimizer step it keeps a host copy of the new weights (:meth:`hold`; the
  next step may change its own weights while copies are still on their way); ``push_weights`` queues a version
  for some ranks (:meth:`push`). One thread per destination sends from the held copy, so the trainers' commands
  never wait for a transfer and one slow or dead receiver holds up no other.
- a rollout rank, :class:`CommFetch`: ``fetch_weights`` starts a thread that receives the version into fresh host
  tensors; :meth:`CommFetch.result` gives them to the install (the interface of :class:`dynaresize.staging.Prefetch`,
  the file path's reader).

Every receive has exactly one send. A new version's fetches go out with a ``push_weights`` to rank 0 beside them
(ahead of rank 0's next training command, which would otherwise hold the push up for a whole chunk), each fetch
marked ``pushed``: the rank then posts one receive whatever it holds (into a buffer it drops when it needs none).
Any other fetch (received again, a resume's) is pushed only after its ack says it started a receive. Transfers of different versions carry different tags
(:func:`dynaresize.comm.weights.version_tag`).

The relay (``pipeline.weights_relay`` f > 0): a rollout rank's fetch may name another rollout rank as its sender
(``src``); that relay forwards what it received (:meth:`WeightSender.relay`) once its own receive ended and its
checksum matched, to its receivers one after another. Who sends to whom: :mod:`dynaresize.schedule.relay` (pure).
Every transfer ends with a CRC-32 of its bytes (:mod:`dynaresize.comm.weights`): a wrong copy is refused, never
installed or forwarded; a relay that cannot forward tells its receivers at once.

Why point to point and not the pre-built sync group's broadcast: a collective needs every member at once, while
here ranks ask at different times (each when its stream reaches the fetch), some ask again for an older version
(a lost rank's groups handed out again), and a rank may be lost or switching meanwhile. The source sends the
weights once per receiver in the star (the relay: at most f times per rank; the broadcast of the barrier path
once per tree/ring); on NCCL the world
group's point-to-point sends from a second thread beside the trainers' collectives are UNVERIFIED (no GPU here).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from dynaresize.background import Background
from dynaresize.comm.weights import Named, WeightSyncError, recv_weights_from, send_refusal, send_weights_to
from dynaresize.schedule.relay import RELAY_MARK

log = logging.getLogger("dynaresize.worker")


class CommFetch(Background):
    """One version received from ``src`` on a background thread into fresh host tensors (the second buffer)."""

    def __init__(self, expected: Named, src: int, version: int, bucket_bytes: int, device: torch.device | str):
        self.version, self.src = version, src
        self.source = f"{RELAY_MARK if src else ''}rank {src} (point to point over the world group)"
        self.bytes = 0
        # ``expected`` (this rank's own weights) gives names, shapes and dtypes only: it is never written here
        want = list(expected)

        def receive() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            tensors, self.bytes = recv_weights_from(want, src, version, bucket_bytes, device=device)
            return tensors, {"version": version}

        super().__init__(receive, f"weights-recv-v{version}")

    def result(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        try:
            return self._wait()
        except Exception as e:  # noqa: BLE001 - named for the install that needed it
            raise WeightSyncError(f"receiving version {self.version} from {self.source}: {type(e).__name__}: {e}") from e


class Relayed:
    """A relay's copy of a version: what its receive (the second buffer) brings, once ended and checked. If that
    receive fails (its sender was lost), the sends waiting on it wait up to ``replan_s`` for the receive the
    coordinator posts from another holder (:meth:`replace`), then raise (their receivers are told at once)."""

    def __init__(self, fetch: "CommFetch", order: Sequence[str], replan_s: float = 120.0):
        self.fetch, self.names, self.replan_s = fetch, list(order), replan_s
        self._cond = threading.Condition()

    def replace(self, fetch: "CommFetch") -> None:
        with self._cond:
            self.fetch = fetch
            self._cond.notify_all()

    def __call__(self) -> list[tuple[str, torch.Tensor]]:
        deadline = time.monotonic() + self.replan_s
        while True:
            with self._cond:
                fetch = self.fetch
            try:
                tensors, _ = fetch.result()
                return [(n, tensors[n]) for n in self.names]
            except WeightSyncError:
                with self._cond:
                    while self.fetch is fetch and time.monotonic() < deadline:
                        self._cond.wait(max(0.0, deadline - time.monotonic()))
                    if self.fetch is fetch:
                        raise


class WeightSender:
    """A sending rank's side: held versions and the threads that send them. Trainer rank 0 holds host copies made at
    its optimizer step (:meth:`hold`); a relay (``pipeline.weights_relay`` > 0) holds the versions it receives
    (:meth:`relay`: sent once its own receive ended and checked). A relay's pushes (``one_at_a_time``) go through one
    thread in the order pushed, so its link carries one transfer at a time and its first receiver can forward
    soonest; the star's through one thread per destination, so one slow or dead receiver holds up no other."""

    def __init__(self, bucket_bytes: int, device: torch.device | str):
        self.bucket_bytes, self.device = bucket_bytes, device
        # version -> its tensors, or (a relay's) what waits for this rank's own receive of it and returns them
        self.held: dict[int, list[tuple[str, torch.Tensor]] | Callable[[], list[tuple[str, torch.Tensor]]]] = {}
        self._lock = threading.Lock()
        self._queues: dict[int, queue.Queue] = {}
        self.sent: list[dict[str, Any]] = []  # (version, rank, bytes, start, end, error): read by the main thread
        self.errors: list[str] = []

    def hold(self, version: int, named: Named, keep_from: int | None = None) -> int:
        """Keep a host copy of ``named`` as ``version``; versions older than ``keep_from`` are dropped (copies on
        their way keep their own reference). Returns the bytes copied."""
        copy = [(n, t.detach().to("cpu", copy=True)) for n, t in named]
        with self._lock:
            self.held[version] = copy
            for v in [v for v in self.held if keep_from is not None and v < keep_from]:
                del self.held[v]
        return sum(t.numel() * t.element_size() for _, t in copy)

    def relay(self, version: int, fetch: "CommFetch", order: Sequence[str], keep: int = 2, replan_s: float = 120.0) -> None:
        """Forward ``version`` from this rank's own receive of it (``fetch``, its second buffer), once that ended and
        its checksum matched; the newest ``keep`` versions are held (a send on its way keeps its own reference). A
        second receive of the same version (its own relay was lost, another holder sends it) replaces the first:
        sends waiting on the first take the second."""
        with self._lock:
            cur = self.held.get(version)
            if isinstance(cur, Relayed):
                cur.replace(fetch)
                return
            self.held[version] = Relayed(fetch, order, replan_s)
            for v in sorted(self.held)[:-keep]:
                del self.held[v]

    def holds(self, version: int) -> bool:
        with self._lock:
            return version in self.held

    def push(self, version: int, ranks: Sequence[int], one_at_a_time: bool = False) -> None:
        """Queue ``version`` for each of ``ranks`` (each receives it once; a thread sends in queue order)."""
        with self._lock:
            named = self.held.get(version)
        if named is None:
            raise WeightSyncError(f"rank 0 holds no copy of version {version} to send (held: "
                                  f"{', '.join(map(str, sorted(self.held))) or 'none'})")
        for r in ranks:
            key = -1 if one_at_a_time else r
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.Queue()
                threading.Thread(target=self._serve, args=(q,), daemon=True, name=f"weights-send-r{key}").start()
            q.put((version, r, named))

    def _serve(self, q: queue.Queue) -> None:
        while True:
            version, rank, named = q.get()
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"version": version, "rank": rank, "start": t0}
            try:
                if callable(named):
                    try:
                        named = named()
                    except Exception:
                        send_refusal(rank, version, device=self.device)
                        raise
                rec["bytes"] = send_weights_to(named, rank, version, self.bucket_bytes, device=self.device)
            except Exception as e:  # noqa: BLE001 - a lost receiver: reported, the other destinations go on
                rec["error"] = f"{type(e).__name__}: {e}"
                log.warning("sending version %d to rank %d failed: %s", version, rank, rec["error"])
            rec["end"] = time.perf_counter()
            with self._lock:
                self.sent.append(rec)

    def take_sent(self) -> list[dict[str, Any]]:
        """The transfers finished since the last call (for the event log, written on the main thread)."""
        with self._lock:
            out, self.sent = self.sent, []
        return out
