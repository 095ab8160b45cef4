"""Config of the RL task (section ``task``): which task, its parameters, and the length curriculum.

The curriculum is generic (any task built on :class:`dynaresize.tasks.base.LengthTailTask` reads it): the problem
size ``n`` is drawn with probability proportional to ``n ** -alpha`` on ``[min_len, max_len]``, and ``max_len`` and
``alpha`` move linearly from their start to their end values over ``ramp_steps`` RL steps. A growing ``max_len``
and a falling ``alpha`` make responses longer and the tail heavier as the run goes on (as real RL runs do), so the
best train:rollout split drifts.
"""

from __future__ import annotations

from typing import Any, Literal

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


class DatasetConfig(Section):
    """Files and schedule of the dataset task (``task.name: dataset``), verl's record layout."""

    train_files: list[str] = Field(
        default_factory=list, description="Training records: .jsonl/.json (one object a line) or .parquet files, read in order"
    )
    val_files: list[str] = Field(default_factory=list, description="Held-out validation records (same layout); empty: no validation")
    shuffle: bool = Field(True, description="Shuffle the training records each epoch, by a permutation drawn from run.seed and the epoch")
    epochs: int | None = Field(
        None, ge=1, description="Passes over the training records; the run is refused when run.steps needs more (unset: cycle for ever)"
    )
    val_every: int = Field(10, ge=0, description="Steps between validation passes (also before the first and after the last step); 0: never")
    val_samples: int = Field(4, ge=1, description="Responses per validation prompt: k of pass@k (a response with reward >= 1 passes)")
    val_max_prompts: int | None = Field(None, ge=1, description="Validation prompts used (the first ones in file order; unset: all)")
    val_temperature: float | None = Field(
        None, ge=0, description="Sampling temperature of validation passes (null: rollout.temperature; 0: greedy, the "
        "most likely token each step); verl's rollout.val_kwargs.temperature"
    )
    val_top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus threshold of validation passes (null: rollout.top_p); verl's "
        "rollout.val_kwargs.top_p"
    )


class RewardConfig(Section):
    """Which function scores a response (on the rollout ranks) and what a failing one does."""

    function: str | None = Field(
        None, description="'module:function' or 'path/to/file.py:function' (verl's custom_reward_function path:name), "
        "called by keyword as verl's reward manager does: data_source, solution_str, ground_truth, extra_info and "
        "reward.kwargs, each only if the function takes it (checked before any rank starts); returns a number or "
        "{'score': x, ...}. Built in: dynaresize.rewards.math:compute_score. Unset: the task's own reward"
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments of every call (verl's reward_kwargs), e.g. "
        "{method: flexible, format_score: 0.1}; a key the function does not take is refused at start-up"
    )
    on_error: Literal["zero", "fail"] = Field(
        "zero", description="A reward that raises or returns a non-number: score the sample 0 and report it with its key "
        "(zero), or fail the run with that report (fail)"
    )
    max_error_fraction: float = Field(
        0.5, ge=0, le=1, description="With on_error=zero: stop the run (exit 1, one message naming the function, the "
        "first error and its sample) once more than this share of a batch's samples failed, instead of training on "
        "zeros; 1: never stop"
    )


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
    dataset: DatasetConfig = Field(
        default_factory=DatasetConfig, description="Dataset files and schedule (passed to tasks whose constructor takes 'dataset')"
    )
