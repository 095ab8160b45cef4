"""One streaming pass over an event log into compact columns that every analysis tool shares.

Why: a 4096-GPU x 1000-step log must be analysed in seconds without holding its JSON objects in memory. Rank sets
stay rank-set strings, interned once (a simulated step names a handful of distinct sets); busy intervals become
four numeric columns; steps, topology changes and switches become small records. Nothing is ever expanded per
rank here: per-rank work happens later on "atoms" (see :mod:`dynaresize.analysis.atoms`).

Damage never raises: lines the schema rejects are counted by :class:`dynaresize.events.ReadStats`; events that
pass the schema but make no sense (a malformed rank set, an interval that ends before it starts) are counted
in ``RunData.warnings`` and skipped.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize.events import EVENTS_FILE, Event, EventType, ReadStats, Role, Stage, count_ranks, read_events

MISMATCH_KEYS = ("mismatch_", "tis_")  # step_end's training-inference mismatch figures (dynaresize.rl.mismatch)

# Interval kinds: the stages first, then one kind per switch operation ("op:<name>").
STAGE_KINDS = [s.value for s in Stage]

# What started a stage interval (``RunData.iv_tag``): a command reaching its rank (the default), work on a background
# thread or after the command's own work (``background``: a weight fetch or send; ``publish``: rank 0's copy of the
# new weights after its optimizer step), an optimizer step (``optimizer_step``: a new version), a training chunk
# (``chunk``: forward and backward, no step), or a fetched version's install (``install``: the start of the generate
# that installs it). Switch ops are TAG_COMMAND.
TAG_COMMAND, TAG_BACKGROUND, TAG_STEP, TAG_CHUNK, TAG_INSTALL = 0, 1, 2, 3, 4


def stage_tag(ev: Event) -> int:
    """The ``iv_tag`` of a stage event (see ``TAG_COMMAND``)."""
    if ev.get("background") or ev.get("publish"):
        return TAG_BACKGROUND
    if ev.get("optimizer_step"):
        return TAG_STEP
    if ev.get("chunk"):
        return TAG_CHUNK
    if ev.get("install"):
        return TAG_INSTALL
    return TAG_COMMAND


@dataclass
class StepRec:
    step: int
    start: float = math.nan  # step_start.t
    end: float = math.nan  # step_end.t
    samples: int = 0
    tokens_generated: int | None = None
    tokens_trained: int | None = None
    reward_mean: float | None = None
    loss: float | None = None
    mismatch: dict[str, float] = field(default_factory=dict)  # step_end's mismatch_* / tis_* figures
    rollout_s: float | None = None  # step_end's busy seconds: the batch's generation per rollout rank
    train_s: float | None = None  # and its training (the slowest trainer of each chunk and the step)


@dataclass
class StageSpan:
    """All intervals of one stage in one step: wall span (first start, last end), token/sample totals."""

    start: float
    end: float
    tokens: int = 0
    samples: int = 0
    count: int = 0
    # distinct ranks of the stage's intervals in this step: a rank logs one interval per command, and on the
    # barrier-free schedule a rank runs several generate (or train_chunk) commands a step, so a sum over intervals
    # would count it once per command (the fit's ``tokens / ranks`` then came out several times too small)
    ranks: int = 0
    rank_sets: set[str] = field(default_factory=set)  # the distinct rank-set strings seen (a handful a step)


@dataclass
class OpRec:
    op: str
    ranks: int  # rank-set id
    start: float
    end: float
    critical: bool
    nbytes: int | None = None


@dataclass
class SwitchRec:
    switch_id: str
    step: int | None = None
    t_start: float | None = None
    t_end: float | None = None
    from_split: tuple[int, int] | None = None  # (train, rollout)
    to_split: tuple[int, int] | None = None
    mode: str | None = None
    planned_critical_s: float | None = None
    critical_path_s: float | None = None  # as reported by switch_end
    hidden_s: float | None = None
    ops: list[OpRec] = field(default_factory=list)


@dataclass
class RunData:
    """Everything the analyses need from one log, compact. Times are run seconds (the log's ``t`` clock)."""

    path: Path
    run_id: str = ""
    source: str = ""
    world_size: int = 0
    t_run_start: float | None = None
    t_run_end: float | None = None
    status: str | None = None  # run_end status; None when the log has no run_end (killed run)
    t_max: float = 0.0
    t_min: float = math.inf
    ranksets: list[str] = field(default_factory=list)
    _rs_index: dict[str, int] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=lambda: list(STAGE_KINDS))
    _kind_index: dict[str, int] = field(default_factory=lambda: {k: i for i, k in enumerate(STAGE_KINDS)})
    # busy intervals (stages and switch ops), columnar
    iv_start: array = field(default_factory=lambda: array("d"))
    iv_end: array = field(default_factory=lambda: array("d"))
    iv_rs: array = field(default_factory=lambda: array("i"))
    iv_kind: array = field(default_factory=lambda: array("i"))
    iv_step: array = field(default_factory=lambda: array("i"))  # -1 when unknown (switch ops)
    iv_critical: array = field(default_factory=lambda: array("b"))  # 1 for stages and critical ops
    iv_tag: array = field(default_factory=lambda: array("b"))  # what started the interval: TAG_COMMAND, ...
    steps: dict[int, StepRec] = field(default_factory=dict)
    stage_spans: dict[tuple[int, str], StageSpan] = field(default_factory=dict)
    # role assignments in log order: (t, step, kind, a, b) with kind "topology" (a=train set, b=rollout set)
    # or "role" (a=rank set, b=index of the new Role)
    roles: list[tuple[float, int, str, int, int]] = field(default_factory=list)
    switches: dict[str, SwitchRec] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    # validation passes (``metric`` events val_reward_mean, val_pass_at_k): policy version -> {name: value, "k": k}
    validation: dict[int, dict[str, float]] = field(default_factory=dict)
    rank_states: dict[str, int] = field(default_factory=dict)
    stats: ReadStats = field(default_factory=ReadStats)
    warnings: int = 0
    warning_reasons: list[str] = field(default_factory=list)

    # -- helpers -------------------------------------------------------------------------------------------
    def rankset_id(self, text: str) -> int:
        i = self._rs_index.get(text)
        if i is None:
            i = self._rs_index[text] = len(self.ranksets)
            self.ranksets.append(text)
        return i

    def kind_id(self, kind: str) -> int:
        i = self._kind_index.get(kind)
        if i is None:
            i = self._kind_index[kind] = len(self.kinds)
            self.kinds.append(kind)
        return i

    def warn(self, reason: str) -> None:
        self.warnings += 1
        if len(self.warning_reasons) < 20:
            self.warning_reasons.append(f"line {self.stats.lines}: {reason}")

    @property
    def n_intervals(self) -> int:
        return len(self.iv_start)

    @property
    def complete(self) -> bool:
        return self.status is not None

    @property
    def name(self) -> str:
        p = self.path.parent if self.path.name == EVENTS_FILE else self.path
        return self.run_id or p.name


