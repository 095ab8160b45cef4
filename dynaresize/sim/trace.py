"""A trace workload: the simulator's batches taken from a run's ``batches.jsonl`` instead of drawn.

``sim.workload.trace`` names a run's ``batches.jsonl`` (or the run directory holding it). Each line is one trained
step (written by :class:`dynaresize.job.reporting.Reporter`): ``keys`` (``step.prompt.index``), and per sample, in
the order of ``keys``, ``prompt_tokens`` and ``response_tokens``. Step k's :class:`~dynaresize.sim.workload.Batch`
is that step's logged samples: response lengths in dispatch order (prompt order, the G responses of a prompt
consecutive, by their index), one prompt length per prompt, all kept, each length multiplied by
``sim.workload.trace_token_scale`` (an emulated run: ``emulation.tokens_per_token``) and rounded (at least 1).

Every problem is one :class:`TraceError` naming the file, the line and the key: a missing file, a line that is not
a record, a record without per-sample lengths (a log written before they were logged), lengths that do not match
the keys, a step that appears twice or is missing, prompts of different group sizes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and key."""


@dataclass(frozen=True)
class TraceStep:
    response_tokens: np.ndarray  # per sample, dispatch order (prompt order, G per prompt), float64
    prompt_tokens: np.ndarray  # per prompt, prompt order, float64


@dataclass(frozen=True)
class Trace:
    path: Path
    group_size: int
    steps: tuple[TraceStep, ...]  # step k at index k (every step from 0 is present)


def trace_file(path: str | Path) -> Path:
    """The ``batches.jsonl`` that ``path`` names (the file itself, or a run directory holding it)."""
    p = Path(path)
    return p / "batches.jsonl" if p.is_dir() else p


_CACHE: dict[tuple[str, int, int], Trace] = {}


def load_trace(path: str | Path) -> Trace:
    """The parsed trace (cached per file, size and modification time: a simulation asks for it once per step)."""
    f = trace_file(path)
    try:
        st = os.stat(f)
    except OSError as e:
        raise TraceError(f"{f}: cannot read the trace: {e.strerror or e} (want a run's batches.jsonl or its run directory)") from None
    key = (str(f.resolve()), st.st_mtime_ns, st.st_size)
    tr = _CACHE.get(key)
    if tr is None:
        tr = _parse(f)
        _CACHE.clear()
        _CACHE[key] = tr
    return tr


def _ints(f: Path, n: int, rec: dict, name: str, want: int) -> list[int]:
    v = rec.get(name)
    if v is None:
        raise TraceError(f"{f} line {n}: no {name!r} (a batches.jsonl written before per-sample lengths were logged "
                         "cannot be replayed as a trace)")
    if not isinstance(v, list) or len(v) != want or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise TraceError(f"{f} line {n}: {name!r} must be {want} token counts >= 0 (one per key), got {str(v)[:80]}")
    return v


def _parse(f: Path) -> Trace:
    by_step: dict[int, TraceStep] = {}
    group_size: tuple[int, int] | None = None  # (G, line it was first seen on)
    for n, line in enumerate(f.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise TraceError(f"{f} line {n}: not a JSON record ({line[:60]!r})") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{f} line {n}: not a JSON object ({line[:60]!r})")
        step, keys = rec.get("step"), rec.get("keys")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TraceError(f"{f} line {n}: 'step' must be an integer >= 0, got {step!r}")
        if step in by_step:
            raise TraceError(f"{f} line {n}: 'step' {step} appears twice")
        if not isinstance(keys, list) or not keys:
            raise TraceError(f"{f} line {n}: 'keys' must be a non-empty list of sample keys 'step.prompt.index'")
        resp = _ints(f, n, rec, "response_tokens", len(keys))
        prm = _ints(f, n, rec, "prompt_tokens", len(keys))
        groups: dict[int, list[tuple[int, int]]] = {}  # prompt -> [(index, sample position)]
        plen: dict[int, int] = {}
        for i, k in enumerate(keys):
            parts = k.split(".") if isinstance(k, str) else []
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                raise TraceError(f"{f} line {n}: 'keys'[{i}] = {k!r} is not 'step.prompt.index'")
            p, j = int(parts[1]), int(parts[2])
            groups.setdefault(p, []).append((j, i))
            if plen.setdefault(p, prm[i]) != prm[i]:
                raise TraceError(f"{f} line {n}: 'prompt_tokens'[{i}] = {prm[i]}: prompt {p} has {plen[p]} tokens in "
                                 "another of its samples")
        sizes = {len(v) for v in groups.values()}
        if len(sizes) != 1:
            raise TraceError(f"{f} line {n}: 'keys': prompts with different group sizes {sorted(sizes)} (a trace needs "
                             "every prompt with the same number of responses)")
        g = sizes.pop()
        if group_size is None:
            group_size = (g, n)
        elif g != group_size[0]:
            raise TraceError(f"{f} line {n}: 'keys': group size {g}, but {group_size[0]} on line {group_size[1]} "
                             "(rows of different group sizes)")
        order = [i for p in sorted(groups) for _, i in sorted(groups[p])]
        by_step[step] = TraceStep(np.asarray([resp[i] for i in order], dtype=np.float64),
                                  np.asarray([plen[p] for p in sorted(groups)], dtype=np.float64))
    if not by_step:
        raise TraceError(f"{f}: no records (an empty batches.jsonl)")
    missing = sorted(set(range(max(by_step) + 1)) - set(by_step))
    if missing:
        raise TraceError(f"{f}: 'step' {missing[0]} is missing (the trace has steps {min(by_step)}..{max(by_step)}, "
                         f"{len(missing)} missing)")
    return Trace(f, group_size[0], tuple(by_step[k] for k in range(len(by_step))))


def scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """Token counts times ``scale``, rounded, at least 1 (the simulator's lengths are whole tokens >= 1)."""
    return np.maximum(np.rint(x * scale), 1.0)
