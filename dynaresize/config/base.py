"""The base class every config section derives from.

Rules shared by all sections: unknown keys are errors (``extra="forbid"``), assignments are validated, a boolean is
not a number (YAML reads ``yes``/``on``/``true`` as booleans, and pydantic would silently take them as 1), and every
field carries a one-line ``description`` (a unit test walks the whole tree and fails on a field without one;
``dynaresize config fields`` prints them). A rule that spans fields (a ``model_validator``) raises :class:`RuleError`
naming the key it blames, so the loader's message names that key path, its value and where it was set.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from dynaresize.control.secret import redact


class ConfigError(ValueError):
    """A config that cannot be loaded: the message names the source, the key path, the value and what is allowed
    (a URL's password redacted: the message is printed and logged). It lives beside the sections, below everything
    that reads a config (the loader, the tasks that read their data at load), so none of them imports another for it."""

    def __init__(self, message: str):
        super().__init__(redact(str(message)))


class RuleError(ValueError):
    """A rule broken by ``key`` (a dotted path or tuple, relative to the section that checks the rule) with
    ``value``; ``str(err)`` says what is allowed."""

    def __init__(self, key: str | tuple, value: Any, message: str):
        super().__init__(message)
        self.key = tuple(key.split(".")) if isinstance(key, str) else tuple(key)
        self.value = value


def _is_number(annotation: Any) -> bool:
    """``int``, ``float``, a ``Literal`` of numbers (``Literal[0, 1, 2]`` takes ``True`` as 1) or an optional one."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) is typing.Literal:
        args = typing.get_args(annotation)
        return bool(args) and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(_is_number(a) for a in args)
    return False


class Section(BaseModel):
    """A YAML config section: strict, documented, JSON-serialisable."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and _is_number(field.annotation):
                    raise RuleError(name, value, f"expected a number, got the boolean {value} (YAML reads yes/no/on/off as booleans)")
        return data
