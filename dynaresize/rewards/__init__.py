"""Rewards: a function picked by import path, called as verl's ``compute_score``, guarded so it never takes a rank down.

``load_reward(cfg)`` returns a :class:`Reward` for the root config: ``reward.function`` (``"module:function"``, or
``"path/to/file.py:function"`` for a file outside any package, relative to the working directory) when set, else the task's own reward (:class:`dynaresize.tasks.base.TaskReward`). Rollout ranks call it on every
response they generate (``Reward.score``); a function that raises or returns something that is not a finite number
(a ``bool`` is not one either; a verl-style ``{"score": x, ...}`` dict is read as ``x``) gives score 0 and an error
text naming the sample key, which the coordinator reports (``reward.on_error: zero``) or fails the run with
(``reward.on_error: fail``).
"""

from __future__ import annotations

import importlib
from math import isfinite  # (not `import math`: the submodule dynaresize.rewards.math would shadow it)
from dataclasses import dataclass
from typing import Any, Callable

from dynaresize.config.loader import ConfigError

BUILTIN_REWARDS = {"math": "dynaresize.rewards.math:compute_score"}


@dataclass(frozen=True)
class Scored:
    score: float
    error: str | None = None  # why the reward function failed (score is then 0.0)


def resolve_function(path: str, what: str = "reward.function") -> Callable[..., Any]:
    """``module:function`` (or a built-in short name) as a callable; one :class:`ConfigError` when it is not one."""
    full = BUILTIN_REWARDS.get(path, path)
    module_name, sep, attr = full.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} = {path!r}: expected 'module:function' (e.g. 'dynaresize.rewards.math:compute_score') "
                          f"or one of {sorted(BUILTIN_REWARDS)}")
    try:
        obj: Any = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an import that fails in any way is one clear message
        raise ConfigError(f"{what} = {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} = {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what} = {path!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _load_file(file: str):
    """A reward module given as a file (``path/to/my_reward.py:compute_score``, verl's custom_reward_function.path)."""
    import importlib.util
    import sys
    from pathlib import Path

    p = Path(file).expanduser().resolve()
    if not p.is_file():
        raise ConfigError(f"reward.function = '{file}:...': no such file {p}")
    name = f"dynaresize_user_reward_{abs(hash(str(p)))}"
    spec = importlib.util.spec_from_file_location(name, p)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Reward:
    """A compute_score-style function behind a guard (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name

    def score(self, key: str, info: dict[str, Any], response: str) -> Scored:
        try:
            value = self.fn(info.get("data_source", ""), response, info.get("ground_truth"), info.get("extra_info") or {})
        except Exception as e:  # noqa: BLE001 - a user's reward must never crash the rank
            return Scored(0.0, f"sample {key}: reward {self.name} raised {type(e).__name__}: {str(e)[:200]}")
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isfinite(float(value)):
            return Scored(0.0, f"sample {key}: reward {self.name} returned {repr(value)[:80]}, not a finite number")
        return Scored(float(value))


def load_reward(cfg, task: Any = None) -> Reward:
    """The run's reward for the root ``Config``; ``task`` (loaded already, or loaded here) for the task's own."""
    if cfg.reward.function:
        return Reward(resolve_function(cfg.reward.function), cfg.reward.function)
    from dynaresize.tasks.base import TaskReward
    from dynaresize.tasks.registry import load_task

    task = task if task is not None else load_task(cfg.task)
    if not callable(getattr(task, "reward", None)):
        raise ConfigError(f"reward.function: unset, and task {cfg.task.name!r} has no reward of its own; set it, e.g. "
                          "reward.function: dynaresize.rewards.math:compute_score")
    return Reward(TaskReward(task), f"{cfg.task.name} (the task's own)")
