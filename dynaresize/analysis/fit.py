"""Fit the simulator's cost model to a logged run (pure: RunData in, a plain dict out).

Model fitted (the one the simulator and :mod:`dynaresize.analysis.synth` use):

- stage time = overhead_s + tokens / (ranks x tokens_per_s_per_gpu), for rollout and for train, by ordinary
  least squares of the stage's wall time against ``x = tokens / ranks`` over the steps (slope = 1 / per-GPU
  throughput, intercept = fixed overhead). ``tokens`` is the stage event's ``tokens`` (else the step's
  ``tokens_generated``/``tokens_trained``; for train the step's ``tokens_trained`` comes first, because every
  data-parallel rank of the runtime logs the whole batch's count); ``ranks`` is the size of the stage's rank set. Steps whose stage has
  no token count are left out; with fewer than 3 points, or when every point has the same x, only the mean
  time is kept (overhead = mean, throughput unknown). One pass of outlier rejection: points whose residual is
  more than 3.5 robust standard deviations (1.4826 x MAD) off the first fit are dropped and the line refitted (a
  real run's first rollout carries warm-up, and a shared CPU stalls single stages); ``rejected`` counts them.
  The rollout line is what the simulator's ``sim.rollout.model: empirical`` replays; the log records no
  per-response lengths, so no separate long-tail term (longest response) is fitted: the overhead is the part
  that does not shrink with more ranks.
- weight_sync_s: the median weight_sync stage time.
- workload (taken from the log): each step's mean response length (rollout stage tokens / samples) and samples
  per step; whether ``tokens_trained`` counts the response only (the CPU runtime: train tokens of step k equal
  the rollout tokens of step k) or prompt + response. B x G and the length cap come from the run's
  ``config.yaml`` when present (else B = samples, G = 1, no cap known).
- schedule: what the run's coordinator ran (:func:`ran_lockstep`, :func:`ran_mechanisms`). A run on the scheduler
  core is ``barrier`` with the mechanisms it ran (``pipeline.schedule: barrier_free``: continuous rollout and, with
  ``streaming_training``, streaming training; ``barrier``: none), read from its ``schedule.jsonl``. A runtime log of
  the retired lock-step loop is ``barrier_lockstep`` with step_gap_s = median over steps of (step_end_k -
  step_end_{k-1} - max(rollout span of k+1, train span of k)) - weight_sync_s, the coordinator's own per-step time
  (batch assembly, command round trips), clipped at 0.
- command latency (``sim.command_latency_s``): per command, from its trigger to its last rank's start, by kind;
  the training chunks' median is the one the simulator charges, and the optimizer step's measured time and latency
  give the step overhead an emulated run's what-if uses (:func:`fit_command_latency`); the lock-step
  ``step_gap_s`` written is the measured gap less the two commands per step the model then prices (the weight
  fetch and the generate/train command on the critical path).
- switch ops: the median duration per op name (robust to one slow outlier), with n, min, max and the share of
  critical occurrences; written as ``override_s`` (op -> seconds), the measured-duration override of the
  simulator's switch cost model (``dynaresize.policy.config.SwitchCostConfig.override_s``), except for ops seen
  both on the critical path and in the background (two different costs under one name). An override is a
  constant: it does not scale with GPU count or bytes the way the simulator's formulas do (comm_init grows
  with the world size), so replays at a much larger scale keep the measured small-scale value.
"""

from __future__ import annotations

import json
import math
import statistics

from pathlib import Path

import numpy as np
import yaml

