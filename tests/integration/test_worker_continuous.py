"""Continuous batching across generate commands, through the real command path: a real redis-server, the
CommandBus, the rank's CommandReceiver (``run_stream``) and one rollout rank's Worker (in this process: a rollout
rank's generate makes no collective call), with a real tiny torch model and the Redis work queue.

- the next command's samples join the running decode, each command is acked when its own samples ended, and every
  sample has the tokens of its one-batch decoding for its seed (a batch of one, on the weights of its version);
- a generate of version v+1 while version v decodes: the v samples end with v, the v+1 ones start after the install;
- fencing aborts: shutdown, a rank the data plane declared lost, a newer coordinator epoch.
"""

from __future__ import annotations

import copy
import uuid

import pytest
import torch

from dynaresize.contract.dataplane import RedisDataPlane
from dynaresize.contract.decode import DecodeSums
from dynaresize.contract.workqueue import RolloutQueue, WorkItem
from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.registry import Registry
from dynaresize.control.server import connect
from dynaresize.engines.protocol import SamplingParams
from dynaresize.engines.rollout_torch import TorchRollout
from dynaresize.worker.local import TINY_MODEL, rollout_rank, tiny_qwen2
from dynaresize.worker.main import RankHandler

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EOS = [3, 4, 5]  # 3 of 48 tokens end a response: lengths from 1 to max_tokens
GEN = {"pull_batch": 4, "max_tokens": 12, "temperature": 1.0, "top_p": 1.0}
PARAMS = SamplingParams(max_tokens=12)


def _item(step: int, p: int, i: int) -> WorkItem:
    """Sample ``i`` of prompt ``p`` of ``step``: prompts of 2 to 4 tokens, a seed per sample."""
    return WorkItem(step, p, i, [1, 6 + p, 7 + step, 9][: 2 + p % 3], seed=1000 * step + 10 * p + i)


@pytest.fixture
def rank(tmp_path, redis_server):
    """(bus, receiver, handler, queue, worker) of job-unique keys; 4 prompts x 3 responses published at steps 1, 2."""
    job = f"cb-{uuid.uuid4().hex[:8]}"
    cfg = redis_server.cfg.model_copy(update={"block_ms": 50})
    client = connect(redis_server.endpoint_file, role="test", cfg=cfg)
    queue = RolloutQueue(client, job)
    for step in (1, 2):
        queue.publish(step, [_item(step, p, i) for p in range(4) for i in range(3)])
    module = tiny_qwen2(TINY_MODEL, seed=1).eval()
    worker = rollout_rank(module, RedisDataPlane(client, job), tmp_path / "stage", tmp_path / "weights",
                          rollout={"max_running": 5, **{k: GEN[k] for k in ("pull_batch", "max_tokens")}}, eos_ids=EOS)
    bus = CommandBus(client, job, cfg)
    recv = CommandReceiver(connect(redis_server.endpoint_file, role="rank0", cfg=cfg), job, 0, cfg)
    yield bus, recv, RankHandler(worker), queue, worker, client, job, cfg
    recv.close()


def _drive(recv: CommandReceiver, handler: RankHandler, n: int) -> None:
    """Run the rank until ``n`` commands were begun and every one is answered and committed."""
    recv.run_stream(handler, stop=lambda: recv.applied >= n and not handler.busy() and not recv._held, idle_s=0.05)


def _alone(module, item) -> list[int]:
    """The one-batch decoding of one sample (a batch of one) on ``module``'s weights."""
    return TorchRollout(module, EOS, 0).generate([item.prompt_ids], [item.seed], PARAMS)[0].token_ids


