"""SortLetters: sort lowercase letters ('s:dbca=' -> 'abcd'); answer length = problem size (long-tailed)."""

from __future__ import annotations

import random
import string

from dynaresize.tasks.base import LengthTailTask


class SortLetters(LengthTailTask):
    prefix = "s:"

    def _body(self, rng: random.Random, n: int) -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    def answer(self, prompt: str) -> str:
        return "".join(sorted(self.problem(prompt)))
