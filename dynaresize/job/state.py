"""The coordinator's checkpoint: everything needed to continue a run with the same step counter.

Written atomically (temp file + rename) to ``<run_dir>/checkpoints/coordinator.json`` after the ranks have
acknowledged staging their own state under ``checkpoints/<tag>/``. Buffered rollouts are not in this file: they
live in the run's Redis (append-only file in ``<run_dir>/redis``), keyed by sample, and survive the restart.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynaresize import atomic
from dynaresize.policy.types import DecodeProfile, Estimates, LeftSplit, PolicyState, Topology

STATE_FILE = "coordinator.json"
STATE_VERSION = 1


@dataclass
class JobState:
    step: int = 0  # next step to train
    version: int = 0  # policy version the ranks hold (updates applied)
    n_train: int = 1  # trainers (ranks 0..n_train-1)
    checkpoint: str | None = None  # directory (relative to the run dir) holding the ranks' staged state
    samples: int = 0  # samples trained on so far
    tokens: int = 0
    rewards: dict[str, float] = field(default_factory=dict)  # step -> mean reward of its batch
    switches: list[dict[str, Any]] = field(default_factory=list)
    policy: dict[str, Any] | None = None  # serialised PolicyState
    elapsed_s: float = 0.0  # wall time of all incarnations so far, start-up included
    loop_s: float = 0.0  # time spent in the RL loop (steps), all incarnations: what throughput is measured over
    incarnation: int = 0  # how many times the run was started (1 on the first start)
    lost: list[int] = field(default_factory=list)  # ranks declared lost and fenced off (the job runs without them)
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)  # policy version -> validation pass record
    # run.steps of the launch that wrote this state: batches from it on were never generated (an extended run, whose
    # run.steps is larger, generates them after the checkpoint); None in a state written before this field
    run_steps: int | None = None

    def to_json(self) -> str:
        return json.dumps({"state_version": STATE_VERSION, **asdict(self)}, indent=1, sort_keys=True)


def policy_to_dict(ps: PolicyState) -> dict[str, Any]:
    """The policy's state as JSON (``coordinator.json``, ``schedule.jsonl``'s header): everything but the pipeline
    predictor's batches (a restarted coordinator's policy plays from its next batches; they would put every response
    length of 8 batches into each checkpoint)."""
    d = asdict(ps)
    if d.get("estimates"):
        d["estimates"].pop("trace", None)
        d["estimates"].pop("play", None)  # (the same batches carried along their drift)
    return d


def policy_from_dict(d: dict[str, Any] | None) -> PolicyState | None:
    """The state :func:`policy_to_dict` wrote, every field (a takeover's replay starts its policy from it, as the
    segment's live coordinator did)."""
    if not d:
        return None
    est = d.get("estimates")
    return PolicyState(
        estimates=_estimates(est) if est else None,
        signal_dir=int(d.get("signal_dir", 0)),
        signal_count=int(d.get("signal_count", 0)),
        steps_since_resize=int(d.get("steps_since_resize", 10**9)),
        cooldown_left=int(d.get("cooldown_left", 0)),
        history=tuple(d.get("history", ())),
        here_ratio=None if d.get("here_ratio") is None else float(d["here_ratio"]),
        here_ratio_var=float(d.get("here_ratio_var", 0.0)),
        here_steps=int(d.get("here_steps", 0)),
        left=tuple(LeftSplit(**{**x, "topology": Topology(**x["topology"])}) for x in d.get("left", ())),
        resized_at=tuple(int(k) for k in d.get("resized_at", ())),
        forced_step=int(d.get("forced_step", -1)),
    )


def _estimates(d: dict[str, Any]) -> Estimates:
    est = {k: v for k, v in d.items() if k not in ("trace", "play", "decode", "ratios")}
    est["ratios"] = tuple((int(n), float(r)) for n, r in d.get("ratios", ()))
    prof = d.get("decode")
    if prof:
        est["decode"] = DecodeProfile(**{**prof, "group_max": tuple(prof["group_max"])})
    return Estimates(**est)


def save_state(run_dir: Path, st: JobState) -> Path:
    """``<run_dir>/checkpoints/coordinator.json``, atomically (temp file, fsync, rename)."""
    return write_state(Path(run_dir) / "checkpoints" / STATE_FILE, st)


def write_state(path: Path, st: JobState) -> Path:
    """Write ``st`` to ``path`` atomically: a temp file next to it, fsynced, renamed over it, the directory fsynced.
    On any error (a full disk) the temp file is removed and the old file, if any, is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic.write_text(path, st.to_json())


class StateError(ValueError):
    pass


def load_state(run_dir: Path) -> JobState | None:
    path = Path(run_dir) / "checkpoints" / STATE_FILE
    if not path.exists():
        return None
    return read_state(path)


def read_state(path: Path) -> JobState:
    """Parse one coordinator state file; :class:`StateError` names the file and what is wrong with it."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{path}: missing") from None
    except ValueError as e:
        raise StateError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    except OSError as e:
        raise StateError(f"{path}: unreadable ({e})") from None
    if not isinstance(d, dict):
        raise StateError(f"{path}: not a JSON object; the checkpoint is damaged")
    if d.pop("state_version", None) != STATE_VERSION:
        raise StateError(f"{path}: unknown state_version (this build reads {STATE_VERSION})")
    try:
        return JobState(**d)
    except TypeError as e:
        raise StateError(f"{path}: {e}") from None
