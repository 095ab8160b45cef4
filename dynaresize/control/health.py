"""Liveness that knows the control plane's health: a rank is lost only for a silence while Redis answered.

Why: every heartbeat goes through Redis. When Redis stalls (a slow disk under ``appendfsync always``, a fork for a
save, a network hiccup between the job and an external server) no heartbeat arrives, and the coordinator's own
calls stall in the same window; counting that window as the ranks' silence declared every rank lost, used a
restart and retrained the steps since the last checkpoint, while the message blamed the ranks.

Two parts:

- :class:`RoundTrips` (the observation, impure: a clock): the coordinator's Redis client reports each call's
  round trip (:func:`dynaresize.control.server.client_for` with ``round_trips=``; a blocking read's own block
  time is not a delay). A call slower than ``slow_after_s`` marks the window it spanned as one in which Redis was
  slow or unreachable; a call still in flight counts up to now. Overlapping windows, and windows less than the
  grace apart, are one stall.
- :func:`lost_ranks` (the decision, pure): which ranks are lost, and why, from each silent rank's last heartbeat in
  the coordinator's clock, now, and the stalls: a rank is lost when its silence *outside* the stalls, each
  extended by ``grace_s`` (a rank's heartbeat needs a period and a client backoff to get through once Redis
  answers), exceeds the deadline. With a healthy Redis nothing is discounted: a dead rank is seen at today's
  deadline; one that dies during a stall is seen once Redis answers plus that deadline.

The coordinator (:meth:`dynaresize.job.transport.Transport.check_alive`) drives both: it announces each stall
once it is over ("Redis replies took 12.1 s; ranks waited; no rank lost") and stops the run, naming Redis, when a
reply took longer than ``redis.write_wait_s``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from dynaresize.control.config import RedisConfig

BACKOFF_CAP_S = 1.0  # a client's longest sleep between two retries (dynaresize.control.server uses this one)


@dataclass(frozen=True, slots=True)
class Stall:
    """A window (the coordinator's monotonic clock) in which Redis was slow or did not answer."""

    start: float
    end: float
    slowest_s: float  # the longest round trip of a call in it (what "Redis replies took" says)
    ongoing: bool = False  # a call still waits (``end`` is now)


def merge(windows: Sequence[Stall], join_s: float) -> list[Stall]:
    """Windows that overlap or lie less than ``join_s`` apart become one (pure)."""
    out: list[Stall] = []
    for w in sorted(windows, key=lambda w: w.start):
        if out and w.start <= out[-1].end + join_s:
            last = out[-1]
            out[-1] = Stall(last.start, max(last.end, w.end), max(last.slowest_s, w.slowest_s), last.ongoing or w.ongoing)
        else:
            out.append(w)
    return out


@dataclass(frozen=True, slots=True)
class Lost:
    """A rank lost for silence: how long, and how much of it was not counted (Redis was slow)."""

    silent_s: float
    excused_s: float

    def why(self) -> str:
        if self.excused_s <= 0.05:
            return f"no heartbeat for {self.silent_s:.1f} s"
        return (f"no heartbeat for {self.silent_s:.1f} s ({self.excused_s:.1f} s of it while Redis was slow or "
                f"unreachable, not counted)")


def lost_ranks(last_heard: Mapping[int, float], now: float, stalls: Sequence[Stall], deadline_s: float,
               grace_s: float) -> dict[int, Lost]:
    """The ranks among ``last_heard`` (rank -> time of its last heartbeat, the coordinator's clock) whose silence
    up to ``now``, less its overlap with the ``stalls`` (each extended by ``grace_s`` past its end), is longer than
    ``deadline_s``. Pure: the same observations give the same answer."""
    covers = merge([Stall(s.start, (now if s.ongoing else s.end) + grace_s, s.slowest_s) for s in stalls], 0.0)
    out: dict[int, Lost] = {}
    for rank, last in last_heard.items():
        silent = max(0.0, now - last)
        excused = sum(max(0.0, min(now, c.end) - max(last, c.start)) for c in covers)
        if silent - excused > deadline_s:
            out[rank] = Lost(silent, excused)
    return out


def stall_grace_s(cfg: "RedisConfig") -> float:
    """How long after a stall a live rank's heartbeat may still be on its way: a heartbeat period, plus a client's
    retry backoff."""
    return cfg.heartbeat_s + BACKOFF_CAP_S


class RoundTrips:
    """The coordinator's Redis round trips, as windows of slowness (thread-safe: every thread of the coordinator
    shares the client). ``slow_after_s``: a call taking longer is a stall (above the scheduling noise of a loaded
    machine; blocking reads report their block time, which is not counted). Windows older than ``keep_s`` go."""

    def __init__(self, slow_after_s: float, keep_s: float = 3600.0, clock: Callable[[], float] = time.monotonic):
        self.slow_after_s = slow_after_s
        self.keep_s = keep_s
        self.clock = clock
        self._lock = threading.Lock()
        self._done: list[Stall] = []
        self._inflight: dict[int, tuple[float, float]] = {}  # token -> (start, blocked_s)
        self._next = 0
        self._announced_to = float("-inf")  # stalls ending up to here were announced

    def begin(self, blocked_s: float = 0.0) -> int:
        """A call starts; ``blocked_s``: how long it may block on the server by design (a blocking read)."""
        with self._lock:
            self._next += 1
            self._inflight[self._next] = (self.clock(), max(0.0, blocked_s))
            return self._next

    def end(self, token: int, blocked_s: float | None = None) -> None:
        """The call ended; ``blocked_s``: how long it blocked by design after all (a blocking read that got data at
        once did not block: 0), else what :meth:`begin` was told."""
        now = self.clock()
        with self._lock:
            start, blocked = self._inflight.pop(token, (now, 0.0))
            took = now - start - (blocked if blocked_s is None else blocked_s)
            if took > self.slow_after_s:
                self._done.append(Stall(start, now, took))
            self._done = [s for s in self._done if s.end >= now - self.keep_s]

    def stalls(self) -> list[Stall]:
        """Every recorded stall, and the calls waiting longer than ``slow_after_s`` now (``ongoing``)."""
        now = self.clock()
        with self._lock:
            out = list(self._done)
            out += [Stall(t, now, now - t - b, ongoing=True) for t, b in self._inflight.values()
                    if now - t - b > self.slow_after_s]
        return out

    def pending(self, at_least_s: float = 0.0) -> bool:
        """Whether a stall (over or not) with a reply slower than ``at_least_s`` was not returned by
        :meth:`finished` yet."""
        return any(s.end > self._announced_to and s.slowest_s >= at_least_s for s in self.stalls())

    def finished(self, join_s: float, over_s: float, at_least_s: float = 0.0) -> list[Stall]:
        """Stalls with a reply slower than ``at_least_s`` (windows less than ``join_s`` apart are one: the retried
        calls of one stall), over for at least ``over_s``, and not returned before: each is returned once (its
        announcement). Shorter hiccups are left out first, so that a loaded machine's late replies never keep a
        stall from being over."""
        now = self.clock()
        merged = merge([s for s in self.stalls() if s.slowest_s >= at_least_s], join_s)
        with self._lock:
            out = [s for s in merged if not s.ongoing and s.end + over_s <= now and s.end > self._announced_to]
            if out:
                self._announced_to = max(s.end for s in out)
        return out