from dynaresize.analysis.reader import TAG_BACKGROUND, TAG_CHUNK, TAG_COMMAND, TAG_INSTALL, TAG_STEP, RunData


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
    res = y - (c0 + c1 * x)
    mad = float(np.median(np.abs(res - np.median(res))))
    keep = np.abs(res - np.median(res)) <= max(3.5 * 1.4826 * mad, 1e-9 * max(1.0, float(np.abs(y).max())))
    rejected = int(n - keep.sum())
    if rejected and keep.sum() >= 3 and np.ptp(x[keep]) > 0:
        x, y, n = x[keep], y[keep], int(keep.sum())
        A = np.stack([np.ones(n), x], axis=1)
        (c0, c1), *_ = np.linalg.lstsq(A, y, rcond=None)
    else:
        rejected = 0
    pred = c0 + c1 * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"n": n, "overhead_s": float(c0), "tokens_per_s_per_gpu": float(1.0 / c1) if c1 > 0 else None,
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None, "rmse_s": math.sqrt(ss_res / n), "rejected": rejected}


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
        st = rd.steps.get(step)
        if stage == "train" and st is not None and st.tokens_trained:
            tokens = st.tokens_trained  # each data-parallel rank logs the whole batch's count: summing them overcounts
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
    ws_med = statistics.median(ws) if ws else None
    return {
        "source": {"run": rd.name, "kind": rd.source, "path": str(rd.path), "world_size": rd.world_size, "steps": len(rd.steps),
                   "switches": len(rd.switches), "bad_lines": rd.stats.bad},
        "rollout": fit_stage(*pts["rollout"]),
        "train": fit_stage(*pts["train"]),
        "weight_sync_s": ws_med,
        "workload": fit_workload(rd),
        "schedule": fit_schedule(rd, ws_med or 0.0),
        "command_latency": fit_command_latency(rd),
        "ops": op_stats,
        # the logged split schedule, as policy.forced_splits: {step whose training ran first on the new split: trainers}
        # (a runtime switch_start names that step; a simulated one the step after which it was decided)
        "forced_splits": {sw.step + (rd.source == "sim"): sw.to_split[0] for sw in rd.switches.values()
                          if sw.step is not None and sw.to_split is not None},
        # an op seen both on the critical path and in the background has two costs (e.g. the device->host part
        # of optimizer_stage_out vs its NVMe write): one override would flatten them, so it keeps the formula
        "override_s": {k: v["median_s"] for k, v in op_stats.items() if v["critical_share"] in (0.0, 1.0)},
    }


def fit_busy(rd: RunData, stage: str) -> dict:
    """The same line as the stage fit, over each step's busy seconds (``step_end``'s ``rollout_s``: generation per
    rollout rank; ``train_s``: the trainers' chunks and optimizer step) instead of the stage's wall span. On the
    barrier-free schedule a span holds waits as well as work (a streamed batch's training waits for its groups, a
    rank's generation interleaves two batches), so on a short CPU run the span need not grow with the tokens at all;
    the busy seconds are the work alone."""
    xs, ys = [], []
    for k, st in sorted(rd.steps.items()):
        sp = rd.stage_spans.get((k, stage))
        busy = st.rollout_s if stage == "rollout" else st.train_s
        tokens = st.tokens_generated if stage == "rollout" else st.tokens_trained
        if sp is not None and sp.ranks > 0 and busy and tokens:
            xs.append(tokens / sp.ranks)
            ys.append(busy)
    return fit_stage(xs, ys)


def unfitted(fit: dict) -> str:
    """Why a stage fit has no throughput, in words."""
    n = fit.get("n") or 0
    if n < 3:
        return f"{n} step(s) with a token count and a time (3 needed)"
    if fit.get("r2") is None:
        return f"every one of its {n} steps has the same tokens per rank"
    return (f"its time does not grow with its tokens per rank over {n} steps (the fitted slope is not positive: "
            f"overhead and noise hide the per-token cost)")


def _run_dir(rd: RunData) -> Path:
    p = Path(rd.path)
    return p.parent if p.name == "events.jsonl" else p


def _read_config(run_dir: Path) -> dict:
    """The run's own ``config.yaml`` as written (not validated: an old run's keys may be retired), or {}."""
    f = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(f.read_text()) if f.is_file() else None
    except (OSError, yaml.YAMLError):
        data = None
    return data if isinstance(data, dict) else {}


def _run_config(rd: RunData) -> dict:
    return _read_config(_run_dir(rd))


