"""Config of the RL task (section ``task``): which task, its parameters, and the length curriculum.

The curriculum is generic (any task built on :class:`dynaresize.tasks.base.LengthTailTask` reads it): the problem
size ``n`` is drawn with probability proportional to ``n ** -alpha`` on ``[min_len, max_len]``, and ``max_len`` and
``alpha`` move linearly from their start to their end values over ``ramp_steps`` RL steps. A growing ``max_len``
and a falling ``alpha`` make responses longer and the tail heavier as the run goes on (as real RL runs do), so the
best train:rollout split drifts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from dynaresize.config.base import RuleError, Section


class CurriculumConfig(Section):
    min_len: int = Field(1, ge=1, description="Smallest problem size n (digits to reverse, letters to sort)")
    max_len_start: int = Field(8, ge=1, description="Largest problem size at step 0")
    max_len_end: int = Field(16, ge=1, description="Largest problem size once the ramp is over")
    alpha_start: float = Field(1.5, ge=0, description="Tail exponent at step 0: P(n) ~ n^-alpha (larger: shorter answers)")
    alpha_end: float = Field(0.8, ge=0, description="Tail exponent once the ramp is over (smaller: heavier tail)")
    ramp_steps: int = Field(20, ge=0, description="RL steps over which max_len and alpha move linearly (0: end values from step 0)")

    @model_validator(mode="after")
    def _lengths_are_ordered(self) -> "CurriculumConfig":
        for key in ("max_len_start", "max_len_end"):
            if getattr(self, key) < self.min_len:
                raise RuleError(key, getattr(self, key), f"{key}={getattr(self, key)} is below min_len={self.min_len}")
        return self


class TaskConfig(Section):
    name: str = Field(
        "dynaresize.tasks.reverse:ReverseDigits",
        description="Importable 'module:Class' path of the task (prompts, reference answers, reward)",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the task's constructor")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig,
        description="Length distribution and its drift over steps (passed to tasks whose constructor takes 'curriculum')",
    )
