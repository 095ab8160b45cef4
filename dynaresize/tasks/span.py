"""SpanLetters: write out a range of the alphabet ('a:dk=' -> 'defghijk'); answer length = problem size.

Why it exists: the quickstart needs responses that get longer during the run WITHOUT the task getting harder.
Every answer token follows one fixed rule (the successor of the previous letter; stop after the end letter named
in the prompt), and the prompt is always 5 characters, so a 20-letter answer asks for the same skill as a 3-letter
one; only the curriculum's length distribution moves. A sampling mistake derails the rest of the answer (the
partial-credit reward counts matching positions), so a sharper policy earns visibly more: RL has headroom.
"""

from __future__ import annotations

import random
import string

from dynaresize.tasks.base import LengthTailTask

LETTERS = string.ascii_lowercase


class SpanLetters(LengthTailTask):
    prefix = "a:"
    max_problem_len = len(LETTERS)

    def _body(self, rng: random.Random, n: int) -> str:
        n = min(n, len(LETTERS))
        start = rng.randrange(len(LETTERS) - n + 1)
        return LETTERS[start] + LETTERS[start + n - 1]

    def answer(self, prompt: str) -> str:
        body = self.problem(prompt)
        if len(body) != 2 or any(c not in LETTERS for c in body) or body[0] > body[1]:
            raise ValueError(f"SpanLetters: malformed prompt {prompt!r} (expected 'a:XY=' with letters X <= Y)")
        return LETTERS[LETTERS.index(body[0]) : LETTERS.index(body[1]) + 1]
