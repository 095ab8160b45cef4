"""What a task is: deterministic prompts, a reference answer, and a verifiable reward.

A task is plain Python with no torch: the coordinator samples prompts, rollout ranks score responses, and the model
builder trains the tiny model's tokenizer on the task's text. Everything crossing processes is JSON.

Two kinds of task, one wire form (:class:`Sample`, verl's layout: prompt, data_source, ground truth, extra info):

* a generated task (the built-ins, or a user class): ``prompt(seed, step, index) -> str``, ``answer(prompt)``,
  ``reward(prompt, response)``; :func:`sample_of` wraps its prompt as a ``Sample`` whose ``extra_info["prompt"]``
  lets :class:`TaskReward` call ``reward`` with the verl signature;
* a dataset (:class:`dynaresize.tasks.dataset.DatasetTask`): ``sample(seed, step, index, per_step) -> Sample`` and
  ``reference(sample)``; its reward comes from ``reward.function`` (``module:function``, verl's compute_score).

Determinism: ``prompt(seed, step, index)`` depends on nothing else, so it does not matter which rank (or which
run, resized or static) asks for sample ``index`` of step ``step``.

Worked example (``ReverseDigits``, default curriculum)::

    >>> from dynaresize.tasks.reverse import ReverseDigits
    >>> t = ReverseDigits()
    >>> p = t.prompt(seed=0, step=3, index=5); p
    'r:864='
    >>> t.answer(p)
    '468'
    >>> t.reward(p, '468'), t.reward(p, '461'), t.reward(p, '')
    (1.0, 0.6666666666666666, 0.0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dynaresize.tasks.config import CurriculumConfig

#: Characters of the built-in tasks (digits, a-z, separators): with 4 special tokens, a 43-token vocabulary.
DEFAULT_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz:=,"


@runtime_checkable
class Task(Protocol):
    """The interface a user task implements (import path in ``task.name``, constructor kwargs in ``task.params``)."""

    def prompt(self, seed: int, step: int, index: int) -> str:
        """Prompt ``index`` of RL step ``step``; a pure function of its arguments."""
        ...

    def answer(self, prompt: str) -> str:
        """The reference answer (used by the supervised warm-start and by rewards)."""
        ...

    def reward(self, prompt: str, response: str) -> float:
        """Score of a decoded response (special tokens removed), in [0, 1]."""
        ...


@dataclass(frozen=True)
class Sample:
    """One prompt and what scoring it needs, in verl's layout (it travels to the rollout ranks as JSON)."""

    prompt: str | list[dict[str, Any]]  # plain text, or chat messages [{"role": ..., "content": ...}, ...]
    data_source: str  # which dataset the record came from (verl's rewards dispatch on it)
    ground_truth: Any = None  # reward_model.ground_truth: what the reward compares the response with
    extra_info: dict[str, Any] = field(default_factory=dict)  # free-form record info, passed to the reward

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def to_info(self) -> dict[str, Any]:
        """What a rollout rank needs to score a response (JSON-ready)."""
        return {"data_source": self.data_source, "ground_truth": self.ground_truth, "extra_info": self.extra_info}


def sample_of(task: Any, seed: int, step: int, index: int, per_step: int) -> Sample:
    """Sample ``index`` of step ``step`` (``per_step`` prompts a step), for either kind of task."""
    if callable(getattr(task, "sample", None)):
        return task.sample(seed, step, index, per_step)
    text = task.prompt(seed, step, index)
    return Sample(text, type(task).__name__, task.answer(text), {"prompt": text})


def reference_answer(task: Any, sample: Sample) -> str:
    """The response the supervised warm-start teaches for ``sample``."""
    if callable(getattr(task, "reference", None)):
        return task.reference(sample)
    return task.answer(sample.prompt)


class TaskReward:
    """A generated task's own ``reward(prompt, response)`` called with verl's compute_score signature."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        return self.task.reward((extra_info or {})["prompt"], solution_str)


def sample_rng(seed: int, step: int, index: int, salt: str = "") -> random.Random:
    """A private RNG for one sample: string seeds are hashed with SHA-512, so this is stable across processes."""
    return random.Random(f"{salt}:{seed}:{step}:{index}")


@dataclass(frozen=True)
class Curriculum:
    """Problem size n ~ n^-alpha on [min_len, max_len(step)], with max_len and alpha ramped linearly over steps."""

    min_len: int = 1
    max_len_start: int = 8
    max_len_end: int = 16
    alpha_start: float = 1.5
    alpha_end: float = 0.8
    ramp_steps: int = 20

    @classmethod
    def from_config(cls, cfg: CurriculumConfig) -> "Curriculum":
        return cls(**cfg.model_dump())

    def at(self, step: int) -> tuple[int, float]:
        """``(max_len, alpha)`` in force at ``step``."""
        frac = 1.0 if self.ramp_steps <= 0 else min(1.0, max(0, step) / self.ramp_steps)
        max_len = round(self.max_len_start + frac * (self.max_len_end - self.max_len_start))
        return max(self.min_len, max_len), self.alpha_start + frac * (self.alpha_end - self.alpha_start)

    def weights(self, step: int) -> dict[int, float]:
        """Normalised P(n) at ``step`` (for tests, the simulator and docs)."""
        max_len, alpha = self.at(step)
        w = {n: n**-alpha for n in range(self.min_len, max_len + 1)}
        total = sum(w.values())
        return {n: x / total for n, x in w.items()}

    def mean_len(self, step: int) -> float:
        return sum(n * p for n, p in self.weights(step).items())

    def draw(self, rng: random.Random, step: int) -> int:
        w = self.weights(step)
        return rng.choices(list(w), weights=list(w.values()))[0]


class LengthTailTask:
    """Base of the built-in tasks: a size drawn from the curriculum, a positional partial-credit reward.

    Subclasses set ``alphabet`` and ``prefix`` and implement ``_body(rng, n)`` (the problem text after the prefix,
    without the trailing '=') and ``answer``.
    """

    alphabet: str = DEFAULT_ALPHABET
    prefix: str = ""

    def __init__(self, curriculum: Curriculum | None = None, partial_credit: bool = True) -> None:
        self.curriculum = curriculum or Curriculum()
        self.partial_credit = partial_credit

    def _body(self, rng: random.Random, n: int) -> str:
        raise NotImplementedError

    def prompt(self, seed: int, step: int, index: int) -> str:
        rng = sample_rng(seed, step, index, salt=type(self).__name__)
        return f"{self.prefix}{self._body(rng, self.curriculum.draw(rng, step))}="

    def problem(self, prompt: str) -> str:
        """The part of the prompt between the prefix and the final '='."""
        if not (prompt.startswith(self.prefix) and prompt.endswith("=")):
            raise ValueError(f"{type(self).__name__}: malformed prompt {prompt!r} (expected '{self.prefix}...=')")
        return prompt[len(self.prefix) : -1]

    def answer(self, prompt: str) -> str:
        raise NotImplementedError

    def reward(self, prompt: str, response: str) -> float:
        """1.0 for the exact answer; else (partial credit) matching positions / max(len(answer), len(response))."""
        ref = self.answer(prompt)
        if response == ref:
            return 1.0
        if not self.partial_credit:
            return 0.0
        hits = sum(a == b for a, b in zip(ref, response))
        return hits / max(len(ref), len(response), 1)
