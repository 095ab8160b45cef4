"""The one event log: a versioned JSONL schema written by the runtime and the simulator, read by every tool.

File: ``<run_dir>/events.jsonl``, one JSON object per line, appended (each line written with one ``write`` on an
``O_APPEND`` descriptor, so concurrent writers in one or several processes never interleave inside a line).

Every line has these keys:

==========  =======================================================================================
``v``       schema version (``SCHEMA_VERSION``); a reader refuses lines of a newer major version
``type``    one of :class:`EventType`
``t``       seconds since the run started (wall clock for real runs, simulated time for simulated ones)
==========  =======================================================================================

and the keys its type requires (``REQUIRED`` below; extra keys are allowed and kept in ``Event.data``).
Time intervals (``start``, ``end``) are in the same clock as ``t``. Sets of ranks are written compactly as
rank-set strings such as ``"0-3,6,8-11"`` (see :func:`format_ranks`), so a 4096-GPU simulated step stays a few lines.

Event types and their required keys (types in brackets; optional keys after ``|``):

- ``run_start``: run_id [str], source ["runtime"|"sim"], world_size [int], wall_time [float, Unix time of t=0] | job_id [str: the
  run's Redis namespace, ``dynaresize.rundir.job_id``]
  | config [dict], train_ranks [str], rollout_ranks [str]
- ``run_end``: status ["completed"|"interrupted"|"failed"], steps [int]
- ``step_start``: step [int]
- ``step_end``: step [int], samples [int] | tokens_generated, tokens_trained [int], reward_mean [float], loss [float],
  mismatch_abs_mean, mismatch_abs_max, mismatch_k3 [float], mismatch_tokens [int] (the training-inference mismatch,
  ``dynaresize.rl.mismatch``; the same with ``mismatch_same_version_``), tis_weight_mean, tis_capped_frac [float]
- ``stage``: step [int], stage [:class:`Stage`], ranks [str], start [float], end [float]
  | tokens [int], samples [int], version [int] (policy version used by a rollout)
  One busy interval of a set of ranks. Idle time is derived (run time minus busy time), never logged.
- ``topology``: step [int], train_ranks [str], rollout_ranks [str]  (at start and after every switch)
- ``role_change``: step [int], ranks [str], from_role [:class:`Role`], to_role [:class:`Role`]
- ``decision``: step [int], action ["hold"|"resize"], reason [str]
  | imbalance [float], target_train [int], target_rollout [int], expected_saving_s [float], cost_s [float]
- ``switch_start``: switch_id [str], step [int], from_train [int], from_rollout [int], to_train [int], to_rollout [int]
  | planned_critical_s [float], mode ["optimized"|"naive"]
- ``switch_op``: switch_id [str], op [:class:`SwitchOp`], ranks [str], start [float], end [float], critical [bool]
  | bytes [int]  (``critical`` false means the op ran in the background, hidden behind other work)
- ``switch_end``: switch_id [str], critical_path_s [float] | hidden_s [float]
- ``rank``: rank [int], state ["registered"|"alive"|"dead"|"rejoined"|"left"] | host [str], incarnation [int]
- ``metric``: name [str], value [float] | step [int], rank [int]
- ``control``: what [str], reason [str] | rank [int], command_id [str], epoch [int]  (rejected or notable
  control-plane messages)

Version history: 1 (first).
"""

from __future__ import annotations

import enum
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

SCHEMA_VERSION = 1
EVENTS_FILE = "events.jsonl"


