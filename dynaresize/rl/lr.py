"""The learning rate of each optimizer step (``train.lr``, ``lr_warmup_steps``, ``lr_schedule``, ``min_lr_ratio``).

A pure function of the run's optimizer-step count, never a scheduler object inside a trainer engine: trainers are
rebuilt on every role switch and on a resume, and a fresh scheduler would start its warmup again each time. The
worker sets the LR of optimizer step ``i`` (0-based, counted over the whole run: RL step ``k`` of ``mini_batches x
epochs`` updates owns steps ``k x mini_batches x epochs`` onwards) right before that step, so the sequence is the
same for any trainer count, any switch and any resume.

verl's (and Hugging Face's) schedules, value for value (``get_constant_schedule_with_warmup``,
``get_cosine_schedule_with_warmup`` with ``min_lr_ratio`` and ``num_cycles = 0.5``), the scheduler stepped after
each update, so update ``i`` uses the factor of ``i``::

    warmup w > 0, i < w:  lr x i / w                              (update 0 runs at LR 0, as in verl)
    constant:             lr
    cosine:               lr x (m + (1 - m) x 0.5 x (1 + cos(pi x (i - w) / max(1, T - w))))

with ``m = min_lr_ratio`` and ``T`` the run's optimizer steps (``run.steps x mini_batches x epochs``). Worked
example, lr 1e-3, w = 2, T = 6, cosine, m = 0.1: 0, 5e-4, 1e-3, 8.682e-4, 5.5e-4, 2.318e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LrSchedule:
    lr: float
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int = 1  # optimizer steps of the whole run (cosine reaches min_lr_ratio x lr there)

    @classmethod
    def from_config(cls, train, rl_steps: int) -> "LrSchedule":
        """From a ``TrainConfig`` and the run's RL steps (``run.steps``)."""
        per_step = int(getattr(train, "mini_batches", 1)) * int(getattr(train, "epochs", 1))
        return cls(float(train.lr), int(getattr(train, "lr_warmup_steps", 0)), getattr(train, "lr_schedule", "constant"),
                   float(getattr(train, "min_lr_ratio", 0.0)), max(1, int(rl_steps) * per_step))

    def __call__(self, step: int) -> float:
        """The LR of optimizer step ``step`` (0-based over the run)."""
        if step < 0:
            raise ValueError(f"optimizer step {step} < 0")
        w = self.warmup_steps
        if step < w:
            return self.lr * step / max(1, w)
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - w) / max(1, self.total_steps - w))
        m = self.min_lr_ratio
        return self.lr * max(0.0, m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress)))
