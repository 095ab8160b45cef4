"""The sample-level engine and scheduler core as they were before the fast engine (issue 28, item 3), frozen: the
golden check (tests/unit/test_sim_fast.py) runs random worlds through both and asserts identical runs."""

from __future__ import annotations

from dynaresize.policy import ResizePolicy, Topology
from dynaresize.schedule import Mechanisms
from tests.support.sim_reference.samples_ref import TAIL_SHARE_BARRIER_FREE, SamplePipeline, SampleRunResult, SampleSettings


def run_samples_reference(s, topo: Topology, mech: Mechanisms, log: bool = False, name: str | None = None,
                          record_versions: bool = False, tail_share: float = TAIL_SHARE_BARRIER_FREE) -> SampleRunResult:
    """``dynaresize.sim.compare.run_samples`` on the frozen engine."""
    p = s.cfg.sim.pipeline
    policy = ResizePolicy(s.cfg.policy, s.costs, s.candidates) if mech.resize else None
    name = name or f"{'dyn' if mech.resize else 'static ' + str(topo)} {mech.label} (samples)"
    settings = SampleSettings(s.cfg.pipeline.staleness_bound, log, s.cfg.switching.costs.deferred_overlap_fraction,
                              p.claim_groups, p.stream_chunks, record_versions, p.helper_rate, p.helper_cost_s,
                              p.trainer_gen_cost_s, p.trainer_gen_kv_fraction, p.trainer_gen_rate, tail_share)
    return SamplePipeline(name, s.table, topo, mech, s.costs, policy, settings).run()