_ROLE_INDEX = {r.value: i for i, r in enumerate(Role)}
RANK_ROLES = [r.value for r in Role]


def _rankset_ok(text: str) -> bool:
    """Cheap validity check of a rank-set string without expanding it."""
    if not text:
        return True
    for part in text.split(","):
        a, sep, b = part.partition("-")
        if not a.isdigit() or (sep and (not b.isdigit() or int(b) < int(a))):
            return False
    return True


def _max_rank(text: str) -> int:
    last = text.rsplit(",", 1)[-1]
    return max(int(x) for x in last.split("-")) if last else -1


def _union_size(rank_sets: set[str]) -> int:
    """Ranks in the union of rank-set strings (``"0-3,8"``), from their ranges merged (never expanded per rank)."""
    ranges = []
    for text in rank_sets:
        for part in text.split(","):
            a, sep, b = part.partition("-")
            ranges.append((int(a), int(b) if sep else int(a)))
    n, hi = 0, -1
    for a, b in sorted(ranges):
        if b > hi:
            n += b - max(a, hi + 1) + 1
            hi = b
    return n


def load_run(path: str | Path) -> RunData:
    """Read a run directory (or an ``events.jsonl`` file) in one streaming pass."""
    p = Path(path)
    log = p / EVENTS_FILE if p.is_dir() else p
    if not log.exists():
        raise FileNotFoundError(f"no event log at {log}")
    rd = RunData(path=log)
    for ev in read_events(log, rd.stats):
        try:
            _ingest(rd, ev)
        except (ValueError, TypeError) as e:  # schema-valid but nonsensical values
            rd.warn(f"{ev.type.value}: {e}")
    if rd.world_size <= 0 and rd.ranksets:
        rd.world_size = max(_max_rank(s) for s in rd.ranksets if s) + 1
    if rd.t_min == math.inf:
        rd.t_min = 0.0
    return rd


def _rs(rd: RunData, ev: Event, key: str) -> int | None:
    text = ev[key]
    if not _rankset_ok(text):
        rd.warn(f"{ev.type.value}: bad rank set {key}={text!r}")
        return None
    if text:
        mx = _max_rank(text)
        if mx >= rd.world_size > 0:
            rd.warn(f"{ev.type.value}: rank {mx} >= world_size {rd.world_size}; world grown")
            rd.world_size = mx + 1
    return rd.rankset_id(text)


def _interval(rd: RunData, ev: Event, kind: str, step: int, critical: bool, tag: int = TAG_COMMAND) -> int | None:
    start, end = float(ev["start"]), float(ev["end"])
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        rd.warn(f"{ev.type.value}: bad interval start={start} end={end}")
        return None
    rs = _rs(rd, ev, "ranks")
    if rs is None:
        return None
    rd.iv_start.append(start)
    rd.iv_end.append(end)
    rd.iv_rs.append(rs)
    rd.iv_kind.append(rd.kind_id(kind))
    rd.iv_step.append(step)
    rd.iv_critical.append(1 if critical else 0)
    rd.iv_tag.append(tag)
    rd.t_min = min(rd.t_min, start)
    rd.t_max = max(rd.t_max, end)
    return rs


