"""Tasks: deterministic prompts, correct answers and rewards, the drifting length curriculum, loading by path."""

from __future__ import annotations

import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.tasks import Curriculum, Task, load_task
from dynaresize.tasks.config import TaskConfig
from dynaresize.tasks.reverse import ReverseDigits
from dynaresize.tasks.sort import SortLetters

pytestmark = pytest.mark.unit


class EchoTask:
    """A user task defined outside the package: repeat the word ``times`` times."""

    alphabet = "abc="

    def __init__(self, times: int = 1) -> None:
        self.times = times

    def prompt(self, seed: int, step: int, index: int) -> str:
        return "abc"[(seed + step + index) % 3] + "="

    def answer(self, prompt: str) -> str:
        return prompt[0] * self.times

    def reward(self, prompt: str, response: str) -> float:
        return float(response == self.answer(prompt))


class NotATask:
    alphabet = "ab"

    def prompt(self, seed, step, index):
        return "a"


def test_prompts_are_a_pure_function_of_seed_step_index():
    a, b = ReverseDigits(), ReverseDigits()
    assert [a.prompt(3, 5, i) for i in range(20)] == [b.prompt(3, 5, i) for i in range(20)]
    assert [a.prompt(3, 5, i) for i in range(20)] != [a.prompt(4, 5, i) for i in range(20)]
    assert len({a.prompt(0, 0, i) for i in range(50)}) > 20  # indices give different problems
    assert ReverseDigits().prompt(0, 3, 5) == "r:864="  # stable across processes and Python versions (SHA-512 seeding)


def test_answers_and_partial_credit_rewards():
    rev, srt = ReverseDigits(), SortLetters()
    assert rev.answer("r:1234=") == "4321"
    assert srt.answer("s:dbca=") == "abcd"
    assert rev.reward("r:1234=", "4321") == 1.0
    assert rev.reward("r:1234=", "4300") == 0.5  # 2 of 4 positions
    assert rev.reward("r:1234=", "43210000") == 0.5  # 4 hits / 8 (too long is penalised)
    assert rev.reward("r:1234=", "") == 0.0
    assert ReverseDigits(partial_credit=False).reward("r:1234=", "4320") == 0.0
    with pytest.raises(ValueError, match="malformed prompt"):
        rev.answer("1234")


def test_rewards_stay_in_unit_interval_and_alphabet_covers_prompts():
    for task in (ReverseDigits(), SortLetters()):
        assert isinstance(task, Task)
        for i in range(200):
            p = task.prompt(1, 30, i)
            assert set(p) | set(task.answer(p)) <= set(task.alphabet)
            assert 0.0 <= task.reward(p, p) <= 1.0


def test_curriculum_ramps_max_len_and_alpha_linearly():
    c = Curriculum(min_len=1, max_len_start=8, max_len_end=16, alpha_start=1.5, alpha_end=0.8, ramp_steps=20)
    assert c.at(0) == (8, 1.5)
    assert c.at(10) == (12, pytest.approx(1.15))
    assert c.at(20) == (16, pytest.approx(0.8)) and c.at(500) == c.at(20)
    w = c.weights(0)
    assert sum(w.values()) == pytest.approx(1.0)
    assert w[1] / w[2] == pytest.approx(2**1.5)  # P(n) ~ n^-alpha
    assert c.mean_len(0) < c.mean_len(10) < c.mean_len(20)


def test_response_lengths_drift_upward_and_have_a_tail():
    task = ReverseDigits()
    early = [len(task.answer(task.prompt(0, 0, i))) for i in range(400)]
    late = [len(task.answer(task.prompt(0, 40, i))) for i in range(400)]
    assert max(early) <= 8 and max(late) > 8
    assert sum(late) / 400 > 1.5 * sum(early) / 400
    assert max(late) >= 3 * sorted(late)[200]  # long tail: the longest is far above the median


def test_load_builtin_by_path_and_short_name_with_curriculum_from_config():
    task = load_task(TaskConfig(name="sort_letters", curriculum={"max_len_end": 30}, params={"partial_credit": False}))
    assert isinstance(task, SortLetters) and task.curriculum.max_len_end == 30 and task.partial_credit is False
    assert isinstance(load_task(TaskConfig()), ReverseDigits)


def test_user_task_by_import_path_from_yaml(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(f"task:\n  name: '{__name__}:EchoTask'\n  params: {{times: 3}}\n")
    task = load_task(load_config(path).task)
    assert isinstance(task, EchoTask) and task.times == 3
    p = task.prompt(0, 0, 1)
    assert task.answer(p) == "bbb" and task.reward(p, "bbb") == 1.0


@pytest.mark.parametrize(
    ("name", "params", "needle"),
    [
        ("nocolon", {}, "expected 'module:Class'"),
        ("no.such.module:X", {}, "cannot import module 'no.such.module'"),
        ("dynaresize.tasks.reverse:Nope", {}, "has no attribute 'Nope'"),
        ("dynaresize.tasks.base:DEFAULT_ALPHABET", {}, "expected a class"),
        ("dynaresize.tasks.reverse:ReverseDigits", {"bogus": 1}, "does not accept them"),
        (f"{__name__}:NotATask", {}, "not a Task (missing methods ['answer', 'reward'])"),
    ],
)
def test_bad_task_config_is_one_clear_error(name, params, needle):
    with pytest.raises(ConfigError) as e:
        load_task(TaskConfig(name=name, params=params))
    msg = str(e.value)
    assert needle in msg
    assert ("task.params" if params else "task.name") in msg and (repr(name) in msg or name in msg)


def test_curriculum_config_rejects_max_below_min(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task:\n  curriculum: {min_len: 5, max_len_start: 3}\n")
    with pytest.raises(ConfigError, match="max_len_start=3 is below min_len=5"):
        load_config(path)


def test_span_letters_answers_rewards_and_fixed_prompt_shape():
    from dynaresize.tasks.span import SpanLetters

    t = SpanLetters()
    assert t.answer("a:dk=") == "defghijk"
    assert t.answer("a:cc=") == "c"
    assert t.reward("a:dk=", "defghijk") == 1.0
    assert t.reward("a:dk=", "defgxijk") == pytest.approx(7 / 8)
    assert t.reward("a:dk=", "") == 0.0
    with pytest.raises(ValueError, match="malformed"):
        t.answer("a:kd=")
    for step in (0, 50):
        for i in range(50):
            p = t.prompt(3, step, i)
            assert len(p) == 5 and p.startswith("a:") and set(p) <= set(t.alphabet)


def test_span_letters_responses_get_longer_but_prompts_do_not():
    """The quickstart's drift: answer lengths follow the curriculum (capped at 26) while prompts keep one shape."""
    from dynaresize.tasks.span import SpanLetters

    cur = Curriculum(min_len=2, max_len_start=5, max_len_end=24, alpha_start=1.5, alpha_end=0.5, ramp_steps=60)
    t = SpanLetters(curriculum=cur)
    early = [len(t.answer(t.prompt(0, 0, i))) for i in range(400)]
    late = [len(t.answer(t.prompt(0, 60, i))) for i in range(400)]
    assert max(early) <= 5 and min(early) >= 2
    assert sum(late) / len(late) > 2 * sum(early) / len(early)
    assert max(late) >= 20
    assert load_task(TaskConfig(name="span_letters")).__class__ is SpanLetters
