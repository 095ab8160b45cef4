"""The takeover component (:class:`dynaresize.job.takeover.Takeover`) without processes: the replay of a segment as
the driver reads it (typed lines, each written line compared with the logged one), the transport's calls answered
from the ranks' stored acks, and going live where the old coordinator stopped: the commands still in flight sent
again under their ids in the order first sent, a generate the rank aborted at the takeover under the next id of its
chain, the driver's table re-keyed. The whole takeover, end to end: tests/integration/test_takeover_core.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynaresize.control.wire import Ack, Command, encode
from dynaresize.job.flight import Sent
from dynaresize.job.errors import JobError
from dynaresize.job.takeover import (FENCE_ABORT, Drained, Fenced, Noted, Observed, Segment, StoredAcks, Takeover,
                                     redo_id)
from dynaresize.job.transport import InFlight
from dynaresize.schedule import GroupsDone
from dynaresize.schedule.codec import encode as encode_core

pytestmark = pytest.mark.unit

JOB = "tk-test"
MAX = 1 << 20


class FakeRedis:
    """The ranks' stored acks (``dr:<job>:applied:<r>``): hget only."""

    def __init__(self):
        self.h: dict[tuple[str, str], bytes] = {}

    def hget(self, key: str, field: str):
        return self.h.get((key, field))


class FakeBus:
    """The command bus as the takeover uses it: build a command under an id, send it again (recorded)."""

    epoch = 2

    def __init__(self):
        self.resent: list[Command] = []

    def command(self, kind, ranks, payload, command_id: str) -> Command:
        return Command(job_id=JOB, epoch=self.epoch, command_id=command_id, kind=kind, ranks=",".join(map(str, ranks)),
                       payload=payload)

    def resend(self, cmd: Command) -> None:
        self.resent.append(cmd)


class Events:
    def __init__(self):
        self.emitted: list[tuple] = []

    def emit(self, *args, **kwargs) -> None:
        self.emitted.append((args, kwargs))


def store(redis: FakeRedis, cid: str, rank: int, ok: bool = True, error: str | None = None) -> None:
    from dynaresize.contract.keys import Keys

    ack = Ack(job_id=JOB, epoch=1, command_id=cid, rank=rank, incarnation=1, ok=ok, result={} if ok else None, error=error)
    redis.h[(Keys(JOB).applied(rank), cid)] = encode(ack, MAX)


def setup(tmp_path: Path, records: list[dict]):
    redis, bus, events = FakeRedis(), FakeBus(), Events()
    job = SimpleNamespace(run_dir=tmp_path, state=SimpleNamespace(step=3, checkpoint=None), events=events)
    tx = SimpleNamespace(svc=SimpleNamespace(bus=bus), replay=None)
    lines = [json.dumps({"config": {}, "state": {}})] + [json.dumps(r) for r in records]
    (tmp_path / "schedule.jsonl").write_text("".join(x + "\n" for x in lines))
    in_flight: dict[str, Sent] = {}
    tk = Takeover(Segment({"config": {}, "state": {}}, records, lines), StoredAcks(redis, JOB, MAX), job, tx, in_flight)
    return tk, redis, bus, events, job, tx, in_flight


def held(tk: Takeover, bus: FakeBus, kind: str, ranks: list[int], cid: str, **payload) -> InFlight:
    return tk.hold(InFlight(bus.command(kind, ranks, payload, command_id=cid), ranks))


def test_the_replay_reads_the_segment_as_typed_lines_and_compares_every_line_written(tmp_path):
    done = GroupsDone(2, 0, (0, 1))
    records = [{"event": encode_core(done), "actions": []}, {"noted": [2, 3]}, {"lost": [3]}, {"checkpoint": 4}]
    tk, _, _, events, job, tx, _ = setup(tmp_path, records)
    assert tk.replaying and tx.replay is tk and job.events is not events  # muted: the old coordinator logged it
    job.events.emit("step_end", step=0)
    assert events.emitted == []
    assert tk.next_line() == Observed(done)
    assert tk.replays({"event": encode_core(done), "actions": []}) and tk.at == 1
    assert tk.next_line() == Noted((2, 3))
    with pytest.raises(JobError, match=r"gave \{'noted': \[2\]\} where the log has .* \(line 3 of the segment\)"):
        tk.replays({"noted": [2]})
    assert tk.replays({"noted": [2, 3]})
    assert tk.next_line() == Fenced((3,)) and tk.replays({"lost": [3]})
    assert tk.next_line() == Drained(4) and tk.at_checkpoint()
    assert tk.replays({"checkpoint": 4}) and tk.next_line() is None  # the log ends here
    assert not tk.replays({"event": "new"})  # live now: the driver writes the line
    assert not tk.replaying and tx.replay is None and job.events is events
    assert [kw["what"] for _, kw in events.emitted] == ["takeover"]


def test_a_call_without_stored_acks_is_the_frontier_where_the_commands_in_flight_are_sent_again(tmp_path):
    tk, redis, bus, events, job, tx, in_flight = setup(tmp_path, [{"event": "x"}])
    gen = held(tk, bus, "generate", [2], "i1.c0.generate.0.aa", prompts=[0])  # in flight, aborted at the takeover
    done = held(tk, bus, "generate", [3], "i1.c0.generate.1.bb", prompts=[1])  # answered in the replay
    fetch = held(tk, bus, "fetch_weights", [3], "i1.c0.fetch_weights.0.cc", version=1)  # in flight, not applied
    in_flight[gen.cmd.command_id] = Sent("generate", gen, batch=0, groups=(0,))
    in_flight[fetch.cmd.command_id] = Sent("fetch_weights", fetch, version=1)
    store(redis, gen.cmd.command_id, 2, ok=False, error=FENCE_ABORT + "2")
    store(redis, done.cmd.command_id, 3)
    ping = held(tk, bus, "ping", [0, 1], "i1.c0.ping.0.dd")
    store(redis, ping.cmd.command_id, 0)
    assert tk.answer(done.cmd, [3]).acks[3].ok  # every rank's stored ack: answered, still replaying
    assert tk.replaying and bus.resent == []
    assert tk.answer(ping.cmd, [0, 1]) is None  # rank 1 has none: the old coordinator stopped in this call
    assert not tk.replaying and tx.replay is None
    assert [c.command_id for c in bus.resent] == [redo_id("i1.c0.generate.0.aa"), fetch.cmd.command_id, ping.cmd.command_id]
    assert gen.cmd.command_id == redo_id("i1.c0.generate.0.aa")  # the flight carries the command as sent now
    assert all(c.epoch == bus.epoch for c in bus.resent)
    assert sorted(in_flight) == sorted([redo_id("i1.c0.generate.0.aa"), fetch.cmd.command_id])
    assert in_flight[redo_id("i1.c0.generate.0.aa")].flight.cmd.command_id == redo_id("i1.c0.generate.0.aa")
    assert tk.held == [] and tk.live_at is not None
    (_, kw), = events.emitted
    assert kw["what"] == "takeover" and "3 command(s) in flight sent again" in kw["reason"]
    tk.go_live()  # once only
    assert len(bus.resent) == 3
