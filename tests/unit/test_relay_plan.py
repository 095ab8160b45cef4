"""The weight relay's plan (dynaresize/schedule/relay.py): who sends a version to whom, the star and the relay, with
lost and switching relays, refused copies and versions asked again."""

from __future__ import annotations

import pytest

from dynaresize.schedule.relay import RelayPlan, Transfer


def tree(plan: RelayPlan, version: int, receivers: list[int]) -> dict[int, int]:
    """Every receiver asks in turn; returns each one's sender."""
    plan.published(version)
    src = {}
    for r in receivers:
        (t,) = plan.ask(r, version)
        assert (t.version, t.dst) == (version, r)
        src[r] = t.src
    return src


def depth(src: dict[int, int], r: int) -> int:
    d = 0
    while r in src:
        r, d = src[r], d + 1
    return d


def test_the_star_sends_everything_from_the_origin():
    src = tree(RelayPlan(0, fanout=0), 1, list(range(1, 9)))
    assert set(src.values()) == {0}


@pytest.mark.parametrize("n", [2, 8, 64, 1688])
def test_the_relay_is_a_tree_of_fanout_2_and_log_depth(n):
    src = tree(RelayPlan(0, fanout=2), 1, list(range(1, n + 1)))
    sends = {s: list(src.values()).count(s) for s in set(src.values())}
    assert max(sends.values()) <= 2 and sends[0] == min(2, n)  # every link at most twice, rank 0's too
    assert max(depth(src, r) for r in src) <= n.bit_length()  # breadth first: log2 depth, not a chain
    assert all(src[r] < r for r in src)  # a receiver's sender asked before it


def test_a_rank_that_holds_the_version_asks_for_nothing():
    plan = RelayPlan(0, fanout=2)
    tree(plan, 1, [5])
    assert plan.ask(5, 1) == [] and plan.holders(1) == [0, 5]


def test_receivers_that_asked_before_the_version_existed_are_planned_when_it_is_published():
    plan = RelayPlan(0, fanout=2)
    assert plan.ask(1, 7) == [] and plan.ask(2, 7) == []
    assert plan.published(7) == [Transfer(7, 0, 1), Transfer(7, 0, 2)]
    with pytest.raises(ValueError):
        RelayPlan(0, fanout=-1)


def test_a_lost_relays_receivers_are_planned_from_another_holder_and_keep_their_own_receivers():
    plan = RelayPlan(0, fanout=2)
    src = tree(plan, 1, [1, 2, 3, 4, 5, 6])  # the nearest, least-used holder first: 0 -> 1, 2; 1 -> 3, 5; 2 -> 4, 6
    assert src == {1: 0, 2: 0, 3: 1, 4: 2, 5: 1, 6: 2}
    again = plan.lost(1)  # rank 1 dies mid-forward
    assert sorted(t.dst for t in again) == [3, 5]
    assert all(t.src not in (1, t.dst) for t in again) and 1 not in plan.holders(1)
    for t in again:
        assert plan.source(t.dst, 1) == t.src
    assert plan.ask(1, 1) == []  # a lost rank is not served until it joins again
    plan.joins(1)
    (t,) = plan.ask(1, 1)
    assert t.src != 1


def test_a_lost_relay_whose_receivers_feed_each_other_forms_no_cycle():
    plan = RelayPlan(0, fanout=1)  # a chain: 0 -> 1 -> 2 -> 3
    assert tree(plan, 1, [1, 2, 3]) == {1: 0, 2: 1, 3: 2}
    (t,) = plan.lost(1)
    assert t == Transfer(1, 0, 2)  # not from 3, which receives through 2
    assert plan.source(3, 1) == 2


def test_a_refused_copy_is_planned_again_from_another_holder():
    plan = RelayPlan(0, fanout=2)
    tree(plan, 1, [1, 2, 3])  # 0 -> 1, 2; 1 -> 3
    (t,) = plan.failed(Transfer(1, 1, 3))  # rank 3 refused what rank 1 sent (a wrong checksum)
    assert t.dst == 3 and t.src not in (1, 3)
    assert plan.failed(Transfer(1, 1, 3)) == []  # an old report changes nothing


def test_a_switching_relay_is_planned_as_a_sender_no_more():
    plan = RelayPlan(0, fanout=2)
    tree(plan, 1, [1, 2])
    plan.leaves(1)
    assert [t.src for t in plan.ask(3, 1)] == [2]


def test_a_version_asked_again_is_served_by_any_other_holder_and_beyond_the_fanout_when_all_are_spent():
    plan = RelayPlan(0, fanout=1)
    tree(plan, 1, [1, 2, 3])  # 0 -> 1 -> 2 -> 3: every holder but 3 spent its one copy
    (t,) = plan.again(1, 1)  # rank 1 installed a newer version over 1 and needs it again
    assert t.dst == 1 and t.src == 3
    for r in (1, 2, 3):
        plan.leaves(r)
    # only rank 0 may send and it has spent its copy: it sends beyond the fan-out rather than leave rank 9 waiting
    assert plan.ask(9, 1) == [Transfer(1, 0, 9)]


def test_retired_versions_are_forgotten():
    plan = RelayPlan(0, fanout=2)
    tree(plan, 1, [1])
    tree(plan, 2, [1])
    plan.retire(2)
    assert plan.holders(1) == [] and plan.holders(2) == [0, 1]
