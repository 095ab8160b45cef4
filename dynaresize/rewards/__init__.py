"""Rewards: a function picked by import path, called as verl calls ``compute_score``, guarded so it never takes a rank down.

``load_reward(cfg)`` returns a :class:`Reward` for the root config: ``reward.function`` when set, else the task's own
reward (:class:`dynaresize.tasks.base.TaskReward`). ``reward.function`` is an import path (``"module:function"``) or
a file (``"path/to/my_reward.py:function"``, relative to the working directory: verl's
``custom_reward_function.path`` and ``.name`` joined by a colon).

The call is verl's reward-manager convention: by keyword, ``data_source=``, ``solution_str=``, ``ground_truth=``,
``extra_info=`` plus the keys of ``reward.kwargs`` (verl's ``reward_kwargs``). Only the parameters the function
accepts are passed (a ``**kwargs`` parameter accepts all), so verl's own scorers run unchanged: gsm8k's
``compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)``, math's
``compute_score(solution_str, ground_truth)``, the 4-argument default. The signature is checked when the reward is
loaded, before any rank starts (:func:`call_plan`): a required parameter nothing supplies, a positional-only one, a
``reward.kwargs`` key it does not take, or no ``solution_str`` at all is one :class:`ConfigError` naming it. Why
keywords: a positional call hands verl's gsm8k scorer the ground truth as ``method``, and every sample scores 0. A
function that names none of verl's four parameters (``f(ds, response, truth, info)``, this project's earlier
convention) gets them by position, in verl's order.

Rollout ranks call it on every response they generate (``Reward.score``); a function that raises or returns
something that is not a finite number (a ``bool`` is not one either; a verl-style ``{"score": x, ...}`` dict is read
as ``x``) gives score 0 and an error text naming the sample key, which the coordinator reports; it stops the run at
the first one (``reward.on_error: fail``) or when more than ``reward.max_error_fraction`` of a batch failed
(``dynaresize.job.rollout``), so a broken reward never trains on zeros.
"""

from __future__ import annotations

import importlib
import inspect
from math import isfinite  # (not `import math`: the submodule dynaresize.rewards.math would shadow it)
from dataclasses import dataclass
from typing import Any, Callable

from dynaresize.config.loader import ConfigError

BUILTIN_REWARDS = {"math": "dynaresize.rewards.math:compute_score"}
SUPPLIED = ("data_source", "solution_str", "ground_truth", "extra_info")  # what every call offers (verl's names)


@dataclass(frozen=True)
class Scored:
    score: float
    error: str | None = None  # why the reward function failed (score is then 0.0)


def resolve_function(path: str, what: str = "reward.function") -> Callable[..., Any]:
    """``module:function`` (or a built-in short name) as a callable; one :class:`ConfigError` when it is not one."""
    full = BUILTIN_REWARDS.get(path, path)
    module_name, sep, attr = full.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} = {path!r}: expected 'module:function' (e.g. 'dynaresize.rewards.math:compute_score'), "
                          f"'path/to/file.py:function', or one of {sorted(BUILTIN_REWARDS)}")
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


@dataclass(frozen=True)
class CallPlan:
    """How a reward function is called: by keyword with ``names`` (and reward.kwargs), or, for a function that names
    none of verl's parameters, positionally with all four in verl's order (``positional``)."""

    names: tuple[str, ...]
    positional: bool = False


