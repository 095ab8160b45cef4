"""The runtime's measured decode model (dynaresize.contract.decode) and the batch it hands the pipeline predictor
(dynaresize.job.workload): the fit recovers known iteration costs, never goes negative, refuses what a peer must not
send, and a batch's workload holds its own lengths and training."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.contract.decode import MIN_ITERATIONS, DecodeSums, fit_decode
from dynaresize.contract.workqueue import SampleResult
from dynaresize.job.core_io import scheduler_config
from dynaresize.job.workload import batch_workload
from dynaresize.policy.types import Observation, PipelineWorkload, Topology
from dynaresize.schedule.codec import decode, encode
from dynaresize.schedule.types import StepMeasured

ROOT = Path(__file__).resolve().parents[2]


def _sums(w: float, u: float, p: float, n: int = 200, noise: float = 0.0, seed: int = 0, a_range=(1, 32)) -> DecodeSums:
    rng = random.Random(seed)
    s = DecodeSums()
    for _ in range(n):
        a = rng.randint(*a_range)
        m = rng.choice([0, 0, 0, 0, rng.randint(1, a)])  # most iterations admit nothing
        s.add(a, m, (w + a * u + m * p) * (1 + noise * rng.uniform(-1, 1)))
    return s


@pytest.mark.parametrize("w,u,p", [(0.004, 0.0003, 0.002), (0.0, 0.001, 0.0), (0.01, 0.0, 0.0005)])
def test_the_fit_recovers_known_iteration_costs(w, u, p):
    fit = fit_decode(_sums(w, u, p))
    assert fit is not None and fit.iterations == 200
    assert (fit.iteration_s, fit.seq_iteration_s, fit.prefill_s_per_seq) == pytest.approx((w, u, p), abs=1e-9)


def test_a_noisy_fit_stays_close_and_never_negative():
    fit = fit_decode(_sums(0.004, 0.0003, 0.002, n=2000, noise=0.1, seed=3))
    assert fit.iteration_s == pytest.approx(0.004, rel=0.1)
    assert fit.seq_iteration_s == pytest.approx(0.0003, rel=0.1)
    assert fit.prefill_s_per_seq == pytest.approx(0.002, rel=0.2)
    # a cost that only scales with the sequences (and noise pulling the intercept below 0): no negative coefficient
    for seed in range(20):
        fit = fit_decode(_sums(0.0, 0.001, 0.0, noise=0.3, seed=seed))
        assert min(fit.iteration_s, fit.seq_iteration_s, fit.prefill_s_per_seq) >= 0
        assert fit.predict(16) == pytest.approx(0.016, rel=0.15)


def test_one_concurrency_only_still_predicts_it_and_too_few_iterations_give_none():
    s = DecodeSums()
    for _ in range(50):
        s.add(8, 0, 0.02)
    fit = fit_decode(s)  # w and u cannot be told apart: any fit must still give the time measured at 8
    assert fit.predict(8) == pytest.approx(0.02)
    few = _sums(0.004, 0.0003, 0.0, n=MIN_ITERATIONS - 1)
    assert fit_decode(few) is None and fit_decode(DecodeSums()) is None


def test_sums_add_up_and_travel_as_plain_numbers():
    a, b = _sums(0.004, 0.0003, 0.002, n=30, seed=1), _sums(0.004, 0.0003, 0.002, n=40, seed=2)
    both = DecodeSums.from_wire(a.to_wire())
    both.merge(b)
    assert both.n == 70 and both.t == pytest.approx(a.t + b.t)
    assert DecodeSums.from_wire({"n": 3, "t": 0.5}) == DecodeSums(n=3.0, t=0.5)  # missing keys are zero


@pytest.mark.parametrize("bad,words", [
    ([1, 2], "must be an object"), ({"n": 1, "x": 2}, "unknown key"), ({"n": float("nan")}, "n must be a finite"),
    ({"t": -1.0}, "t must be a finite"), ({"a": True}, "a must be a finite"), ({"mm": "3"}, "mm must be a finite"),
    ({"at": math.inf}, "at must be a finite"),
])
def test_bad_sums_from_a_peer_are_refused_naming_the_key(bad, words):
    with pytest.raises(ValueError, match=words):
        DecodeSums.from_wire(bad)


def _cfg(*extra: str):
    return load_config(ROOT / "configs/quickstart.yaml", ["rollout.group_size=2", "rollout.max_running=6",
                                                          "pipeline.groups_per_command=1", *extra])


def _sample(prompt: int, index: int, n: int) -> SampleResult:
    return SampleResult(5, prompt, index, list(range(n)), [0.0] * n, 4, 1)


def test_a_batch_workload_holds_its_complete_groups_and_shares_its_training_by_tokens():
    cfg = _cfg()
    core_cfg = scheduler_config(cfg, 2, 0)
    samples = [_sample(0, 0, 3), _sample(0, 1, 5), _sample(2, 1, 4), _sample(2, 0, 2), _sample(1, 0, 7)]  # 1: incomplete
    sums = _sums(0.004, 0.0003, 0.002)
    wl, fit = batch_workload(cfg, core_cfg, samples, {0}, sums, chunk_s=2.0, n_train=2, step_s=0.5, sync_s=0.1)
    assert fit is not None and isinstance(wl, PipelineWorkload)
    assert wl.lengths == (3.0, 5.0, 2.0, 4.0)  # prompts 0 and 2, each by index; prompt 1 lacks a response
    assert (wl.group_size, wl.kv_slots, wl.claim_groups) == (2, 6, 1)
    eff = cfg.policy.train_scaling_per_doubling  # 2 trainers: one doubling
    assert wl.train_s_per_group == pytest.approx((2.0 * 2 * eff, 0.0))  # only group 0 was trained
    assert (wl.step_overhead_s, wl.sync_s, wl.staleness) == (0.5, 0.1, core_cfg.staleness)
    assert wl.iteration_s == pytest.approx(0.004) and wl.prefill_s_per_group == pytest.approx(2 * 0.002)
    # nothing to fit, nothing trained, or no complete group: no workload
    assert batch_workload(cfg, core_cfg, samples, {0}, DecodeSums(), 2.0, 2, 0.5, 0.1)[0] is None
    assert batch_workload(cfg, core_cfg, samples, set(), sums, 2.0, 2, 0.5, 0.1)[0] is None
    assert batch_workload(cfg, core_cfg, samples[-1:], {1}, sums, 2.0, 2, 0.5, 0.1)[0] is None


def test_an_observation_with_its_workload_survives_the_schedule_log():
    cfg = _cfg()
    wl, _ = batch_workload(cfg, scheduler_config(cfg, 2, 0), [_sample(0, 0, 3), _sample(0, 1, 5)], {0},
                           _sums(0.004, 0.0003, 0.002), 2.0, 2, 0.5, 0.1)
    ev = StepMeasured(Observation(3, Topology(2, 2), 1.5, 2.5, workload=wl), 7, 0.25)
    assert decode(encode(ev)) == ev


def test_a_rank_counts_what_an_engine_without_a_waiting_count_decodes_and_admits():
    """vLLM's adapter says how many requests it holds, not how many wait: the rank takes it to decode what its KV
    slots hold and to admit what they freed (Worker._count_iteration's fallback), and exactly otherwise."""
    from types import SimpleNamespace

    from dynaresize.worker.core import Worker

    eng = SimpleNamespace(running=10)  # no `waiting`
    rank = SimpleNamespace(rollout=eng, _slots=4, _decoding=0, decode_sums=DecodeSums())
    count = lambda running, waiting, ended, s: Worker._count_iteration(rank, running, waiting, ended, s)  # noqa: E731
    count(10, None, 1, 0.5)  # 4 admitted and decoded, 1 ended: 3 go on
    eng.running = 9
    count(9, None, 0, 0.25)  # 4 decoded, 1 admitted into the freed slot
    eng.running = 2
    count(2, None, 2, 0.125)  # the last 2 (both already decoding)
    s = rank.decode_sums
    assert (s.n, s.a, s.m, s.t) == (3, 10, 5, 0.875) and rank._decoding == 0
    # an engine that says what waits (torch, emulated): exact, whatever its slots
    eng = SimpleNamespace(running=7, waiting=3)
    rank = SimpleNamespace(rollout=eng, _slots=4, _decoding=0, decode_sums=DecodeSums())
    Worker._count_iteration(rank, 9, 5, 2, 0.5)  # before: 9 held, 5 waiting; after: 7 held, 3 waiting, 2 ended
    assert (rank.decode_sums.a, rank.decode_sums.m) == (6, 2)
