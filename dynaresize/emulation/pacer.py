"""The emulation's clock side: a piece of real compute lasts its modelled wall time, or is recorded as an overrun.

``with pacer.span(kind, modelled_s): <real compute>`` sleeps the rest of ``modelled_s`` after the block when the real
compute was shorter; when it was longer than ``modelled_s x (1 + tolerance) + GRACE_S`` the span is an overrun (the emulation
is not faithful there), counted per kind with the worst one (its real and modelled seconds) and the seconds beyond the model.
``finish(kind, start, modelled_s)`` is the same for a span whose start was taken earlier (``time.perf_counter``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

GRACE_S = 5e-4  # an overrun must exceed the tolerance by this much too: a span modelled at ~0 s (an op the profile
# prices at microseconds) is not an overrun for the microseconds any Python call takes


@dataclass
class KindStats:
    spans: int = 0
    modelled_s: float = 0.0
    overruns: int = 0
    worst_real_s: float = 0.0  # the overrun that exceeded its model most: its real seconds ...
    worst_modelled_s: float = 0.0  # ... and its modelled seconds
    overrun_s: float = 0.0  # real - modelled, summed over the overruns

    def to_json(self) -> dict[str, Any]:
        return {"spans": self.spans, "modelled_s": round(self.modelled_s, 6), "overruns": self.overruns,
                "worst_real_s": round(self.worst_real_s, 6),
                "worst_modelled_s": round(self.worst_modelled_s, 6), "overrun_s": round(self.overrun_s, 6)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "KindStats":
        return cls(int(d["spans"]), float(d["modelled_s"]), int(d["overruns"]), float(d["worst_real_s"]),
                   float(d["worst_modelled_s"]), float(d["overrun_s"]))

    def worse(self, real_s: float, modelled_s: float) -> None:
        """Keep (real_s, modelled_s) as the worst overrun when it exceeded its model by more than the worst so far."""
        if real_s - modelled_s > self.worst_real_s - self.worst_modelled_s:
            self.worst_real_s, self.worst_modelled_s = real_s, modelled_s

    def add(self, other: "KindStats") -> None:
        """Another record of the same kind (another rank's) merged into this one."""
        self.spans += other.spans
        self.modelled_s += other.modelled_s
        self.overruns += other.overruns
        self.overrun_s += other.overrun_s
        self.worse(other.worst_real_s, other.worst_modelled_s)


class Pacer:
    def __init__(self, tolerance: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if tolerance < 0:
            raise ValueError(f"overrun tolerance must be >= 0, got {tolerance}")
        self.tolerance, self.clock, self.sleep = tolerance, clock, sleep
        self.kinds: dict[str, KindStats] = {}

    @contextmanager
    def span(self, kind: str, modelled_s: float) -> Iterator[None]:
        start = self.clock()
        yield
        self.finish(kind, start, modelled_s)

    def finish(self, kind: str, start: float, modelled_s: float) -> float:
        """End a span begun at ``start``: wait until ``start + modelled_s`` or record the overrun; returns the end."""
        return self.settle(kind, start, self.clock() - start, modelled_s)

    def settle(self, kind: str, start: float, real_s: float, modelled_s: float) -> float:
        """A span begun at ``start`` whose real work took ``real_s`` (work done elsewhere, e.g. a background read):
        wait until ``start + modelled_s``, and record an overrun when ``real_s`` exceeded the model; returns the end."""
        if modelled_s < 0:
            raise ValueError(f"modelled duration of {kind!r} is negative ({modelled_s})")
        st = self.kinds.setdefault(kind, KindStats())
        st.spans += 1
        st.modelled_s += modelled_s
        if real_s > modelled_s * (1.0 + self.tolerance) + GRACE_S:
            st.overruns += 1
            st.worse(real_s, modelled_s)
            st.overrun_s += real_s - modelled_s
        now = self.clock()
        if now < start + modelled_s:
            self.sleep(start + modelled_s - now)
            return self.clock()
        return now

    @property
    def overruns(self) -> int:
        return sum(s.overruns for s in self.kinds.values())

    def to_json(self) -> dict[str, Any]:
        return {k: s.to_json() for k, s in sorted(self.kinds.items())}


def merge(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The run's ``emulation`` summary from each rank's :meth:`Pacer.to_json`: faithful when no span overran."""
    kinds: dict[str, KindStats] = {}
    for rec in per_rank:
        for kind, s in rec.items():
            kinds.setdefault(kind, KindStats()).add(KindStats.from_json(s))
    by_kind = {k: st.to_json() for k, st in kinds.items()}
    total = sum(st.overruns for st in kinds.values())
    return {"faithful": total == 0, "overruns": total, "overrun_s": round(sum(st.overrun_s for st in kinds.values()), 6),
            "ranks": len(per_rank), "by_kind": by_kind}
