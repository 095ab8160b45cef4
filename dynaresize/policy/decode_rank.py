"""One rollout GPU under continuous batching: the decode model the sample-level simulator runs per GPU
(:mod:`dynaresize.sim.samples`) and the resize policy's pipeline predictor plays forward
(:mod:`dynaresize.policy.pipeline_predictor`). A decode iteration of a GPU holding ``a`` sequences costs
``iteration_s + sum of their per-iteration costs``; KV slots cap ``a``; an admission's prefill stalls the GPU.

Pure: no clock, no randomness (the same admissions give the same plan, mark for mark).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate, chain, repeat
from operator import add, floordiv, mul, sub

_EPS = 1e-9


def _segment_costs(w: float, us: list[float]) -> list[float]:
    """Seconds per iteration of each segment of a plan: ``w`` + the per-iteration costs of the sequences still
    active in it (the suffix sums of ``us``, summed from the end). Never modified once made (plans share them)."""
    acc = list(accumulate(reversed(us)))
    acc.reverse()
    return list(map(add, repeat(w), acc))  # w + a for each


_SAME_U_COSTS: dict[tuple[float, float, int], list[float]] = {}  # (w, u, sequences) -> _segment_costs(w, [u] * n)


class DecodeRank:
    """One rollout GPU under continuous batching.

    Plain Python lists, not numpy: a rank holds a few dozen sequences, where numpy's per-call overhead costs more
    than the arithmetic (at 4096 GPUs the simulator makes about three rank events per GPU and step). Each
    admission re-plans the rank's decoding from then on, if nothing new is admitted: the active sequences sorted by
    the tokens they still have to decode (ties in admission order), the cost of each iteration segment between two
    completions (``w`` + the per-iteration cost of the sequences still active), and the completion time of each
    sequence and group. Sequences that ended are dropped by moving ``head`` past them (they are a prefix of the
    plan).
    """

    def __init__(self, rank: int, w: float):
        self.rank, self.w = rank, w
        self.gkey: dict[int, tuple[int, int]] = {}  # local group id -> (batch, group)
        self.next_gid = 0
        self.next_seq = 0  # admission number of the next sequence (the sort's tie-break)
        self.slots = 1
        self.token = 0
        self.t_valid = 0.0
        self.planned = False  # a plan exists (set by the first admission)
        self.t0 = 0.0  # the plan's start (after the prefill pause)
        # the plan, one entry per sequence in plan order, in parallel lists (no tuple per sequence): tokens left at
        # t0, admission number, per-iteration cost u, local group id. A drained rank's admission keeps only its sort
        # order (``fresh``: order, first admission number, first group id, group size; ``an``, ``us``, ``gs`` None):
        # the other three lists are made only if the rank admits more before it drains (``_ids``)
        self.rs: list[float] = []
        self.an: list[int] | None = []
        self.us: list[float] | None = []
        self.gs: list[int] | None = []
        self.fresh: tuple[list[int], int, int, int] | None = None
        self.u_same: float | None = None  # the u every planned sequence has, if they all have the same (else None)
        self.t_marks: list[float] = []  # completion time of each planned sequence (non-decreasing)
        self.cost: list[float] = []  # seconds per iteration in the segment that ends at each mark
        self.head = 0  # planned sequences before it have ended
        self.groups: list[tuple[float, int]] = []  # (completion time, local group id), sorted
        self.gptr = 0

    @property
    def active(self) -> int:
        return len(self.rs) - self.head

    def advance(self, t: float) -> None:
        """Drop the sequences that ended by ``t``."""
        if self.planned:  # the marks do not decrease: the first one after t (+ _EPS) from head on
            self.head = bisect_right(self.t_marks, t + _EPS, self.head)
        if t > self.t_valid:
            self.t_valid = t

    def _done_iterations(self, t: float) -> float:
        """Iterations decoded between the plan's start and ``t``."""
        marks = self.t_marks
        i = bisect_right(marks, t)
        if i >= len(marks):
            return self.rs[-1]
        if i == 0:
            return (t - self.t0) / self.cost[0]
        return self.rs[i - 1] + (t - marks[i - 1]) / self.cost[i]

    def admit(self, t: float, lengths: list[float], u: float, keys: list[tuple[int, int]], group_size: int,
              pause: float, sizes: list[int] | None = None) -> None:
        """Sequences of the groups ``keys`` (``group_size`` consecutive lengths each, or ``sizes[i]`` for the i-th
        group: groups whose other sequences ended elsewhere) start at ``t + pause``; the prefill pause stalls the
        sequences already decoding too."""
        self.advance(t)
        # groups whose last sequence ended by ``t`` but not reported yet (their rank event comes later at this same
        # instant, after this admission): they keep their completion time; a new plan would have lost them (the
        # simulator then stalled with the group in flight for ever: a 7:1 barrier run of bench_emulated)
        ended = [g for g in self.groups[self.gptr:] if g[0] <= t + _EPS]
        gid, n, m, k = self.next_gid, self.next_seq, len(lengths), len(keys)
        self.gkey.update(zip(range(gid, gid + k), keys))
        self.next_gid += k
        self.next_seq += m
        head = self.head
        if head == len(self.rs) and m and m == k * group_size and sizes is None:
            self._plan_fresh(t, pause, lengths, u, n, gid, group_size, ended)
            return
        # sequences still decoding: their tokens left at t, then the new ones, all sorted by (tokens left, admission
        # number) as tuples (the order the plan is defined by)
        rs = self.rs[head:]
        if rs and t > self.t0:
            d = self._done_iterations(t)
            rs = list(map(max, map(sub, rs, repeat(d)), repeat(_EPS)))  # each max(r - d, _EPS), the loop in C
        rs += lengths
        an, us, gs = self._ids()
        an = an[head:]
        an += range(n, n + m)
        us = us[head:]
        us += repeat(u, m)
        gs = gs[head:]
        gs += chain.from_iterable(map(repeat, range(gid, gid + k), repeat(group_size, k) if sizes is None else sizes))
        seqs = sorted(zip(rs, an, us, gs))  # (the admission numbers are unique: us and gs never compared)
        rs, an, us, gs = map(list, zip(*seqs)) if seqs else ([], [], [], [])
        self._plan(t, pause, rs, an, us, gs, u if self.u_same == u else None, ended)

    def _ids(self) -> tuple[list[int], list[float], list[int]]:
        """The plan's admission numbers, per-iteration costs and group ids (made from ``fresh`` if need be)."""
        if self.an is None:
            order, n, gid, group_size = self.fresh
            self.an = list(map(add, repeat(n), order))  # the i-th new sequence's admission number is n + i
            self.us = [self.u_same] * len(order)
            self.gs = list(map(add, repeat(gid), map(floordiv, order, repeat(group_size))))  # and its group gid + i // G
            self.fresh = None
        return self.an, self.us, self.gs

    def _plan_fresh(self, t: float, pause: float, lengths: list[float], u: float, n: int, gid: int, group_size: int,
                    ended: list[tuple[float, int]]) -> None:
        """``_plan`` of a drained rank's admission (most admissions: its next groups), without its tuples: the new
        sequences sorted by length, ties in admission order (a stable sort of their indices: the admission numbers
        are n + index); a group ends at the mark of its longest sequence (sequences with the same tokens left end at
        the same mark: the segment between them adds 0.0)."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        rs = list(map(lengths.__getitem__, order))
        marks = self._marks(t + pause, rs, u, None)
        ends = [marks[bisect_left(rs, max(lengths[i:i + group_size]))] for i in range(0, len(lengths), group_size)]
        self.rs, self.an, self.us, self.gs, self.fresh, self.u_same = rs, None, None, None, (order, n, gid, group_size), u
        self._planned(t, marks, sorted(zip(ends, range(gid, gid + len(ends)))), ended)

    def _plan(self, t: float, pause: float, rs: list[float], an: list[int], us: list[float], gs: list[int],
              u_same: float | None, ended: list[tuple[float, int]]) -> None:
        """The plan of the sequences ``rs, an, us, gs`` (sorted) from ``t + pause``; ``u_same``: the u every one of
        them has, if they all have the same (else None)."""
        self.head, self.gptr = 0, 0
        if not rs:
            self.planned, self.rs, self.an, self.us, self.gs, self.u_same = False, [], [], [], [], None
            self.t_marks, self.cost, self.groups = [], [], list(ended)
            return
        marks = self._marks(t + pause, rs, u_same, us)
        gend = dict(zip(gs, marks))  # the last sequence of a group in completion order
        self.rs, self.an, self.us, self.gs, self.u_same = rs, an, us, gs, u_same
        self._planned(t, marks, sorted(zip(gend.values(), gend.keys())), ended)

    def _marks(self, t0: float, rs: list[float], u_same: float | None, us: list[float] | None) -> list[float]:
        """The completion marks of the sequences ``rs`` (sorted) from ``t0``; sets the segments' costs. The same
        floating-point operations, in the same order, as the plain loops they replace: the cost of each segment is w +
        the per-iteration costs of the sequences still active, summed from the end; a sequence's completion is t0 +
        the running sum of (tokens left - the previous one's) x its segment's cost."""
        if u_same is None:
            cost = _segment_costs(self.w, us)
        else:  # the same sums for every rank decoding n sequences of one batch: computed once
            key = (self.w, u_same, len(rs))
            cost = _SAME_U_COSTS.get(key)
            if cost is None:
                if len(_SAME_U_COSTS) >= 4096:
                    _SAME_U_COSTS.clear()
                cost = _SAME_U_COSTS[key] = _segment_costs(self.w, [u_same] * len(rs))
        self.t0, self.cost = t0, cost
        return list(map(add, repeat(t0), accumulate(map(mul, map(sub, rs, chain((0.0,), rs)), cost))))  # t0 + a each

    def _planned(self, t: float, marks: list[float], groups: list[tuple[float, int]],
                 ended: list[tuple[float, int]]) -> None:
        self.head, self.gptr, self.planned, self.t_marks, self.groups = 0, 0, True, marks, groups
        if ended:
            groups[:0] = ended  # (ended by t: before every group of the new plan, which ends after t)
        self.t_valid = t

    def next_group_time(self) -> float:
        return self.groups[self.gptr][0] if self.gptr < len(self.groups) else math.inf

    def pop_groups(self, t: float) -> list[tuple[int, int]]:
        """Groups whose last response ended by ``t``."""
        out = []
        groups, lim = self.groups, t + _EPS
        while self.gptr < len(groups) and groups[self.gptr][0] <= lim:
            out.append(self.gkey.pop(groups[self.gptr][1]))
            self.gptr += 1
        return out

    def claim_time(self, claim: int) -> float:
        """When the free slots reach ``claim`` sequences (or the rank drains)."""
        free = self.slots - self.active
        if free >= claim or not self.planned:
            return self.t_valid
        k = min(claim - free, self.active) - 1  # (with fewer sequences than that left: when it drains)
        return self.t_marks[self.head + k] if k >= 0 else self.t_valid

    def drain_time(self) -> float:
        return self.t_marks[-1] if self.planned else self.t_valid