def _switch(rd: RunData, sid: str) -> SwitchRec:
    sw = rd.switches.get(sid)
    if sw is None:
        sw = rd.switches[sid] = SwitchRec(sid)
    return sw


def _ingest(rd: RunData, ev: Event) -> None:
    t = ev.t
    rd.t_max = max(rd.t_max, t)
    et = ev.type
    if et is EventType.STAGE:
        rs = _interval(rd, ev, ev["stage"], ev["step"], True, stage_tag(ev))
        if rs is None:
            return
        key = (ev["step"], ev["stage"])
        span = rd.stage_spans.get(key)
        if span is None:
            span = rd.stage_spans[key] = StageSpan(ev["start"], ev["end"])
        span.start, span.end = min(span.start, ev["start"]), max(span.end, ev["end"])
        span.tokens += int(ev.get("tokens") or 0)
        span.samples += int(ev.get("samples") or 0)
        span.count += 1
        if ev["ranks"] not in span.rank_sets:
            span.rank_sets.add(ev["ranks"])
            span.ranks = count_ranks(ev["ranks"]) if len(span.rank_sets) == 1 else _union_size(span.rank_sets)
    elif et is EventType.SWITCH_OP:
        rs = _interval(rd, ev, "op:" + ev["op"], -1, ev["critical"])
        if rs is None:
            return
        b = ev.get("bytes")
        _switch(rd, ev["switch_id"]).ops.append(
            OpRec(ev["op"], rs, float(ev["start"]), float(ev["end"]), ev["critical"], b if isinstance(b, int) else None)
        )
    elif et is EventType.METRIC:
        name, step = ev["name"], ev.get("step")
        if name.startswith("val_") and isinstance(step, int):
            rec = rd.validation.setdefault(step, {})
            rec[name[4:]] = float(ev["value"])
            if isinstance(ev.get("k"), int):
                rec["k"] = ev["k"]
    elif et is EventType.STEP_START:
        rd.steps.setdefault(ev["step"], StepRec(ev["step"])).start = t
        rd.t_min = min(rd.t_min, t)
    elif et is EventType.STEP_END:
        s = rd.steps.setdefault(ev["step"], StepRec(ev["step"]))
        s.end, s.samples = t, ev["samples"]
        for k in ("tokens_generated", "tokens_trained"):
            if isinstance(ev.get(k), int):
                setattr(s, k, ev[k])
        for k in ("reward_mean", "loss", "rollout_s", "train_s"):
            if isinstance(ev.get(k), (int, float)) and not isinstance(ev.get(k), bool):
                setattr(s, k, float(ev[k]))
        s.mismatch = {k: float(v) for k, v in ev.data.items() if k.startswith(MISMATCH_KEYS)
                      and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    elif et is EventType.TOPOLOGY:
        tr, ro = _rs(rd, ev, "train_ranks"), _rs(rd, ev, "rollout_ranks")
        if tr is not None and ro is not None:
            rd.roles.append((t, ev["step"], "topology", tr, ro))
    elif et is EventType.ROLE_CHANGE:
        rs = _rs(rd, ev, "ranks")
        if rs is not None:
            rd.roles.append((t, ev["step"], "role", rs, _ROLE_INDEX[ev["to_role"]]))
    elif et is EventType.SWITCH_START:
        sw = _switch(rd, ev["switch_id"])
        sw.step, sw.t_start = ev["step"], t
        sw.from_split = (ev["from_train"], ev["from_rollout"])
        sw.to_split = (ev["to_train"], ev["to_rollout"])
        sw.mode = ev.get("mode") if isinstance(ev.get("mode"), str) else None
        pc = ev.get("planned_critical_s")
        sw.planned_critical_s = float(pc) if isinstance(pc, (int, float)) else None
    elif et is EventType.SWITCH_END:
        sw = _switch(rd, ev["switch_id"])
        sw.t_end, sw.critical_path_s = t, float(ev["critical_path_s"])
        h = ev.get("hidden_s")
        sw.hidden_s = float(h) if isinstance(h, (int, float)) else None
    elif et is EventType.DECISION:
        rd.decisions[ev["action"]] = rd.decisions.get(ev["action"], 0) + 1
    elif et is EventType.RANK:
        rd.rank_states[ev["state"]] = rd.rank_states.get(ev["state"], 0) + 1
    elif et is EventType.RUN_START:
        rd.run_id, rd.source = ev["run_id"], ev["source"]
        rd.world_size = max(rd.world_size, ev["world_size"])
        rd.t_run_start = t
        tr, ro = ev.get("train_ranks"), ev.get("rollout_ranks")
        if isinstance(tr, str) and isinstance(ro, str):
            a, b = _rs(rd, ev, "train_ranks"), _rs(rd, ev, "rollout_ranks")
            if a is not None and b is not None:
                rd.roles.append((t, -1, "topology", a, b))
    elif et is EventType.RUN_END:
        rd.t_run_end, rd.status = t, ev["status"]