def call_plan(fn: Callable[..., Any], name: str, kwargs: dict[str, Any] | None = None) -> CallPlan:
    """How ``fn`` is called (see :class:`CallPlan`); one :class:`ConfigError` naming the parameter when the call
    cannot work. A function whose signature cannot be read gets all four by keyword (verl's call)."""
    kwargs = dict(kwargs or {})
    clash = sorted(set(kwargs) & set(SUPPLIED))
    if clash:
        raise ConfigError(f"reward.kwargs: {clash[0]!r} is supplied per sample ({', '.join(SUPPLIED)}); remove it")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return CallPlan(SUPPLIED)
    offered = set(SUPPLIED) | set(kwargs)
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes = f"it takes {', '.join(p.name for p in params) or 'nothing'}"
    if not takes_all and not {p.name for p in params} & set(SUPPLIED):
        return _by_position(params, name, kwargs, takes)
    offers = f"a reward is called by keyword with {', '.join(SUPPLIED)} and the keys of reward.kwargs"
    for p in params:
        if p.kind is p.POSITIONAL_ONLY and (p.name in offered or p.default is p.empty):
            raise ConfigError(f"reward.function = {name!r}: parameter {p.name!r} is positional-only; {offers}")
        if p.name in by_name and p.default is p.empty and p.name not in offered:
            raise ConfigError(f"reward.function = {name!r}: required parameter {p.name!r} is never supplied ({offers}); "
                              f"give it a default or set reward.kwargs.{p.name}")
    if not takes_all:
        unknown = sorted(set(kwargs) - set(by_name))
        if unknown:
            raise ConfigError(f"reward.kwargs: {unknown[0]!r} is not a parameter of {name!r} ({takes})")
        if "solution_str" not in by_name:
            raise ConfigError(f"reward.function = {name!r}: takes no 'solution_str' parameter, so it never sees the "
                              f"response ({offers}; {takes})")
    return CallPlan(tuple(n for n in SUPPLIED if takes_all or n in by_name))


def _by_position(params: list[inspect.Parameter], name: str, kwargs: dict[str, Any], takes: str) -> CallPlan:
    """A function that names none of verl's parameters, e.g. ``f(ds, response, truth, info)``: the four in verl's
    order, by position (this project's earlier convention), when it can take them so."""
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(SUPPLIED) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(f"reward.function = {name!r}: names none of verl's parameters ({', '.join(SUPPLIED)}) "
                          f"and cannot take them by position either ({takes})")
    unknown = sorted(set(kwargs) - {p.name for p in params[len(SUPPLIED):]})
    if unknown:
        raise ConfigError(f"reward.kwargs: {unknown[0]!r} is not a parameter of {name!r} ({takes})")
    extra = [p.name for p in positional[len(SUPPLIED):] if p.default is p.empty and p.name not in kwargs]
    if extra:
        raise ConfigError(f"reward.function = {name!r}: required parameter {extra[0]!r} is never supplied ({takes})")
    return CallPlan(SUPPLIED, positional=True)


class Reward:
    """A compute_score-style function behind a guard (see the module docstring); its signature is checked here."""

    def __init__(self, fn: Callable[..., Any], name: str, kwargs: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.name = name
        self.kwargs = dict(kwargs or {})
        self.plan = call_plan(fn, name, self.kwargs)

    def score(self, key: str, info: dict[str, Any], response: str) -> Scored:
        offered = {"data_source": info.get("data_source", ""), "solution_str": response,
                   "ground_truth": info.get("ground_truth"), "extra_info": info.get("extra_info") or {}}
        try:
            if self.plan.positional:
                value = self.fn(*offered.values(), **self.kwargs)
            else:
                value = self.fn(**{n: offered[n] for n in self.plan.names}, **self.kwargs)
        except Exception as e:  # noqa: BLE001 - a user's reward must never crash the rank
            return Scored(0.0, f"sample {key}: reward {self.name} raised {type(e).__name__}: {str(e)[:200] or '(no message)'}")
        if isinstance(value, dict) and "score" in value:
            value = value["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isfinite(float(value)):
            return Scored(0.0, f"sample {key}: reward {self.name} returned {repr(value)[:80]}, not a finite number")
        return Scored(float(value))


def load_reward(cfg, task: Any = None) -> Reward:
    """The run's reward for the root ``Config``; ``task`` (loaded already, or loaded here) for the task's own."""
    if cfg.reward.function:
        return Reward(resolve_function(cfg.reward.function), cfg.reward.function, cfg.reward.kwargs)
    from dynaresize.tasks.base import TaskReward
    from dynaresize.tasks.registry import load_task

    task = task if task is not None else load_task(cfg.task)
    if not callable(getattr(task, "reward", None)):
        raise ConfigError(f"reward.function: unset, and task {cfg.task.name!r} has no reward of its own; set it, e.g. "
                          "reward.function: dynaresize.rewards.math:compute_score")
    return Reward(TaskReward(task), f"{cfg.task.name} (the task's own)", cfg.reward.kwargs)
