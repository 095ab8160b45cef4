"""verl's reward functions, unchanged: called by keyword with only the parameters they take, their signatures checked
at load, reward.kwargs passed through, and a batch whose rewards mostly fail stopping the run.

The scorers live in tests/fixtures/verl_style/rewards.py (verl's signatures, written here) and are loaded by file
path, the way a verl user gives ``custom_reward_function.path``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.contract.workqueue import SampleResult
from dynaresize.job.errors import JobError
from dynaresize.job.rollout import RolloutWork
from dynaresize.rewards import Reward, call_plan, load_reward

pytestmark = pytest.mark.unit

FILE = Path(__file__).resolve().parents[1] / "fixtures" / "verl_style" / "rewards.py"
INFO = {"data_source": "openai/gsm8k", "ground_truth": "72", "extra_info": {"index": 3, "split": "train"}}


def reward(fn: str, *overrides: str) -> Reward:
    return load_reward(load_config(None, [f"reward.function={FILE}:{fn}", *overrides]))


def test_gsm8k_style_signature_scores_by_keyword():
    """The issue's case: positionally this scorer got the ground truth as ``method`` and every sample scored 0."""
    r = reward("gsm8k_score")
    assert r.plan.names == ("solution_str", "ground_truth") and not r.plan.positional
    assert r.score("0.0.0", INFO, "48 + 24 = 72 #### 72") == r.score("0.0.0", INFO, "#### 72")
    assert r.score("0.0.0", INFO, "#### 72").score == 1.0 and r.score("0.0.0", INFO, "#### 72").error is None
    assert r.score("0.0.0", INFO, "#### 71").score == 0.0
    assert r.score("0.0.0", INFO, "it is 72").score == 0.0  # strict: no '####', no answer


def test_reward_kwargs_reach_the_function():
    r = reward("gsm8k_score", "reward.kwargs={method: flexible, format_score: 0.1}")
    assert r.score("k", INFO, "it is 72").score == 1.0  # flexible: the last number
    assert r.score("k", INFO, "it is 70").score == pytest.approx(0.1)  # format_score for a wrong number
    assert r.score("k", INFO, "no number").score == 0.0


def test_math_style_two_argument_signature():
    r = reward("math_score")
    assert r.plan.names == ("solution_str", "ground_truth")
    assert (r.score("k", INFO, "so 72").score, r.score("k", INFO, "so 7").score) == (1.0, 0.0)


def test_four_argument_default_gets_all_four_and_its_dict_is_read():
    r = reward("default_score")
    assert r.plan.names == ("data_source", "solution_str", "ground_truth", "extra_info")
    assert r.score("k", INFO, "so 72").score == 1.0
    seen = []
    Reward(lambda data_source, solution_str, ground_truth, extra_info=None: seen.append(
        (data_source, solution_str, ground_truth, extra_info)) or 0.5, "spy").score("k", INFO, "resp")
    assert seen == [("openai/gsm8k", "resp", "72", {"index": 3, "split": "train"})]


def test_var_keyword_takes_everything_and_unnamed_parameters_go_by_position():
    got = {}
    r = Reward(lambda solution_str, **kw: got.update(kw, solution_str=solution_str) or 1.0, "kw", {"lang": "en"})
    assert r.score("k", INFO, "resp").score == 1.0
    assert got == {"data_source": "openai/gsm8k", "ground_truth": "72", "extra_info": INFO["extra_info"],
                   "lang": "en", "solution_str": "resp"}
    pos = Reward(lambda ds, response, truth, info: float(response == truth and ds == "openai/gsm8k"), "pos")
    assert pos.plan.positional and pos.score("k", INFO, "72").score == 1.0