def _record_begins(handler: RankHandler) -> list[tuple[str, bool, int]]:
    """(kind, whether earlier samples were decoding when it arrived, requests in the engine after it began) of each
    command (the receiver settles a command only while others are pending)."""
    seen, begin, settle = [], handler.begin, handler.settle
    arrived: list[bool] = []

    def spy_settle(cmd):
        arrived.append(handler.worker.streaming)
        return settle(cmd)

    def spy(cmd):
        was = arrived.pop() if arrived else handler.worker.streaming
        out = begin(cmd)
        seen.append((cmd.kind.value, was, handler.worker.rollout.running))
        return out

    handler.begin, handler.settle = spy, spy_settle
    return seen


def test_the_next_commands_samples_join_the_running_decode_with_each_seeds_tokens(rank):
    bus, recv, handler, queue, worker, *_ = rank
    begins = _record_begins(handler)
    cmds = [bus.send("generate", [0], {"step": 1, "version": 0, "prompts": ps, **GEN}) for ps in ([0, 1], [2], [3])]
    _drive(recv, handler, 3)
    acks = [bus.await_acks(c.command_id, [0], 5).acks[0] for c in cmds]
    assert all(a.ok for a in acks), [a.error for a in acks]
    got = [(a.result["samples"], a.result["prompts"], a.result["version"]) for a in acks]
    assert got == [(6, [0, 1], 0), (3, [2], 0), (3, [3], 0)]
    assert [a.result["tokens"] for a in acks] != [0, 0, 0]
    # each iteration of the stream is timed and counted once, in the next ack: a decoded sequence is one token of
    # one iteration, and every sample was admitted once (DecodeSums, the fit of the engine's iteration cost)
    sums = [DecodeSums.from_wire(a.result["decode"]) for a in acks if "decode" in a.result]
    assert sum(s.a for s in sums) == sum(a.result["tokens"] for a in acks)
    assert sum(s.m for s in sums) == 12 and sum(s.n for s in sums) >= max(len(r.response_ids) for r in queue.results(1))
    assert all(s.t > 0 and s.aa >= s.a for s in sums)
    # commands 2 and 3 began while command 1 decoded: their samples queued behind the running ones for free slots
    assert [(k, was) for k, was, _ in begins] == [("generate", False), ("generate", True), ("generate", True)]
    assert begins[-1][2] > worker.rollout.max_running  # more requests than slots: admitted as slots freed
    res = {r.key: r for r in queue.results(1)}
    items = {it.key: it for it in (_item(1, p, i) for p in range(4) for i in range(3))}
    assert sorted(res) == sorted(items)
    for key, it in items.items():
        assert res[key].response_ids == _alone(worker.module, it), key
        assert (res[key].version, res[key].rank) == (0, 0)
    # the rank's rollout stage intervals do not overlap (busy time counted once) and add up to the acks' busy_s
    assert sum(a.result["busy_s"] for a in acks) > 0
    assert recv.cursor == recv._from(False)  # every entry committed: the cursor is where reading goes on


def test_a_new_version_waits_for_the_old_versions_samples_to_end_then_installs(rank, tmp_path):
    bus, recv, handler, queue, worker, *_ = rank
    v0 = copy.deepcopy(worker.module)
    g = torch.Generator().manual_seed(5)
    v1 = {n: (p.detach() + 0.3 * torch.randn(p.shape, generator=g)) for n, p in worker.module.named_parameters()}
    worker.stager.stage(str((tmp_path / "weights" / "v1").resolve()), v1, {"version": 1})
    begins = _record_begins(handler)
    f = bus.send("fetch_weights", [0], {"version": 1})  # read in the background while version 0 decodes
    a = bus.send("generate", [0], {"step": 1, "version": 0, "prompts": [0, 1, 2, 3], **GEN})
    b = bus.send("generate", [0], {"step": 2, "version": 1, "prompts": [0, 1, 2, 3], **GEN})
    _drive(recv, handler, 3)
    acks = {c.command_id: bus.await_acks(c.command_id, [0], 5).acks[0] for c in (a, f, b)}
    assert all(x.ok for x in acks.values()), [x.error for x in acks.values()]
    assert acks[a.command_id].result["version"] == 0 and acks[b.command_id].result["version"] == 1
    # the generate of version 1 found version 0 decoding: it finished it, then installed version 1
    assert [(k, was) for k, was, _ in begins] == [("fetch_weights", False), ("generate", False), ("generate", True)]
    assert worker.version == 1
    with_v1 = copy.deepcopy(v0)
    TorchRollout(with_v1, EOS, 0).load_weights(v1.items())  # the install's path (tied weights stay tied)
    old, new = queue.results(1), queue.results(2)
    assert len(old) == len(new) == 12
    assert {r.version for r in old} == {0} and {r.version for r in new} == {1}
    for step, results, module in ((1, old, v0), (2, new, with_v1)):  # every token of a sample from its one version
        for r in results:
            assert r.response_ids == _alone(module, _item(step, r.prompt, r.index)), (step, r.key)
    assert any(r.response_ids != _alone(v0, _item(2, r.prompt, r.index)) for r in new)  # version 1 draws otherwise


