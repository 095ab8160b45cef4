"""The golden check of the fast sample-level engine (issue 28, item 3): random worlds run through the frozen engine and
core of before (tests/support/sim_reference: the event loop as it was at commit a6367d7) and through today's
:mod:`dynaresize.sim.samples`, and the two runs must be identical, bit for bit: the run's end, every step's trainer
split, the switches and their costs, the busy GPU-seconds, the helps and trainer-gen excursions, the sample-to-version
map and the whole event log (every stage interval, decision and switch op, in order). No tolerance: the fast engine
computes the same floating-point operations in the same order, it only skips Python work whose result is known."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dynaresize.config.loader import load_config
from dynaresize.policy import Topology
from dynaresize.schedule import Mechanisms
from dynaresize.sim.compare import run_samples, setup
from tests.support.sim_reference import run_samples_reference

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def fingerprint(r) -> dict:
    """Everything a sample-level run reports (its wall time aside)."""
    return dict(
        total_s=r.total_s, samples=r.samples, steps=r.steps, switches=r.switches, overhead_s=r.overhead_s,
        critical_s=r.critical_s, topologies=r.topologies, busy_rollout_gpu_s=r.busy_rollout_gpu_s,
        busy_train_gpu_s=r.busy_train_gpu_s, helps=r.helps, trainer_gens=r.trainer_gens,
        trainer_gen_groups=r.trainer_gen_groups, trainer_gen_over_s=r.trainer_gen_over_s, versions=r.versions,
        events=[(e.type, e.t, e.data) for e in (r.events or [])],
    )


def assert_same(s, topo: Topology, mech: Mechanisms) -> dict:
    new = fingerprint(run_samples(s, topo, mech, log=True, record_versions=True))
    old = fingerprint(run_samples_reference(s, topo, mech, log=True, record_versions=True))
    for k in old:
        assert new[k] == old[k], f"{k} differs ({topo}, {mech})"
    return new


WORLD = st.fixed_dictionaries(dict(
    gpus=st.integers(2, 12), prompts=st.integers(1, 12), group=st.integers(1, 6), steps=st.integers(2, 10),
    mean=st.floats(20, 800), sigma=st.floats(0, 1.5), cap=st.integers(50, 3000), cap_share=st.sampled_from([0.0, 0.2]),
    slots=st.integers(1, 48), staleness=st.integers(0, 2), scaling=st.floats(0.6, 1.0), overhead=st.floats(0, 2),
    helper_rate=st.floats(0.3, 1.0), helper_cost=st.floats(0, 1), gen_cost=st.floats(0, 2),
    latency=st.sampled_from([0.0, 0.0, 0.01, 0.2]), sync=st.floats(0, 1), train_frac=st.floats(0, 1),
    claim=st.integers(1, 4), chunks=st.integers(1, 8), mech=st.lists(st.booleans(), min_size=5, max_size=5),
    prompt_sigma=st.sampled_from([0.0, 0.5]), eager=st.booleans(), seed=st.integers(0, 3),
))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WORLD)
def test_random_worlds_run_identically_on_the_reference_engine(w):
    init = max(1, min(w["gpus"] - 1, round(w["train_frac"] * w["gpus"])))
    mean = min(w["mean"], w["cap"])
    eager = ["policy.min_dwell_steps=1", "policy.cooldown_steps=0", "policy.imbalance_threshold=0.02",
             "policy.min_relative_gain=0.0", "policy.consecutive_signals=1"] if w["eager"] else []
    cfg = load_config(ROOT / "configs/sim/paper_8gpu.yaml", [
        f"cluster.gpus={w['gpus']}", f"cluster.initial_train={init}", f"sim.steps={w['steps']}", f"run.seed={w['seed']}",
        f"sim.workload.prompts_per_step={w['prompts']}", f"sim.workload.responses_per_prompt={w['group']}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}",
        f"sim.workload.response_sigma={w['sigma']}", f"sim.workload.max_response_tokens={w['cap']}",
        f"sim.workload.cap_share={w['cap_share']}", f"sim.workload.prompt_tokens_sigma={w['prompt_sigma']}", f"sim.rollout.max_seqs_per_gpu={w['slots']}",
        f"pipeline.staleness_bound={w['staleness']}", f"sim.train.scaling_per_doubling={w['scaling']}",
        f"sim.train.step_overhead_s={w['overhead']}", f"sim.pipeline.helper_rate={w['helper_rate']}",
        f"sim.pipeline.helper_cost_s={w['helper_cost']}", f"sim.pipeline.trainer_gen_cost_s={w['gen_cost']}",
        f"sim.pipeline.claim_groups={w['claim']}", f"sim.pipeline.stream_chunks={w['chunks']}",
        f"sim.command_latency_s={w['latency']}", f"switching.costs.override_s={{weight_sync: {w['sync']}}}",
        "sim.write_events=false", *eager])
    s = setup(cfg)
    mech = Mechanisms(*w["mech"])
    assert_same(s, s.initial, mech)
    assert_same(s, Topology(w["gpus"] - init, init), Mechanisms(*w["mech"][:2], False, *w["mech"][3:]))


@pytest.mark.parametrize("name,steps,over", [
    ("paper_8gpu", 24, ["policy.min_dwell_steps=1", "policy.cooldown_steps=0", "policy.imbalance_threshold=0.02",
                        "policy.min_relative_gain=0.0"]),
    ("stationary_8gpu", 20, []),
    ("scale_64gpu", 8, []),
    ("dapo_64gpu", 6, []),
    ("taskmix_64gpu", 6, []),
])
def test_scenarios_run_identically_on_the_reference_engine(name, steps, over):
    s = setup(load_config(ROOT / f"configs/sim/{name}.yaml", ["sim.write_events=false", f"sim.steps={steps}", *over]))
    for mech in (Mechanisms(False, False, True), Mechanisms(True, True, True), Mechanisms(True, True, True, True, True),
                 Mechanisms(True, False, False, True, False)):
        run = assert_same(s, s.initial, mech)
        assert run["events"] and run["total_s"] > 0
