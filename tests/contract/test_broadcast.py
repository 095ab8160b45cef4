"""The job-wide broadcast stream (issue 15, item 10) against a real redis-server: one write per command whatever the
number of targets, ranks merge it with their own stream in send order, fencing and at-most-once as before.
(``test_commands.py`` runs every command test in both modes.)"""

from __future__ import annotations

import pytest

from dynaresize.control.commands import READ_COUNT, CommandBus, CommandReceiver
from dynaresize.contract.protocol import CommandKind

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]


def test_one_write_per_command_whatever_the_number_of_targets(client, cfg, job_id):
    cfg = cfg.model_copy(update={"broadcast_min_ranks": 2})
    c = client()
    bus = CommandBus(c, job_id, cfg)
    bus.send(CommandKind.PING, range(1024), {})
    assert c.xlen(f"dr:{job_id}:bcast") == 1
    assert not any(c.exists(f"dr:{job_id}:cmd:{r}") for r in (0, 1, 1023)), "no per-rank entry"
    bus.send(CommandKind.PING, [7], {})  # one target: its own stream
    assert c.xlen(f"dr:{job_id}:cmd:7") == 1 and c.xlen(f"dr:{job_id}:bcast") == 1


def test_ranks_merge_both_streams_in_send_order_past_one_read(client, cfg, job_id):
    """More than READ_COUNT entries in each stream, interleaved: every rank applies its commands in send order."""
    cfg = cfg.model_copy(update={"broadcast_min_ranks": 2})
    bus = CommandBus(client("coord"), job_id, cfg)
    sent: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for i in range(READ_COUNT + 60):
        for targets in ([0], [0, 1, 2], [1], [1, 2]):  # own, broadcast, own, broadcast (rank 0 not a target)
            cmd = bus.send(CommandKind.PING, targets, {"i": i})
            for r in targets:
                sent[r].append(cmd.command_id)
    for r in sent:
        got: list[str] = []
        recv = CommandReceiver(client(f"rank{r}"), job_id, r, cfg, wake=False)
        while recv.process(lambda cmd: got.append(cmd.command_id) or {}) or len(got) < len(sent[r]):
            pass
        assert got == sent[r], f"rank {r}: applied out of order or not all ({len(got)} of {len(sent[r])})"
        assert recv.process(lambda cmd: got.append(cmd.command_id) or {}) == 0


def test_a_broadcast_is_applied_once_and_its_cursor_survives_a_restarted_receiver(client, cfg, job_id):
    cfg = cfg.model_copy(update={"broadcast_min_ranks": 2})
    bus = CommandBus(client("coord"), job_id, cfg)
    first = bus.send(CommandKind.PING, [0, 1], {})
    applied: list[str] = []
    recv = CommandReceiver(client("rank0"), job_id, 0, cfg, wake=False)
    assert recv.process(lambda cmd: applied.append(cmd.command_id) or {"x": 1}) == 1
    bus.resend(first)  # a retried send: a second broadcast entry with the same id
    second = bus.send(CommandKind.PING, [0, 1], {})
    again = CommandReceiver(client("rank0"), job_id, 0, cfg, wake=False)  # the rank's process restarted
    assert again.process(lambda cmd: applied.append(cmd.command_id) or {"x": 2}) == 2
    assert applied == [first.command_id, second.command_id], "the resent copy answers its stored ack"
    acks = bus.await_acks(first.command_id, [0], 1).acks
    assert acks[0].result == {"x": 1}


def test_a_fenced_coordinator_cannot_broadcast_and_its_stale_copies_are_rejected(client, cfg, job_id):
    cfg = cfg.model_copy(update={"broadcast_min_ranks": 2})
    old = CommandBus(client("old"), job_id, cfg)
    stale = old.command(CommandKind.PING, [0, 1])
    new = CommandBus(client("new"), job_id, cfg)
    with pytest.raises(Exception, match="fenced out"):
        old.resend(stale)
    fresh = new.send(CommandKind.PING, [0, 1], {})
    applied: list[str] = []
    recv = CommandReceiver(client("rank1"), job_id, 1, cfg, wake=False)
    recv.process(lambda cmd: applied.append(cmd.command_id) or {})
    assert applied == [fresh.command_id]
