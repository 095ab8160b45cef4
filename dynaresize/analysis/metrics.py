"""The numbers of one run: per-step rows and run totals (definitions in docs/analysis.md, kept in sync here).

- span: from the earliest step start or busy interval to the latest step end or interval end (start-up before the
  first step and teardown after the last are outside it). ``total GPU-s = world_size x span``.
- busy GPU-s: per rank, the union of its stage and switch-op intervals inside the span; idle = total - busy.
- bubble fraction = idle GPU-s / total GPU-s.
- role time: a rank is in the role its latest ``topology``/``role_change`` gives it. Utilisation of a role =
  busy GPU-s of ranks while in that role / GPU-s spent in that role.
- step window k = (end of step k-1, end of step k] (the first step from its own start): windows tile the run,
  so per-step idle GPU-s add up to the run's idle time inside those windows.
- rollout_s / train_s of a step: wall span of the intervals of that stage labelled with that step.
- step time (``duration_s``): ``step_end - step_start``; a run on the scheduler core logs no ``step_start`` (its
  steps overlap: batch k+1 generates while k trains), so there it is the step's window, optimizer step to optimizer
  step (the end of step k-1 to the end of step k; the first step from the start of the span).
- reward: ``step_end``'s ``reward_mean`` (the batch's mean reward).
- switch critical_s: ``switch_end.critical_path_s`` (else the union of its critical ops); hidden_s:
  ``switch_end.hidden_s`` (else the summed duration of its non-critical ops).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

from dynaresize.analysis.reader import RANK_ROLES, RunData
from dynaresize.analysis.views import Views, build_views, union

ROLE_NAMES = RANK_ROLES  # ["rollout", "train", "idle"]


@dataclass
class StepRow:
    step: int
    start: float | None
    end: float | None
    duration_s: float | None
    rollout_s: float | None
    train_s: float | None
    train_ranks: int
    rollout_ranks: int
    idle_rollout_gpu_s: float | None
    idle_train_gpu_s: float | None
    idle_unassigned_gpu_s: float | None
    bubble: float | None  # idle GPU-s / (world x window)
    samples: int
    tokens: int | None
    switches: str  # ids of switches that started in this step
    # training-inference mismatch over the step's trained tokens (step_end's mismatch_*; None: not reported)
    dlogp_mean: float | None = None  # mean |log pi_train - log pi_rollout|
    dlogp_max: float | None = None  # max |log pi_train - log pi_rollout|
    mismatch_k3: float | None = None  # mean k3 = r - 1 - log r, r = pi_train / pi_rollout
    mismatch_tokens: int | None = None
    reward: float | None = None  # the batch's mean reward (step_end's reward_mean)


@dataclass
class OpCost:
    op: str
    n: int
    total_s: float
    mean_s: float
    median_s: float
    max_s: float
    critical_s: float
    hidden_s: float
    gpu_s: float


@dataclass
class SwitchRow:
    switch_id: str
    step: int | None
    from_split: str
    to_split: str
    mode: str
    wall_s: float
    critical_s: float
    hidden_s: float
    n_ops: int
    complete: bool


@dataclass
class Summary:
    run: dict
    totals: dict
    roles: dict
    ops: list[OpCost]
    switches: list[SwitchRow]
    steps: list[StepRow]
    read: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _f(x: float) -> float:
    return float(round(x, 6))


def _g(x: float) -> float:
    """6 significant digits (mismatch figures are ~1e-7 on CPU in fp32: fixed decimals would make them 0)."""
    return float(f"{x:.6g}")


def analyze(rd: RunData, views: Views | None = None) -> Summary:
    v = views or build_views(rd)
    world = rd.world_size
    steps = sorted(rd.steps.values(), key=lambda s: s.step)
    done = [s for s in steps if not math.isnan(s.end)]
    # windows: per-step windows, then the whole span as the last one
    w0, w1, prev = [], [], None
    for s in done:
        a = prev if prev is not None else (s.start if not math.isnan(s.start) else v.span_start)
        w0.append(a)
        w1.append(s.end)
        prev = s.end
    w0.append(v.span_start)
    w1.append(v.span_end)
    w0a, w1a = np.array(w0, dtype=float), np.array(w1, dtype=float)
    nr = len(ROLE_NAMES)
    avail = np.zeros((len(w0a), nr))
    busy = np.zeros((len(w0a), nr))
    for av in v.views:
        size = av.atom.size
        for a, b, role in av.roles:
            lo, hi = np.maximum(a, w0a), np.minimum(b, w1a)
            ok = hi > lo
            if not ok.any():
                continue
            avail[:, role] += np.where(ok, hi - lo, 0.0) * size
            busy[:, role] += np.where(ok, av.busy_before(np.where(ok, hi, 0)) - av.busy_before(np.where(ok, lo, 0)), 0.0) * size
    idle = avail - busy
    total_gpu_s = world * v.span_s
    busy_total = float(busy[-1].sum())
    idle_total = total_gpu_s - busy_total

    # per-kind GPU-seconds (raw sums, overlaps counted per kind)
    kind_gpu = {}
    if len(v.starts):
        dur = (np.minimum(v.ends, v.span_end) - np.maximum(v.starts, v.span_start)).clip(0) * v.rs_count[v.rs]
        sums = np.bincount(v.kind, weights=dur, minlength=len(rd.kinds))
        kind_gpu = {k: _f(float(sums[i])) for i, k in enumerate(rd.kinds) if sums[i] > 0}

    ops, sw_rows = _switches(rd, v)
    sw_by_step: dict[int, list[str]] = {}
    for r in sw_rows:
        if r.step is not None:
            sw_by_step.setdefault(r.step, []).append(r.switch_id)

    rows = []
    widx = {s.step: i for i, s in enumerate(done)}
    for s in steps:
        ro = rd.stage_spans.get((s.step, "rollout"))
        tr = rd.stage_spans.get((s.step, "train"))
        i = widx.get(s.step)
        t_ref = s.start if not math.isnan(s.start) else (w0[i] if i is not None else v.span_start)
        ntr, nro, _ = v.split_at(t_ref)
        tokens = s.tokens_generated if s.tokens_generated is not None else (ro.tokens if ro and ro.tokens else None)
        win = (w1[i] - w0[i]) if i is not None else 0.0
        rows.append(StepRow(
            step=s.step,
            start=None if math.isnan(s.start) else _f(s.start),
            end=None if math.isnan(s.end) else _f(s.end),
            duration_s=(_f(s.end - s.start) if not (math.isnan(s.end) or math.isnan(s.start))
                        else _f(win) if i is not None and win > 0 else None),
            rollout_s=_f(ro.end - ro.start) if ro else None,
            train_s=_f(tr.end - tr.start) if tr else None,
            train_ranks=ntr, rollout_ranks=nro,
            idle_rollout_gpu_s=_f(idle[i, 0]) if i is not None else None,
            idle_train_gpu_s=_f(idle[i, 1]) if i is not None else None,
            idle_unassigned_gpu_s=_f(idle[i, 2]) if i is not None else None,
            bubble=_f(idle[i].sum() / (world * win)) if i is not None and win > 0 and world else None,
            samples=s.samples, tokens=tokens,
            switches=",".join(sw_by_step.get(s.step, [])),
            dlogp_mean=s.mismatch.get("mismatch_abs_mean"), dlogp_max=s.mismatch.get("mismatch_abs_max"),
            mismatch_k3=s.mismatch.get("mismatch_k3"),
            mismatch_tokens=int(s.mismatch["mismatch_tokens"]) if "mismatch_tokens" in s.mismatch else None,
            reward=s.reward_mean,
        ))

    samples = sum(s.samples for s in done)
    tok_gen = sum(s.tokens_generated or 0 for s in done) or sum(sp.tokens for (st, k), sp in rd.stage_spans.items() if k == "rollout")
    tok_tr = sum(s.tokens_trained or 0 for s in done) or sum(sp.tokens for (st, k), sp in rd.stage_spans.items() if k == "train")
    durs = [r.duration_s for r in rows if r.duration_s is not None]
    crit = sum(r.critical_s for r in sw_rows)
    hid = sum(r.hidden_s for r in sw_rows)
    span = v.span_s
    totals = {
        # validation passes by policy version: {version: {"reward_mean", "pass_at_k", "k"}} (none: no pass ran)
        "validation": {v: dict(rec) for v, rec in sorted(rd.validation.items())},
        "span_s": _f(span),
        "steps_completed": len(done),
        "samples": samples,
        "tokens_generated": tok_gen,
        "tokens_trained": tok_tr,
        "samples_per_s": _f(samples / span) if span > 0 else 0.0,
        "tokens_per_s": _f(tok_gen / span) if span > 0 else 0.0,
        "step_time_mean_s": _f(statistics.fmean(durs)) if durs else None,
        "step_time_median_s": _f(statistics.median(durs)) if durs else None,
        "total_gpu_s": _f(total_gpu_s),
        "busy_gpu_s": _f(busy_total),
        "idle_gpu_s": _f(idle_total),
        "bubble_fraction": _f(idle_total / total_gpu_s) if total_gpu_s > 0 else 0.0,
        "switches": len(sw_rows),
        "switch_critical_s": _f(crit),
        "switch_hidden_s": _f(hid),
        "switch_hidden_fraction": _f(hid / (crit + hid)) if crit + hid > 0 else None,
        "switch_critical_fraction_of_span": _f(crit / span) if span > 0 else 0.0,
        "gpu_s_by_kind": kind_gpu,
        "decisions": dict(rd.decisions),
        "mismatch": run_mismatch([s.mismatch for s in done]),
    }
    roles = {}
    for j, name in enumerate(ROLE_NAMES):
        a, b = float(avail[-1, j]), float(busy[-1, j])
        roles[name] = {"gpu_s": _f(a), "busy_gpu_s": _f(b), "idle_gpu_s": _f(a - b), "utilisation": _f(b / a) if a > 0 else None}
    run = {
        "name": rd.name, "run_id": rd.run_id, "source": rd.source, "path": str(rd.path), "world_size": world,
        "status": rd.status, "complete": rd.complete, "span_start": _f(v.span_start), "span_end": _f(v.span_end),
        "atoms": len(v.atoms), "roles_inferred": v.roles_inferred,
    }
    read = {
        "lines": rd.stats.lines, "events": rd.stats.events, "bad_lines": rd.stats.bad,
        "bad_reasons": list(rd.stats.reasons), "skipped_events": rd.warnings, "skipped_reasons": list(rd.warning_reasons),
    }
    notes = []
    if not rd.complete:
        notes.append("no run_end event: the run was interrupted or is still running; totals cover what was logged")
    if rd.stats.bad:
        notes.append(f"{rd.stats.bad} damaged line(s) skipped")
    if rd.warnings:
        notes.append(f"{rd.warnings} event(s) with nonsensical values skipped")
    if v.roles_inferred:
        notes.append("no topology events: roles inferred from each rank's dominant stage")
    return Summary(run, totals, roles, ops, sw_rows, rows, read, notes)


def run_mismatch(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The run's training-inference mismatch from the steps' figures: means weighted by each step's tokens, the
    largest maximum, the tokens; over every trained token (``mismatch_``) and for the trainer's own version
    (``mismatch_same_version_``). Keys as in ``step_end``; a set no step reported is left out."""
    out: dict[str, float] = {}
    for p in ("mismatch_", "mismatch_same_version_"):
        steps = [m for m in per_step if m.get(f"{p}tokens", 0) > 0 and all(f"{p}{k}" in m for k in ("abs_mean", "abs_max", "k3"))]
        tokens = sum(m[f"{p}tokens"] for m in steps)
        if not steps:
            continue
        out[f"{p}abs_mean"] = _g(sum(m[f"{p}abs_mean"] * m[f"{p}tokens"] for m in steps) / tokens)
        out[f"{p}abs_max"] = max(m[f"{p}abs_max"] for m in steps)
        out[f"{p}k3"] = _g(sum(m[f"{p}k3"] * m[f"{p}tokens"] for m in steps) / tokens)
        out[f"{p}tokens"] = int(tokens)
        out[f"{p}steps"] = len(steps)
    tis = [m for m in per_step if "tis_weight_mean" in m and m.get("mismatch_tokens", 0) > 0]
    if tis:
        tokens = sum(m["mismatch_tokens"] for m in tis)
        out["tis_weight_mean"] = _g(sum(m["tis_weight_mean"] * m["mismatch_tokens"] for m in tis) / tokens)
        out["tis_capped_frac"] = _g(sum(m.get("tis_capped_frac", 0.0) * m["mismatch_tokens"] for m in tis) / tokens)
    return out


