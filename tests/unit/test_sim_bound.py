"""The lower bound of a run's time (dynaresize/sim/bound.py): the worked example by hand, and no run beats it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dynaresize.config.loader import load_config
from dynaresize.sim.bound import bound_total
from dynaresize.sim.compare import oracle_total, run_dynamic, run_static, setup, static_choices

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.stem for p in (ROOT / "configs/sim").glob("*.yaml") if p.stem != "base")

# the module docstring's worked example: w = 6 ms, u = 1 ms, a = 4; 2 prompts of 100 x 4 responses of 1000 tokens
TINY = ["sim.steps=3", "cluster.initial_train=2", "sim.rollout.iteration_fixed_s=0.006", "sim.rollout.compute_per_seq_s=0.001",
        "sim.rollout.kv_bytes_per_token=0", "sim.rollout.max_seqs_per_gpu=4", "sim.rollout.prefill_tokens_per_s=1000",
        "sim.workload.prompts_per_step=2", "sim.workload.responses_per_prompt=4", "sim.workload.response_tokens_start=1000",
        "sim.workload.response_tokens_end=1000", "sim.workload.response_sigma=0", "sim.workload.prompt_tokens_mean=100",
        "sim.workload.prompt_tokens_sigma=0", "sim.train.tokens_per_gpu_s=880", "sim.train.scaling_per_doubling=1.0",
        "sim.train.step_overhead_s=1", "sim.train.attention_per_context_token=0"]


def tiny(gpus: int, *extra: str):
    return load_config(ROOT / "configs/sim/paper_8gpu.yaml", TINY + [f"cluster.gpus={gpus}", *extra])


def test_worked_example_by_hand():
    cfg = tiny(4)
    s = setup(cfg)
    b = bound_total(s.table, cfg.sim, 4, 1)
    # R = 8000 tokens x (0.006 + 4 x 0.001) / 4 + 200 prompt tokens / 1000 = 20.2 GPU-s; T = 8800 / 880 + 1 = 11 GPU-s
    assert b.rollout_gpu_s == pytest.approx([20.2] * 3) and b.train_gpu_s == pytest.approx([11.0] * 3)
    assert b.tail_s == pytest.approx([7.0] * 3)  # 1000 tokens x 7 ms
    assert b.work_s == pytest.approx(3 * 31.2 / 4)
    # post = 1 + 1100 / 880 / 4 = 1.3125; latency edge 7 + 1.3125; train_min = 10 / 4 + 1 = 3.5
    assert b.chain_end_s == pytest.approx([8.3125, 11.8125, 16.625])
    assert b.total_s == pytest.approx(23.4) and b.binding == "work"
    b16 = bound_total(setup(tiny(16)).table, tiny(16).sim, 16, 1)
    assert b16.work_s == pytest.approx(3 * 31.2 / 16)
    assert b16.chain_end_s == pytest.approx([7 + 1 + 1100 / 880 / 16, 7 + 1 + 1100 / 880 / 16 + 10 / 16 + 1, 2 * (8 + 1100 / 880 / 16)])
    assert b16.total_s == pytest.approx(16.15625) and b16.binding == "chain"
    # staleness 0: every step waits for the previous one; 2: two batches may run ahead
    assert bound_total(s.table, cfg.sim, 16, 0).chain_s == pytest.approx(3 * (8 + 1100 / 880 / 16))
    assert bound_total(s.table, cfg.sim, 16, 2).chain_s == pytest.approx(8 + 1100 / 880 / 16 + 2 * (10 / 16 + 1))


def test_tiny_runs_respect_the_bound_and_the_best_is_close():
    for gpus in (4, 16):
        cfg = tiny(gpus, "sim.steps=12")
        s = setup(cfg)
        b = bound_total(s.table, cfg.sim, gpus, 1)
        best = min(run_static(s, c).total_s for c in s.candidates)
        assert b.total_s <= best <= 2.5 * b.total_s


def test_dropped_groups_cost_rollout_work_but_no_training():
    base = load_config(ROOT / "configs/sim/scale_64gpu.yaml", ["sim.steps=20"])
    dapo = load_config(ROOT / "configs/sim/dapo_64gpu.yaml", ["sim.steps=20", "sim.workload.cap_share=0"])
    b0 = bound_total(setup(base).table, base.sim, 64, 1)
    b1 = bound_total(setup(dapo).table, dapo.sim, 64, 1)
    assert (b1.rollout_gpu_s > b0.rollout_gpu_s).all()  # more prompts generated per trained sample
    assert b1.train_gpu_s.sum() == pytest.approx(b0.train_gpu_s.sum(), rel=0.06)  # as many kept samples, drawn alike
    assert b1.rollout_gpu_s.sum() > 1.15 * b0.rollout_gpu_s.sum()


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_simulated_run_beats_the_bound(name):
    cfg = load_config(ROOT / f"configs/sim/{name}.yaml")
    cfg = load_config(ROOT / f"configs/sim/{name}.yaml", [f"sim.steps={min(cfg.sim.steps, 60)}", "sim.compare_static_max=12",
                                                          "sim.write_events=false"])
    s = setup(cfg)
    b = bound_total(s.table, cfg.sim, cfg.cluster.gpus, cfg.pipeline.staleness_bound)
    assert b.total_s > 0 and b.work_s > 0 and b.chain_s > 0
    choices = static_choices(s)
    s.table.sweep([c.n_rollout for c in choices])
    runs = [run_static(s, c) for c in choices]
    runs += [run_dynamic(s, False), run_dynamic(s, False, naive=True), run_dynamic(s, False, greedy=True)]
    for r in runs:
        assert r.total_s >= b.total_s, f"{name}: {r.name} {r.total_s:.1f} s < bound {b.total_s:.1f} s"
    assert oracle_total(s) >= b.total_s
