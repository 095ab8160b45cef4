"""The liveness decision that knows Redis's health (dynaresize.control.health, issue 47 item 1): pure, so every
case is a table of observations."""

from __future__ import annotations

import pytest

from dynaresize.control.health import RoundTrips, Stall, lost_ranks, merge

pytestmark = pytest.mark.unit

DEADLINE, GRACE = 5.0, 2.0


def test_a_rank_silent_while_redis_answered_is_lost_at_todays_deadline():
    assert lost_ranks({3: 95.1}, 100.0, [], DEADLINE, GRACE) == {}
    got = lost_ranks({3: 94.0}, 100.0, [], DEADLINE, GRACE)
    assert set(got) == {3} and got[3].why() == "no heartbeat for 6.0 s"


def test_silence_inside_a_stall_and_its_grace_is_not_counted():
    stall = Stall(80.0, 92.0, 12.1)  # every rank's last beat just before Redis stalled for 12 s
    last = {0: 79.5, 1: 79.9, 2: 79.0}
    # at 96: 16.5 s of silence, 14 of it in the stall and its grace: 2.5 s counted
    assert lost_ranks(last, 96.0, [stall], DEADLINE, GRACE) == {}
    # a rank that died in the stall: seen once its silence outside the stall passes the deadline
    got = lost_ranks({2: 79.0}, 99.5, [stall], DEADLINE, GRACE)
    assert set(got) == {2} and got[2].excused_s == pytest.approx(14.0)
    assert "14.0 s of it while Redis was slow or unreachable, not counted" in got[2].why()


def test_an_ongoing_stall_counts_up_to_now():
    ongoing = Stall(50.0, 60.0, 10.0, ongoing=True)
    assert lost_ranks({0: 49.0}, 80.0, [ongoing], DEADLINE, GRACE) == {}  # Redis still stalled at 80
    assert set(lost_ranks({0: 49.0}, 80.0, [Stall(50.0, 60.0, 10.0)], DEADLINE, GRACE)) == {0}


def test_overlapping_stalls_are_not_discounted_twice():
    assert merge([Stall(0, 5, 5), Stall(3, 8, 5), Stall(8.8, 10, 0.5)], 1.0) == [Stall(0, 10, 5)]
    two = [Stall(10, 20, 10), Stall(12, 18, 6)]
    got = lost_ranks({0: 10.0}, 30.0, two, DEADLINE, GRACE)  # 20 s silent, 12 excused (10..22): 8 counted
    assert set(got) == {0} and got[0].excused_s == pytest.approx(12.0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_round_trips_record_slow_calls_as_stalls_announced_once():
    clock = Clock()
    rt = RoundTrips(slow_after_s=1.0, clock=clock)
    a = rt.begin()
    clock.t = 0.3
    rt.end(a)  # fast: nothing
    b, c = rt.begin(), rt.begin()
    clock.t = 5.0
    assert rt.stalls() == [Stall(0.3, 5.0, 4.7, ongoing=True)] * 2 and rt.pending()
    rt.end(b)
    clock.t = 12.4
    rt.end(c)  # a retried call of the same stall: one stall of 12.1 s
    d = rt.begin(blocked_s=0.5)
    clock.t = 13.0
    rt.end(d)  # a blocking read: its own block is not a delay
    assert rt.finished(join_s=3.0, over_s=3.0) == []  # not over long enough: a retry may still join it
    clock.t = 16.0
    assert rt.finished(join_s=3.0, over_s=3.0) == [Stall(0.3, 12.4, pytest.approx(12.1))]
    assert rt.finished(join_s=3.0, over_s=3.0) == [] and not rt.pending()  # announced once


def test_a_loaded_machines_late_replies_never_keep_a_stall_from_being_announced():
    clock = Clock()
    rt = RoundTrips(slow_after_s=1.0, clock=clock)
    big = rt.begin()
    clock.t = 3.0
    rt.end(big)
    for t in range(4, 20, 2):  # a 1.2 s reply every 2 s after it: slow, but below the announcement's bar
        clock.t = t
        small = rt.begin()
        clock.t = t + 1.2
        rt.end(small)
    assert rt.finished(join_s=5.0, over_s=5.0) == []  # all of them one stall, never over for 5 s
    assert rt.finished(join_s=5.0, over_s=5.0, at_least_s=2.0) == [Stall(0.0, 3.0, 3.0)]
