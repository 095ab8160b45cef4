"""The sample-level simulator: agreement with the step-level model on the barrier schedule, the sample-to-version
map of a barrier-free run equal to the barrier run's, and idle tail GPUs counted as idle by ``dynaresize analyze``."""

from __future__ import annotations

import pytest

from dynaresize.analysis.metrics import analyze
from dynaresize.analysis.reader import load_run
from dynaresize.config.loader import load_config
from dynaresize.events import EventLog, EventType, make_event
from dynaresize.policy import Topology
from dynaresize.schedule import Mechanisms, version_of
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import run_samples, run_static, setup

pytestmark = pytest.mark.unit

BARRIER = Mechanisms(False, False, False)
ALL = Mechanisms(True, True, True)


def _setup(name: str, *over: str):
    return setup(load_config(f"configs/sim/{name}.yaml", ["sim.write_events=false", *over]))


@pytest.mark.parametrize("name,steps,splits", [
    ("paper_8gpu", 30, (4, 5, 6)),
    ("stationary_8gpu", 30, (3, 5, 7)),
    ("scale_64gpu", 12, (32, 48)),
])
def test_barrier_schedule_agrees_with_the_step_level_model(name, steps, splits):
    s = _setup(name, f"sim.steps={steps}")
    for nt in splits:
        topo = Topology(nt, s.cfg.cluster.gpus - nt)
        step = run_static(s, topo)
        sample = run_samples(s, topo, BARRIER)
        # per-GPU batches vs the step-level model's active sequences spread evenly over the pool: a GPU that drew the
        # longer responses ends its share later (the sample level is never faster by more than rounding)
        assert step.total_s * 0.995 <= sample.total_s <= step.total_s * 1.05, (name, nt, sample.total_s / step.total_s)
        assert sample.samples == step.samples


def test_barrier_free_run_keeps_the_barrier_runs_sample_to_version_map():
    s = _setup("paper_8gpu", "sim.steps=24", "policy.min_dwell_steps=1", "policy.cooldown_steps=0",
               "policy.imbalance_threshold=0.02", "policy.min_relative_gain=0.0")
    static = run_samples(s, s.initial, BARRIER, record_versions=True)
    dyn = run_samples(s, s.initial, ALL, record_versions=True)
    assert dyn.switches >= 1, "the run should resize (the test compares a resized run with a static one)"
    assert static.versions == dyn.versions
    assert all(v == version_of(b, 1) for (b, _), v in dyn.versions.items())
    groups = {b for b, _ in dyn.versions}
    assert groups == set(range(24))
    assert dyn.samples == static.samples


def test_continuous_rollout_and_streaming_fill_a_rollout_bound_tail():
    s = _setup("stationary_8gpu", "sim.steps=20")
    topo = Topology(6, 2)  # rollout-bound: trainers wait for the last responses at the barrier
    barrier = run_samples(s, topo, BARRIER)
    cont = run_samples(s, topo, Mechanisms(True, False, False))
    both = run_samples(s, topo, Mechanisms(True, True, False))
    assert both.total_s < cont.total_s <= barrier.total_s * 1.001
    assert both.total_s < 0.97 * barrier.total_s


def test_the_same_inputs_give_the_same_run():
    s = _setup("paper_8gpu", "sim.steps=10")
    a, b = run_samples(s, s.initial, ALL), run_samples(s, s.initial, ALL)
    assert (a.total_s, a.switches, a.topologies) == (b.total_s, b.switches, b.topologies)


def _write_run(tmp_path, res, world: int):
    head = make_event(EventType.RUN_START, 0.0, run_id="t", source="sim", world_size=world, wall_time=0.0)
    tail = make_event(EventType.RUN_END, round(res.total_s, 6), status="completed", steps=res.steps)
    with EventLog(tmp_path / "events.jsonl", t0=0.0) as ev:
        ev.write_many([head, *res.events, tail])
    return analyze(load_run(tmp_path))


