"""Per-atom views of a run: each atom's busy time as a union of intervals, and its role over time.

Why a separate module: the metrics, the timeline and the trace all need "what was this group of ranks doing,
and in which role, at time t". Busy time is the UNION of all intervals that touch the atom (stages and switch
operations; a background operation overlapping a training stage is not counted twice). Roles come from
``topology`` events (the first one also covers the time before it), ``run_start``'s optional initial split and
``role_change`` events; a log without any of them gets roles inferred from each atom's dominant stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynaresize.analysis.atoms import Atom, build_atoms
from dynaresize.analysis.reader import RANK_ROLES, RunData
from dynaresize.events import Role, count_ranks

ROLE_TRAIN, ROLE_ROLLOUT, ROLE_IDLE = RANK_ROLES.index(Role.TRAIN.value), RANK_ROLES.index(Role.ROLLOUT.value), RANK_ROLES.index(Role.IDLE.value)


@dataclass
class AtomView:
    atom: Atom
    busy_start: np.ndarray  # disjoint sorted union of busy intervals
    busy_end: np.ndarray
    roles: list[tuple[float, float, int]]  # (start, end, role index into RANK_ROLES) covering the span
    _xs: np.ndarray | None = None
    _ys: np.ndarray | None = None

    def busy_before(self, t: np.ndarray) -> np.ndarray:
        """Busy seconds of one rank of this atom in ``(-inf, t]`` (piecewise linear, exact)."""
        if self._xs is None:
            xs = np.empty(2 * len(self.busy_start))
            xs[0::2], xs[1::2] = self.busy_start, self.busy_end
            dur = self.busy_end - self.busy_start
            cum = np.concatenate(([0.0], np.cumsum(dur)))
            ys = np.empty_like(xs)
            ys[0::2], ys[1::2] = cum[:-1], cum[1:]
            self._xs, self._ys = xs, ys
        if len(self._xs) == 0:
            return np.zeros_like(t, dtype=float)
        return np.interp(t, self._xs, self._ys, left=0.0, right=float(self._ys[-1]))


@dataclass
class Views:
    rd: RunData
    span_start: float
    span_end: float
    atoms: list[Atom]
    member: np.ndarray  # [atom, rankset]
    views: list[AtomView]
    rs_count: np.ndarray  # ranks per rank set
    starts: np.ndarray
    ends: np.ndarray
    rs: np.ndarray
    kind: np.ndarray
    critical: np.ndarray
    split_changes: list[tuple[float, int, int, int]]  # (t, n_train, n_rollout, n_idle)
    roles_inferred: bool

    @property
    def span_s(self) -> float:
        return max(self.span_end - self.span_start, 0.0)

    def split_at(self, t: float) -> tuple[int, int, int]:
        cur = self.split_changes[0][1:] if self.split_changes else (0, 0, 0)
        for tc, a, b, c in self.split_changes:
            if tc > t:
                break
            cur = (a, b, c)
        return cur


def fold_atoms(atoms: list[Atom], max_groups: int) -> list[tuple[int, str]]:
    """At most ``max_groups`` (atom index shown, label), in rank order. Beyond the limit, neighbouring atoms are
    folded (only as many as needed) and the fold shows its largest member, which its label names."""
    order = sorted(range(len(atoms)), key=lambda i: atoms[i].first)
    out = []
    for chunk in np.array_split(np.array(order, dtype=np.int64), min(max(max_groups, 1), max(len(order), 1))):
        chunk = [int(i) for i in chunk]
        if not chunk:
            continue
        if len(chunk) == 1:
            i = chunk[0]
            out.append((i, f"{atoms[i].label()} (x{atoms[i].size})"))
            continue
        rep = max(chunk, key=lambda i: atoms[i].size)
        lo = min(atoms[i].first for i in chunk)
        hi = max(b for i in chunk for _, b in atoms[i].blocks)
        n = sum(atoms[i].size for i in chunk)
        out.append((rep, f"{lo}-{hi} (x{n}, {len(chunk)} groups; shows {atoms[rep].label(12)})"))
    return out


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted union of intervals (touching intervals merge; empty ones vanish)."""
    keep = ends > starts
    s, e = starts[keep], ends[keep]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_max = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_max[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def span_of(rd: RunData, starts: np.ndarray, ends: np.ndarray) -> tuple[float, float]:
    """The analysed span: from the earliest step start or busy interval to the latest step end or interval end."""
    lo = [float(starts.min())] if len(starts) else []
    hi = [float(ends.max())] if len(ends) else []
    lo += [s.start for s in rd.steps.values() if not math.isnan(s.start)]
    hi += [s.end for s in rd.steps.values() if not math.isnan(s.end)]
    if not lo or not hi:
        return 0.0, 0.0
    return min(lo), max(max(hi), min(lo))


def build_views(rd: RunData) -> Views:
    starts = np.frombuffer(rd.iv_start, dtype=np.float64) if rd.n_intervals else np.zeros(0)
    ends = np.frombuffer(rd.iv_end, dtype=np.float64) if rd.n_intervals else np.zeros(0)
    rs = np.frombuffer(rd.iv_rs, dtype=np.int32) if rd.n_intervals else np.zeros(0, dtype=np.int32)
    kind = np.frombuffer(rd.iv_kind, dtype=np.int32) if rd.n_intervals else np.zeros(0, dtype=np.int32)
    critical = np.frombuffer(rd.iv_critical, dtype=np.int8).astype(bool) if rd.n_intervals else np.zeros(0, bool)
    t0, t1 = span_of(rd, starts, ends)
    atoms, member = build_atoms(rd.ranksets, rd.world_size)
    rs_count = np.array([count_ranks(s) for s in rd.ranksets], dtype=np.int64)
    role_tracks, changes, inferred = _roles(rd, atoms, member, t0, t1, starts, ends, rs, kind)
    views = []
    for i, atom in enumerate(atoms):
        m = member[i][rs] if len(rs) else np.zeros(0, bool)
        us, ue = union(starts[m], ends[m])
        views.append(AtomView(atom, us, ue, role_tracks[i]))
    return Views(rd, t0, t1, atoms, member, views, rs_count, starts, ends, rs, kind, critical, changes, inferred)


def _roles(rd, atoms, member, t0, t1, starts, ends, rs, kind):
    n = len(atoms)
    assigns = sorted(rd.roles, key=lambda a: a[0])  # stable: log order among equal times
    inferred = False
    if not assigns:  # no topology at all: each atom's dominant stage (rollout vs train) names its role
        inferred = True
        cur = np.full(n, ROLE_IDLE)
        kr, kt = rd.kinds.index(Role.ROLLOUT.value), rd.kinds.index(Role.TRAIN.value)
        for i in range(n):
            m = member[i][rs] if len(rs) else np.zeros(0, bool)
            d = (ends - starts)[m]
            k = kind[m]
            r, t = d[k == kr].sum(), d[k == kt].sum()
            if r or t:
                cur[i] = ROLE_ROLLOUT if r > t else ROLE_TRAIN
        tracks = [[(t0, t1, int(cur[i]))] for i in range(n)]
        return tracks, [(t0, *_counts(atoms, cur))], inferred
    cur = np.full(n, ROLE_IDLE)
    tracks: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]
    seg_start = np.full(n, t0)
    changes: list[tuple[float, int, int, int]] = []
    first = True
    for t, _step, what, a, b in assigns:
        new = cur.copy()
        if what == "topology":
            new[:] = ROLE_IDLE
            new[member[:, b]] = ROLE_ROLLOUT
            new[member[:, a]] = ROLE_TRAIN
        else:
            new[member[:, a]] = b
        tt = t0 if first else min(max(t, t0), t1)
        first = False
        for i in np.flatnonzero(new != cur):
            if tt > seg_start[i]:
                tracks[i].append((float(seg_start[i]), tt, int(cur[i])))
            seg_start[i] = tt
        cur = new
        if changes and changes[-1][0] == tt:
            changes[-1] = (tt, *_counts(atoms, cur))
        else:
            changes.append((tt, *_counts(atoms, cur)))
    for i in range(n):
        if t1 > seg_start[i] or not tracks[i]:
            tracks[i].append((float(seg_start[i]), t1, int(cur[i])))
    return tracks, changes, inferred


def _counts(atoms: list[Atom], roles: np.ndarray) -> tuple[int, int, int]:
    sizes = np.array([a.size for a in atoms], dtype=np.int64)
    return (int(sizes[roles == ROLE_TRAIN].sum()), int(sizes[roles == ROLE_ROLLOUT].sum()), int(sizes[roles == ROLE_IDLE].sum()))
