"""Who sends a weight version to whom: the star (rank 0 to every receiver) or the relay (every rank that holds a
version forwards it to the next ranks that asked). Pure: no clock, no Redis, no randomness; the coordinator and the
simulator feed it the same events and get the same transfers.

Why a relay: in the star, rank 0's link carries a version once per rollout rank (1,688 x 16.4 GB at 4096 GPUs, ~550 s
per version on a 50 GB/s link: longer than a step). In the relay no link carries a version more than ``fanout``
times (rank 0's included) and it reaches n ranks in about ``fanout x log_fanout(n)`` transfer times.

The rule. A receiver's sender is planned the moment it asks, from the ranks that hold the version or will: a rank
counts as a holder as soon as its receive is planned, and forwards once it holds the whole version and checked it
(store and forward: a relay never passes on bytes it has not checked). That is all the coordinator knows (a fetch is
acknowledged when its receive starts, not when it ends), and it needs no round trip per transfer. The sender is the
holder nearest the origin (fewest relay hops: the versions spread as a tree of depth log_f(n), not a chain) that has
sent it to fewer than ``fanout`` receivers, then the one that sent fewest, then the lowest rank; when every holder
has sent its f (after losses), the nearest, least-used holder sends beyond f (no receiver waits forever). A relay
sends to its receivers one after another, in the order planned.

Why ``fanout`` 2 by default (``pipeline.weights_relay``): each link carries a version at most twice; f = 1 (a chain)
needs n transfer times and one lost rank cuts all after it; a larger f sends more copies per link for fewer hops
(the spread takes ~f x log_f(n) transfer times: 2 -> 2 log2 n, 3 -> 1.9 log2 n, 4 -> 2 log2 n), so 2 costs least per
link for about the best spread. Measured in the simulator (docs/simulator.md, "Weight delivery").

Faults and repeats: a lost rank is no holder; the receivers it was to send to (planned from it) are planned again
from another holder (:meth:`RelayPlan.lost` returns those transfers; their own receivers keep them as their sender);
a switching rank sends nothing new (its planned sends still go); a version asked again (a lost rank's groups handed
out again) is served by any holder. A receiver checks the checksum and the structure hash of what it got
(:mod:`dynaresize.comm.weights`) and refuses a wrong version; :meth:`RelayPlan.failed` plans it again.

``fanout=0`` is the star: the origin sends to every receiver (today's transport).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

# how a receive from a relay (not rank 0) names its sender (``CommFetch.source``): an install that fails on it says
# so, and the coordinator serves the version from another holder and sends the generate again (``relay_failed``)
RELAY_MARK = "relay "


@dataclass(frozen=True)
class Transfer:
    """``src`` sends version ``version`` to ``dst`` (point to point over the world group built at start-up)."""

    version: int
    src: int
    dst: int


@dataclass
class _Version:
    depth: dict[int, int] = field(default_factory=dict)  # holder (or planned to hold) -> relay hops from the origin
    sent: dict[int, int] = field(default_factory=dict)  # holder -> receivers planned from it
    src_of: dict[int, int] = field(default_factory=dict)  # receiver -> its planned sender
    sending: dict[int, bool] = field(default_factory=dict)  # holder -> may be planned as a sender
    waiting: list[int] = field(default_factory=list)  # asked before any rank held the version
    room: list[tuple[int, int, int]] = field(default_factory=list)  # heap of (depth, sent, rank) with sent < fan-out
    # (an entry whose sent or sending changed since is stale and skipped)


class RelayPlan:
    """The transfers of weight versions from ``origin`` (trainer rank 0) to the ranks that ask for them."""

    def __init__(self, origin: int = 0, fanout: int = 2):
        if fanout < 0:
            raise ValueError(f"relay fan-out {fanout} < 0 (0: the star)")
        self.origin, self.fanout = origin, fanout
        self.v: dict[int, _Version] = {}
        self.gone: set[int] = set()  # lost ranks: neither holder nor receiver until they join again

    # --- events -----------------------------------------------------------------------------------------------------
    def published(self, version: int) -> list[Transfer]:
        """The origin holds ``version`` (its optimizer step made it); receivers that asked before are planned."""
        st = self._st(version)
        if self.origin in st.depth:
            return []
        st.depth[self.origin], st.sent[self.origin], st.sending[self.origin] = 0, 0, True
        heapq.heappush(st.room, (0, 0, self.origin))
        waiting, st.waiting = st.waiting, []
        return [t for r in waiting for t in self.ask(r, version)]

    def ask(self, rank: int, version: int) -> list[Transfer]:
        """``rank`` asks for ``version``; a rank that holds it (or will) gets nothing new."""
        st = self._st(version)
        if rank in st.depth or rank in self.gone or rank in st.waiting:
            return []
        src = self._sender(st)
        if src is None:
            st.waiting.append(rank)
            return []
        return [self._plan(st, version, src, rank)]

    def again(self, rank: int, version: int) -> list[Transfer]:
        """``rank`` asks for ``version`` once more (it installed a newer one over it since): from any other holder,
        and it is no sender of it until then."""
        st = self._st(version)
        if rank == self.origin or rank in self.gone:
            return []
        self._drop(st, rank)
        # it held the whole version before: the ranks it fed are not waiting for it and may send it back
        src = self._sender(st, exclude=rank, below=False)
        if src is None:
            st.waiting.append(rank)
            return []
        return [self._plan(st, version, src, rank)]

    def failed(self, t: Transfer) -> list[Transfer]:
        """``t.dst`` refused what ``t.src`` sent (a wrong checksum or structure) or the send failed: planned again
        from another holder (not ``t.src``, unless it is the only one)."""
        st = self.v.get(t.version)
        if st is None or st.src_of.get(t.dst) != t.src:
            return []
        self._drop(st, t.dst)
        if t.dst in self.gone:
            return []
        src = self._sender(st, exclude=t.dst, avoid=t.src)
        if src is None:
            st.waiting.append(t.dst)
            return []
        return [self._plan(st, t.version, src, t.dst)]

    def lost(self, rank: int) -> list[Transfer]:
        """``rank`` is gone: no longer a holder or a receiver; the receivers planned from it are planned again from
        another holder (their own receivers keep them as their sender)."""
        self.gone.add(rank)
        out: list[Transfer] = []
        for version, st in sorted(self.v.items()):
            if rank in st.waiting:
                st.waiting.remove(rank)
            orphans = sorted(d for d, s in st.src_of.items() if s == rank)
            self._drop(st, rank)
            for d in orphans:
                src = self._sender(st, exclude=d)
                if src is None:  # nobody else holds it: asks again when it is published
                    del st.src_of[d]
                    continue
                out.append(self._plan(st, version, src, d, again=True))
        return out

    def leaves(self, rank: int) -> None:
        """``rank`` switches role (its buffers go): planned as a sender no more; the sends planned from it still go."""
        for st in self.v.values():
            if rank in st.sending and rank != self.origin:
                st.sending[rank] = False

    def joins(self, rank: int) -> None:
        """A lost rank's replacement (the same number) may hold and ask again."""
        self.gone.discard(rank)

    def retire(self, below: int) -> None:
        """Versions older than ``below`` are needed by no one: forgotten."""
        for version in [v for v in self.v if v < below]:
            del self.v[version]

    # --- queries ---------------------------------------------------------------------------------------------------
    def holds(self, rank: int, version: int) -> bool:
        st = self.v.get(version)
        return st is not None and rank in st.depth

    def holders(self, version: int) -> list[int]:
        st = self.v.get(version)
        return sorted(st.depth) if st else []

    def source(self, rank: int, version: int) -> int | None:
        st = self.v.get(version)
        return st.src_of.get(rank) if st else None

    # --- the rule --------------------------------------------------------------------------------------------------
    def _st(self, version: int) -> _Version:
        return self.v.setdefault(version, _Version())

    def _plan(self, st: _Version, version: int, src: int, dst: int, again: bool = False) -> Transfer:
        st.sent[src] += 1
        if st.sent[src] < self.fanout:
            heapq.heappush(st.room, (st.depth[src], st.sent[src], src))
        st.src_of[dst] = src
        if not again:
            st.depth[dst], st.sent[dst], st.sending[dst] = st.depth[src] + 1, 0, True
            heapq.heappush(st.room, (st.depth[dst], 0, dst))
        return Transfer(version, src, dst)

    def _drop(self, st: _Version, rank: int) -> None:
        for d in (st.depth, st.sent, st.sending):
            d.pop(rank, None)
        st.src_of.pop(rank, None)  # (its sender's count keeps the copy: it went over that link)

    def _sender(self, st: _Version, exclude: int | None = None, avoid: int | None = None, below: bool = True) -> int | None:
        """The holder that sends to the next receiver (``exclude``: that receiver, whose own receivers cannot send to
        it; ``avoid``: a sender it refused, taken only when no other holder is left)."""
        if self.fanout == 0:  # the star: the origin, to everyone
            return self.origin if st.sending.get(self.origin) else None
        aside, pick = [], None
        while st.room:  # the nearest holder with room: the heap's first entry still true
            d, n, r = st.room[0]
            if not st.sending.get(r) or st.sent.get(r) != n or st.depth.get(r) != d:
                heapq.heappop(st.room)  # stale
            elif r in (exclude, avoid) or (below and self._below(st, r, exclude)):
                aside.append(heapq.heappop(st.room))
            else:
                pick = r
                break
        for e in aside:
            heapq.heappush(st.room, e)
        if pick is not None:
            return pick
        # every holder sent its f (or those left are the excluded ones): the nearest, least-used beyond f
        cands = [r for r, ok in st.sending.items() if ok and r != exclude and not (below and self._below(st, r, exclude))]
        others = [r for r in cands if r != avoid] or cands
        return min(others, key=lambda r: (st.depth[r], st.sent[r], r)) if others else None

    @staticmethod
    def _below(st: _Version, r: int, top: int | None) -> bool:
        """``r`` receives the version through ``top`` (it cannot send it to ``top``)."""
        seen = set()
        while top is not None and r in st.src_of and r not in seen:
            seen.add(r)
            r = st.src_of[r]
            if r == top:
                return True
        return False
