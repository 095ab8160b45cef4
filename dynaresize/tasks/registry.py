"""Load the task named in the config: an importable 'module:Class' path (or a built-in short name) plus kwargs.

Every mistake (bad path, missing class, wrong kwargs, an object that is not a Task) raises one ``ConfigError``
naming ``task.name`` / ``task.params`` and the value, so a typo in the YAML fails at start-up, not mid-run.
"""

from __future__ import annotations

import importlib
import inspect

from dynaresize.config.base import ConfigError
from dynaresize.tasks.base import Curriculum, Task
from dynaresize.tasks.config import TaskConfig

#: Short names accepted in ``task.name`` besides full 'module:Class' paths.
BUILTIN_TASKS = {
    "reverse_digits": "dynaresize.tasks.reverse:ReverseDigits",
    "sort_letters": "dynaresize.tasks.sort:SortLetters",
    "span_letters": "dynaresize.tasks.span:SpanLetters",
    "dataset": "dynaresize.tasks.dataset:DatasetTask",
}


def resolve_class(name: str) -> type:
    path = BUILTIN_TASKS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"task.name = {name!r}: expected 'module:Class' (e.g. 'dynaresize.tasks.reverse:ReverseDigits') "
            f"or one of {sorted(BUILTIN_TASKS)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task.name = {name!r}: cannot import module {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"task.name = {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise ConfigError(f"task.name = {name!r}: {attr!r} is a {type(obj).__name__}, expected a class")
    return obj


def load_task(cfg: TaskConfig) -> Task:
    """Instantiate ``cfg.name`` with ``cfg.params`` (and ``curriculum=`` when its constructor takes one)."""
    cls = resolve_class(cfg.name)
    kwargs = dict(cfg.params)
    try:
        accepts_curriculum = "curriculum" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepts_curriculum = False
    if accepts_curriculum and "curriculum" not in kwargs:
        kwargs["curriculum"] = Curriculum.from_config(cfg.curriculum)
    if _accepts(cls, "dataset") and "dataset" not in kwargs:
        kwargs["dataset"] = cfg.dataset
    try:
        task = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"task.params = {cfg.params!r}: {cfg.name} does not accept them: {e}") from None
    if callable(getattr(task, "sample", None)):  # a dataset: samples and references; reward from reward.function
        missing = [m for m in ("reference",) if not callable(getattr(task, m, None))]
    else:
        missing = [m for m in ("prompt", "answer", "reward") if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"task.name = {cfg.name!r}: not a Task (missing methods {missing}); see dynaresize.tasks.base.Task")
    return task


def _accepts(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