class Role(str, enum.Enum):
    """A rank's role: the event log's, the heartbeats' and the scheduler core's (which assigns TRAIN and ROLLOUT;
    IDLE: a stopping rank, the control demo's before its first role)."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    IDLE = "idle"


class Stage(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"
    SWITCH = "switch"
    CHECKPOINT = "checkpoint"


class SwitchOp(str, enum.Enum):
    """Fine-grained operations a role switch is made of (the simulator and the runtime use the same names)."""

    DRAIN = "drain"  # finish or hand back in-flight rollout work
    OFFLOAD = "offload"  # engine state off the device (vLLM sleep, trainer to host)
    ONLOAD = "onload"  # engine state back on the device (vLLM wake_up)
    PROCESS_RESTART = "process_restart"  # naive: kill the worker and start a new one
    COMM_INIT = "comm_init"  # naive: init_process_group / new_group
    COMM_SELECT = "comm_select"  # optimised: pick a pre-built group
    WEIGHT_LOAD = "weight_load"  # load weights from disk/staging
    WEIGHT_SYNC = "weight_sync"  # trainer -> rollout broadcast
    OPTIMIZER_STAGE_OUT = "optimizer_stage_out"  # optimizer state to node-local staging
    OPTIMIZER_STAGE_IN = "optimizer_stage_in"  # optimizer state back (deferred: at the first step)
    OPTIMIZER_RESHARD = "optimizer_reshard"  # ZeRO partitions re-split for a new trainer count
    ENGINE_BUILD = "engine_build"  # build the training/rollout engine on the new topology
    WARMUP = "warmup"


class EventType(str, enum.Enum):
    RUN_START = "run_start"
    RUN_END = "run_end"
    STEP_START = "step_start"
    STEP_END = "step_end"
    STAGE = "stage"
    TOPOLOGY = "topology"
    ROLE_CHANGE = "role_change"
    DECISION = "decision"
    SWITCH_START = "switch_start"
    SWITCH_OP = "switch_op"
    SWITCH_END = "switch_end"
    RANK = "rank"
    METRIC = "metric"
    CONTROL = "control"


_NUM = (int, float)
REQUIRED: dict[EventType, dict[str, tuple[type, ...]]] = {
    EventType.RUN_START: {"run_id": (str,), "source": (str,), "world_size": (int,), "wall_time": _NUM},
    EventType.RUN_END: {"status": (str,), "steps": (int,)},
    EventType.STEP_START: {"step": (int,)},
    EventType.STEP_END: {"step": (int,), "samples": (int,)},
    EventType.STAGE: {"step": (int,), "stage": (str,), "ranks": (str,), "start": _NUM, "end": _NUM},
    EventType.TOPOLOGY: {"step": (int,), "train_ranks": (str,), "rollout_ranks": (str,)},
    EventType.ROLE_CHANGE: {"step": (int,), "ranks": (str,), "from_role": (str,), "to_role": (str,)},
    EventType.DECISION: {"step": (int,), "action": (str,), "reason": (str,)},
    EventType.SWITCH_START: {
        "switch_id": (str,), "step": (int,), "from_train": (int,), "from_rollout": (int,), "to_train": (int,), "to_rollout": (int,),
    },
    EventType.SWITCH_OP: {"switch_id": (str,), "op": (str,), "ranks": (str,), "start": _NUM, "end": _NUM, "critical": (bool,)},
    EventType.SWITCH_END: {"switch_id": (str,), "critical_path_s": _NUM},
    EventType.RANK: {"rank": (int,), "state": (str,)},
    EventType.METRIC: {"name": (str,), "value": _NUM},
    EventType.CONTROL: {"what": (str,), "reason": (str,)},
}
_ENUM_FIELDS: dict[str, type[enum.Enum]] = {"stage": Stage, "op": SwitchOp, "from_role": Role, "to_role": Role}
_RESERVED = ("v", "type", "t")


class EventError(ValueError):
    """A line or event that does not follow the schema."""


@dataclass(frozen=True, slots=True)
class Event:
    """One validated event. ``data`` holds every key except ``v``, ``type`` and ``t``."""

    type: EventType
    t: float
    data: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def to_json(self) -> str:
        return json.dumps({"v": SCHEMA_VERSION, "type": self.type.value, "t": self.t, **self.data}, separators=(",", ":"))


def validate(obj: Any) -> Event:
    """Check a decoded line against the schema and return it as an :class:`Event` (raises :class:`EventError`)."""
    if not isinstance(obj, dict):
        raise EventError(f"not a JSON object: {type(obj).__name__}")
    v = obj.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise EventError(f"bad or missing schema version v={v!r}")
    if v > SCHEMA_VERSION:
        raise EventError(f"schema version {v} is newer than this reader ({SCHEMA_VERSION})")
    try:
        etype = EventType(obj.get("type"))
    except ValueError:
        raise EventError(f"unknown event type {obj.get('type')!r}") from None
    t = obj.get("t")
    if not isinstance(t, _NUM) or isinstance(t, bool):
        raise EventError(f"{etype.value}: bad or missing time t={t!r}")
    for key, types in REQUIRED[etype].items():
        val = obj.get(key)
        ok = isinstance(val, types) and (bool in types or not isinstance(val, bool))
        if not ok:
            raise EventError(f"{etype.value}: key {key!r} = {val!r}: expected {'/'.join(t.__name__ for t in types)}")
    for key, en in _ENUM_FIELDS.items():
        if key in obj and etype in (EventType.STAGE, EventType.SWITCH_OP, EventType.ROLE_CHANGE):
            try:
                en(obj[key])
            except ValueError:
                raise EventError(f"{etype.value}: key {key!r} = {obj[key]!r}: allowed: {[m.value for m in en]}") from None
    data = {k: val for k, val in obj.items() if k not in _RESERVED}
    return Event(etype, float(t), data)


def make_event(etype: EventType | str, t: float, **data: Any) -> Event:
    """Build and validate an event (used by writers, so a bad event fails where it is made, not in a reader)."""
    etype = EventType(etype)
    clean = {k: (val.value if isinstance(val, enum.Enum) else val) for k, val in data.items()}
    return validate({"v": SCHEMA_VERSION, "type": etype.value, "t": t, **clean})


class EventLog:
    """Append-only writer of ``events.jsonl``. Thread-safe; safe across processes (one write per line, O_APPEND).

    ``clock`` gives ``t``: by default seconds since ``t0`` (the wall time of the run's start, read from the file's
    ``run_start`` event when appending to an existing log, so that resumed runs keep one time axis). The simulator
    passes explicit times to :meth:`emit_at`.
    """

    def __init__(self, path: str | Path, t0: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        if t0 is None:
            t0 = _existing_t0(self.path)
        self.t0 = time.time() if t0 is None else t0

    def now(self) -> float:
        return time.time() - self.t0

    def emit(self, etype: EventType | str, **data: Any) -> Event:
        """Write an event stamped with the current run time."""
        return self.emit_at(self.now(), etype, **data)

    def emit_at(self, t: float, etype: EventType | str, **data: Any) -> Event:
        ev = make_event(etype, t, **data)
        self.write(ev)
        return ev

    def write(self, ev: Event) -> None:
        line = (ev.to_json() + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def write_many(self, events: Iterable[Event]) -> None:
        """Write several events in one system call (the simulator's fast path)."""
        blob = "".join(ev.to_json() + "\n" for ev in events).encode()
        with self._lock:
            os.write(self._fd, blob)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _existing_t0(path: Path) -> float | None:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("type") == EventType.RUN_START.value:
                    wall = obj.get("wall_time")
                    return float(wall) if isinstance(wall, _NUM) else None
    except FileNotFoundError:
        return None
    return None


@dataclass
class ReadStats:
    """What a reader skipped: bad lines are counted (with the first few reasons), never fatal."""

    lines: int = 0
    events: int = 0
    bad: int = 0
    reasons: list[str] = field(default_factory=list)

    def note(self, lineno: int, reason: str) -> None:
        self.bad += 1
        if len(self.reasons) < 20:
            self.reasons.append(f"line {lineno}: {reason}")


def read_events(path: str | Path, stats: ReadStats | None = None, types: set[EventType] | None = None) -> Iterator[Event]:
    """Stream the events of a log (a file, or a run directory holding ``events.jsonl``).

    Damaged lines (a run killed in the middle of a write, a truncated file, garbage) are skipped and counted in
    ``stats``; this never raises on content. ``types`` filters before full validation (faster for big logs).
    """
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    stats = stats if stats is not None else ReadStats()
    wanted = {t.value for t in types} if types else None
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            stats.lines += 1
            try:
                obj = json.loads(raw)
            except ValueError as e:
                stats.note(lineno, f"not JSON ({e.__class__.__name__})")
                continue
            if wanted is not None and isinstance(obj, dict) and obj.get("type") not in wanted:
                if obj.get("type") in EventType._value2member_map_:
                    continue
            try:
                ev = validate(obj)
            except EventError as e:
                stats.note(lineno, str(e))
                continue
            stats.events += 1
            yield ev


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6, 8, 9]`` -> ``"0-3,6,8-9"`` (sorted, deduplicated; ``""`` for none)."""
    rs = sorted(set(int(r) for r in ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def parse_ranks(text: str) -> list[int]:
    """Inverse of :func:`format_ranks`; raises ``ValueError`` on a malformed rank-set string."""
    out: list[int] = []
    if not text:
        return out
    for part in text.split(","):
        a, sep, b = part.partition("-")
        if not a.isdigit() or (sep and not b.isdigit()):
            raise ValueError(f"bad rank set {text!r} (part {part!r}); expected e.g. '0-3,6'")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo:
            raise ValueError(f"bad rank set {text!r}: range {part!r} is decreasing")
        out.extend(range(lo, hi + 1))
    return out


def count_ranks(text: str) -> int:
    """Number of ranks in a rank-set string, without expanding it."""
    n = 0
    if not text:
        return 0
    for part in text.split(","):
        a, sep, b = part.partition("-")
        n += (int(b) - int(a) + 1) if sep else 1
    return n
