"""ReverseDigits: reverse a digit string ('r:4071=' -> '1704'); answer length = problem size (long-tailed)."""

from __future__ import annotations

import random

from dynaresize.tasks.base import LengthTailTask


class ReverseDigits(LengthTailTask):
    prefix = "r:"

    def _body(self, rng: random.Random, n: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(n))

    def answer(self, prompt: str) -> str:
        return self.problem(prompt)[::-1]
