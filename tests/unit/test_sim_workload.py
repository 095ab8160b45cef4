"""Workload drivers of the simulator: drift (unchanged), DAPO dynamic sampling, the length cap, a changing task mix."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.sim.config import WorkloadConfig
from dynaresize.sim.stages import StageTable, StepPhysics
from dynaresize.sim.workload import informative, make_batch

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

# sha256 (first 16 hex digits) of steps {0, 1, K/2, K-1} of each scenario's batches, computed on main (0227c2b)
# before the workload drivers were added: lengths as float64 bytes, then (prompt_tokens, prompt_mean.hex(),
# tokens_generated, tokens_trained, samples). The plain model's draws must stay exactly these.
MAIN_HASHES = {
    "cpu_quickstart": "cd7894901cbbb045",
    "paper_8gpu": "52757c1d23d9fe5a",
    "scale_4096gpu": "397d23089295429d",
    "scale_512gpu": "b80d04b388c90250",
    "scale_64gpu": "4d59795672c85571",
    "stationary_8gpu": "052e520c5f4e77da",
}


def batch_hash(w: WorkloadConfig, seed: int, K: int) -> str:
    h = hashlib.sha256()
    for k in sorted({0, 1, K // 2, K - 1}):
        b = make_batch(w, seed, k, K)
        h.update(np.ascontiguousarray(b.lengths, dtype=np.float64).tobytes())
        h.update(repr((b.prompt_tokens, float(b.prompt_mean).hex(), b.tokens_generated, b.tokens_trained, b.samples)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(MAIN_HASHES))
def test_existing_scenarios_draw_bit_identical_batches(name):
    cfg = load_config(ROOT / f"configs/sim/{name}.yaml")
    assert batch_hash(cfg.sim.workload, cfg.run.seed, cfg.sim.steps) == MAIN_HASHES[name]
    b = make_batch(cfg.sim.workload, cfg.run.seed, 3, cfg.sim.steps)
    G = cfg.sim.workload.responses_per_prompt
    assert b.kept.all() and b.samples == len(b.lengths) == cfg.sim.workload.prompts_per_step * G
    assert (b.prompt_index == np.arange(len(b.lengths)) // G).all() and (b.prompt_correct == -1).all()


def dapo(**ds) -> WorkloadConfig:
    base = dict(enabled=True, accuracy_start=0.3, accuracy_end=0.9)
    base.update(ds)
    return WorkloadConfig(prompts_per_step=64, responses_per_prompt=8, cap_share=0.02, dynamic_sampling=base)


def check_accounting(b, w: WorkloadConfig) -> None:
    G = w.responses_per_prompt
    assert len(b.lengths) == len(b.kept) == len(b.prompt_index) == G * b.prompts_generated
    assert (b.prompt_index == np.repeat(np.arange(b.prompts_generated), G)).all()  # prompt order, a group consecutive
    assert (b.kept.reshape(-1, G).all(axis=1) == b.kept.reshape(-1, G).any(axis=1)).all()  # whole groups
    assert b.tokens_generated == int(b.lengths.sum())
    assert b.samples == int(b.kept.sum())
    prompts = b.prompt_lengths[b.prompt_index[b.kept]].sum() if w.trained_tokens == "sequence" else 0
    assert b.tokens_trained == int(b.lengths[b.kept].sum() + prompts)
    assert b.prompt_tokens == int(b.prompt_lengths.sum())


@pytest.mark.parametrize("mode", ["rounds", "stream"])
def test_dynamic_sampling_is_deterministic_per_seed_and_step(mode):
    w = dapo(mode=mode)
    a, b = make_batch(w, 7, 40, 100), make_batch(w, 7, 40, 100)
    for f in ("lengths", "kept", "prompt_index", "prompt_lengths", "prompt_correct"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    make_batch(w, 7, 41, 100)  # drawing another step first changes nothing
    assert np.array_equal(make_batch(w, 7, 40, 100).lengths, a.lengths)
    assert not np.array_equal(make_batch(w, 8, 40, 100).lengths, a.lengths)
    assert not np.array_equal(make_batch(w, 7, 39, 100).lengths[:100], a.lengths[:100])
    check_accounting(a, w)


@pytest.mark.parametrize("mode", ["rounds", "stream"])
def test_dropped_groups_have_all_equal_rewards_and_kept_ones_come_first_in_prompt_order(mode):
    w = dapo(mode=mode, round_prompts_factor=1.0)
    B, G = w.prompts_per_step, w.responses_per_prompt
    for step in (0, 50, 99):
        b = make_batch(w, 0, step, 100)
        check_accounting(b, w)
        kept_p = b.kept.reshape(-1, G)[:, 0]
        ok = informative(b.prompt_correct, G)
        assert kept_p.sum() == B  # the batch is full
        assert (ok[kept_p]).all()  # every kept group has mixed rewards ...
        assert set(b.prompt_correct[~ok]) <= {0, G}  # ... every uninformative one is all-wrong or all-right
        last = int(np.flatnonzero(kept_p)[-1])
        assert (kept_p[: last + 1] == ok[: last + 1]).all()  # the first B informative prompts, in prompt order
        assert not kept_p[last + 1:].any()
        if mode == "stream":
            assert last == b.prompts_generated - 1  # generation stopped at the prompt that completed the batch
        else:
            assert b.prompts_generated % B == 0  # whole rounds of B prompts; the surplus is generated, not trained
    assert informative(np.array([0, 1, 7, 8]), 8).tolist() == [False, True, True, False]


def test_rollout_work_per_trained_sample_grows_with_accuracy():
    w = dapo(mode="stream", accuracy_start=0.5, accuracy_end=0.97)
    w = w.model_copy(update=dict(cap_share=0.0))
    per_sample = [np.mean([make_batch(w, s, k, 100).prompts_generated for s in range(3)]) / w.prompts_per_step for k in (0, 50, 99)]
    assert per_sample[0] < per_sample[1] < per_sample[2]
    assert per_sample[2] > 2 * per_sample[0]


def test_oversampling_is_bounded_and_an_unsolvable_step_trains_nothing():
    w = dapo(accuracy_start=0.0, accuracy_end=0.0, max_oversample=2.5, round_prompts_factor=1.0)
    b = make_batch(w, 0, 3, 10)
    assert b.prompts_generated == int(2.5 * w.prompts_per_step)  # 2 full rounds + half a round, then it gives up
    assert b.samples == 0 and b.tokens_trained == 0 and b.tokens_generated > 0
    assert (b.prompt_correct == 0).all()
    check_accounting(b, w)


def test_truncated_responses_score_zero():
    w = dapo(accuracy_start=1.0, accuracy_end=1.0)  # everything finished is correct
    w = w.model_copy(update=dict(cap_share=0.3))
    b = make_batch(w, 0, 0, 10)
    G = w.responses_per_prompt
    at_cap = (b.lengths == w.max_response_tokens).reshape(-1, G).sum(axis=1)
    assert (b.prompt_correct == G - at_cap).all()


def test_cap_share_puts_that_share_exactly_at_the_cap():
    w = WorkloadConfig(prompts_per_step=512, responses_per_prompt=8, response_tokens_start=300, response_tokens_end=300,
                       response_sigma=0.3, cap_share=0.1, max_response_tokens=8192)
    b = make_batch(w, 0, 0, 10)
    at_cap = b.lengths == 8192
    assert at_cap.mean() == pytest.approx(0.1, abs=0.02)  # 4096 draws: sd 0.005
    assert b.lengths.max() == 8192 and b.lengths[~at_cap].max() < 3000  # nothing else near the cap
    plain = make_batch(w.model_copy(update=dict(cap_share=0.0)), 0, 0, 10)
    assert np.array_equal(b.lengths[~at_cap], plain.lengths[~at_cap])  # the cap replaces lengths, draws stay aligned


def test_task_mix_changes_at_the_given_steps():
    w = WorkloadConfig(prompts_per_step=200, responses_per_prompt=4, tasks=[
        dict(name="short", response_tokens_mean=100, response_sigma=0.1),
        dict(name="long", response_tokens_mean=5000, response_sigma=0.1, prompt_tokens_mean=2000)],
        task_weights={0: [1, 0], 10: [0, 1], 20: [1, 1]})
    assert make_batch(w, 0, 9, 30).prompt_task.tolist() == [0] * 200
    assert make_batch(w, 0, 9, 30).lengths.max() < 200
    b = make_batch(w, 0, 10, 30)
    assert (b.prompt_task == 1).all() and b.lengths.min() > 3000 and b.prompt_lengths.mean() > 1500
    b = make_batch(w, 0, 25, 30)
    assert 0.35 < b.prompt_task.mean() < 0.65
    long_ = np.repeat(b.prompt_task == 1, 4)
    assert b.lengths[long_].min() > 3000 and b.lengths[~long_].max() < 200  # a prompt's responses follow its task


def test_scenarios_with_drivers_run_through_the_stage_model():
    for name in ("dapo_64gpu", "taskmix_64gpu"):
        cfg = load_config(ROOT / f"configs/sim/{name}.yaml")
        tab = StageTable(cfg.sim, cfg.run.seed, cfg.sim.steps, cfg.cluster.gpus)
        for k in (0, cfg.sim.steps - 1):
            assert 0 < tab.rollout_s(k, 16) < 1e5 and 0 < tab.train_s(k, 48) < 1e5
        b = make_batch(cfg.sim.workload, cfg.run.seed, cfg.sim.steps - 1, cfg.sim.steps)
        check_accounting(b, cfg.sim.workload)
        assert StepPhysics(cfg.sim, b).lmax == b.lengths.max()
    dp = load_config(ROOT / "configs/sim/dapo_64gpu.yaml")
    w, K = dp.sim.workload, dp.sim.steps
    first, last = make_batch(w, 0, 0, K), make_batch(w, 0, K - 1, K)
    assert last.prompts_generated > first.prompts_generated  # accuracy rose: more prompts per kept group
    assert (last.lengths == w.max_response_tokens).mean() >= w.cap_share * 0.5


def test_bad_task_mix_is_named(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("extends: " + str(ROOT / "configs/sim/scale_64gpu.yaml") + "\nsim:\n  workload:\n    tasks:\n"
                 "      - {name: a, response_tokens_mean: 500}\n    task_weights:\n      5: [1]\n")
    with pytest.raises(ConfigError, match=r"sim\.workload\.task_weights.*needs the mix from step 0"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"sim\.workload\.task_weights\.150.*3 weights"):
        load_config(ROOT / "configs/sim/taskmix_64gpu.yaml", ["sim.workload.task_weights={0: [1, 1, 1], 150: [1, 2]}"])


# --- long-CoT drivers: an S-shaped length growth and a growing share at the cap (configs/sim/longcot_64gpu.yaml) ---

from dynaresize.sim.workload import cap_share, logistic_share, mean_response  # noqa: E402


def test_logistic_growth_starts_and_ends_on_its_means_and_grows_fastest_at_its_midpoint():
    K = 101
    w = WorkloadConfig(response_tokens_start=1000, response_tokens_end=7000, drift="logistic", drift_midpoint=0.3,
                       drift_width=0.1, max_response_tokens=16384)
    m = np.array([mean_response(w, k, K) for k in range(K)])
    assert m[0] == pytest.approx(1000) and m[-1] == pytest.approx(7000)
    assert (np.diff(m) > 0).all()  # monotone
    assert int(np.argmax(np.diff(m))) in (29, 30)  # the steepest step at 30% of the run
    assert m[10] < 1000 + 0.15 * 6000 and m[60] > 1000 + 0.9 * 6000  # slow start, flattening end (an S, not a line)
    # symmetric about a midpoint of 0.5: exactly half-way there
    assert logistic_share(0.5, 0.5, 0.2) == pytest.approx(0.5) and logistic_share(0.0, 0.5, 0.2) == 0.0
    # the draws follow the curve
    b = make_batch(w.model_copy(update=dict(prompts_per_step=512, response_sigma=0.3)), 0, 60, K)
    assert b.lengths.mean() == pytest.approx(m[60], rel=0.03)


def test_the_share_at_the_cap_moves_linearly_from_cap_share_to_cap_share_end():
    K = 11
    w = WorkloadConfig(prompts_per_step=1024, responses_per_prompt=8, response_tokens_start=300, response_tokens_end=300,
                       response_sigma=0.3, cap_share=0.01, cap_share_end=0.2, max_response_tokens=8192)
    assert [cap_share(w, k, K) for k in (0, 5, 10)] == pytest.approx([0.01, 0.105, 0.2])
    for k, want in ((0, 0.01), (5, 0.105), (10, 0.2)):  # 8192 draws a step: sd <= 0.0045
        assert (make_batch(w, 0, k, K).lengths == 8192).mean() == pytest.approx(want, abs=0.015)
    # an end equal to the start is the constant share: the very same draws
    same = w.model_copy(update=dict(cap_share_end=0.01))
    const = w.model_copy(update=dict(cap_share_end=None))
    assert np.array_equal(make_batch(same, 0, 7, K).lengths, make_batch(const, 0, 7, K).lengths)


def test_the_longcot_scenario_grows_several_fold_with_more_responses_at_the_cap():
    cfg = load_config(ROOT / "configs/sim/longcot_64gpu.yaml")
    w, K = cfg.sim.workload, cfg.sim.steps
    first, last = make_batch(w, cfg.run.seed, 0, K), make_batch(w, cfg.run.seed, K - 1, K)
    assert last.lengths.mean() > 4 * first.lengths.mean()
    cap = w.max_response_tokens
    assert (last.lengths == cap).mean() > 10 * (first.lengths == cap).mean() > 0
    check_accounting(last, w)


def test_cap_share_end_is_checked_and_excludes_a_trace(tmp_path):
    with pytest.raises(ConfigError, match="cap_share_end"):
        load_config(ROOT / "configs/sim/paper_8gpu.yaml", ["sim.workload.cap_share_end=1.5"])
    with pytest.raises(ConfigError, match="drift"):
        load_config(ROOT / "configs/sim/paper_8gpu.yaml", ["sim.workload.drift=sigmoid"])
    with pytest.raises(ConfigError, match="cap_share_end"):
        load_config(ROOT / "configs/sim/paper_8gpu.yaml", [f"sim.workload.trace={ROOT / 'tests/fixtures/real_cpu_run'}",
                                                           "sim.workload.cap_share_end=0.1", "sim.steps=2"])
