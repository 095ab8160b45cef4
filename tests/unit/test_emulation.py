"""The emulated accelerator's timing model (against hand-computed values and the simulator's formulas) and its
pacer (sleeps the rest of a span, records an overrun)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dynaresize.config.schema import Config
from dynaresize.emulation.model import ScaledSwitchCostModel, TimingModel, distinct_prompt_tokens, switch_cost_model
from dynaresize.emulation.pacer import Pacer, merge
from dynaresize.events import SwitchOp
from dynaresize.policy import SwitchCostModel, Topology

# round numbers, so every expected value below is computed by hand
PROFILE = {
    "cluster": {"device": "emulated", "gpus": 4},
    "emulation": {"time_scale": 0.5, "tokens_per_token": 10},
    "sim": {
        "rollout": {"iteration_fixed_s": 0.01, "compute_per_seq_s": 0.001, "kv_bytes_per_token": 1e6, "hbm_gbps": 1000,
                    "prefill_tokens_per_s": 1000},
        "train": {"tokens_per_gpu_s": 100, "attention_per_context_token": 0.001, "scaling_per_doubling": 0.9,
                  "step_overhead_s": 2.0},
    },
    "switching": {"costs": {"model_params_b": 1, "weight_bytes_per_param": 2, "optimizer_bytes_per_param": 8,
                            "pcie_gbps": 20, "nccl_gbps": 10, "train_engine_rebuild_s": 0.3,
                            "override_s": {"comm_select": 0.4}}},
}


def cfg(**over) -> Config:
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PROFILE.items()}
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return Config.model_validate(d)


@pytest.fixture
def m() -> TimingModel:
    return TimingModel(cfg())


def test_decode_iteration_and_prefill(m):
    # 0.5 x 10 x (0.01 + 4 x (0.001 + 20 x 10 x 1e6 / 1e12)) = 5 x 0.0148
    assert m.decode_iteration_s(4, 20) == pytest.approx(0.074)
    assert m.decode_iteration_s(0, 20) == 0.0
    assert m.prefill_s(30) == pytest.approx(0.5 * 30 * 10 / 1000)
    assert distinct_prompt_tokens([[1, 2, 3], [1, 2, 3], [4, 5]]) == 5  # a group's responses share one prefill


def test_decode_of_a_batch_sums_to_the_simulators_rollout_time():
    """One rank decoding a batch to the end, paced per iteration the way the torch engine calls it (mean context of
    the live rows + it + 0.5), costs what StepPhysics says for the same modelled lengths on one GPU."""
    from dynaresize.sim.stages import StepPhysics
    from dynaresize.sim.workload import Batch

    c = cfg()
    m = TimingModel(c)
    plen, L = 3, np.array([2, 5, 5, 9])  # real tokens
    it_s = sum(m.decode_iteration_s(int((L > it).sum()), plen + it + 0.5) for it in range(int(L.max())))
    k = c.emulation.tokens_per_token
    b = Batch(lengths=(L * k).astype(np.float64), prompt_tokens=plen * k, prompt_mean=plen * k, tokens_generated=int(L.sum() * k),
              tokens_trained=0, samples=4, prompt_index=np.zeros(4, dtype=np.int64), prompt_lengths=np.array([plen * k], dtype=np.float64),
              kept=np.ones(4, dtype=bool), prompt_task=np.zeros(1, dtype=np.int64), prompt_correct=np.full(1, -1))
    ph = StepPhysics(c.sim, b)
    assert it_s + m.prefill_s(plen) == pytest.approx(c.emulation.time_scale * ph.rollout_s(1), rel=1e-9)


def test_train_chunk_and_optimizer_step(m):
    # samples (prompt, response) = (2, 3), (2, 5) real -> 50, 70 modelled; context E[S^2] / 2E[S] = 3700 / 120
    ctx = 3700 / 120
    want = 0.5 * 120 * (1 + 0.001 * ctx) / (100 * 2 * 0.9)
    assert m.train_s([2, 2], [3, 5], 2) == pytest.approx(want)
    assert m.train_s([2, 2], [3, 5], 1) == pytest.approx(want * 2 * 0.9)
    resp = TimingModel(cfg(sim={**PROFILE["sim"], "workload": {"trained_tokens": "response"}}))
    assert resp.train_s([2, 2], [3, 5], 2) == pytest.approx(want * 80 / 120)
    assert m.optimizer_step_s() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="2 prompt lengths but 1"):
        m.train_s([2, 2], [3], 2)


def test_weight_sync_and_switch_ops(m):
    assert m.weight_sync_s() == pytest.approx(0.5 * 2e9 / 10e9)
    # 2 -> 1 trainers of 4: rank 1 moves to rollout: optimizer shard out (8e9 / 2 over PCIe) and weights offload
    # (2e9 over PCIe) on offload, the override 0.4 s on comm_select, the weight sync (0.2 s), onload + wake (2e9 / 20e9
    # + 0.5) and warm-up (1 s) on engine_build: each x 0.5
    ops = m.switch_ops_s(2, 1, 4, 1)
    assert ops[SwitchOp.OFFLOAD] == pytest.approx(0.5 * (0.2 + 0.1))
    assert ops[SwitchOp.COMM_SELECT] == pytest.approx(0.2)
    assert ops[SwitchOp.WEIGHT_SYNC] == pytest.approx(0.1)
    assert ops[SwitchOp.ENGINE_BUILD] == pytest.approx(0.5 * (0.1 + 0.5 + 1.0))
    # rank 0 stays a trainer: the engine rebuild (0.3 s); the reshard and stage-in are deferred (background)
    assert m.switch_ops_s(2, 1, 4, 0) == {SwitchOp.OFFLOAD: 0.0, SwitchOp.COMM_SELECT: 0.0, SwitchOp.WEIGHT_SYNC: 0.0,
                                          SwitchOp.ENGINE_BUILD: pytest.approx(0.15), SwitchOp.OPTIMIZER_RESHARD: 0.0}
    assert m.switch_ops_s(2, 1, 4, 3) == {}  # not in the switch
    # what a moving rank paces is the critical cost the policy plans for it, in emulated seconds
    plain = SwitchCostModel(cfg().switching.costs, cfg().switching.optimizations)
    assert sum(ops.values()) == pytest.approx(0.5 * plain.critical_cost_s(Topology(2, 2), Topology(1, 3)))
    # deferred stage-in (8e9 / 1 over NVMe 3 GB/s) + reshard (8e9 / 10e9) of 1 -> 3 trainers, minus 0.9 x training
    bg = 0.5 * (8e9 / 3 / 3e9 + 8e9 / 3 / 10e9)
    assert m.deferred_stage_in_s(1, 3, 4, 0.0) == pytest.approx(bg)
    assert m.deferred_stage_in_s(1, 3, 4, 0.5) == pytest.approx(bg - 0.45)
    assert m.deferred_stage_in_s(1, 3, 4, 100.0) == 0.0


def test_the_policy_prices_switches_in_emulated_seconds():
    c = cfg()
    scaled = switch_cost_model(c)
    assert isinstance(scaled, ScaledSwitchCostModel)
    plain = switch_cost_model(cfg(cluster={"device": "cpu"}))
    assert type(plain) is SwitchCostModel
    a, b = Topology(3, 1), Topology(1, 3)
    assert scaled.critical_cost_s(a, b) == pytest.approx(0.5 * plain.critical_cost_s(a, b))
    assert scaled.weight_sync_s() == pytest.approx(0.5 * plain.weight_sync_s())


def test_empirical_rollout_has_nothing_to_emulate():
    with pytest.raises(ValueError, match="sim.rollout.model=physics"):
        TimingModel(cfg(sim={**PROFILE["sim"], "rollout": {"model": "empirical"}}))


def test_pacer_sleeps_the_rest_of_a_span():
    p = Pacer(0.05)
    t0 = time.perf_counter()
    with p.span("decode", 0.05):
        pass
    assert time.perf_counter() - t0 >= 0.05
    assert p.overruns == 0
    assert p.to_json()["decode"]["spans"] == 1


def test_pacer_records_an_overrun_and_merge_says_not_faithful():
    p = Pacer(0.05)
    with p.span("train", 0.05):
        pass  # within the model: no overrun
    t0 = time.perf_counter()
    with p.span("train", 0.01):
        time.sleep(0.03)  # 3x the model: an overrun, and no sleep after it
    assert time.perf_counter() - t0 < 0.03 + 0.01
    st = p.to_json()["train"]
    assert st["spans"] == 2 and st["overruns"] == 1
    assert st["worst_real_s"] >= 0.03 and st["worst_modelled_s"] == 0.01
    assert st["overrun_s"] >= 0.02
    q = Pacer(0.05)
    with q.span("decode", 0.001):
        pass
    block = merge([p.to_json(), q.to_json()])
    assert block["faithful"] is False and block["ranks"] == 2
    assert block["by_kind"]["train"]["overruns"] == st["overruns"] and block["by_kind"]["decode"]["overruns"] == 0
    assert merge([q.to_json()])["faithful"] is True


def test_pacer_settle_counts_work_done_elsewhere():
    p = Pacer(0.0)
    start = time.perf_counter()
    end = p.settle("weight_fetch", start, 0.001, 0.03)  # a background read of 1 ms, modelled 30 ms
    assert end - start >= 0.03 and p.overruns == 0
    p.settle("weight_fetch", time.perf_counter() - 1.0, 0.5, 0.1)  # the read itself took 0.5 s: an overrun
    assert p.overruns == 1
    with pytest.raises(ValueError, match="negative"):
        p.settle("x", start, 0.0, -1.0)


def test_the_runs_emulation_block_merges_each_ranks_last_record(tmp_path):
    from dynaresize.emulation.engine import OVERRUNS_METRIC
    from dynaresize.emulation.report import describe, emulation_summary
    from dynaresize.events import EventLog, EventType

    fast, slow = Pacer(0.05), Pacer(0.05)
    with fast.span("decode", 0.001):
        pass
    with EventLog(tmp_path / "events.jsonl") as ev:
        ev.emit(EventType.METRIC, name=OVERRUNS_METRIC, value=0, rank=1, by_kind=fast.to_json())
        with slow.span("train", 0.0):
            time.sleep(0.01)
        ev.emit(EventType.METRIC, name=OVERRUNS_METRIC, value=1, rank=0, by_kind=slow.to_json())
        with fast.span("decode", 0.001):
            pass
        ev.emit(EventType.METRIC, name=OVERRUNS_METRIC, value=0, rank=1, by_kind=fast.to_json())  # cumulative: the last counts
        ev.emit(EventType.METRIC, name="val_reward", value=0.5)
    block = emulation_summary(tmp_path)
    assert block["ranks"] == 2 and block["faithful"] is False and block["overruns"] == 1
    assert block["by_kind"]["decode"]["spans"] == 2 and block["by_kind"]["train"]["overruns"] == 1
    assert "NOT faithful" in describe(block) and "train 1/1" in describe(block)
    assert describe(merge([fast.to_json()])).startswith("emulation: faithful")


def test_the_drift_profile_grows_answers_at_least_four_fold_over_its_run():
    """configs/emulated-8gpu-drift.yaml's claim (issue 45: lengths growing >= x4 over the run), from its curriculum: the
    mean answer (letters; the tiny tokenizer merges some in pairs, so the bench's ``growth`` column measures the
    tokens) over the run's last quarter of steps against its first, on the run's own prompts, the ramp inside the run,
    and the simulator's stand-in (what `dynaresize simulate` on the file models) growing."""
    from dynaresize.config.loader import load_config
    from dynaresize.tasks.registry import load_task

    cfg = load_config("configs/emulated-8gpu-drift.yaml")
    task, steps, per_step = load_task(cfg.task), cfg.run.steps, cfg.rollout.prompts_per_step
    mean = [sum(len(task.answer(task.prompt(cfg.run.seed, s, i))) for i in range(per_step)) / per_step
            for s in range(steps)]
    q = steps // 4
    assert sum(mean[-q:]) / sum(mean[:q]) >= 4.0, mean
    assert cfg.task.curriculum.ramp_steps <= steps and cfg.sim.steps == steps
    w = cfg.sim.workload
    assert w.response_tokens_end > w.response_tokens_start
    # the stationary profile it is benchmarked beside does not drift as far over the same steps
    base = load_config("configs/emulated-8gpu.yaml")
    btask = load_task(base.task)
    bmean = [sum(len(btask.answer(btask.prompt(base.run.seed, s, i))) for i in range(per_step)) for s in range(steps)]
    assert sum(bmean[-q:]) / sum(bmean[:q]) < 4.0
