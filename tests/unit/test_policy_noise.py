"""The policy's noise rules and its robustness on a stationary workload, measured through the simulator.

Rules (dynaresize/policy/policy.py): noise-aware predictions (E[max] of the two stages), a significance test on the
predicted gain with a back-off after recent resizes, a memory of splits left (never predicted faster than they
measured; a revert when a move did not deliver), and a payback horizon cut to the steps left in the run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dynaresize.config.loader import load_config
from dynaresize.events import EventType
from dynaresize.policy import Observation, ResizePolicy, SwitchCostModel, Topology, candidate_topologies
from dynaresize.policy import policy as policy_module
from dynaresize.policy.config import OptimizationsConfig, PolicyConfig, SwitchCostConfig
from dynaresize.policy.types import LeftSplit
from dynaresize.policy.pipeline_predictor import PipelinePredictor
from dynaresize.policy.predictor import StageModel, expected_max
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import best_static_samples, run_dynamic, run_samples, run_static, setup

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
COSTS = SwitchCostModel(SwitchCostConfig(), OptimizationsConfig())
CANDS = candidate_topologies(8)


def test_expected_max_matches_monte_carlo_and_is_the_max_without_noise():
    rng = np.random.default_rng(0)
    for mr, sr, mt, s_t in [(100, 20, 105, 3), (100, 1, 50, 1), (80, 30, 80, 0)]:
        mc = np.maximum(rng.normal(mr, sr, 400_000), rng.normal(mt, s_t, 400_000)).mean()
        assert float(expected_max(mr, sr, mt, s_t)) == pytest.approx(mc, rel=2e-3)
    assert float(expected_max(100, 0, 105, 0)) == 105
    m = StageModel(1.0, 1.0, noise_alpha=0.5)
    est = m.update(None, Observation(0, Topology(4, 4), 100, 90, rollout_tail_s=50))
    assert m.period_s(est, Topology(4, 4)) == pytest.approx(100)  # one observation: no variance yet (no prior here)
    est = m.update(est, Observation(1, Topology(4, 4), 130, 90, rollout_tail_s=80))
    assert est.tail_var == pytest.approx(0.5 * 0.5 * 30 ** 2)
    assert m.period_s(est, Topology(4, 4)) > max(m.rollout_s(est, Topology(4, 4)), m.train_s(est, Topology(4, 4)))


def steps_policy(**kw) -> ResizePolicy:
    base = dict(min_dwell_steps=0, consecutive_signals=1, cooldown_steps=0, ewma_alpha=1.0, train_scaling_per_doubling=1.0,
                tail_cv_prior=0.0)
    base.update(kw)
    return ResizePolicy(PolicyConfig(**base), COSTS, CANDS)


def test_payback_horizon_is_cut_to_the_steps_left():
    # 6:2 at 200 s vs 146.7 s on 5:3 (see test_policy's worked example): a 53.3 s/step saving, ~3.6 s to switch
    obs = dict(step=0, topology=Topology(6, 2), rollout_s=200, train_s=100, rollout_tail_s=40)
    p = steps_policy()
    assert p.step(p.initial_state(), Observation(**obs))[1].resize  # no steps_left: the full 10-step horizon
    d = p.step(p.initial_state(), Observation(**obs, steps_left=5))[1]
    assert d.resize and d.expected_saving_s == pytest.approx(5 * (200 - (40 + 320 / 3)))
    d = p.step(p.initial_state(), Observation(**obs, steps_left=0))[1]
    assert not d.resize and d.reason.startswith("run ends")
    dear = ResizePolicy(PolicyConfig(min_dwell_steps=0, consecutive_signals=1, cooldown_steps=0, ewma_alpha=1.0, tail_cv_prior=0.0),
                        SwitchCostModel(SwitchCostConfig(override_s={"comm_select": 60.0}), OptimizationsConfig()), CANDS)
    assert dear.step(dear.initial_state(), Observation(**obs))[1].resize  # 533 s > 63.6 s x 1.5
    d = dear.step(dear.initial_state(), Observation(**obs, steps_left=1))[1]
    assert not d.resize and d.reason.startswith("payback: saving") and "over 1 steps <= cost 63.6s" in d.reason


def test_noise_blocks_a_move_the_same_gain_without_noise_makes():
    # 5:3, train-bound by a little (112 s): 6:2 is predicted 6% faster (105 s); with a tail that jumps by +-80% from step
    # to step the prediction's standard error is larger than that, and the policy holds
    p = steps_policy(tail_cv_prior=0.0, imbalance_threshold=0.0, noise_alpha=0.5, ewma_alpha=0.5, consecutive_signals=4)
    quiet, noisy = p.initial_state(), p.initial_state()
    t = Topology(5, 3)
    for k in range(6):
        quiet, dq = p.step(quiet, Observation(k, t, 90, 112, rollout_tail_s=60))
        tail = 60 * (1.8 if k % 2 else 0.2)
        noisy, dn = p.step(noisy, Observation(k, t, 30 + tail, 112, rollout_tail_s=tail))
        if dq.resize:
            break
    assert dq.resize and dq.target == Topology(6, 2)
    assert not dn.resize and dn.reason == "predicted gains within the noise"


def test_a_move_that_did_not_deliver_is_reverted_and_only_just_after_it():
    # state after a move 6:2 -> 5:3: on 6:2 the model was right (ratio 1.0 over 6 steps); on 5:3 every step measures
    # 50% slower than the model predicts (220 s for 146.7 s), while the model still ranks 5:3 ahead of 6:2 (200 s)
    p = steps_policy(memory_tolerance=0.1, min_dwell_steps=3, ewma_alpha=0.01)  # estimates that hardly move
    m = p.model
    est = m.update(None, Observation(0, Topology(6, 2), 200, 100, rollout_tail_s=40))
    here, there = m.period_s(est, Topology(5, 3)), m.period_s(est, Topology(6, 2))
    assert here == pytest.approx(40 + 320 / 3) and there == pytest.approx(200)
    left = (LeftSplit(Topology(6, 2), 1.0, 0.0, there, 6),)
    state = replace(p.initial_state(), estimates=est, left=left, here_ratio=1.5, here_steps=3, steps_since_resize=5)
    obs = Observation(9, Topology(5, 3), 220, 120, rollout_tail_s=40)
    s2, d = p.step(state, obs)
    assert d.resize and d.target == Topology(6, 2) and d.reason.startswith("revert: 6:2 measures 201.1s/step < 221.1s/step here (5:3)")
    assert s2.left[-1].topology == Topology(5, 3) and s2.here_steps == 0 and s2.resized_at == (9,)
    # later than payback_horizon_steps after the move the normal rules decide
    late = replace(state, here_steps=p.cfg.payback_horizon_steps + 1)
    assert not p.step(late, obs)[1].reason.startswith("revert")
    # a memory the model's prediction has moved away from by more than memory_tolerance is not trusted
    stale = replace(state, left=(LeftSplit(Topology(6, 2), 1.0, 0.0, there * 1.5, 6),))
    assert not p.step(stale, obs)[1].reason.startswith("revert")
    # nor one measured on fewer than 3 clean steps
    short = replace(state, left=(LeftSplit(Topology(6, 2), 1.0, 0.0, there, 2),))
    assert not p.step(short, obs)[1].reason.startswith("revert")


def test_a_split_left_stays_remembered_by_its_measured_period_while_the_workload_does_not_move():
    # on 5:3 the model, re-learned there, predicts 6:2 at 150 s against 180 s here (train-bound); 6:2 measured 220 s
    # (its prediction then, 200 s, x its error there, 1.1) and the model's prediction for it has since moved by 25%,
    # beyond memory_tolerance. The workload's size (tokens generated + trained a step) is the one when 6:2 was left:
    # the memory holds, at the period measured, and 6:2 is not returned to
    p = steps_policy(memory_tolerance=0.1)
    here = Observation(7, Topology(5, 3), 100, 180, rollout_tail_s=40, tokens_generated=90_000, tokens_trained=110_000)
    est = p.model.update(p.model.update(None, here), here)
    assert est.level == 200_000 and est.level_var == 0
    assert p.model.period_s(est, Topology(6, 2)) == pytest.approx(150)

    def decide(level_then: float):
        left = (LeftSplit(Topology(6, 2), 1.1, 0.0, 200.0, 6, level_then),)
        return p.step(replace(p.initial_state(), estimates=est, left=left, steps_since_resize=20), here)[1]

    d = decide(200_000)
    assert not d.resize and d.reason == "no faster split predicted"
    assert p._memory((LeftSplit(Topology(6, 2), 1.1, 0.0, 200.0, 6, 190_000),), est)[Topology(6, 2)][0] == pytest.approx(
        220 * 200_000 / 190_000)  # carried by the workload's size since
    # the workload 30% larger since (or its size unknown): the memory has expired, and the model's 150 s decides
    for level_then in (200_000 / 1.3, 0.0):
        d = decide(level_then)
        assert d.resize and d.target == Topology(6, 2), d.reason


def test_a_revert_on_a_memory_carried_by_the_workloads_size_counts_the_sizes_noise():
    # as the revert test above (6:2 -> 5:3, 5:3 measuring 220 s), but the model's prediction for 6:2 has moved by a
    # third since it was left (200 s now, 150 s then): only the workload's size, unchanged, carries the memory. 6:2
    # measured 214.6 s (150 s x 1.4309), 2.5% faster than here: a revert on exact sizes, a hold when the steps' sizes
    # vary by 10% (the level now and then, each an EWMA of them, are that uncertain)
    p = steps_policy(memory_tolerance=0.1, min_dwell_steps=3, ewma_alpha=0.01)
    tokens = dict(tokens_generated=100_000, tokens_trained=100_000)
    est = p.model.update(None, Observation(0, Topology(6, 2), 200, 100, rollout_tail_s=40, **tokens))
    left = (LeftSplit(Topology(6, 2), 1.4309, 0.0, 150.0, 6, 200_000.0),)
    obs = Observation(9, Topology(5, 3), 220, 120, rollout_tail_s=40, **tokens)

    def decide(level_var: float):
        state = replace(p.initial_state(), estimates=replace(est, level_var=level_var), left=left, here_ratio=1.5,
                        here_steps=3, steps_since_resize=5)
        return p.step(state, obs)[1]

    d = decide(0.0)
    assert d.resize and d.target == Topology(6, 2) and d.reason.startswith("revert: 6:2 measures 214.6s/step")
    assert not decide(0.01).reason.startswith("revert")


# --- robustness on a stationary workload (issue 13, item 6) ----------------------------------------------------------
def stationary(gpus: int, mean: int, seed: int, steps: int):
    return load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
        f"sim.steps={steps}", "sim.write_events=false", f"cluster.gpus={gpus}", f"cluster.initial_train={round(0.75 * gpus)}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}", f"run.seed={seed}"])


def best_static(s) -> float:
    s.table.sweep([c.n_rollout for c in s.candidates])
    return min(run_static(s, c).total_s for c in s.candidates)


SLOW = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
LENGTHS = st.integers(300, 6000)


@SLOW
@given(gpus=st.sampled_from([8, 16, 32]), mean=LENGTHS, seed=st.integers(0, 10_000))
def test_stationary_workload_few_switches_and_little_loss_against_the_best_static_split(gpus, mean, seed):
    """From the scenario's start (3/4 of the GPUs training) over 200 steps: at most 2 switches, and within 3% of the
    best static split (the run starts away from it: its first steps on the start split are part of the loss).
    The issue's target is 1%; measured on a 60-case grid (8/16/32 GPUs x 300..6000 tokens x 4 seeds) 59 cases were
    within 1%, the other 1.08% (fixed at stop 42: the test below)."""
    s = setup(stationary(gpus, mean, seed, 200))
    dyn = run_dynamic(s, False)
    loss = dyn.total_s / best_static(s) - 1
    assert dyn.switches <= 2, f"{dyn.switches} switches: {dyn.topologies}"
    assert loss <= 0.03, f"{100 * loss:.2f}% behind the best static split ({dyn.switches} switches)"


@pytest.mark.parametrize("gpus, mean, seed", [(8, 700, 0), (16, 3000, 1), (32, 1500, 2)])
def test_stationary_workload_meets_the_one_percent_target(gpus, mean, seed):
    s = setup(stationary(gpus, mean, seed, 200))
    dyn = run_dynamic(s, False)
    assert dyn.switches <= 2 and dyn.total_s <= 1.01 * best_static(s)


def test_a_few_calm_steps_do_not_let_a_noise_move_through():
    """16 GPUs, 300-token responses, seed 1, step level (the known miss of the 1% target until stop 42, +1.08%): the
    policy reaches 13:3, the best split, at step 5; with the variance's EWMA at 0.2 five calm steps halved the tail's
    variance, and at step 148 a 0.60 s predicted gain of 14:2 passed 2 standard errors (0.59 s) by 0.01 s. At
    ``noise_alpha`` 0.1 it stays on 13:3: one switch, within 1%."""
    s = setup(stationary(16, 300, 1, 200))
    dyn = run_dynamic(s, False)
    assert dyn.switches == 1 and dyn.topologies[-1] == "13:3" and dyn.total_s <= 1.01 * best_static(s)
    s.cfg = s.cfg.model_copy(update={"policy": s.cfg.policy.model_copy(update={"noise_alpha": 0.2})})
    faster = run_dynamic(s, False)
    assert faster.switches == 2 and faster.topologies[-1] == "14:2" and faster.total_s > 1.01 * best_static(s)


@SLOW
@given(gpus=st.sampled_from([8, 16, 32]), mean=LENGTHS, seed=st.integers(0, 10_000))
def test_stationary_workload_started_on_the_best_split_stays_near_it(gpus, mean, seed):
    """Started on the best static split, 60 steps: noise moves it at most twice and costs at most 5% (one wrong move
    early in so short a run costs its whole remaining length; on 200 steps see the test above)."""
    s = setup(stationary(gpus, mean, seed, 60))
    s.table.sweep([c.n_rollout for c in s.candidates])
    totals = {c: run_static(s, c).total_s for c in s.candidates}
    best = min(totals, key=totals.get)
    s.initial = best
    dyn = run_dynamic(s, False)
    assert dyn.switches <= 2, f"{dyn.switches} switches from {best}: {dyn.topologies}"
    assert dyn.total_s <= 1.05 * totals[best]


# --- the same at sample level, barrier-free (continuous rollout + streaming training + helpers) -----------------------
BARRIER_FREE = SimMechanisms(True, True, True, True)


@pytest.mark.parametrize("gpus, mean, seed", [(8, 3000, 0), (16, 1000, 1), (16, 3000, 0), (32, 6000, 1), (32, 3000, 1),
                                             (32, 6000, 0), (16, 6000, 0)])
def test_barrier_free_resizing_settles_on_a_stationary_workload(gpus, mean, seed):
    """200 steps from 3/4 of the GPUs training: at most 2 switches and within 1% of the best static split with the
    same mechanisms. With the whole longest response reported as a rollout tail that more GPUs cannot shorten (the
    next batch's head fills it: ``TAIL_SHARE_BARRIER_FREE``), the first four cases switched 3-7 times and lost 2-4%;
    with half of it, the last two switched 2-3 times and lost up to 3.4%."""
    s = setup(stationary(gpus, mean, seed, 200))
    dyn = run_samples(s, s.initial, BARRIER_FREE)
    _, best = best_static_samples(s, BARRIER_FREE)
    assert dyn.switches <= 2, f"{dyn.switches} switches: {dyn.topologies}"
    assert dyn.total_s <= 1.01 * best, f"{100 * (dyn.total_s / best - 1):.2f}% behind the best static split"


def test_the_play_check_holds_a_move_only_a_few_long_batches_carry():
    """16 GPUs at 300 tokens, seed 0 (the known miss of the 1% target at sample level until stop 42): the capacity model
    moves 12:4 -> 14:2 (the barrier-free best), then at step 126 proposes 13:3 on a rollout-bound imbalance of 0.12.
    Over the eight batches replayed 13:3 plays 0.94 s a step faster, carried by two long-tailed batches (+3.1 and
    +8.3 s); on four it plays 1.1 s slower, and on the median batch slower: 0.67 standard errors. The check holds it:
    one switch, within 1% of the best static split. On the mean alone (the check before) the move is made: two
    switches, +1.04%."""
    s = setup(stationary(16, 300, 0, 200))
    _, best = best_static_samples(s, BARRIER_FREE)
    run, reasons = _decisions(s, BARRIER_FREE)
    assert run.switches == 1 and run.total_s <= 1.01 * best, run.topologies[-1]
    assert any(r.startswith("play check: 13:3 plays faster than 14:2 only on a few") for r in reasons.values())
    with pytest.MonkeyPatch.context() as mp:  # the check on the mean alone
        mp.setattr(ResizePolicy, "_played_median", staticmethod(lambda pp, play, cur, cands: np.full(len(cands), np.inf)))
        mean_only, _ = _decisions(s, BARRIER_FREE)
    assert mean_only.switches == 2 and mean_only.topologies[-1] == "13:3" and mean_only.total_s > 1.01 * best


def test_a_move_the_long_batches_carry_beyond_the_spread_is_made():
    """32 GPUs at 300 tokens, seed 1, the runtime's mechanisms (no helpers): at 27:5 the move to 26:6 plays 0.3 s a step
    slower on half the batches replayed and 2.6-4.0 s faster on the long-tailed others, 1.76 standard errors in all; over
    the whole run those batches decide it (26:6 is the best static split). The check lets it through; on the median
    alone it would hold it (+2.35%)."""
    mech = replace(BARRIER_FREE, gradient_helpers=False)
    s = setup(stationary(32, 300, 1, 200))
    split, best = best_static_samples(s, mech)
    run, _ = _decisions(s, mech)
    assert str(split) == "26:6" and run.topologies[-1] == "26:6" and run.switches <= 2 and run.total_s <= 1.01 * best
    with pytest.MonkeyPatch.context() as mp:  # the median alone: never beyond the spread
        mp.setattr(policy_module, "DISSENT_Z", math.inf)
        median_only, _ = _decisions(s, mech)
    assert median_only.topologies[-1] == "27:5" and median_only.total_s > 1.01 * best


def _decisions(s, mech, **policy):
    """The run, and its decisions' reasons by step."""
    s.cfg = s.cfg.model_copy(update={"policy": s.cfg.policy.model_copy(update=policy)})
    run = run_samples(s, s.initial, mech, log=True)
    return run, {e["step"]: e["reason"] for e in run.events if e.type is EventType.DECISION}


def test_the_play_check_holds_a_move_the_capacity_model_gets_wrong():
    """16 GPUs at 6000 tokens, seed 0: the capacity model moves 12:4 -> 9:7 (the barrier-free best), then 3 steps later
    to 10:6 on a train-bound imbalance of 0.10 (+1.4% over 200 steps). Played forward on the run's batches 10:6 is
    2 s a step slower than 9:7, so the play check holds: one switch, within 1% of the best static split."""
    s = setup(stationary(16, 6000, 0, 200))
    _, best = best_static_samples(s, BARRIER_FREE)
    unchecked, reasons = _decisions(s, BARRIER_FREE, play_check=False)
    assert unchecked.switches == 2 and unchecked.total_s > 1.01 * best
    assert not any(r.startswith("play check") for r in reasons.values())
    checked, reasons = _decisions(s, BARRIER_FREE, play_check=True)
    assert checked.switches == 1 and checked.total_s <= 1.01 * best, checked.topologies[-1]
    assert any(r.startswith("play check: 10:6 does not play faster than 9:7") for r in reasons.values())
    w = s.cfg.sim.workload
    pp = PipelinePredictor(0.95)  # a play's batches: warm-up, measured (pipeline_trace_steps), behind
    play = (pp.warmup + s.cfg.policy.pipeline_trace_steps + pp.lookahead) * w.prompts_per_step * w.responses_per_prompt
    over, reasons = _decisions(s, BARRIER_FREE, play_check=True, play_check_budget=2 * play - 1)
    assert over.switches == 2 and not any(r.startswith("play check") for r in reasons.values())  # two plays too many
    _, reasons = _decisions(s, BARRIER_FREE, play_check=True, play_check_budget=2 * play)
    assert any(r.startswith("play check: 10:6 does not play faster than 9:7") for r in reasons.values())


def test_a_move_the_play_check_held_is_played_again_after_the_batches_turned_over_then_twice_as_late():
    """32 GPUs at 1000 tokens, seed 1: on 17:15 (the best) the capacity model proposes 22:10 at every step from step 8;
    the play holds it at step 8, plays it again at 16 (pipeline_trace_steps = 8 later), then at 32 (16 later); the
    steps between hold without playing."""
    s = setup(stationary(32, 1000, 1, 42))
    _, reasons = _decisions(s, BARRIER_FREE)
    played = [k for k, r in reasons.items() if r.startswith("play check: 22:10 does not play faster than 17:15")]
    remembered = [k for k, r in reasons.items() if r.startswith("play check: 22:10 played no faster")]
    assert played == [8, 16, 32], [reasons.get(k) for k in range(8, 34)]
    assert remembered == [k for k in range(9, max(reasons) + 1) if k not in (16, 32)]


def test_with_tail_consolidation_the_play_check_plays_it_and_takes_the_best_split():
    """32 GPUs at 6000 tokens, seed 0, every mechanism with tail consolidation: unchecked, the capacity model moves
    24:8 -> 18:14 (+2.5% against the best static split, 17:15). The check plays consolidation too
    (``sim.mechanisms.ConsolidationHelperPlay``): it takes 17:15 (a neighbour that plays faster beyond the noise) and
    holds the capacity model's later proposals of 18:14: one switch, within 1%. (Before the consolidation play the
    simulator turned the check off under consolidation: a play without it vetoed the moves consolidation makes pay.)"""
    s = setup(stationary(32, 6000, 0, 200))
    mech = SimMechanisms(True, True, True, True, True)
    best = run_samples(s, Topology(17, 15), replace(mech, resize=False)).total_s
    unchecked, reasons = _decisions(s, mech, play_check=False)
    assert unchecked.topologies[-1] == "18:14" and unchecked.total_s > 1.01 * best
    assert not any(r.startswith("play check") for r in reasons.values())
    checked, reasons = _decisions(s, mech, play_check=True)
    assert checked.switches == 1 and checked.topologies[-1] == "17:15", checked.topologies[-1]
    assert checked.total_s <= 1.01 * best
    assert any(r.startswith("play check: 18:14 does not play faster than 17:15") for r in reasons.values())
