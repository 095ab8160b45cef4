"""Streamed commands against a real redis-server (``CommandReceiver.run_stream``): a command accepted as pending
while later ones begin, acks written as each command finishes (any order), the cursor moved only over the answered
prefix; a rank that dies with a command pending answers it "interrupted" after the restart and replays the acks
it wrote, never applying anything twice.

The handler is scripted (a generate stays pending for the number of ``advance`` calls its payload says): the rank
side of the protocol is what is under test here; tests/integration/test_worker_continuous.py runs the real worker."""

from __future__ import annotations

import pytest

from dynaresize.control.commands import PENDING, CommandBus, CommandReceiver
from dynaresize.contract.protocol import CommandKind

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


class Scripted:
    """A StreamHandler: a generate is pending for ``payload['steps']`` advances; anything else is answered at once."""

    def __init__(self):
        self.left: dict[str, int] = {}
        self.done: list = []
        self.begun: list[str] = []
        self.aborted: list[str] = []

    def settle(self, cmd):
        if cmd.kind is CommandKind.SHUTDOWN:  # the rest runs beside what is pending
            self.abort("shutdown")

    def begin(self, cmd):
        self.begun.append(cmd.command_id)
        if cmd.kind is CommandKind.GENERATE:
            self.left[cmd.command_id] = int(cmd.payload["steps"])
            return PENDING
        return {"kind": cmd.kind.value}

    def advance(self):
        for cid in list(self.left):
            self.left[cid] -= 1
            if self.left[cid] <= 0:
                del self.left[cid]
                self.done.append((cid, {"cid": cid}, None))

    def take_done(self):
        out, self.done = self.done, []
        return out

    def busy(self):
        return bool(self.left)

    def wants_more(self):
        return True

    def abort(self, reason):
        for cid in list(self.left):
            self.aborted.append(cid)
            self.done.append((cid, None, f"aborted: {reason}"))
        self.left.clear()


def _cursor(client, job_id):
    return client.get(f"dr:{job_id}:cursor:0")


def test_later_commands_begin_while_one_is_pending_and_acks_come_as_each_ends(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Scripted()
    long = bus.send(CommandKind.GENERATE, [0], {"steps": 6})
    short = bus.send(CommandKind.GENERATE, [0], {"steps": 2})
    fetch = bus.send(CommandKind.FETCH_WEIGHTS, [0], {"version": 1})
    recv.process(h, timeout=0.5)  # one read: all three begin (the generates pend, the fetch is answered)
    assert h.begun == [long.command_id, short.command_id, fetch.command_id]
    assert bus.await_acks(fetch.command_id, [0], 1).acks[0].result == {"kind": "fetch_weights"}
    assert _cursor(client(), job_id) is None  # nothing committed: the first entry is still pending
    h.advance(), h.advance()
    recv._collect(h)
    assert bus.await_acks(short.command_id, [0], 1).acks[0].result == {"cid": short.command_id}
    assert _cursor(client(), job_id) is None and recv.process(h, timeout=0.0) == 0  # nothing begun twice
    recv.run_stream(h, stop=lambda: not h.busy() and not recv._held, idle_s=0.05)
    assert bus.await_acks(long.command_id, [0], 1).acks[0].result == {"cid": long.command_id}
    assert h.begun == [long.command_id, short.command_id, fetch.command_id]
    assert _cursor(client(), job_id) == recv.cursor  # every entry answered: the cursor past the last
    after = bus.send(CommandKind.PING, [0])
    recv.process(h, timeout=0.5)
    assert h.begun[-1] == after.command_id and _cursor(client(), job_id) == recv.cursor


def test_a_rank_that_dies_with_a_command_pending_answers_it_interrupted_and_replays_the_rest(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Scripted()
    long = bus.send(CommandKind.GENERATE, [0], {"steps": 100})
    short = bus.send(CommandKind.GENERATE, [0], {"steps": 1})
    recv.process(h, timeout=0.5)
    h.advance()
    recv._collect(h)
    assert bus.await_acks(short.command_id, [0], 1).acks[0].ok
    recv.close()  # the rank dies: long never finished
    again = CommandReceiver(client("rank-again"), job_id, 0, cfg)
    h2 = Scripted()
    again.run_stream(h2, stop=lambda: again.cursor != b"0-0" and not again._held, idle_s=0.05)
    assert h2.begun == []  # at most once: neither is applied again
    acks = {a.command_id: a for a in (bus.await_acks(c.command_id, [0], 1).acks[0] for c in (long, short))}
    assert len(client().xrange(f"dr:{job_id}:ack:{long.command_id}")) == 1  # its only ack: the restarted rank's
    assert not acks[long.command_id].ok and "interrupted" in acks[long.command_id].error
    replays = client().xrange(f"dr:{job_id}:ack:{short.command_id}")
    assert len(replays) == 2 and b'"replayed":true' in replays[-1][1][b"m"]


def test_a_newer_epoch_aborts_the_pending_commands_of_the_fenced_coordinator(client, cfg, job_id):
    old = CommandBus(client("coord-old"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Scripted()
    g = old.send(CommandKind.GENERATE, [0], {"steps": 100})
    recv.process(h, timeout=0.5)
    new = CommandBus(client("coord-new"), job_id, cfg)
    p = new.send(CommandKind.PING, [0])
    recv.run_stream(h, stop=lambda: not recv._held and len(h.begun) == 2, idle_s=0.05)
    assert h.aborted == [g.command_id]
    a = old.await_acks(g.command_id, [0], 1).acks[0]
    assert not a.ok and f"fenced: epoch {new.epoch} took over from {old.epoch}" in a.error
    assert new.await_acks(p.command_id, [0], 1).acks[0].ok


def test_what_a_command_settles_is_answered_before_it_begins(client, cfg, job_id):
    """A command that must not overlap the pending ones (here shutdown, which aborts them) gets them answered first:
    a rank that dies in the command itself has already written their acks."""
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Scripted()
    g = bus.send(CommandKind.GENERATE, [0], {"steps": 100})
    recv.process(h, timeout=0.5)
    seen = []
    begin = h.begin
    h.begin = lambda cmd: seen.append(len(client().xrange(f"dr:{job_id}:ack:{g.command_id}"))) or begin(cmd)
    s = bus.send(CommandKind.SHUTDOWN, [0])
    recv.process(h, timeout=0.5)
    assert seen == [1]  # the aborted generate's ack was written before shutdown began
    assert not bus.await_acks(g.command_id, [0], 1).acks[0].ok and bus.await_acks(s.command_id, [0], 1).acks[0].ok
    assert _cursor(client(), job_id) == recv.cursor and not recv._held