@pytest.mark.parametrize(
    ("fn", "kwargs", "needle"),
    [
        (lambda solution_str, ground_truth, tokenizer: 0.0, {},
         "reward.function = 'f': required parameter 'tokenizer' is never supplied"),
        (lambda solution_str, ground_truth, /: 0.0, {}, "parameter 'solution_str' is positional-only"),
        (lambda data_source, ground_truth: 0.0, {}, "takes no 'solution_str' parameter, so it never sees the response"),
        (lambda solution_str, ground_truth: 0.0, {"method": "flexible"}, "reward.kwargs: 'method' is not a parameter of 'f'"),
        (lambda solution_str, ground_truth: 0.0, {"ground_truth": "1"}, "reward.kwargs: 'ground_truth' is supplied per sample"),
        (lambda ds, response, truth, info, tok: 0.0, {}, "required parameter 'tok' is never supplied (it takes ds, "
                                                          "response, truth, info, tok)"),
        (lambda ds, response, truth, info: 0.0, {"lang": "en"}, "reward.kwargs: 'lang' is not a parameter of 'f'"),
        (lambda a, b, c: 0.0, {}, "names none of verl's parameters (data_source, solution_str, ground_truth, extra_info) "
                                  "and cannot take them by position either (it takes a, b, c)"),
    ],
)
def test_a_signature_that_cannot_work_is_one_config_error(fn, kwargs, needle):
    with pytest.raises(ConfigError) as e:
        call_plan(fn, "f", kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_signature_error_comes_from_the_config_before_any_rank(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.kwargs: 'nope' is not a parameter of '.*:gsm8k_score' \(it takes "
                                          r"solution_str, ground_truth, method, format_score, score\)"):
        reward("gsm8k_score", "reward.kwargs={nope: 1}")


def test_an_empty_assertion_names_its_type():
    out = reward("always_raises").score("2.1.0", INFO, "x")
    assert out.score == 0.0 and out.error.endswith(":always_raises raised AssertionError: (no message)")
    assert out.error.startswith("sample 2.1.0: reward ")


# -- the coordinator's stop on a batch that mostly fails ------------------------------------------------------


class Events:
    def __init__(self):
        self.seen = []

    def emit(self, etype, **data):
        self.seen.append(data)


def rollout(*overrides: str, planned: int = 8) -> RolloutWork:
    job = SimpleNamespace(cfg=load_config(None, list(overrides)), events=Events(), state=SimpleNamespace(step=0))
    work = RolloutWork(job, SimpleNamespace(tokenizer=None))
    work.items[0] = ([object()] * planned, ["p"] * (planned // 4))  # batch 0: `planned` samples planned
    return work


def results(prompt: int, failing: int, group: int = 4) -> list[SampleResult]:
    err = "sample 0.{p}.{i}: reward f raised AssertionError: (no message)"
    return [SampleResult(0, prompt, i, [1], [0.0], 0, 0, {"reward": 0.0, "reward_error": err.format(p=prompt, i=i)}
                         if i < failing else {"reward": 1.0}) for i in range(group)]


def test_half_failing_is_kept_with_one_warning_more_than_half_stops(caplog):
    work = rollout()
    with caplog.at_level(logging.WARNING, logger="dynaresize.job"):
        work.check_rewards(0, results(0, 2))
        work.check_rewards(0, results(0, 2))  # a group judged again (a replay) counts once
        assert not caplog.records  # the batch is not complete yet: no warning line
        work.check_rewards(0, results(1, 2))
    assert [r.getMessage() for r in caplog.records] == [
        "batch 0: 4 of 8 reward(s) failed and scored 0, e.g. sample 0.0.0: reward f raised AssertionError: (no message)"]
    assert len(work.job.events.seen) == 4  # one event per failed sample

    work = rollout()
    work.check_rewards(0, results(0, 4))  # 4 of 8 planned: not more than half yet
    with pytest.raises(JobError) as e:
        work.check_rewards(0, results(1, 1))
    assert str(e.value) == ("batch 0: the reward failed on 5 of its 8 samples (62% > reward.max_error_fraction=0.5); "
                            "stopped instead of training on zeros. First failure: sample 0.0.0: reward f raised "
                            "AssertionError: (no message)")


def test_the_error_fraction_is_a_setting():
    rollout("reward.max_error_fraction=1").check_rewards(0, results(0, 4) + results(1, 4))  # never stops
    with pytest.raises(JobError, match=r"1 of its 8 samples \(12% > reward.max_error_fraction=0\)"):
        rollout("reward.max_error_fraction=0").check_rewards(0, results(0, 1))
    with pytest.raises(JobError, match="reward.on_error=fail"):
        rollout("reward.on_error=fail").check_rewards(0, results(0, 1))
