"""Tail consolidation (dynaresize/sim/mechanisms.py, a mechanism only the simulator runs): a draining rollout rank's
sequences move, with their KV cache, to a rank decoding the same version. Checked like the core: by hand, over random
event orders by the core's world model (tests/support/schedule_world.py) with moves drawn among the events, on the
decode model (what leaves one GPU decodes on another to the same token), and on whole sample-level runs (the barrier
run's sample-to-version map; the bounds are checked over random worlds in tests/unit/test_sim_bound.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaresize.policy import Topology
from dynaresize.policy.decode_rank import DecodeRank
from dynaresize.schedule import (
    Assign, GroupsDone, Mechanisms, RankReady, Role, ScheduleError, SchedulerConfig,
)
from dynaresize.sim.compare import run_samples, setup
from dynaresize.config.loader import load_config
from dynaresize.sim.mechanisms import (
    ConsolidatingHelpingScheduler, ConsolidatingScheduler, HelperConfig, HelpingScheduler, MovableDecodeRank,
    SimMechanisms, sim_scheduler,
)
from dynaresize.schedule import PipelineScheduler
from tests.support.schedule_world import World, check_finished, feature_config, run_world
from tests.unit.test_sim_mechanisms import FAST, HelperWorld

pytestmark = pytest.mark.unit

CONSOLIDATE = SimMechanisms(True, True, False, False, True)


# --- the decode model ------------------------------------------------------------------------------------------------
def test_evicted_sequences_decode_on_another_gpu_to_the_same_token():
    """Group (0, 0): responses of 2 and 10 tokens on a GPU at w = 10 ms, u = 1 ms. Two iterations at 12 ms, then one
    at 11 ms: at t = 35 ms the long one has 7 tokens left. Evicted, it decodes on an empty GPU at 11 ms an iteration
    and ends at 35 + 77 ms; the first GPU holds nothing and reports nothing."""
    a, b = MovableDecodeRank(0, 0.01), MovableDecodeRank(1, 0.01)
    a.slots = b.slots = 8
    a.admit(0.0, [2.0, 10.0], 0.001, [(0, 0)], 2, 0.0)
    moved = a.evict(0.035)
    assert [(key, [round(x, 9) for x in left], u) for key, left, u in moved] == [((0, 0), [7.0], 0.001)]
    assert a.active == 0 and a.next_group_time() == float("inf") and a.pop_groups(1.0) == []
    b.admit(0.035, moved[0][1], 0.001, [(0, 0)], 2, 0.0, [1])
    assert b.next_group_time() == pytest.approx(0.035 + 7 * 0.011)
    assert b.pop_groups(0.2) == [(0, 0)]


@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([0.001, 0.0015, 0.002])), min_size=1, max_size=6),
       st.floats(0.0, 0.5))
@settings(max_examples=60, deadline=None)
def test_the_tail_load_is_what_the_listed_tail_sums_to(admissions, t_frac):
    """``tail_load`` (an attempt's first look) equals the sums over what ``in_flight_at`` lists, bit for bit: the
    sequences, and sum over groups of u x the group's tokens left (the receiver test compares them exactly)."""
    a = MovableDecodeRank(0, 0.01)
    a.slots = 64
    t = 0.0
    for i, (length, u) in enumerate(admissions):  # groups of 2 with different u, admitted one after another
        a.admit(t, [float(length), float(length + i + 1)], u, [(0, i)], 2, 0.0)
        t += 0.004
    t_end = a.t_marks[-1]
    at = t + t_frac * (t_end - t)
    listed = a.in_flight_at(at)
    delay = 0.0
    for _, left, u in listed:
        delay += u * sum(left)
    assert a.tail_load(at) == (sum(len(left) for _, left, _ in listed), delay)
    assert a.tail_load(t_end + 1.0) == (0, 0.0)


def test_a_group_that_ended_at_the_eviction_stays_to_be_reported():
    """Group (0, 0) ends at the instant of the eviction, before its rank event: it stays on its GPU, to be reported
    there; only group (0, 1)'s sequences leave."""
    a = MovableDecodeRank(0, 0.01)
    a.slots = 8
    a.admit(0.0, [2.0, 2.0, 5.0, 6.0], 0.001, [(0, 0), (0, 1)], 2, 0.0)
    end = a.next_group_time()
    moved = a.evict(end)
    assert [key for key, _, _ in moved] == [(0, 1)]
    assert [round(x, 9) for x in moved[0][1]] == [3.0, 4.0]
    assert a.pop_groups(end) == [(0, 0)] and a.active == 0


def test_the_plain_decode_model_admits_groups_of_uneven_sizes():
    """``DecodeRank.admit(..., sizes)``: a group's remaining sequences, fewer than the group size, end the group."""
    d = DecodeRank(0, 0.01)
    d.slots = 8
    d.admit(0.0, [1.0, 4.0, 2.0], 0.001, [(3, 0), (3, 1)], 2, 0.0, [1, 2])
    assert d.pop_groups(0.013) == [(3, 0)]  # 1 token, three sequences: 13 ms
    assert d.pop_groups(1.0) == [(3, 1)]


# --- the core --------------------------------------------------------------------------------------------------------
def test_a_move_hands_the_groups_to_the_receiver_and_frees_the_sender():
    cfg = SchedulerConfig(4, 1, (6, 6, 6), mechanisms=CONSOLIDATE)
    core = ConsolidatingScheduler(cfg)
    core.start()
    assert core.handle(RankReady(1, 2)) == [Assign(1, 0, (0, 1), 0)]
    assert core.handle(RankReady(2, 2)) == [Assign(2, 0, (2, 3), 0)]
    assert core.handle(RankReady(3, 3)) == [Assign(3, 0, (4, 5), 0)]  # an even share of batch 0 each
    core.handle(GroupsDone(1, 0, (0,)))
    assert not core.other_work(1)  # batch 1 is version 0 too, and batch 2 needs version 1: nothing else to take
    with pytest.raises(ScheduleError, match="does not hold"):
        core.move_groups(1, 2, 0, (2,))  # rank 2's, not rank 1's
    with pytest.raises(ScheduleError, match="does not take rollout work"):
        core.move_groups(1, 0, 0, (1,))  # the trainer
    assert core.handle(RankReady(1, 1)) == [Assign(1, 1, (0,), 0)]
    assert core.move_groups(2, 1, 0, (2, 3)) == []
    assert (core.groups_in_flight(1), core.groups_in_flight(2)) == (4, 0)
    assert core.handle(RankReady(2, 2)) == [Assign(2, 1, (1, 2), 0)]  # freed, it takes its share of batch 1
    with pytest.raises(ScheduleError, match="was not given"):
        core.handle(GroupsDone(2, 0, (2,)))
    core.handle(GroupsDone(1, 0, (2, 3)))
    assert core.batches[0].done == {0, 2, 3} and core.groups_in_flight(1) == 2


def test_a_leaving_rank_switches_once_its_tail_moved():
    cfg = SchedulerConfig(4, 1, (4, 4), mechanisms=CONSOLIDATE)
    core = ConsolidatingScheduler(cfg)
    core.start()
    core.handle(RankReady(1, 2))
    core.handle(RankReady(2, 2))
    core.ranks[2].leaving, core.ranks[2].to, core.ranks[2].switch_id = True, Role.TRAIN, 0  # the policy's border rank
    out = core.move_groups(2, 1, 0, (2,))
    assert out == []  # one group still on it
    out = core.move_groups(2, 1, 0, (3,))
    assert [type(a).__name__ for a in out] == ["Switch"] and out[0].rank == 2
    with pytest.raises(ScheduleError, match="does not take rollout work"):
        core.move_groups(1, 2, 0, (0,))  # a rank switching away takes no tail


def test_the_simulator_builds_the_core_with_the_mechanisms_that_are_on():
    def cls(mech):
        return type(sim_scheduler(SchedulerConfig(3, 1, (2,), mechanisms=mech), HelperConfig(), None))

    assert cls(Mechanisms(True, True)) is PipelineScheduler
    assert cls(SimMechanisms(True, True, True, True)) is HelpingScheduler
    assert cls(CONSOLIDATE) is ConsolidatingScheduler
    assert cls(SimMechanisms(True, True, True, True, True)) is ConsolidatingHelpingScheduler
    assert SimMechanisms(True, True, True, True, True).label == "continuous+streaming+helpers+consolidation"


@dataclass
class MovingWorld(World):
    """The core's world with tail consolidation: any rollout rank's group in flight may move to a rank that could
    decode it (the core's own check of a move is tested above; here only moves it must accept are drawn)."""

    moves: int = 0

    def receivers(self, src: int, version: int) -> list[int]:
        out = []
        for r in self.core.rollout_ranks():
            if (r != src and r not in self.lost and self.core.accepting(r) and not self.busy(r)
                    and version in self.held[r] and self.newest.get(r, 0) <= version
                    and all(v == version for _, _, v in self.inflight[r])
                    and all(v == version for v, _ in self.vinflight[r])):
                out.append(r)
        return out

    def enabled(self) -> list:
        ev = super().enabled()
        for src in self.core.rollout_ranks():
            if src in self.lost:
                continue
            for batch, g, v in self.inflight[src]:
                ev.extend(("move", src, dst, batch, g, v) for dst in self.receivers(src, v))
        return ev

    def fire(self, ev) -> None:
        if isinstance(ev, tuple) and ev[0] == "move":
            _, src, dst, batch, g, v = ev
            self.inflight[src].remove((batch, g, v))
            self.inflight[dst].append((batch, g, v))
            self.newest[dst] = max(self.newest.get(dst, 0), v)
            self.moves += 1
            self.apply(self.core.move_groups(src, dst, batch, (g,)))
            return
        super().fire(ev)


@dataclass
class MovingHelperWorld(MovingWorld, HelperWorld):
    """Moves and gradient helpers together."""


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cont=st.booleans(), stream=st.booleans(), helpers=st.booleans(), n=st.integers(3, 6),
       steps=st.integers(1, 5), s=st.integers(0, 2), groups=st.integers(1, 4), slots=st.integers(1, 3),
       losses=st.integers(0, 1), feature=st.sampled_from(["plain", "resize", "validation", "sampling", "resume"]),
       script=st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_moves_keep_the_contract_with_every_core_feature(data, cont, stream, helpers, n, steps, s, groups, slots,
                                                         losses, feature, script):
    """Moves drawn at any point among the core's events, with any mechanism mix, the helpers or not, staleness, a
    resize script, validation passes, dynamic sampling or a resume, and a lost rank: every group generated once by
    ``version_of(batch)``, every batch trained as the static run trains it."""
    cfg = feature_config(n, steps, groups, s, SimMechanisms(cont, stream, True, helpers, True), feature)
    make = ((lambda c, p: ConsolidatingHelpingScheduler(c, FAST, p)) if helpers
            else (lambda c, p: ConsolidatingScheduler(c, p)))
    w = run_world(cfg, data, slots, script=script if feature == "resize" else None, losses=losses,
                  world=MovingHelperWorld if helpers else MovingWorld, make_core=make)
    check_finished(w)


def test_the_random_worlds_do_move_groups():
    """Guard for the property test above: its random event orders reach moves (else it checks nothing)."""
    from tests.support.schedule_world import run_at_random

    moves = sum(run_at_random(SchedulerConfig(5, 2, (4,) * 3, staleness=1, mechanisms=CONSOLIDATE), seed,
                              make_core=lambda c, p: ConsolidatingScheduler(c, p), world=MovingWorld).moves
                for seed in range(10))
    assert moves > 0


# --- whole runs -------------------------------------------------------------------------------------------------------
def _setup(name: str, *over: str):
    return setup(load_config(f"configs/sim/{name}.yaml", ["sim.write_events=false", *over]))


def test_consolidation_moves_tails_and_keeps_the_barrier_runs_sample_to_version_map():
    """stationary_8gpu at 5:3 with every mechanism and consolidation: ranks drained of their share hand their tails
    on (moves happen), and each group is still generated by the version the static barrier run uses."""
    s = _setup("stationary_8gpu", "sim.steps=20")
    topo = Topology(5, 3)
    barrier = run_samples(s, topo, Mechanisms(False, False, False), record_versions=True)
    moved = run_samples(s, topo, SimMechanisms(True, True, False, True, True), record_versions=True)
    assert moved.moves > 0 and moved.moved_sequences >= moved.moves
    assert moved.versions == barrier.versions and moved.samples == barrier.samples


def test_a_slow_kv_link_makes_no_move_that_cannot_pay():
    """At 1 MB/s a move of a few thousand tokens' KV cache (147 KB each) takes minutes: longer than any tail here, so
    no tail moves and the run is the one without consolidation."""
    s = _setup("stationary_8gpu", "sim.steps=10", "sim.pipeline.kv_move_gbps=0.001")
    topo = Topology(5, 3)
    slow = run_samples(s, topo, SimMechanisms(True, True, False, True, True))
    plain = run_samples(s, topo, SimMechanisms(True, True, False, True))
    assert slow.moves == 0 and slow.total_s == plain.total_s
