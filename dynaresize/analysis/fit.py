"""Fit the simulator's cost model to a logged run (pure: RunData in, a plain dict out).

Model fitted (the one the simulator and :mod:`dynaresize.analysis.synth` use):

- stage time = overhead_s + tokens / (ranks x tokens_per_s_per_gpu), for rollout and for train, by ordinary
  least squares of the stage's wall time against ``x = tokens / ranks`` over the steps (slope = 1 / per-GPU
  throughput, intercept = fixed overhead). ``tokens`` is the stage event's ``tokens`` (else the step's
  ``tokens_generated``/``tokens_trained``); ``ranks`` is the size of the stage's rank set. Steps whose stage has
  no token count are left out; with fewer than 3 points, or when every point has the same x, only the mean
  time is kept (overhead = mean, throughput unknown).
- weight_sync_s: the median weight_sync stage time.
- switch ops: the median duration per op name (robust to one slow outlier), with n, min, max and the share of
  critical occurrences; written as ``override_s`` (op -> seconds), the measured-duration override of the
  simulator's switch cost model (``dynaresize.policy.config.SwitchCostConfig.override_s``), except for ops seen
  both on the critical path and in the background (two different costs under one name). An override is a
  constant: it does not scale with GPU count or bytes the way the simulator's formulas do (comm_init grows
  with the world size), so replays at a much larger scale keep the measured small-scale value.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from dynaresize.analysis.reader import RunData


def fit_stage(xs: list[float], ys: list[float]) -> dict:
    n = len(xs)
    if n == 0:
        return {"n": 0, "overhead_s": None, "tokens_per_s_per_gpu": None, "r2": None, "rmse_s": None}
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if n < 3 or np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):
        return {"n": n, "overhead_s": float(y.mean()), "tokens_per_s_per_gpu": None, "r2": None,
                "rmse_s": float(np.sqrt(((y - y.mean()) ** 2).mean()))}
    A = np.stack([np.ones(n), x], axis=1)
    (c0, c1), *_ = np.linalg.lstsq(A, y, rcond=None)
    pred = c0 + c1 * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"n": n, "overhead_s": float(c0), "tokens_per_s_per_gpu": float(1.0 / c1) if c1 > 0 else None,
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None, "rmse_s": math.sqrt(ss_res / n)}


def fit_costs(rd: RunData) -> dict:
    """Return the fitted costs (see the module docstring) and the fit quality, as plain JSON-able values."""
    pts: dict[str, tuple[list[float], list[float]]] = {"rollout": ([], []), "train": ([], [])}
    ws = []
    for (step, stage), sp in sorted(rd.stage_spans.items()):
        dur = sp.end - sp.start
        if stage == "weight_sync":
            ws.append(dur)
            continue
        if stage not in pts or sp.ranks <= 0:
            continue
        tokens = sp.tokens
        if not tokens:
            st = rd.steps.get(step)
            if st is not None:
                tokens = (st.tokens_generated if stage == "rollout" else st.tokens_trained) or 0
        if tokens > 0:
            pts[stage][0].append(tokens / sp.ranks)
            pts[stage][1].append(dur)
    ops: dict[str, list[tuple[float, bool]]] = {}
    for sw in rd.switches.values():
        for o in sw.ops:
            ops.setdefault(o.op, []).append((o.end - o.start, o.critical))
    op_stats = {}
    for name, lst in sorted(ops.items()):
        d = [x for x, _ in lst]
        op_stats[name] = {"n": len(d), "median_s": statistics.median(d), "min_s": min(d), "max_s": max(d),
                          "critical_share": sum(1 for _, c in lst if c) / len(lst)}
    return {
        "source": {"run": rd.name, "path": str(rd.path), "world_size": rd.world_size, "steps": len(rd.steps),
                   "switches": len(rd.switches), "bad_lines": rd.stats.bad},
        "rollout": fit_stage(*pts["rollout"]),
        "train": fit_stage(*pts["train"]),
        "weight_sync_s": statistics.median(ws) if ws else None,
        "ops": op_stats,
        # an op seen both on the critical path and in the background has two costs (e.g. the device->host part
        # of optimizer_stage_out vs its NVMe write): one override would flatten them, so it keeps the formula
        "override_s": {k: v["median_s"] for k, v in op_stats.items() if v["critical_share"] in (0.0, 1.0)},
    }
