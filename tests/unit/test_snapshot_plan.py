"""Which in-memory snapshot a restart can go on from, and who writes what of it (``dynaresize.job.snapshots.plan``,
pure): the newest step every trainer's partition and the weights survive at, newer than the disk checkpoint."""

from __future__ import annotations

from dynaresize.job.snapshots import Plan, plan


def held(own, held_, step, n=3, weights_of=0):
    def one(r):
        return {"rank": r, "step": step, "n_train": n, "weights": r == weights_of}
    return {"own": [one(own)], "held": [one(held_)]}


STATES = {4: {"n_train": 3, "lost": []}, 5: {"n_train": 3, "lost": [3]}}


def test_a_lost_trainers_partition_is_written_by_the_peer_holding_it_and_the_weights_by_rank_1():
    # 3 trainers in a ring 0 -> 1 -> 2 -> 0; rank 0 lost: rank 1 holds its partition and its weights
    got = plan({1: held(1, 0, 5), 2: held(2, 1, 5)}, {0}, STATES, checkpoint_step=2, world=4)
    assert got == Plan(5, {1: ([0, 1], [0, 1, 2]), 2: ([2], [])})  # rank 3 was lost before step 5: no weights file


def test_no_plan_when_both_copies_of_a_partition_are_gone_or_the_snapshot_is_not_newer():
    why = plan({2: held(2, 1, 5)}, {0, 1}, STATES, checkpoint_step=2, world=4)
    assert isinstance(why, str) and "no surviving copy of trainer rank(s) 0" in why and "both lost" in why
    assert "none of its copies (a switch since drops them)" in plan({2: {"own": [], "held": []}}, {0}, STATES, 2, 4)
    assert "not newer than the disk checkpoint (step 5)" in plan({1: held(1, 0, 5), 2: held(2, 1, 5)}, {0}, STATES, 5, 4)
    assert plan({}, {0}, {}, 0, 4) == "the coordinator kept no snapshot state yet"


def test_an_older_complete_snapshot_is_used_when_the_newest_is_not_whole():
    answers = {1: {"own": held(1, 0, 5)["own"], "held": held(1, 0, 4)["held"]}, 2: held(2, 1, 4)}
    got = plan(answers, {0}, STATES, checkpoint_step=0, world=4)
    assert isinstance(got, Plan) and got.step == 4 and got.writes[1][0] == [0]
    # the ranks keep the two newest: the older one when the newest's first batch was not generated (skip)
    both = {r: {k: held(r, (r - 1) % 3, 4)[k] + held(r, (r - 1) % 3, 5)[k] for k in ("own", "held")} for r in (1, 2)}
    assert plan(both, {0}, STATES, 0, 4).step == 5
    assert plan(both, {0}, STATES, 0, 4, skip=frozenset({5})).step == 4
    assert "not newer than the disk checkpoint (step 4)" in plan(both, {0}, STATES, 4, 4, skip=frozenset({5}))
