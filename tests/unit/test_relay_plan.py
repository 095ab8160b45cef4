"""The weight relay's plan (dynaresize/schedule/relay.py): who sends a version to whom, the star and the relay, with
lost and switching relays and versions asked again."""

from __future__ import annotations

import pytest

from dynaresize.schedule.relay import RelayPlan, Transfer


def spread(plan: RelayPlan, version: int, receivers: list[int]) -> tuple[int, dict[int, int]]:
    """Every receiver asks at once; transfers end one round at a time (each takes one unit). Returns the rounds until
    every receiver holds the version and the copies each rank sent."""
    plan.published(version)
    wave: list[Transfer] = []
    for r in receivers:
        wave += plan.ask(r, version)
    sent: dict[int, int] = {}
    rounds = 0
    while wave:
        rounds += 1
        nxt: list[Transfer] = []
        for t in wave:
            sent[t.src] = sent.get(t.src, 0) + 1
            nxt += plan.done(t)
        wave = nxt
    assert sorted(plan.holders(version)) == sorted([0, *receivers])
    return rounds, sent


def test_star_sends_everything_from_the_origin_at_once():
    rounds, sent = spread(RelayPlan(0, fanout=0), 1, list(range(1, 9)))
    assert rounds == 1 and sent == {0: 8}


@pytest.mark.parametrize("n", [4, 16, 64, 512])
def test_relay_caps_each_links_copies_and_spreads_in_log_rounds(n):
    rounds, sent = spread(RelayPlan(0, fanout=2), 1, list(range(1, n + 1)))
    assert max(sent.values()) == 2  # every link carries the version at most twice, rank 0's too
    assert sent[0] <= 2
    assert rounds <= 2 + 1.5 * n.bit_length()  # holders grow by ~1.62 per round with f=2, so O(log n) rounds


def test_later_askers_are_served_by_relays_not_by_the_origin():
    plan = RelayPlan(0, fanout=2)
    plan.published(3)
    (t,) = plan.ask(5, 3)
    assert t == Transfer(3, 0, 5)
    assert plan.done(t) == []
    assert plan.ask(6, 3) == [Transfer(3, 5, 6)]  # a holder other than rank 0 is preferred


def test_one_transfer_at_a_time_per_sender():
    plan = RelayPlan(0, fanout=2)
    plan.published(1)
    assert plan.ask(1, 1) == [Transfer(1, 0, 1)]
    assert plan.ask(2, 1) == []  # rank 0 is sending: rank 2 waits for the first free holder
    assert plan.done(Transfer(1, 0, 1)) == [Transfer(1, 1, 2)]


def test_a_lost_relays_receivers_are_served_by_another_holder():
    plan = RelayPlan(0, fanout=2)
    plan.published(1)
    t1 = plan.ask(1, 1)[0]
    plan.done(t1)
    t2 = plan.ask(2, 1)[0]
    assert t2.src == 1
    again = plan.lost(1)  # rank 1 dies mid-forward
    assert again == [Transfer(1, 0, 2)]
    assert plan.holders(1) == [0]
    plan.done(again[0])
    assert plan.holders(1) == [0, 2]
    assert plan.done(t2) == []  # the dead relay's transfer ending late changes nothing
    assert plan.ask(1, 1) == []  # a lost rank is not served until it joins again
    plan.joins(1)
    assert plan.ask(1, 1) == [Transfer(1, 2, 1)]


def test_a_refused_transfer_is_planned_again_from_another_holder_first_in_line():
    plan = RelayPlan(0, fanout=2)
    plan.published(1)
    t = plan.ask(1, 1)[0]
    plan.done(t)
    bad = plan.ask(2, 1)[0]
    assert bad == Transfer(1, 1, 2)
    plan.ask(3, 1)  # rank 0 serves rank 3
    nxt = plan.done(bad, ok=False)  # rank 2 refused what rank 1 sent (a wrong checksum)
    assert [x.dst for x in nxt] == [2]


def test_a_switching_relay_sends_no_more_but_its_transfer_on_the_way_counts():
    plan = RelayPlan(0, fanout=2)
    plan.published(1)
    plan.done(plan.ask(1, 1)[0])
    t = plan.ask(2, 1)[0]
    plan.leaves(1)
    assert plan.holders(1) == [0]
    plan.done(t)
    assert plan.holders(1) == [0, 2]
    assert plan.ask(3, 1) == [Transfer(1, 2, 3)]


def test_a_version_asked_again_is_served_by_any_holder_and_beyond_the_fanout_when_all_are_spent():
    plan = RelayPlan(0, fanout=1)
    plan.published(1)
    plan.done(plan.ask(1, 1)[0])  # rank 0 spent its one copy
    plan.done(plan.ask(2, 1)[0])  # rank 1 spent its one; rank 2 has one left
    plan.done(plan.ask(3, 1)[0])
    assert plan.holders(1) == [0, 1, 2, 3]
    plan.lost(3)
    plan.joins(3)
    t = plan.ask(3, 1)  # asked again after its loss: any holder serves it
    assert len(t) == 1 and t[0].src in (1, 2, 0)
    plan.done(t[0])
    for r in (1, 2, 3):
        plan.leaves(r)
    # only rank 0 holds it and has spent its copy: it sends beyond the fan-out rather than leave rank 9 waiting
    assert plan.ask(9, 1) == [Transfer(1, 0, 9)]


def test_no_holder_no_transfer_until_the_version_is_published():
    plan = RelayPlan(0, fanout=2)
    assert plan.ask(1, 7) == []
    assert plan.published(7) == [Transfer(7, 0, 1)]
    with pytest.raises(ValueError):
        RelayPlan(0, fanout=-1)
