"""The pipeline predictor (policy.predictor: pipeline): pure, close to the simulator it replays, and a fallback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.policy import Observation, ResizePolicy, SwitchCostModel, Topology, candidate_topologies
from dynaresize.policy.config import OptimizationsConfig, PolicyConfig, SwitchCostConfig
from dynaresize.policy.pipeline_predictor import PipelinePredictor, extrapolate
from dynaresize.sim.mechanisms import HelperPlay, SimMechanisms
from dynaresize.sim.compare import run_samples, setup
from dynaresize.sim.samples import SamplePipeline, SampleSettings

ROOT = Path(__file__).resolve().parents[2]
MECH = SimMechanisms(True, True, False, True)  # continuous rollout, streaming training, gradient helpers; no resizing


def _world(gpus: int, mean: int, steps: int):
    cfg = load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
        f"sim.steps={steps}", "sim.write_events=false", f"cluster.gpus={gpus}", f"cluster.initial_train={gpus // 2}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}", "run.seed=0"])
    s = setup(cfg)
    p = cfg.sim.pipeline
    pipe = SamplePipeline("t", s.table, s.initial, MECH, s.costs, None,
                          SampleSettings(cfg.pipeline.staleness_bound, False, 0.9, p.claim_groups, p.stream_chunks))
    return s, pipe


def test_pure_and_deterministic():
    _, pipe = _world(8, 300, 8)
    trace = tuple(pipe._workload(pipe._batch(j)) for j in range(4))
    a, b = PipelinePredictor(0.95, hooks=HelperPlay), PipelinePredictor(0.95, hooks=HelperPlay)
    for topo in (Topology(5, 3), Topology(6, 2), Topology(3, 5)):
        x = a.period_s(trace, topo)
        assert x > 0 and x == b.period_s(trace, topo) == a.period_s(trace, topo)
    assert a.plays == 3  # memoised by its inputs


@pytest.mark.parametrize("split", [Topology(6, 2), Topology(5, 3), Topology(4, 4)])
def test_predicts_the_simulated_barrier_free_period(split):
    """On a static split the predicted period is within 10% of the simulator's steady-state step time (what it
    leaves out: which GPU the next group lands on, a help's exact chunking)."""
    s, pipe = _world(8, 300, 30)
    trace = tuple(pipe._workload(pipe._batch(j)) for j in range(10, 14))
    predicted = PipelinePredictor(s.cfg.policy.train_scaling_per_doubling, hooks=HelperPlay).period_s(trace, split)
    s20 = setup(s.cfg.model_copy(update={"sim": s.cfg.sim.model_copy(update={"steps": 20})}))
    measured = (run_samples(s, split, MECH).total_s - run_samples(s20, split, MECH).total_s) / 10
    assert predicted == pytest.approx(measured, rel=0.10)


def test_a_train_queue_hides_the_trainers_command_latency_in_the_prediction_as_in_the_simulator():
    """With a control-plane latency, ``train_queue=2`` (the next chunk or the step queued behind the one running)
    shortens the period, in the predictor as in the simulator it replays (each within 10% of the simulated one)."""
    got = {}
    for q in (1, 2):
        cfg = load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
            "sim.write_events=false", "cluster.gpus=8", "cluster.initial_train=5", "sim.workload.response_tokens_start=300",
            "sim.workload.response_tokens_end=300", "run.seed=0", "sim.command_latency_s=2.0", f"sim.pipeline.train_queue={q}"])
        runs = {}
        for steps in (20, 30):
            s = setup(cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"steps": steps})}))
            runs[steps] = run_samples(s, Topology(5, 3), MECH).total_s
        p = cfg.sim.pipeline
        pipe = SamplePipeline("t", s.table, s.initial, MECH, s.costs, None,
                              SampleSettings(cfg.pipeline.staleness_bound, False, 0.9, p.claim_groups, p.stream_chunks,
                                             train_queue=q))
        trace = tuple(pipe._workload(pipe._batch(j)) for j in range(10, 14))
        assert all(w.train_queue == q and w.command_latency_s == 2.0 for w in trace)
        predicted = PipelinePredictor(cfg.policy.train_scaling_per_doubling, hooks=HelperPlay).period_s(trace, Topology(5, 3))
        measured = (runs[30] - runs[20]) / 10
        assert predicted == pytest.approx(measured, rel=0.10), q
        got[q] = (predicted, measured)
    assert got[2][0] < got[1][0] and got[2][1] < got[1][1], got


