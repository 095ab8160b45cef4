"""The rollout work queue on a real redis-server: pulls, no drop and no duplicate across a mid-rollout resize."""

from __future__ import annotations

import uuid

import pytest

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import connect
from dynaresize.contract.workqueue import RolloutQueue, SampleResult, WorkItem

pytestmark = pytest.mark.contract


@pytest.fixture
def queue(redis_server):
    client = connect(redis_server.endpoint_file, role="test", cfg=RedisConfig())
    q = RolloutQueue(client, f"wq-{uuid.uuid4().hex[:8]}")
    yield q
    client.close()


def items(step, prompts=3, group=4):
    return [WorkItem(step, p, i, [1, 2, p], seed=1000 * p + i) for p in range(prompts) for i in range(group)]


def result(it: WorkItem, rank: int) -> SampleResult:
    return SampleResult(it.step, it.prompt, it.index, [5, 6], [-0.1, -0.2], version=0, rank=rank)


def test_publish_is_idempotent_and_claims_are_disjoint(queue):
    assert queue.publish(0, items(0)) == 12
    assert queue.publish(0, items(0)) == 0  # a retried publish adds nothing
    a = queue.claim(0, rank=1, n=5)
    b = queue.claim(0, rank=2, n=5)
    c = queue.claim(0, rank=3, n=5)
    assert len(a) == 5 and len(b) == 5 and len(c) == 2
    keys = [x.key for x in a + b + c]
    assert len(set(keys)) == 12
    assert queue.claim(0, rank=1, n=5) == []


def test_resize_mid_rollout_neither_drops_nor_duplicates(queue):
    queue.publish(3, items(3))
    leaving = queue.claim(3, rank=1, n=4)  # rank 1 will switch to training mid-rollout
    staying = queue.claim(3, rank=2, n=4)
    queue.complete(3, 1, [result(leaving[0], 1)])  # it finished one before the switch
    assert queue.release(3, rank=1) == 3  # the three unfinished ones go back
    # the staying rank pulls everything that is left, the returned items included
    while True:
        got = queue.claim(3, rank=2, n=3)
        if not got:
            break
        staying += got
    assert queue.complete(3, 2, [result(x, 2) for x in staying]) == 11
    # a late duplicate from the rank that left (it was still alive) is dropped
    assert queue.complete(3, 1, [result(leaving[1], 1)]) == 0
    res = queue.results(3)
    assert [(s.prompt, s.index) for s in res] == [(p, i) for p in range(3) for i in range(4)]
    assert res[1].rank == 2 and res[0].rank == 1
    assert queue.done(3) == queue.total(3) == 12


def test_release_skips_items_already_finished(queue):
    queue.publish(1, items(1, prompts=1, group=2))
    got = queue.claim(1, rank=0, n=2)
    queue.complete(1, 9, [result(got[0], 9)])  # finished elsewhere (after an earlier release)
    assert queue.release(1, rank=0) == 2
    assert [x.key for x in queue.claim(1, rank=5, n=10)] == [got[1].key]


def test_steps_and_clear_are_independent(queue):
    queue.publish(0, items(0, 1, 1))
    queue.publish(1, items(1, 1, 2))
    queue.clear(0)
    assert queue.total(0) == 0 and queue.total(1) == 2


def test_result_with_mismatched_logprobs_is_rejected():
    with pytest.raises(ValueError, match="number of tokens and logprobs"):
        SampleResult.from_json('{"step":0,"prompt":0,"index":0,"response_ids":[1,2],"logprobs":[0.1],"version":0,"rank":0}')


def test_a_claim_retried_with_its_token_takes_nothing_new(queue):
    # redis-py sends a command again after a connection error; a Redis killed after it applied the claim but
    # before the reply went out sees the same claim twice: it must hand out the same items, not strand them
    queue.publish(4, items(4))
    first = queue.claim(4, rank=1, n=3, token="t1")
    again = queue.claim(4, rank=1, n=3, token="t1")
    assert [x.key for x in again] == [x.key for x in first] and queue.pending(4) == 9
    queue.complete(4, 1, [result(first[0], 1)])
    assert [x.key for x in queue.claim(4, rank=1, n=3, token="t1")] == [x.key for x in first[1:]]  # unfinished only
    nxt = queue.claim(4, rank=1, n=3)  # a new claim (fresh token) takes new items
    assert len(nxt) == 3 and not {x.key for x in nxt} & {x.key for x in first} and queue.pending(4) == 6
    assert queue.release(4, rank=1) == 5
    assert queue.claim(4, rank=1, n=3, token="t1") != [], "a release ends the old claim: the token is forgotten"


def test_an_extra_round_is_queued_once_and_counted(queue):
    """Dynamic sampling's extra rounds (dynaresize.job.filtering): added under the same step at most once each."""
    extra = [WorkItem(5, p, i, [1, p], seed=p * 10 + i) for p in range(3, 5) for i in range(4)]
    with pytest.raises(RuntimeError, match="before the step was published"):
        queue.extend(5, 1, extra)
    queue.publish(5, items(5))
    got = queue.claim(5, rank=1, n=100)
    queue.complete(5, 1, [result(it, 1) for it in got])
    assert queue.done(5) == queue.total(5) == 12
    assert queue.extend(5, 1, extra) == 8
    assert queue.extend(5, 1, extra) == 0  # a retry, or a resume replaying the plan: nothing twice
    assert queue.total(5) == 20 and queue.pending(5) == 8
    more = queue.claim(5, rank=2, n=100)
    assert sorted(x.key for x in more) == sorted(x.key for x in extra)
    queue.complete(5, 2, [result(it, 2) for it in more])
    assert queue.done(5) == 20 and [(s.prompt, s.index) for s in queue.results(5)][-8:] == [(p, i) for p in (3, 4) for i in range(4)]


