"""The simulator: physics sanity, pipeline arithmetic, determinism of the event log, the CLI and cost files."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from dynaresize.cli import main as cli_main
from dynaresize.config.loader import ConfigError, load_config
from dynaresize.events import EventType, ReadStats, read_events
from dynaresize.policy import Decision, Observation, OpGroup, Topology
from dynaresize.policy.types import ResizeAction
from dynaresize.sim import stages
from dynaresize.sim.cli import merge_costs
from dynaresize.sim.compare import oracle_total, run_dynamic, run_static, setup
from dynaresize.sim.engine import Pipeline
from dynaresize.sim.stages import StepPhysics
from dynaresize.sim.workload import make_batch

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs/sim/paper_8gpu.yaml"


def small(*extra: str):
    return load_config(PAPER, ["sim.steps=30", *extra])


def test_rollout_physics_monotone_with_a_tail_floor():
    cfg = small()
    ph = StepPhysics(cfg.sim, make_batch(cfg.sim.workload, 0, 10, 30))
    times = [ph.rollout_s(n) for n in range(1, 64)]
    assert all(a >= b - 1e-9 for a, b in zip(times, times[1:]))  # more GPUs never slower
    assert times[-1] >= ph.tail_s * 0.9  # the longest response alone bounds it from below
    assert times[0] > 2 * times[-1]


def test_capped_schedule_matches_closed_form_when_everything_fits():
    cfg = small("sim.rollout.max_seqs_per_gpu=100000", "sim.rollout.kv_cache_gb=1e6")
    ph = StepPhysics(cfg.sim, make_batch(cfg.sim.workload, 0, 3, 30))
    for n in (1, 2, 5):
        assert ph._capped(n) == pytest.approx(float(ph._uncapped(np.array([n]))[0]), rel=1e-9)


def test_thinned_capped_schedule_is_close_to_exact(monkeypatch):
    cfg = small("sim.workload.prompts_per_step=256")  # 2048 responses, KV-capped on few GPUs
    ph = StepPhysics(cfg.sim, make_batch(cfg.sim.workload, 0, 20, 30))
    exact = ph._capped(4)
    monkeypatch.setattr(stages, "CAPPED_EXACT", 512)
    assert ph._capped(4) == pytest.approx(exact, rel=0.05)


def test_static_split_time_is_max_stage_pipelined():
    # constant lengths: every step identical, so total = fill + K x max(rollout + sync, train)
    cfg = small("sim.workload.response_sigma=0", "sim.workload.prompt_tokens_sigma=0", "sim.workload.response_tokens_end=1000")
    s = setup(cfg)
    K = cfg.sim.steps
    for topo in (Topology(6, 2), Topology(2, 6)):
        r = s.table.rollout_s(5, topo.n_rollout)
        t = s.table.train_s(5, topo.n_train)
        sync = s.costs.weight_sync_s()
        res = run_static(s, topo)
        period = max(r + sync, t)
        # steps 0 and 1 need no sync (staleness 1: they use the initial weights)
        assert res.total_s == pytest.approx(r + t + (K - 1) * period, rel=0.01)
        assert res.switches == 0
    assert oracle_total(s) <= min(run_static(s, c).total_s for c in s.candidates) * 1.001


def test_synchronous_pipeline_is_sum_of_stages():
    cfg = small("sim.workload.response_sigma=0", "sim.workload.prompt_tokens_sigma=0", "sim.workload.response_tokens_end=1000",
                "pipeline.staleness_bound=0")
    s = setup(cfg)
    r, t, sync = s.table.rollout_s(5, 2), s.table.train_s(5, 6), s.costs.weight_sync_s()
    assert run_static(s, Topology(6, 2)).total_s == pytest.approx(cfg.sim.steps * (r + t) + (cfg.sim.steps - 1) * sync, rel=0.01)


def test_same_seed_same_event_log_bytes(tmp_path):
    outs = []
    for name in ("a", "b"):
        d = tmp_path / name
        assert cli_main(["simulate", str(PAPER), "sim.steps=40", "sim.workload.response_tokens_end=9000", "--out", str(d)]) == 0
        outs.append((d / "events.jsonl").read_bytes())
    assert outs[0] == outs[1] and len(outs[0]) > 1000
    d = tmp_path / "c"
    cli_main(["simulate", str(PAPER), "sim.steps=40", "sim.workload.response_tokens_end=9000", "run.seed=1", "--out", str(d)])
    assert (d / "events.jsonl").read_bytes() != outs[0]


def test_event_log_follows_the_schema(tmp_path):
    d = tmp_path / "run"
    assert cli_main(["simulate", str(PAPER), "sim.steps=60", "cluster.initial_train=2", "--out", str(d)]) == 0
    stats = ReadStats()
    evs = list(read_events(d, stats))
    assert stats.bad == 0
    types = [e.type for e in evs]
    assert types[0] is EventType.RUN_START and evs[0]["source"] == "sim" and types[-1] is EventType.RUN_END
    assert sum(t is EventType.STEP_END for t in types) == 60
    assert all(b.t >= a.t for a, b in zip(evs, evs[1:]))
    starts = [e for e in evs if e.type is EventType.SWITCH_START]
    assert starts, "the drifting workload should trigger at least one resize"
    assert len(starts) == sum(t is EventType.SWITCH_END for t in types)
    ops = [e for e in evs if e.type is EventType.SWITCH_OP]
    assert any(not e["critical"] for e in ops) and any(e["critical"] for e in ops)
    assert (d / "config.yaml").exists() and json.loads((d / "summary.json").read_text())["steps"] == 60


def test_stationary_workload_settles_and_stays():
    cfg = load_config(ROOT / "configs/sim/stationary_8gpu.yaml", ["sim.steps=150"])
    r = run_dynamic(setup(cfg), log=False)
    assert r.switches <= 1
    assert len(set(r.topologies[20:])) == 1


def test_naive_switching_hides_nothing_and_optimised_hides_some():
    cfg = small("sim.steps=60", "cluster.initial_train=2")
    s = setup(cfg)
    opt = run_dynamic(s, False)
    assert opt.switches >= 1 and opt.hidden_fraction > 0.2
    naive = run_dynamic(s, False, naive=True)
    if naive.switches:
        assert naive.hidden_fraction < opt.hidden_fraction


def test_compare_summary_has_the_promised_keys(capsys):
    assert cli_main(["simulate", str(PAPER), "sim.steps=30", "--compare", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in ("best_static_split", "best_static_throughput", "dynaresize_throughput", "oracle_throughput",
                "gain_vs_best_static", "fraction_of_oracle", "overhead_hidden_fraction", "switches"):
        assert key in summary
    assert summary["oracle_throughput"] >= summary["best_static_throughput"] * 0.999
    assert 0 < summary["fraction_of_oracle"] <= 1.001


def test_the_simulator_reads_switch_costs_and_optimizations_from_the_switching_section():
    src, dst = Topology(6, 2), Topology(4, 4)
    base = setup(small())
    s = setup(small("switching.costs.override_s={comm_select: 77}", "switching.costs.nccl_gbps=50"))
    assert {p.op.value: p.cost_s for p in s.costs.plan(src, dst)}["comm_select"] == 77.0
    assert s.costs.weight_sync_s() == pytest.approx(2 * base.costs.weight_sync_s())
    assert not base.costs.stop_the_world and setup(small("switching.optimizations.comm_reuse=false")).costs.stop_the_world
    # the runs' switches are priced with them: a scripted switch's ops cost 77 s more for comm_select alone
    to = Topology(base.initial.n_train - 1, base.initial.n_rollout + 1)
    a, b = (run_static(x, x.initial, forced={5: to.n_train}) for x in (base, s))
    extra = s.costs.total_cost_s(base.initial, to) - base.costs.total_cost_s(base.initial, to)
    assert a.switches == b.switches == 1 and extra > 76 and b.overhead_s - a.overhead_s == pytest.approx(extra)


def test_cost_file_merges_and_bad_keys_are_named(tmp_path):
    cfg = small()
    f = tmp_path / "costs.yaml"
    f.write_text("switching:\n  costs:\n    pcie_gbps: 50\n    override_s: {drain: 0.25}\n")
    merged = merge_costs(cfg, str(f))
    assert merged.switching.costs.pcie_gbps == 50 and merged.switching.costs.override_s == {"drain": 0.25}
    assert merged.switching.costs.nvme_gbps == cfg.switching.costs.nvme_gbps
    f.write_text("nvme_gbps: 7\n")
    assert merge_costs(cfg, str(f)).switching.costs.nvme_gbps == 7
    f.write_text("warp_drive_s: 1\n")
    with pytest.raises(ConfigError, match=r"costs\.yaml: switching\.costs\.warp_drive_s"):
        merge_costs(cfg, str(f))
    f.write_text("override_s: {teleport: 1}\n")
    with pytest.raises(ConfigError, match="unknown switch op 'teleport'"):
        merge_costs(cfg, str(f))


def test_every_sim_scenario_validates():
    for p in sorted((ROOT / "configs/sim").glob("*.yaml")):
        cfg = load_config(p)
        assert cfg.sim.steps >= 2 and not math.isnan(cfg.sim.rollout.iteration_fixed_s)


@pytest.mark.parametrize("old,new", [("pipelined", "barrier"), ("lockstep", "barrier_lockstep")])
def test_the_old_sim_schedule_names_load_with_one_line_naming_the_new_setting(caplog, old, new):
    """The step-level model's schedules take the runtime's names: ``pipelined`` is the runtime's ``barrier``,
    ``lockstep`` the retired runtime loop (which the runtime itself now reads as ``barrier``)."""
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        cfg = load_config(ROOT / "configs/sim/base.yaml", [f"sim.schedule={old}"])
    assert cfg.sim.schedule == new
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and f"set sim.schedule: {new}" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynaresize.config"):
        assert load_config(ROOT / "configs/sim/base.yaml", [f"sim.schedule={new}"]).sim.schedule == new
    assert not caplog.records


class ResizeOnce:
    """A scripted controller: resize to ``target`` when shown step ``at``, hold otherwise."""

    def __init__(self, at: int, target: Topology):
        self.at, self.target, self.seen = at, target, []

    def decide(self, obs: Observation) -> Decision:
        self.seen.append(obs.step)
        if obs.step == self.at:
            return Decision(ResizeAction.RESIZE, self.target, "scripted")
        return Decision(ResizeAction.HOLD, obs.topology, "scripted")


def _crit(costs, src, dst):
    out = {g: 0.0 for g in OpGroup}
    for p in costs.plan(src, dst):
        out[p.group] += p.cost_s if p.critical else 0.0
    return out


def test_rollout_to_train_switch_is_decided_when_the_rollout_ends_and_its_chain_hidden():
    # constant lengths, 2:6 is strongly train-bound: R_{k+1} ends long before T_k, so the decision is taken then
    # (on the newest finished step, k-1) and the moving ranks' whole op chain runs while T_k still trains
    cfg = small("sim.workload.response_sigma=0", "sim.workload.prompt_tokens_sigma=0", "sim.workload.response_tokens_end=1000")
    s = setup(cfg)
    src, dst = Topology(2, 6), Topology(3, 5)
    ctl = ResizeOnce(3, dst)
    res = Pipeline("x", s.table, src, ctl, s.costs, 1, True, cfg.switching.costs.deferred_overlap_fraction).run()
    assert ctl.seen[:4] == [0, 1, 2, 3]  # one observation per decision, none skipped
    evs = res.events
    t_end = {e["step"]: e.t for e in evs if e.type is EventType.STEP_END}
    dec = next(e for e in evs if e.type is EventType.DECISION and e["step"] == 3)
    assert dec.t < t_end[4]  # decided while T_4 trains (old rule: at t_end[4])
    crit = _crit(s.costs, src, dst)
    assert crit[OpGroup.MOVING] > crit[OpGroup.TRAINERS] > 0  # so the old rule (decide at t_end[4]) would cost MOVING
    assert res.switches == 1
    # only the staying trainers' critical ops (they cannot start before T_4 ends) delay T_5
    assert res.critical_s == pytest.approx(crit[OpGroup.TRAINERS], rel=1e-6)
    assert res.hidden_fraction > 0.8
    assert res.topologies[5] == "3:6" and res.topologies[6] == "3:5"  # T_5 on 3 trainers; R_6 on 5 rollout GPUs
    # stop-the-world switching gains nothing from the earlier decision: every op is on the critical path
    naive = Pipeline("n", s.table, src, ResizeOnce(3, dst), s.naive_costs, 1, False, 0.9).run()
    assert naive.switches == 1 and naive.hidden_fraction == pytest.approx(0.0, abs=1e-9)
    assert naive.critical_s == pytest.approx(s.naive_costs.total_cost_s(src, dst), rel=1e-6)


def test_oracle_is_the_per_step_best_split():
    cfg = small("sim.steps=40", "sim.workload.response_tokens_end=8000")
    s = setup(cfg)
    sync = s.costs.weight_sync_s()
    total = 0.0
    for k in range(cfg.sim.steps):
        per = [(max(s.table.rollout_s(k, c.n_rollout) + (sync if k else 0.0), s.table.train_s(k, c.n_train)), c) for c in s.candidates]
        best = min(per, key=lambda x: x[0])[1]
        total += min(p for p, _ in per)
        if k == 0:
            total += min(s.table.rollout_s(0, best.n_rollout), s.table.train_s(0, best.n_train))
    assert oracle_total(s) == pytest.approx(total, rel=1e-9)
    assert oracle_total(s) <= min(run_static(s, c).total_s for c in s.candidates)