def test_without_a_batch_the_pipeline_policy_is_the_capacity_policy():
    costs = SwitchCostModel(SwitchCostConfig(), OptimizationsConfig())
    cands = candidate_topologies(8)
    pols = [ResizePolicy(PolicyConfig(predictor=p), costs, cands) for p in ("capacity", "pipeline")]
    topo, decisions = Topology(6, 2), []
    for k in range(30):
        obs = Observation(k, topo, rollout_s=100.0 + 7 * (k % 3), train_s=40.0, rollout_tail_s=10.0, steps_left=100)
        d = [p.decide(obs) for p in pols]
        assert d[0] == d[1]
        decisions.append(d[0])
        topo = d[0].target
    assert any(d.resize for d in decisions)


def test_the_gradient_helpers_are_played_only_by_the_simulators_plugin():
    """The helpers are a simulator-only mechanism: the shared predictor refuses batches that have them unless given
    the simulator's HelperPlay, which plays them (here they change the period); without helpers the plug-in changes
    nothing."""
    _, pipe = _world(8, 300, 8)
    trace = tuple(pipe._workload(pipe._batch(j)) for j in range(4))
    assert all(w.helper_rate > 0 for w in trace)
    with pytest.raises(ValueError, match="simulator-only mechanism"):
        PipelinePredictor(0.95).period_s(trace, Topology(5, 3))
    plain = tuple(replace(w, helper_rate=0.0) for w in trace)
    for topo in (Topology(6, 2), Topology(5, 3), Topology(2, 6)):
        assert PipelinePredictor(0.95).step_times(plain, topo) == PipelinePredictor(0.95, hooks=HelperPlay).step_times(plain, topo)
    assert any(PipelinePredictor(0.95, hooks=HelperPlay).period_s(trace, t) != PipelinePredictor(0.95).period_s(plain, t)
               for t in (Topology(2, 6), Topology(3, 5)))


def test_config_names_the_predictors():
    assert PolicyConfig().predictor == "capacity"
    with pytest.raises(Exception):
        PolicyConfig(predictor="oracle")


def _recorded(cfg_over: list[str], split: Topology, steps: int, mech=MECH):
    """A static run's batches as the policy observes them and its step ends (simulated seconds), batch by batch."""
    cfg = load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [f"sim.steps={steps}", "sim.write_events=false"] + cfg_over)
    s = setup(cfg)
    ends, wls = {}, {}

    class Recording(SamplePipeline):
        def _step_done(self, t, batch):
            ends[batch] = t
            wls[batch] = self._workload(self._batch(batch))
            return super()._step_done(t, batch)

    p = cfg.sim.pipeline
    Recording("t", s.table, split, mech, s.costs, None,
              SampleSettings(cfg.pipeline.staleness_bound, False, 0.9, p.claim_groups, p.stream_chunks)).run()
    return cfg, ends, wls


@pytest.mark.parametrize("n_train", [21, 26])
def test_played_in_order_the_batches_give_the_simulated_step_times(n_train):
    """Played on the very batches of a simulated run, in order, the predictor's step times are the simulator's within
    1% (32 GPUs, 1000 tokens, few rollout GPUs: a GPU at its even share of a batch claims again as its groups finish,
    as the core's rank does; before, the play waited for it to drain and was 2-2.5% slow)."""
    split = Topology(n_train, 32 - n_train)
    cfg, ends, wls = _recorded(["cluster.gpus=32", "cluster.initial_train=24", "sim.workload.response_tokens_start=1000",
                                "sim.workload.response_tokens_end=1000", "run.seed=1"], split, 40)
    K = max(ends) + 1
    pp = PipelinePredictor(cfg.policy.train_scaling_per_doubling, warmup_steps=0, hooks=HelperPlay)
    played = pp.step_times(tuple(wls[j] for j in range(K - 1)), split)
    sim = (ends[K - 2] - ends[4]) / (K - 6)
    assert sum(played[5:K - 1]) / (K - 6) == pytest.approx(sim, rel=0.01)