def ran_lockstep(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run of the retired lockstep loop: its config.yaml says ``pipeline.schedule: lockstep``
    (loaded now as ``barrier``), or the run has neither that setting nor a ``schedule.jsonl`` (written before the
    setting existed, when the lockstep loop was the only one; a run on the scheduler core logs its schedule there).
    That loop admitted one command's ``rollout.pull_batch`` samples at a time and started both pools together after
    each sync: the simulator's ``sim.schedule: barrier_lockstep``."""
    pipeline = _read_config(Path(run_dir)).get("pipeline")
    schedule = pipeline.get("schedule") if isinstance(pipeline, dict) else None
    return schedule == "lockstep" or (schedule is None and not (Path(run_dir) / "schedule.jsonl").is_file())


def ran_mechanisms(run_dir: Path):
    """The barrier-free mechanisms (a :class:`dynaresize.schedule.Mechanisms`) the scheduler core ran in ``run_dir``:
    the core's own configuration (the first line of its ``schedule.jsonl``), else what the run's config.yaml gives
    the core (:func:`dynaresize.job.core_io.mechanisms`); None for a run of the retired lockstep loop
    (:func:`ran_lockstep`) or when neither file can be read."""
    run_dir = Path(run_dir)
    if ran_lockstep(run_dir):
        return None
    from dynaresize.schedule.codec import decode

    try:
        with open(run_dir / "schedule.jsonl") as f:
            return decode(json.loads(f.readline())["config"]).mechanisms
    except (OSError, ValueError, KeyError, TypeError):  # no log, or a torn one (a CodecError is a ValueError)
        pass
    from dynaresize.config.loader import ConfigError, load_config
    from dynaresize.job.core_io import mechanisms

    try:
        return mechanisms(load_config(run_dir / "config.yaml"))
    except (OSError, ConfigError, ValueError):
        return None


def fit_workload(rd: RunData) -> dict:
    """What the log says about the workload: per-step mean response length, samples, trained-token convention."""
    means, samples, same = [], [], []
    for k in sorted(rd.steps):
        sp = rd.stage_spans.get((k, "rollout"))
        if sp is None or sp.samples <= 0 or sp.tokens <= 0:
            continue
        while len(means) < k:  # a step without a rollout record keeps the previous mean
            means.append(means[-1] if means else sp.tokens / sp.samples)
        means.append(sp.tokens / sp.samples)
        samples.append(sp.samples)
        tr = rd.stage_spans.get((k, "train"))
        trained = rd.steps[k].tokens_trained or (tr.tokens if tr is not None else 0)
        if trained:
            same.append(abs(trained - sp.tokens) <= 0.01 * sp.tokens)
    if not means:
        return {"steps": 0}
    ro = _run_config(rd).get("rollout") or {}
    b, g = ro.get("prompts_per_step"), ro.get("group_size")
    n = int(statistics.median(samples))
    if not (isinstance(b, int) and isinstance(g, int) and b * g == n):
        b, g = n, 1
    cap = ro.get("max_tokens") if isinstance(ro.get("max_tokens"), int) else None
    return {"steps": len(means), "response_tokens_by_step": means, "prompts_per_step": b, "responses_per_prompt": g,
            "max_response_tokens": cap, "trained_tokens": "response" if same and sum(same) > len(same) / 2 else "sequence"}


def fit_schedule(rd: RunData, sync_s: float) -> dict:
    """The simulator's schedule for the log: ``barrier`` for a simulated log; for a runtime log what its coordinator
    ran: ``barrier`` with the mechanisms of the scheduler core (``mechanisms``: continuous_rollout,
    streaming_training; what the sample-level model turns on), or ``barrier_lockstep`` with the coordinator's
    per-step gap for a run of the retired lockstep loop (:func:`ran_lockstep`)."""
    if rd.source != "runtime":
        return {"schedule": "barrier", "step_gap_s": None, "n": 0}
    if not ran_lockstep(_run_dir(rd)):
        m = ran_mechanisms(_run_dir(rd))
        ran = {"continuous_rollout": m.continuous_rollout, "streaming_training": m.streaming_training} if m else None
        return {"schedule": "barrier", "mechanisms": ran, "step_gap_s": None, "n": 0}
    ends = {k: s.end for k, s in rd.steps.items() if s.end == s.end}
    gaps = []
    for k in sorted(ends):
        if k - 1 not in ends:
            continue
        busy = [sp.end - sp.start for sp in (rd.stage_spans.get((k + 1, "rollout")), rd.stage_spans.get((k, "train"))) if sp]
        if busy:
            gaps.append(ends[k] - ends[k - 1] - max(busy))
    gap = max(0.0, statistics.median(gaps) - sync_s) if gaps else None
    return {"schedule": "barrier_lockstep", "step_gap_s": gap, "n": len(gaps)}


LATENCY_STAGES = ("rollout", "train", "weight_sync")  # spans that begin when a command reaches their ranks
QUEUED_S = 0.002  # a span that begins this soon after its rank's previous one ended was queued behind it


def _latency_kind(stage: str, tag: int) -> str:
    if stage == "rollout":
        return "generate"
    if stage == "weight_sync":
        return "weight_sync"
    return {TAG_STEP: "optimizer_step", TAG_CHUNK: "train_chunk"}.get(tag, "train")


def fit_command_latency(rd: RunData) -> dict:
    """The control plane's latency per command, from the spans the commands started (no command send or ack times
    are logged), by kind of command, and what the simulator is given.

    Commands: a rollout span is one generate command; the k-th training span of step s on each trainer (a chunk's
    forward and backward, an optimizer step, or a whole-batch train) is one command sent to all of them, and so is
    the k-th weight-sync span of step s (a blocking sync); an install (``install``: the start of the generate that
    installs a fetched version) and background work (a fetch, a send, rank 0's copy of new weights) are none. A
    command sent to several ranks takes effect when its LAST rank starts it (the coordinator's next command waits for
    its last ack, and an optimizer step's collectives for its last trainer), so its latency is from its trigger to its
    last rank's start. Its trigger: the latest end, before its first start, of a span of its own ranks (their previous
    command: the ack the coordinator answered; background work is acked when it starts, so its end is none), of a rollout span of its own batch when it trains (the groups it
    needs), or of a version-making training span (an optimizer step, a whole-batch train) when it generates or syncs
    weights. A command whose every span began within ``QUEUED_S`` of its rank's previous end waited for nothing seen
    (it was queued behind that one: a continuous schedule's generates) and is no sample; spans of zero length are
    neither samples nor triggers.

    The sample-level simulator charges ONE latency, ``sim.command_latency_s``, to every command: the fit gives it
    (``command_latency_s``, with its quartiles and ``n`` samples) the median latency of the training chunks when the
    log has any (the scheduler core's schedules: the trainers wait for every one of their commands, a chunk is built
    from complete groups then read by every trainer and counts from the last one, so that chain is where the control
    plane costs throughput; a rollout rank of the continuous schedule holds its next command while it decodes), else
    (a log of the retired lockstep loop, whose whole-batch assembly is the step gap, ``fit_schedule``) the median gap
    from the latest end of any span to each span's start (:func:`_span_gaps`, as this fit was first written). The
    optimizer step waits
    less (nothing to build or read): ``optimizer_step.overhead_s`` is its measured time from its last trainer's start
    to its last end, plus its own latency less ``command_latency_s`` (never below 0): what the simulator's
    ``sim.train.step_overhead_s`` must be for a step to take, latency included, what it took.
    """
    none = {"n": 0, "command_latency_s": None, "p25_s": None, "p75_s": None, "by_kind": {},
            "optimizer_step": {"n": 0, "span_s": None, "overhead_s": None}}
    if not rd.n_intervals:
        return none
    starts, ends = np.frombuffer(rd.iv_start, dtype=np.float64), np.frombuffer(rd.iv_end, dtype=np.float64)
    kinds, rss = np.frombuffer(rd.iv_kind, dtype=np.int32), np.frombuffer(rd.iv_rs, dtype=np.int32)
    steps = np.frombuffer(rd.iv_step, dtype=np.int32)
    tags = np.frombuffer(rd.iv_tag, dtype=np.int8) if len(rd.iv_tag) == rd.n_intervals else np.zeros(rd.n_intervals, np.int8)
    names = {rd.kinds.index(k): k for k in LATENCY_STAGES if k in rd.kinds}
    real = [i for i in range(rd.n_intervals) if ends[i] > starts[i] and int(kinds[i]) in names]
    if not real:
        return none
    by_rs: dict[int, list[float]] = {}  # triggers: every end of a rank set, of a batch's rollout, of a new version
    batch_done: dict[int, list[float]] = {}
    versions: list[float] = []
    groups: dict[tuple, list[int]] = {}  # (kind, step, rank set) -> spans in start order, for multi-rank commands
    cmds: list[list[int]] = []
    for i in sorted(real, key=lambda j: starts[j]):
        stage, tag = names[int(kinds[i])], int(tags[i])
        if tag == TAG_BACKGROUND:  # no command waits for background work (a fetch is acked once it started)
            continue
        by_rs.setdefault(int(rss[i]), []).append(float(ends[i]))
        if stage == "rollout":
            batch_done.setdefault(int(steps[i]), []).append(float(ends[i]))
        if stage == "train" and tag in (TAG_STEP, TAG_COMMAND):
            versions.append(float(ends[i]))
        if tag == TAG_INSTALL:
            continue
        if stage == "rollout":
            cmds.append([i])
        else:
            groups.setdefault((stage, int(steps[i]), int(rss[i])), []).append(i)
    ordinal: dict[tuple, list[int]] = {}
    for (stage, step, _), spans in groups.items():
        for n, i in enumerate(spans):
            ordinal.setdefault((stage, step, n), []).append(i)
    cmds += list(ordinal.values())
    sort = {k: np.sort(np.asarray(v)) for k, v in by_rs.items()}
    sort_batch = {k: np.sort(np.asarray(v)) for k, v in batch_done.items()}
    sort_versions = np.sort(np.asarray(versions))

    def before(arr, t: float) -> float | None:
        j = int(np.searchsorted(arr, t + 1e-9, side="right")) - 1 if arr is not None and len(arr) else -1
        return float(arr[j]) if j >= 0 else None

    lat: dict[str, list[float]] = {}
    step_spans: dict[int, list[int]] = {}
    for c in cmds:
        first, last = min(starts[i] for i in c), max(starts[i] for i in c)
        kind = _latency_kind(names[int(kinds[c[0]])], int(tags[c[0]]))
        if kind == "optimizer_step":
            step_spans.setdefault(int(steps[c[0]]), []).extend(c)
        own = [before(sort[int(rss[i])], starts[i] - 1e-9) for i in c]  # each rank's previous end
        if all(p is not None and starts[i] - p < QUEUED_S for p, i in zip(own, c)):
            continue
        cand = [before(sort[int(rss[i])], first) for i in c]
        if kind in ("train", "train_chunk", "optimizer_step"):
            cand.append(before(sort_batch.get(int(steps[c[0]])), first))
        else:
            cand.append(before(sort_versions, first))
        cand = [x for x in cand if x is not None]
        if cand:
            lat.setdefault(kind, []).append(max(0.0, float(last) - max(cand)))
    every = [x for v in lat.values() for x in v]
    by_kind = {k: {"n": len(v), "median_s": float(np.median(v)), "p25_s": float(np.quantile(v, 0.25)),
                   "p75_s": float(np.quantile(v, 0.75))} for k, v in sorted(lat.items())}
    chosen = lat.get("train_chunk") or _span_gaps(rd)
    if not len(chosen):
        return none
    q25, q50, q75 = (float(x) for x in np.quantile(chosen, [0.25, 0.5, 0.75]))
    spans = [max(ends[i] for i in c) - max(starts[i] for i in c) for c in step_spans.values()]
    step: dict = {"n": len(spans), "span_s": float(np.median(spans)) if spans else None, "overhead_s": None}
    if spans and "optimizer_step" in by_kind:
        step["overhead_s"] = max(0.0, step["span_s"] + by_kind["optimizer_step"]["median_s"] - q50)
    return {"n": len(chosen), "command_latency_s": q50, "p25_s": q25, "p75_s": q75,
            "of": "train_chunk" if "train_chunk" in lat else "any_span",
            "median_all_s": float(np.median(every)) if every else None, "by_kind": by_kind, "optimizer_step": step}


def _span_gaps(rd: RunData) -> np.ndarray:
    """A log without training chunks (the retired lockstep loop's): the gap from the latest end of any span (of
    positive length, on any rank, its own included) to each rollout, train or weight-sync span's start, per span (the
    coordinator sends a command when something it waits for has ended; the median is robust to the spans that waited
    for something unlogged: the run's start, a decision, a switch)."""
    starts = np.frombuffer(rd.iv_start, dtype=np.float64) if len(rd.iv_start) else np.zeros(0)
    ends = np.frombuffer(rd.iv_end, dtype=np.float64) if len(rd.iv_end) else np.zeros(0)
    kinds = np.frombuffer(rd.iv_kind, dtype=np.int32) if len(rd.iv_kind) else np.zeros(0, dtype=np.int32)
    real = ends > starts
    if not real.any():
        return np.zeros(0)
    trig = np.sort(ends[real])
    ids = [rd.kinds.index(k) for k in LATENCY_STAGES if k in rd.kinds]
    s = starts[real & np.isin(kinds, ids)]
    i = np.searchsorted(trig, s + 1e-9, side="right") - 1  # the latest end at or before the start
    ok = i >= 0
    return np.maximum(s[ok] - trig[i[ok]], 0.0)