def test_shutdown_aborts_what_decodes_and_answers_every_command(rank):
    bus, recv, handler, queue, worker, *_ = rank
    a = bus.send("generate", [0], {"step": 1, "version": 0, "prompts": [0, 1, 2, 3], **GEN})
    s = bus.send("shutdown", [0], {})
    recv.run_stream(handler, stop=lambda: worker.stopped and not recv._held, idle_s=0.05)
    ga, sa = bus.await_acks(a.command_id, [0], 5).acks[0], bus.await_acks(s.command_id, [0], 5).acks[0]
    assert not ga.ok and "aborted: the rank shuts down" in ga.error and sa.ok
    assert worker.rollout.running == 0 and not worker.streaming
    assert queue.done(1) < 12  # aborted before the end (completed slices stay; the rest is handed out again)


def test_a_rank_declared_lost_aborts_its_decode_at_the_refused_results(rank):
    bus, recv, handler, queue, worker, client, job, cfg = rank
    a = bus.send("generate", [0], {"step": 1, "version": 0, "prompts": [0, 1, 2, 3], **GEN})
    recv.process(handler, timeout=1.0)
    assert worker.streaming
    Registry(client, job, cfg).fence(0)  # the coordinator declares rank 0 lost: the work queue refuses its results
    recv.run_stream(handler, stop=lambda: not handler.busy() and not recv._held, idle_s=0.05)
    ga = bus.await_acks(a.command_id, [0], 5).acks[0]
    assert not ga.ok and "aborted: fenced" in ga.error and worker.rollout.running == 0
    assert queue.done(1) == 0


def test_a_newer_coordinator_epoch_aborts_the_fenced_ones_decode(rank):
    bus, recv, handler, queue, worker, client, job, cfg = rank
    a = bus.send("generate", [0], {"step": 1, "version": 0, "prompts": [0, 1, 2, 3], **GEN})
    recv.process(handler, timeout=1.0)
    assert worker.streaming
    newer = CommandBus(client, job, cfg)  # takes the next epoch: the first coordinator is fenced
    p = newer.send("ping", [0], {})
    recv.run_stream(handler, stop=lambda: recv.applied >= 2 and not handler.busy() and not recv._held, idle_s=0.05)
    assert newer.await_acks(p.command_id, [0], 5).acks[0].ok
    old = bus.await_acks(a.command_id, [0], 5).acks[0]
    assert not old.ok and "fenced: epoch" in old.error and worker.rollout.running == 0
    # resent by the newer coordinator under the same id: its stored (failed) ack is replayed, not a second run
    newer.resend(newer.command("generate", [0], a.payload, command_id=a.command_id))
    recv.run_stream(handler, stop=lambda: recv.cursor == recv._from(False) and recv._read()[0] == [], idle_s=0.05)
    again = newer.await_acks(a.command_id, [0], 5).acks[0]
    assert again.replayed and not again.ok and not worker.streaming
