"""Who sends a weight version to whom: the star (rank 0 to every receiver) or the relay (every rank that holds a
version forwards it to the next ranks that asked). Pure: no clock, no Redis, no randomness; the coordinator and the
simulator feed it the same events and get the same transfers.

Why a relay: in the star, rank 0's link carries a version once per rollout rank (1,688 x 16.4 GB at 4096 GPUs, ~550 s
per version on a 50 GB/s link: longer than a step). In the relay a version's holders grow as it spreads, so no link
carries it more than ``fanout`` times (rank 0 included) and the spread takes about log(receivers) transfer times.

The rule (``fanout`` f >= 1): a receiver that asked waits until a holder is free; a holder sends to ONE receiver at
a time (a store-and-forward relay spreads fastest when each sender's whole link goes to one transfer: the receiver
starts forwarding sooner) and to at most f receivers per version. Among free holders the plan prefers ranks other
than the origin (rank 0 trains; a rollout rank forwards from its second buffer while it decodes), then the one that
served fewest, then the lowest rank. Why f = 2 by default: with one transfer at a time per sender the holders grow
per transfer time by a factor ~1.62 (f=2), ~1.84 (f=3) or 2 (unbounded, where rank 0 sends log2(n) times);
f = 2 keeps every rank's link at two copies per version at 1.4x the unbounded tree's spread time (simulated:
docs/simulator.md, "Weight delivery"), and a lost relay leaves at most two receivers to re-plan.

Faults and repeats: a lost rank's receivers go back to the queue and are served by another holder; a switching rank
stops being a holder (its transfers on their way finish); a version asked again (a lost rank's groups handed out
again) is served by any holder; when every holder has served its f and none is busy, the least-served holder sends
beyond f (no receiver waits forever). A receiver that got a version refuses it when the checksum or the structure
hash does not match (:mod:`dynaresize.comm.weights`); the caller reports that as a failed transfer and the receiver
is planned again.

``fanout=0`` is the star: the origin sends to every receiver, all at once (today's transport).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Transfer:
    """``src`` sends version ``version`` to ``dst`` (point to point over the world group built at start-up)."""

    version: int
    src: int
    dst: int


@dataclass
class _Version:
    holders: dict[int, int] = field(default_factory=dict)  # rank -> receivers it was given (this version)
    busy: dict[int, set[int]] = field(default_factory=dict)  # sender -> receivers on their way from it
    src_of: dict[int, int] = field(default_factory=dict)  # receiver on its way -> its sender
    waiting: list[int] = field(default_factory=list)  # asked, not planned yet (in order of asking)


class RelayPlan:
    """The transfers of weight versions from ``origin`` (trainer rank 0) to the ranks that ask for them."""

    def __init__(self, origin: int = 0, fanout: int = 2):
        if fanout < 0:
            raise ValueError(f"relay fan-out {fanout} < 0 (0: the star)")
        self.origin, self.fanout = origin, fanout
        self.v: dict[int, _Version] = {}
        self.gone: set[int] = set()  # lost ranks: never a holder again

    # --- events -----------------------------------------------------------------------------------------------------
    def published(self, version: int) -> list[Transfer]:
        """The origin holds ``version`` (its optimizer step made it)."""
        st = self._st(version)
        st.holders.setdefault(self.origin, 0)
        return self._plan(version)

    def ask(self, rank: int, version: int) -> list[Transfer]:
        """``rank`` asks for ``version`` (again, if it was lost on its way: any holder serves it)."""
        st = self._st(version)
        if rank in st.holders or rank in st.src_of or rank in st.waiting or rank in self.gone:
            return []
        st.waiting.append(rank)
        return self._plan(version)

    def done(self, t: Transfer, ok: bool = True) -> list[Transfer]:
        """A transfer ended: ``ok``, its receiver holds the version (and forwards it); not ok (the receiver refused
        the bytes, or the send failed), the receiver is planned again from another holder."""
        st = self.v.get(t.version)
        if st is None or st.src_of.get(t.dst) != t.src:
            return []
        self._unbusy(st, t.src, t.dst)
        if ok:
            st.holders.setdefault(t.dst, 0)
        elif t.dst not in self.gone:
            st.waiting.insert(0, t.dst)
        return self._plan(t.version)

    def lost(self, rank: int) -> list[Transfer]:
        """``rank`` is gone: no longer a holder or a receiver; the receivers it was sending to are planned again."""
        self.gone.add(rank)
        out: list[Transfer] = []
        for version, st in self.v.items():
            st.holders.pop(rank, None)
            if rank in st.waiting:
                st.waiting.remove(rank)
            if rank in st.src_of:  # it was receiving: its sender is free
                self._unbusy(st, st.src_of[rank], rank)
            for dst in sorted(st.busy.pop(rank, set())):  # it was sending: those receivers go first
                del st.src_of[dst]
                st.waiting.insert(0, dst)
            out += self._plan(version)
        return out

    def leaves(self, rank: int) -> list[Transfer]:
        """``rank`` switches role (its buffers go): no new transfer from it; those on their way finish."""
        for st in self.v.values():
            if rank != self.origin:
                st.holders.pop(rank, None)
        return []

    def joins(self, rank: int) -> None:
        """A lost rank's replacement (same number) may hold and ask again."""
        self.gone.discard(rank)

    def retire(self, below: int) -> None:
        """Versions older than ``below`` are needed by no one: forgotten."""
        for version in [v for v in self.v if v < below]:
            del self.v[version]

    # --- queries ---------------------------------------------------------------------------------------------------
    def holds(self, rank: int, version: int) -> bool:
        st = self.v.get(version)
        return st is not None and rank in st.holders

    def holders(self, version: int) -> list[int]:
        st = self.v.get(version)
        return sorted(st.holders) if st else []

    def in_flight(self, version: int) -> list[Transfer]:
        st = self.v.get(version)
        return [Transfer(version, s, d) for d, s in sorted(st.src_of.items())] if st else []

    # --- the rule --------------------------------------------------------------------------------------------------
    def _st(self, version: int) -> _Version:
        return self.v.setdefault(version, _Version())

    def _unbusy(self, st: _Version, src: int, dst: int) -> None:
        del st.src_of[dst]
        left = st.busy.get(src)
        if left is not None:
            left.discard(dst)
            if not left:
                del st.busy[src]

    def _plan(self, version: int) -> list[Transfer]:
        st = self.v[version]
        out: list[Transfer] = []
        while st.waiting and st.holders:
            src = self._sender(st)
            if src is None:
                break
            dst = st.waiting.pop(0)
            st.holders[src] += 1
            st.busy.setdefault(src, set()).add(dst)
            st.src_of[dst] = src
            out.append(Transfer(version, src, dst))
        return out

    def _sender(self, st: _Version) -> int | None:
        if self.fanout == 0:  # the star: the origin, to everyone at once
            return self.origin if self.origin in st.holders else None
        free = [r for r, n in st.holders.items() if r not in st.busy]
        capped = [r for r in free if st.holders[r] < self.fanout]
        if not capped and not st.busy:  # every holder served its f and none is sending: go beyond f
            capped = free
        if not capped:
            return None
        return min(capped, key=lambda r: (r == self.origin, st.holders[r], r))
