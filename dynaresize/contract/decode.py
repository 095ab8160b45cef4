"""A rollout rank's decode iterations, as the sums a least-squares fit of its iteration cost needs.

A rank in the barrier-free schedule times each iteration of its engine's stream (the engine's step, and scoring and
completing the samples that ended in it) and counts the sequences the iteration decoded (``a``) and those it admitted
(``m``: their prefill). Each generate ack carries the sums since the rank's previous one (:class:`DecodeSums`,
``GenerateResult.decode``); the coordinator adds a batch's acks and fits

    iteration seconds = iteration_s + a * seq_iteration_s + m * prefill_s_per_seq

(:func:`fit_decode`, least squares with every coefficient >= 0): the decode model the pipeline predictor plays
(``PipelineWorkload``), measured on the engine the run uses instead of configured. The same model as the simulator's
(``iteration_fixed_s`` + the active sequences' per-iteration cost, a prefill that stalls the GPU), with one
per-sequence cost for the batch (the simulator's is the batch's mean context's too).

Nothing here is pickled: the sums travel as a JSON object of nine finite numbers, checked by
:meth:`DecodeSums.from_wire` (a bad one raises :class:`ValueError` naming the key and the value).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import astuple, dataclass, fields
from typing import Any

MIN_ITERATIONS = 8  # fewer timed iterations in a batch: no fit (its period is not predicted from it)


@dataclass
class DecodeSums:
    """Sums over timed decode iterations: count, sequences decoded ``a``, sequences admitted ``m``, seconds ``t``
    and their products (the normal equations of the fit and its residual)."""

    n: float = 0.0
    a: float = 0.0
    m: float = 0.0
    t: float = 0.0
    aa: float = 0.0
    am: float = 0.0
    mm: float = 0.0
    at: float = 0.0
    mt: float = 0.0
    tt: float = 0.0

    def add(self, a: int, m: int, seconds: float) -> None:
        """One iteration that decoded ``a`` sequences, admitted ``m`` of them, in ``seconds``."""
        self.n += 1
        self.a += a
        self.m += m
        self.t += seconds
        self.aa += a * a
        self.am += a * m
        self.mm += m * m
        self.at += a * seconds
        self.mt += m * seconds
        self.tt += seconds * seconds

    def merge(self, other: "DecodeSums") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_wire(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, d: Any) -> "DecodeSums":
        """The sums a rank sent (``GenerateResult.decode``); ValueError naming what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"decode sums must be an object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"decode sums: unknown key(s) {unknown[:5]}")
        vals = {}
        for k in names:
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"decode sums: {k} must be a finite number >= 0, got {str(v)[:40]!r}")
            vals[k] = float(v)
        return cls(**vals)


@dataclass(frozen=True)
class DecodeFit:
    """The fitted iteration cost (seconds) and how many iterations it rests on."""

    iteration_s: float
    seq_iteration_s: float
    prefill_s_per_seq: float
    iterations: int

    def predict(self, a: float, m: float = 0.0) -> float:
        return self.iteration_s + a * self.seq_iteration_s + m * self.prefill_s_per_seq


def _solve(mat: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (at most 3 x 3); None when singular."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(mat)]
    scale = max((abs(x) for row in mat for x in row), default=0.0)
    if scale <= 0:
        return None
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-12 * scale:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for k in range(c, n + 1):
                a[r][k] -= f * a[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def fit_decode(s: DecodeSums, min_iterations: int = MIN_ITERATIONS) -> DecodeFit | None:
    """Least squares of ``seconds ~ iteration_s + a seq_iteration_s + m prefill_s_per_seq`` with every coefficient
    >= 0: the least residual over the subsets of the three terms whose own fit is non-negative (with three terms that
    is the non-negative least squares solution). None with fewer than ``min_iterations`` iterations or no fit."""
    if s.n < min_iterations or s.t <= 0:
        return None
    n, a, m, t, aa, am, mm, at, mt, tt = astuple(s)
    gram = {(0, 0): n, (0, 1): a, (0, 2): m, (1, 1): aa, (1, 2): am, (2, 2): mm}
    xty = (t, at, mt)
    best: tuple[float, list[float]] | None = None
    for k in (3, 2, 1):
        for terms in itertools.combinations(range(3), k):
            mat = [[gram[min(i, j), max(i, j)] for j in terms] for i in terms]
            rhs = [xty[i] for i in terms]
            beta = _solve(mat, rhs)
            if beta is None or min(beta) < 0:
                continue
            sse = tt - 2 * sum(b * r for b, r in zip(beta, rhs)) + sum(
                beta[i] * mat[i][j] * beta[j] for i in range(k) for j in range(k))
            if best is None or sse < best[0] - 1e-15 * max(1.0, tt):
                coef = [0.0, 0.0, 0.0]
                for i, b in zip(terms, beta):
                    coef[i] = b
                best = (sse, coef)
    if best is None:
        return None
    w, u, p = best[1]
    return DecodeFit(w, u, p, int(s.n))