def test_the_windowed_play_of_a_rollout_bound_split_is_its_steady_state():
    """The newest 8 batches, cycled, predict a rollout-bound split's period within 2% (64 GPUs at 51:13): the play
    starts with the rollout one batch ahead and a split slightly short of rollout lives off that lead for ~10 steps,
    so the warm-up is a whole cycle of the trace (with 3 batches it was 3% fast)."""
    split = Topology(51, 13)
    cfg, ends, wls = _recorded(["cluster.gpus=64", "cluster.initial_train=48", "sim.workload.prompts_per_step=256",
                                "sim.workload.response_tokens_start=2500", "sim.workload.response_tokens_end=2500"],
                               split, 40)
    pp = PipelinePredictor(cfg.policy.train_scaling_per_doubling, hooks=HelperPlay)
    got = [pp.period_s(tuple(wls[j] for j in range(k - 7, k + 1)), split) for k in (16, 24, 32)]
    sim = (ends[38] - ends[10]) / 28
    assert sum(got) / len(got) == pytest.approx(sim, rel=0.02)


def test_extrapolate_follows_a_drift_and_leaves_a_stationary_trace_as_observed():
    _, pipe = _world(8, 300, 12)
    flat = tuple(pipe._workload(pipe._batch(j)) for j in range(8))
    assert extrapolate(flat, 1.0) == flat  # no trend beyond the noise: replayed as observed
    grown = tuple(replace(w, lengths=tuple(x * (1 + 0.1 * i) for x in w.lengths),
                          train_s_per_group=tuple(x * (1 + 0.1 * i) for x in w.train_s_per_group))
                  for i, w in enumerate(flat))
    out = extrapolate(grown, 1.0)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    target = mean([mean(w.lengths) for w in flat]) * 1.8  # the trend's value one batch past the newest (1 + 0.1 x 8)
    for w in out:
        assert mean(w.lengths) == pytest.approx(target, rel=0.06)
    assert extrapolate(grown, 1.0) == out  # pure
    assert extrapolate(grown[:3], 1.0) == grown[:3]  # too few batches for a trend


def test_the_play_of_tail_consolidation_predicts_the_simulators_period_where_a_play_without_it_cannot():
    """16 GPUs at 6000 tokens (seed 1), tail consolidation with the helpers, static 10:6: played on the run's own
    batches with the simulator's consolidation play (``play_hooks``: ConsolidationHelperPlay) the period is within 3%
    of the simulated one; the same batches played without it (HelperPlay, the batches' consolidation switched off)
    miss it by more than 5% (the moved tails' time, which no other play sees). A play that does not move tails refuses
    batches that had consolidation."""
    from dynaresize.sim.mechanisms import ConsolidationHelperPlay, play_hooks

    mech = SimMechanisms(True, True, False, True, True)  # + tail consolidation; no resizing
    assert play_hooks(mech) is ConsolidationHelperPlay and play_hooks(MECH) is HelperPlay
    cfg = load_config(ROOT / "configs/sim/stationary_8gpu.yaml", [
        "sim.write_events=false", "cluster.gpus=16", "cluster.initial_train=12", "sim.workload.response_tokens_start=6000",
        "sim.workload.response_tokens_end=6000", "run.seed=1"])
    split = Topology(10, 6)
    runs = {}
    for steps in (20, 60):
        s = setup(cfg.model_copy(update={"sim": cfg.sim.model_copy(update={"steps": steps})}))
        runs[steps] = run_samples(s, split, mech)
    assert runs[60].moves > 0
    measured = (runs[60].total_s - runs[20].total_s) / 40
    p = cfg.sim.pipeline
    pipe = SamplePipeline("t", s.table, split, mech, s.costs, None,
                          SampleSettings(cfg.pipeline.staleness_bound, False, 0.9, p.claim_groups, p.stream_chunks,
                                         helper_rate=p.helper_rate, helper_cost_s=p.helper_cost_s,
                                         kv_move_gbps=p.kv_move_gbps, consolidation_min_gain=p.consolidation_min_gain))
    trace = tuple(pipe._workload(pipe._batch(j)) for j in range(20, 36))
    assert all(w.consolidation_min_gain == p.consolidation_min_gain and w.kv_move_s_per_token > 0 for w in trace)
    per_doubling = cfg.policy.train_scaling_per_doubling
    played = PipelinePredictor(per_doubling, hooks=ConsolidationHelperPlay).period_s(trace, split)
    assert played == pytest.approx(measured, rel=0.03)
    plain = tuple(replace(w, consolidation_min_gain=0.0) for w in trace)
    assert PipelinePredictor(per_doubling, hooks=HelperPlay).period_s(plain, split) > 1.05 * measured
    with pytest.raises(ValueError, match="tail consolidation"):
        PipelinePredictor(per_doubling, hooks=HelperPlay).period_s(trace, split)