def _switches(rd: RunData, v: Views) -> tuple[list[OpCost], list[SwitchRow]]:
    by_op: dict[str, list] = {}
    rows = []
    for sw in rd.switches.values():
        for o in sw.ops:
            by_op.setdefault(o.op, []).append(o)
        if sw.ops:
            s = np.array([o.start for o in sw.ops])
            e = np.array([o.end for o in sw.ops])
            wall = float(e.max() - s.min())
            c = np.array([o.critical for o in sw.ops])
            us, ue = union(s[c], e[c])
            crit_ops = float((ue - us).sum())
            hid_ops = float((e - s)[~c].sum())
        else:
            wall = (sw.t_end - sw.t_start) if sw.t_end is not None and sw.t_start is not None else 0.0
            crit_ops = hid_ops = 0.0
        crit = sw.critical_path_s if sw.critical_path_s is not None else crit_ops
        hid = sw.hidden_s if sw.hidden_s is not None else hid_ops
        rows.append(SwitchRow(
            sw.switch_id, sw.step,
            f"{sw.from_split[0]}:{sw.from_split[1]}" if sw.from_split else "?",
            f"{sw.to_split[0]}:{sw.to_split[1]}" if sw.to_split else "?",
            sw.mode or "", _f(wall), _f(crit), _f(hid), len(sw.ops), sw.t_end is not None,
        ))
    rows.sort(key=lambda r: (r.step if r.step is not None else 1 << 60, r.switch_id))
    ops = []
    for name, lst in sorted(by_op.items()):
        d = [o.end - o.start for o in lst]
        gpu = sum((o.end - o.start) * int(v.rs_count[o.ranks]) for o in lst)
        ops.append(OpCost(
            name, len(d), _f(sum(d)), _f(statistics.fmean(d)), _f(statistics.median(d)), _f(max(d)),
            _f(sum(x for x, o in zip(d, lst) if o.critical)), _f(sum(x for x, o in zip(d, lst) if not o.critical)), _f(gpu),
        ))
    return ops, rows
