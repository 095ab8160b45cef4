"""The rollout stage of a pool size, from how a batch decodes: the capacity predictor's rollout model for the
barrier-free schedule (``policy.rollout_model: decode``).

Busy spans do not divide over the rollout GPUs. Each GPU decodes its share of a batch with continuous batching:
an iteration costs ``iteration_s + a x seq_iteration_s`` with ``a`` sequences active. So a GPU's busy span on a
batch is ``iteration_s x (its iterations) + seq_iteration_s x (its tokens) + prefill``. Its iterations are set by
the longest response of its share while the share fits its KV slots, and by its tokens over its slots once it does
not. The core hands a batch out as at most an even share in flight per GPU, ``c = ceil(groups / n)`` groups, each
GPU taking its whole room at once. So ``groups // c`` GPUs hold ``c`` groups, one holds the rest, and any other waits
for the next batch. The mean busy span of ``n`` rollout GPUs is then::

    rollout(n) = iteration_s x M(n) + (seq_iteration_s x tokens + prefill_s_per_group x groups) / n
    M(n) = max(mean over the n GPUs of E[the longest response of a share], tokens / (n x kv_slots))

where ``E[longest of c groups]`` is the expected maximum of ``c`` groups drawn without replacement from the batch's
groups (an order statistic of their longest responses). Fewer GPUs hold more sequences each and pay the iteration's
fixed cost once for all of them. The busy span's tail, the longest response of a share, shrinks with the share.
Neither shows in ``work / n``.

:class:`~dynaresize.policy.types.DecodeProfile` holds what the model needs, from an observed batch
(:class:`~dynaresize.policy.types.PipelineWorkload`: its response lengths and decode model, :func:`profile_of`),
blended from batch to batch (:func:`dynaresize.policy.predictor.blend`, with the policy's other EWMAs);
:func:`busy_span_s` is the model. The policy scales it by the measured
busy span over the model's on the split measured (``Estimates.rollout_ratio``). Pure: no clock, no randomness.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from dynaresize.policy.types import DecodeProfile, PipelineWorkload

PROFILE_POINTS = 256  # longest responses kept per batch (order statistics at even ranks beyond this many groups)


def profile_of(wl: PipelineWorkload) -> DecodeProfile | None:
    """The profile of an observed batch; None when it has no group or no decode model."""
    G = max(1, wl.group_size)
    ng = len(wl.lengths) // G
    if ng < 1 or wl.iteration_s + wl.seq_iteration_s <= 0:
        return None
    lens = np.asarray(wl.lengths[:ng * G], dtype=np.float64).reshape(ng, G)
    gm = np.sort(lens.max(axis=1))
    if ng > PROFILE_POINTS:  # order statistics at even ranks
        gm = np.interp(np.linspace(0, ng - 1, PROFILE_POINTS), np.arange(ng), gm)
    return DecodeProfile(float(wl.iteration_s), float(wl.seq_iteration_s), float(wl.prefill_s_per_group), max(1, int(wl.kv_slots)),
                         ng, float(lens.sum()), tuple(float(x) for x in gm))


def longest(p: DecodeProfile, c: int) -> float:
    """E[the longest response of ``c`` groups drawn without replacement from the batch's]."""
    if c <= 0:
        return 0.0
    n = len(p.group_max)
    k = c if n == p.groups else max(1, round(c * n / p.groups))  # (order statistics kept: the share scaled)
    global _last
    xs, memo = _last
    if xs is not p.group_max:  # (a decision asks for many shares of one profile: no hash of its values each time)
        xs, memo = _last = p.group_max, {}
    k = min(n, k)
    got = memo.get(k)
    if got is None:
        got = memo[k] = _expected_max_of(xs, k)
    return got


_last: tuple[tuple[float, ...], dict[int, float]] = ((), {})  # the last profile's shares asked (a cache by identity)


def busy_span_s(p: DecodeProfile, n_rollout: int) -> float:
    """Mean busy span of a rollout GPU on a batch with ``n_rollout`` GPUs (the module's model)."""
    n = max(1, int(n_rollout))
    c = -(-p.groups // n)
    full, rest = divmod(p.groups, c)
    m = (full * longest(p, c) + longest(p, rest)) / n
    iterations = max(m, p.tokens / (n * p.kv_slots))
    return p.iteration_s * iterations + (p.seq_iteration_s * p.tokens + p.prefill_s_per_group * p.groups) / n


@lru_cache(maxsize=4096)
def _expected_max_of(xs: tuple[float, ...], c: int) -> float:
    """E[max of a c-subset] of the ascending values ``xs``: P(max = x_i) = C(i-1, c-1) / C(N, c). One ``c`` at a time:
    a decision asks for a few shares of a profile that changes with every batch (the whole table is N^2)."""
    n = len(xs)
    x = np.asarray(xs, dtype=np.float64)
    lf = _log_factorials(n)
    i = np.arange(1, n + 1)
    logp = np.where(i >= c, lf[np.maximum(i - 1, 0)] - lf[c - 1] - lf[np.maximum(i - c, 0)] - (lf[n] - lf[c] - lf[n - c]),
                    -np.inf)
    return float((np.exp(logp) * x).sum())


@lru_cache(maxsize=8)
def _log_factorials(n: int) -> np.ndarray:
    """log k! for k = 0..n."""
    return np.array([math.lgamma(k + 1) for k in range(n + 1)])
