"""The scheduler core's vocabulary as JSON: a driver logs every event it feeds the core and every action it gets back
(the runtime's ``schedule.jsonl``), and a replay decodes the events and compares the actions it gets with the logged
ones (``tests/integration/test_continuous_schedule.py``). Pure: values to plain dicts and back, no I/O.

An encoded value is ``{"type": <class name>, <field>: <value>, ...}``; tuples become lists, enums their value,
nested dataclasses (an :class:`~dynaresize.policy.types.Observation`, a :class:`~dynaresize.policy.types.Decision`)
encoded values of their own.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

from dynaresize.policy.types import Decision, Observation, PipelineWorkload, PlannedOp, ResizeAction, Topology
from dynaresize.schedule import types as T

_KNOWN: dict[str, type] = {c.__name__: c for c in (
    T.RankReady, T.GroupsDone, T.TrainChunkDone, T.OptimizerStepDone, T.WeightsArrived, T.SwitchDone, T.RankLost,
    T.StepMeasured, T.ValidationDone, T.Validate, T.Extend, T.DynamicSampling, T.Assign, T.Train, T.Step, T.SendWeights, T.Switch, T.Decided, T.Restart,
    T.SchedulerConfig, T.Mechanisms, Observation, PipelineWorkload, Topology, Decision, PlannedOp,
)}


class CodecError(ValueError):
    """A logged value that is not one of the core's (the log is damaged or from another version)."""


def encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"type": type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = encode(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(raw: Any) -> Any:
    """The value :func:`encode` made (fields rebuilt with their declared types: tuples, enums, nested values)."""
    if not isinstance(raw, dict) or "type" not in raw:
        raise CodecError(f"not an encoded scheduler value: {str(raw)[:120]}")
    cls = _KNOWN.get(raw["type"])
    if cls is None:
        raise CodecError(f"unknown scheduler value type {raw['type']!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _typed(hints[f.name], raw[f.name])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{raw['type']}: {e}") from None


def _typed(hint: Any, raw: Any) -> Any:
    if isinstance(raw, dict) and "type" in raw:
        return decode(raw)
    if raw is None:
        return None
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is tuple:
        inner = args[0] if args else Any
        return tuple(_typed(inner, v) for v in raw)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return _typed(args[0], raw) if len(args) == 1 else raw
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(raw)
    if hint is ResizeAction:
        return ResizeAction(raw)
    return raw