def test_analyze_counts_rollout_gpus_left_idle_in_the_tail(tmp_path):
    s = _setup("stationary_8gpu", "sim.steps=10")
    topo = Topology(3, 5)  # training-bound and a long tail: rollout ranks idle while the last responses decode
    step = run_static(s, topo, log=True)
    sample = run_samples(s, topo, BARRIER, log=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sa, sb = _write_run(tmp_path / "a", step, 8), _write_run(tmp_path / "b", sample, 8)
    # the step-level log marks every rollout rank busy for the whole stage; the sample-level one only while it decodes
    assert sb.totals["bubble_fraction"] > sa.totals["bubble_fraction"] + 0.01
    assert sb.roles["rollout"]["idle_gpu_s"] > sa.roles["rollout"]["idle_gpu_s"]
    assert sb.roles["rollout"]["busy_gpu_s"] < 0.97 * sa.roles["rollout"]["busy_gpu_s"]


def test_a_config_with_the_removed_trainer_gen_loads_with_one_warning(caplog):
    """trainer-gen was removed (docs/simulator.md, "Removed: trainer-gen"): an old config that sets it still loads,
    with one line saying the setting was removed and why, and runs as without it."""
    import logging

    old = ["sim.pipeline.trainer_rollout=true", "sim.pipeline.trainer_gen_cost_s=3", "sim.pipeline.trainer_gen_rate=0.5"]
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        cfg = load_config("configs/sim/paper_8gpu.yaml", ["sim.steps=4", *old])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "trainer_rollout, trainer_gen_cost_s, trainer_gen_rate removed" in lines[0] and "trainer-gen was removed" in lines[0]
    assert not hasattr(cfg.sim.pipeline, "trainer_rollout")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        load_config("configs/sim/paper_8gpu.yaml", ["sim.steps=4"])
    assert not caplog.records


def test_helpers_priced_by_their_groups_tokens_keep_the_map_and_do_not_slow_a_training_bound_split():
    """dapo_64gpu at 42:22 is training-bound: rollout ranks wait for versions and help. Priced at the batch's mean
    per group, a helper took the newest (longest) groups and ended long after the trainers, so helpers made this
    split slower; priced by each group's tokens they make it faster. Either way the samples and their versions are
    the barrier run's."""
    s = _setup("dapo_64gpu", "sim.steps=30")
    topo = Topology(42, 22)
    barrier = run_samples(s, topo, Mechanisms(False, False, False), record_versions=True)
    without = run_samples(s, topo, Mechanisms(True, True, False), record_versions=True)
    helped = run_samples(s, topo, SimMechanisms(True, True, False, True), record_versions=True)
    assert helped.helps > 0
    assert helped.versions == barrier.versions == without.versions and helped.samples == barrier.samples
    assert helped.total_s < without.total_s
    # every group trained once, by the trainers or a helper: the same training compute, of which the helpers' share
    assert helped.train_work_s == pytest.approx(without.train_work_s, rel=1e-12) == pytest.approx(barrier.train_work_s, rel=1e-12)
    assert without.helped_work_s == barrier.helped_work_s == 0.0 < helped.helped_work_s < 0.5 * helped.train_work_s


def test_a_group_that_ended_at_the_instant_of_an_admission_is_still_reported():
    """A rank's admission re-plans its decoding; a group whose last sequence ended at that same instant, not popped
    yet (its rank event comes after the admission in the heap's order), keeps its completion (it was lost: the
    simulator stalled with the group in flight, a 7:1 barrier run of tools/bench_emulated.py)."""
    from dynaresize.policy.decode_rank import DecodeRank

    dr = DecodeRank(0, 0.01)
    dr.slots = 8
    dr.admit(0.0, [3.0, 5.0], 0.001, [(0, 0)], 2, 0.0)  # one group of two sequences
    end = dr.next_group_time()
    assert end > 0
    dr.admit(end, [4.0, 4.0], 0.001, [(0, 1)], 2, 0.0)  # the next command's group arrives as it ends
    assert dr.pop_groups(end) == [(0, 0)]
    assert dr.pop_groups(dr.next_group_time()) == [(0, 1)]
    assert dr.next_group_time() == float("inf")
