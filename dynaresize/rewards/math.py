r"""The built-in math reward: extract the final answer of a response, compare it with the ground truth as a number.

``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float`` (verl's signature), 1.0 for a
correct final answer, else 0.0. The final answer is, in this order: the content of the last ``\boxed{...}`` (nested
braces allowed); the text after the last ``####`` (GSM8K's marker); the text after the last "answer is" or
"answer:"; else the last number in the response. Both sides are normalised (``$``, thousands commas, spaces, a
trailing full stop, ``\frac{a}{b}``, ``a/b``, a trailing ``%``) and compared as numbers (exact for integers and
fractions, relative 1e-6 for decimals); what does not parse as a number is compared as normalised text.

    >>> compute_score("byo_arith", "3+4 is \\boxed{7}", "7")
    1.0
    >>> compute_score("gsm8k", "so 1,200 eggs. #### 1200", 1200)
    1.0
    >>> compute_score("byo_arith", "the answer is 0.5", "1/2"), compute_score("byo_arith", "8", "7")
    (1.0, 0.0)
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer of a response (see the module docstring for the order), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().splitlines()[0] if text.rsplit("####", 1)[1].strip() else None
    m = list(re.finditer(r"answer(?: is|:)\s*", text, flags=re.IGNORECASE))
    if m:
        rest = text[m[-1].end():].strip()
        if rest:
            return rest.splitlines()[0]
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _normalise(s: str) -> str:
    s = s.strip().replace("$", "").replace("\\!", "").replace("\\,", "").replace("{,}", "")
    s = s.replace("\\left", "").replace("\\right", "").replace(" ", "")
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    return s.rstrip(".")


def to_number(s: str) -> Fraction | float | None:
    """A number from a normalised answer string (integers and fractions exactly), or None."""
    s = _normalise(s)
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%")
    m = _FRAC.match(s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        value: Fraction | float = Fraction(s)
    except (ValueError, ZeroDivisionError):
        try:
            value = float(s)
        except ValueError:
            return None
    return value / 100 if percent else value


def equal(answer: str, truth: Any) -> bool:
    a, t = to_number(answer), to_number(str(truth))
    if a is not None and t is not None:
        if isinstance(a, Fraction) and isinstance(t, Fraction):
            return a == t
        return abs(float(a) - float(t)) <= 1e-6 * max(1.0, abs(float(t)))
    return _normalise(answer) == _normalise(str(truth))


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` (as a number, else as text), else 0.0."""
    if isinstance(ground_truth, (list, tuple)):  # several accepted answers
        return max((compute_score(data_source, solution_str, g, extra_info) for g in ground_truth), default=0.0)
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and equal(answer, ground_truth) else 0.0
