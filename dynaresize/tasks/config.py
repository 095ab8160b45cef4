"""Config of the RL task (section ``task``): which task, its parameters, and the length curriculum."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dynaresize.config.base import Section


class TaskConfig(Section):
    name: str = Field(
        "dynaresize.tasks.reverse:ReverseDigits",
        description="Importable 'module:Class' path of the task (prompts, reference answers, reward)",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the task's constructor")