def test_claim_prompts_takes_only_those_prompts_and_skips_finished_items(queue):
    queue.publish(6, items(6, prompts=4, group=3))
    other = queue.claim(6, rank=3, n=1)  # (0, 0) goes to another rank first: it stays there
    queue.complete(6, 3, [result(other[0], 3)])
    got = queue.claim_prompts(6, rank=1, prompts=[2, 0])
    assert [(x.prompt, x.index) for x in got] == [(0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    assert queue.pending(6) == 6  # prompts 1 and 3 untouched, in their order
    assert [(x.prompt, x.index) for x in queue.claim(6, rank=2, n=100)] == [(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2)]
    # the same prompts again: nothing pending, this rank's unfinished items of them come back (a lost reply)
    queue.complete(6, 1, [result(got[0], 1)])
    assert [x.key for x in queue.claim_prompts(6, rank=1, prompts=[0, 2])] == [x.key for x in got[1:]]
    assert queue.claim_prompts(6, rank=4, prompts=[0, 2, 7]) == []  # held by rank 1, done, or never published
    # a pending item that got its result meanwhile (a late duplicate of a released rank) is dropped, not handed out
    queue.publish(7, items(7, prompts=1, group=2))
    first = queue.claim(7, rank=5, n=2)
    queue.release(7, rank=5)
    queue.complete(7, 5, [result(first[0], 5)])
    assert [x.key for x in queue.claim_prompts(7, rank=1, prompts=[0])] == [first[1].key] and queue.pending(7) == 0


def test_claim_prompts_retried_with_its_token_takes_nothing_new(queue):
    queue.publish(8, items(8, prompts=3, group=2))
    first = queue.claim_prompts(8, rank=1, prompts=[1], token="p1")
    assert [x.key for x in queue.claim_prompts(8, rank=1, prompts=[1, 2], token="p1")] == [x.key for x in first]
    assert queue.pending(8) == 4, "a replay with the same token must not take prompt 2"
    queue.complete(8, 1, [result(first[0], 1)])
    assert [x.key for x in queue.claim_prompts(8, rank=1, prompts=[1], token="p1")] == [first[1].key]
    assert len(queue.claim_prompts(8, rank=1, prompts=[2], token="p2")) == 2 and queue.pending(8) == 2


def test_claim_prompts_refuses_a_fenced_rank_and_release_puts_its_items_back(queue):
    queue.publish(9, items(9, prompts=2, group=2))
    got = queue.claim_prompts(9, rank=1, prompts=[0, 1])
    assert len(got) == 4 and queue.pending(9) == 0
    assert queue.release(9, rank=1) == 4 and queue.pending(9) == 4
    assert [x.key for x in queue.claim_prompts(9, rank=2, prompts=[1])] == ["9.1.0", "9.1.1"]
    queue.r.sadd(queue.fenced_key, 3)  # what Registry.fence records
    assert queue.claim_prompts(9, rank=3, prompts=[0]) == [] and queue.pending(9) == 2


def test_claim_prompts_rejects_bad_prompt_indices(queue):
    for bad in ([-1], [1.0], ["2"], [True]):
        with pytest.raises(ValueError, match="prompt indices must be ints >= 0"):
            queue.claim_prompts(0, rank=1, prompts=bad)


def test_results_of_reads_the_named_samples_in_the_order_given(queue):
    queue.publish(4, items(4))
    got = queue.claim(4, rank=1, n=12)
    queue.complete(4, 1, [result(x, 1) for x in got if x.prompt != 2])  # prompt 2's samples not done
    res = queue.results_of(4, ["4.1.3", "4.0.0", "4.2.0", "4.1.0"])
    assert [s.key for s in res] == ["4.1.3", "4.0.0", "4.1.0"]  # the unfinished one left out
    assert queue.results_of(4, []) == []


def test_a_new_launch_puts_back_every_claim_of_every_step(queue):
    """Claims are bound to the launch that made them: the continuous schedule runs ahead of its checkpoint, so a
    process stopped at step 5 can hold claims of step 7 and 9 that a resume from step 2 reaches only later; if they
    stayed claimed, the prompts would never be claimed again (the old "batch 31: 32 samples missing" on every
    --resume). ``release_all`` puts back every step's claims and leaves finished samples alone."""
    for step in (2, 7, 9):
        queue.publish(step, items(step))
    held = {(2, 1): queue.claim(2, rank=1, n=4), (7, 2): queue.claim_prompts(7, 2, [0, 1]), (9, 3): queue.claim(9, rank=3, n=12)}
    queue.complete(9, 3, [result(it, 3) for it in held[(9, 3)][:5]])  # finished before the stop: kept
    assert queue.pending(7) == 4 and queue.pending(9) == 0
    assert queue.release_all() == 4 + 8 + 7
    assert (queue.pending(2), queue.pending(7), queue.pending(9)) == (12, 12, 7)
    # the new launch's rank 1 can claim the groups the old rank 2 held at step 7, and nothing is claimed twice
    got = queue.claim_prompts(7, 1, [0, 1])
    assert sorted(it.key for it in got) == sorted(it.key for it in held[(7, 2)])
    rest = queue.claim(9, rank=1, n=100)
    assert sorted(it.key for it in rest) == sorted(it.key for it in held[(9, 3)][5:])
    assert queue.release_all() == len(got) + len(rest)  # the same again: idempotent, nothing duplicated
    assert queue.pending(7) == 12 and queue.done(9) == 5
