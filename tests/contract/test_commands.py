"""Commands and acks against a real redis-server: ordering, durability, at-most-once, fencing, bad input."""

from __future__ import annotations

import json
import threading

import pytest
import redis

from dynaresize.control.commands import CommandBus, CommandReceiver, FencedError
from dynaresize.control.registry import Registry
from dynaresize.contract.protocol import CommandKind
from dynaresize.control.wire import Command, WireError, encode
from dynaresize.events import EventLog, read_events

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


@pytest.fixture(params=["per_rank", "broadcast"])
def cfg(cfg, request):
    """Every test twice: commands in per-rank streams, and in the job's broadcast stream (even for one rank)."""
    return cfg.model_copy(update={"broadcast_min_ranks": 0 if request.param == "per_rank" else 1})


class Recorder:
    """A handler that records what it applied (and can fail on demand)."""

    def __init__(self, fail_kinds=()):
        self.seen: list[tuple[str, dict]] = []
        self.fail_kinds = set(fail_kinds)

    def __call__(self, cmd: Command):
        self.seen.append((cmd.command_id, cmd.payload))
        if cmd.kind in self.fail_kinds:
            raise RuntimeError("engine not ready")
        return {"n": len(self.seen)}


def drain(recv: CommandReceiver, handler, rounds: int = 3) -> None:
    for _ in range(rounds):
        recv.process(handler, timeout=0.05)


def test_ordered_durable_delivery_across_a_disconnect(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    rc = client("rank0")
    recv = CommandReceiver(rc, job_id, 0, cfg)
    h = Recorder()
    first = bus.send(CommandKind.PING, [0], {"i": 0})
    drain(recv, h)
    recv.close()
    rc.close()  # the rank disconnects; commands keep coming
    sent = [bus.send(CommandKind.SWITCH_ROLE, [0], {"i": i}) for i in range(1, 6)]
    # a new process/connection for the same rank resumes from the cursor stored in Redis
    recv2 = CommandReceiver(client("rank0-again"), job_id, 0, cfg)
    drain(recv2, h)
    assert [cid for cid, _ in h.seen] == [first.command_id] + [c.command_id for c in sent]
    res = bus.await_acks(sent[-1].command_id, [0], timeout=1)
    assert res.missing == [] and res.acks[0].ok and res.acks[0].result == {"n": 6}


def test_wake_up_delivers_promptly_to_a_waiting_rank(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg.model_copy(update={"block_ms": 1000}))
    recv = CommandReceiver(client("rank"), job_id, 3, cfg.model_copy(update={"block_ms": 1000}))
    got = []
    t = threading.Thread(target=lambda: recv.process(lambda c: got.append(c.command_id), timeout=3))
    t.start()
    cmd, res = bus.request(CommandKind.PING, [3], timeout=2)
    t.join()
    assert got == [cmd.command_id] and res.missing == []
    assert res.acks[3].acked_at - cmd.issued_at < 0.5, "the pub/sub wake-up, not the 1 s fallback, should deliver it"


def test_retried_command_applies_once_and_replays_its_ack(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Recorder()
    cmd = bus.send(CommandKind.STAGE_STATE, [0], {"x": 1})
    drain(recv, h)
    bus.resend(cmd)
    bus.resend(cmd)
    drain(recv, h)
    assert len(h.seen) == 1, "a re-sent command must not be applied again"
    acks = [json.loads(f[b"m"]) for _, f in client().xrange(f"dr:{job_id}:ack:{cmd.command_id}")]
    assert [a["replayed"] for a in acks] == [False, True, True]
    assert all(a["result"] == {"n": 1} for a in acks)


def test_interrupted_command_is_not_applied_twice(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    cmd = bus.send(CommandKind.TRAIN, [0])
    client().hset(f"dr:{job_id}:applied:0", cmd.command_id, "started")  # a rank died mid-apply
    h = Recorder()
    drain(CommandReceiver(client("rank"), job_id, 0, cfg), h)
    assert h.seen == []
    ack = bus.await_acks(cmd.command_id, [0], 1).acks[0]
    assert not ack.ok and "interrupted" in ack.error


def test_handler_failure_is_an_error_ack_not_a_dead_rank(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    bad = bus.send(CommandKind.GENERATE, [0])
    good = bus.send(CommandKind.PING, [0])
    drain(recv, Recorder(fail_kinds={CommandKind.GENERATE}))
    a = bus.await_acks(bad.command_id, [0], 1).acks[0]
    assert not a.ok and "RuntimeError: engine not ready" in a.error
    assert bus.await_acks(good.command_id, [0], 1).acks[0].ok


def test_epoch_fencing_rejects_and_logs_the_old_coordinator(client, cfg, job_id, tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    old = CommandBus(client("coord-old"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg, events=events)
    h = Recorder()
    ok = old.send(CommandKind.PING, [0])
    drain(recv, h)
    in_flight = old.send(CommandKind.SWITCH_ROLE, [0], {"to": "train"})  # not yet read by the rank
    new = CommandBus(client("coord-new"), job_id, cfg)  # a new coordinator incarnation takes over
    assert new.epoch == old.epoch + 1
    with pytest.raises(FencedError):
        old.send(CommandKind.SWITCH_ROLE, [0])
    fresh = new.send(CommandKind.PING, [0])
    drain(recv, h)
    assert [cid for cid, _ in h.seen] == [ok.command_id, fresh.command_id]
    stale = old.await_acks(in_flight.command_id, [0], 1).acks[0]
    assert not stale.ok and "stale epoch" in stale.error
    rejected = [e for e in read_events(tmp_path / "events.jsonl") if e.type.value == "control"]
    assert [e["command_id"] for e in rejected] == [in_flight.command_id]
    assert "stale epoch" in rejected[0]["reason"] and rejected[0]["epoch"] == old.epoch


def test_a_new_coordinator_resends_pending_commands_under_the_same_ids_and_each_applies_once(client, cfg, job_id):
    """Coordinator takeover: the new one sends its predecessor's pending commands again with the same ids. One
    was applied already (its stored result is replayed under the new epoch); one was never read (the old copy is
    rejected as stale, the new one applied). The new coordinator sees exactly one good ack per command."""
    old = CommandBus(client("coord-old"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    h = Recorder()
    applied = old.send(CommandKind.TRAIN, [0], {"step": 4})
    drain(recv, h)
    unread = old.send(CommandKind.SYNC_WEIGHTS, [0], {"version": 5})  # the old coordinator dies here
    new = CommandBus(client("coord-new"), job_id, cfg)
    again = new.send(CommandKind.TRAIN, [0], {"step": 4}, command_id=applied.command_id)
    sync = new.send(CommandKind.SYNC_WEIGHTS, [0], {"version": 5}, command_id=unread.command_id)
    drain(recv, h)
    assert [cid for cid, _ in h.seen] == [applied.command_id, unread.command_id], "each command applied once"
    a = new.await_acks(again.command_id, [0], 1).acks[0]
    assert a.ok and a.replayed and a.epoch == new.epoch and a.result == {"n": 1}
    b = new.await_acks(sync.command_id, [0], 1).acks[0]
    assert b.ok and not b.replayed and b.epoch == new.epoch, "the stale copy's rejection must not count as its ack"
    with pytest.raises(FencedError):
        old.check_epoch()
    new.check_epoch()


def test_await_acks_reports_who_did_not_answer(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recvs = {r: CommandReceiver(client(f"rank{r}"), job_id, r, cfg) for r in range(4)}
    cmd = bus.send(CommandKind.SYNC_WEIGHTS, range(4), {"version": 3})
    for r in (0, 2):
        drain(recvs[r], Recorder(), rounds=1)
    res = bus.await_acks(cmd.command_id, range(4), timeout=0.3)
    assert sorted(res.acks) == [0, 2] and res.missing == [1, 3]
    acks, missing = res  # unpacks as (acks by rank, missing ranks)
    assert acks[2].rank == 2 and missing == [1, 3]


def test_two_jobs_share_one_server_without_seeing_each_other(client, cfg, job_id, registration):
    other = job_id + "-b"
    bus_a, bus_b = CommandBus(client(), job_id, cfg), CommandBus(client(), other, cfg)
    assert bus_a.epoch == bus_b.epoch == 1, "epochs are per job"
    # nothing heartbeats here: registrations that stay live for the test's length (FAST's 0.2 s ran out on a loaded
    # machine between the registering and the look, and the job's own rank was "not live")
    slow = cfg.model_copy(update={"heartbeat_s": 1.0, "dead_after_heartbeats": 60})
    Registry(client(), job_id, slow).register(registration(job_id, 0))
    Registry(client(), other, slow).register(registration(other, 0))
    Registry(client(), other, slow).register(registration(other, 1))
    assert sorted(Registry(client(), job_id, slow).live()) == [0]
    assert sorted(Registry(client(), other, slow).live()) == [0, 1]
    ha, hb = Recorder(), Recorder()
    ca = bus_a.send(CommandKind.PING, [0], {"job": "a"})
    cb = bus_b.send(CommandKind.PING, [0], {"job": "b"})
    drain(CommandReceiver(client(), job_id, 0, cfg), ha)
    drain(CommandReceiver(client(), other, 0, cfg), hb)
    assert ha.seen == [(ca.command_id, {"job": "a"})] and hb.seen == [(cb.command_id, {"job": "b"})]
    assert bus_a.await_acks(cb.command_id, [0], 0.1).missing == [0]
    keys = {k.decode() for k in client().scan_iter(match="dr:*", count=1000)}
    assert all(k.startswith((f"dr:{job_id}:", f"dr:{other}:")) for k in keys if job_id in k)
    assert any(k.startswith(f"dr:{other}:") for k in keys) and any(k.startswith(f"dr:{job_id}:epoch") for k in keys)


def test_bad_messages_are_rejected_logged_and_skipped(client, cfg, job_id, tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    bus = CommandBus(client("coord"), job_id, cfg)
    stream = f"dr:{job_id}:cmd:0"
    raw = client()
    good = bus.command(CommandKind.PING, [0])
    unknown = json.loads(good.model_dump_json()) | {"command_id": "u1", "kind": "teleport"}
    extra = json.loads(good.model_dump_json()) | {"command_id": "x1", "sneaky": 1}
    raw.xadd(stream, {"m": b"{not json"})
    raw.xadd(stream, {"m": json.dumps(unknown)})
    raw.xadd(stream, {"m": json.dumps(extra)})
    raw.xadd(stream, {"m": b"x" * (cfg.max_message_bytes + 1)})
    raw.xadd(stream, {"other": b"no m field"})
    raw.xadd(stream, {"m": b"\xff\xfe\x00"})
    after = bus.send(CommandKind.PING, [0])
    recv = CommandReceiver(client("rank"), job_id, 0, cfg, events=events)
    h = Recorder()
    drain(recv, h)
    assert [cid for cid, _ in h.seen] == [after.command_id], "the rank survives and applies the next good command"
    assert recv.rejected == 6
    reasons = [e["reason"] for e in read_events(tmp_path / "events.jsonl") if e["what"] == "rejected"]
    assert len(reasons) == 6
    assert "Invalid JSON" in reasons[0] and "kind" in reasons[1] and "sneaky" in reasons[2]
    assert "max_message_bytes" in reasons[3] and "missing message field" in reasons[4]
    u = bus.await_acks("u1", [0], 0.5).acks[0]  # readable id: the coordinator gets an error ack
    assert not u.ok and "kind" in u.error
    with pytest.raises(WireError, match="max_message_bytes"):
        encode(bus.command(CommandKind.PING, [0], {"blob": "x" * cfg.max_message_bytes}), cfg.max_message_bytes)


def test_a_retried_claim_recognises_itself(client, cfg, job_id):
    """redis-py may retry the claim after a lost reply: the retry must not look like someone else's claim."""
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    cmd = bus.send(CommandKind.TRAIN, [0])
    assert recv._claim(keys=[f"dr:{job_id}:applied:0"], args=[cmd.command_id, recv._token]) is None
    h = Recorder()
    drain(recv, h)  # the 'retry': same token, so the command is applied (once)
    assert [cid for cid, _ in h.seen] == [cmd.command_id]
    assert bus.await_acks(cmd.command_id, [0], 1).acks[0].ok


def lose_first_commit(recv: CommandReceiver) -> None:
    """The receiver's next commit fails as if Redis went away after the handler ran; later ones go through."""
    real_commit, calls = recv._commit, []

    def flaky_commit(*a, **kw):
        calls.append(a)
        if len(calls) == 1:
            raise redis.ConnectionError("Redis went away after the handler ran")
        return real_commit(*a, **kw)

    recv._commit = flaky_commit


def test_commit_lost_to_a_connection_error_does_not_reapply(client, cfg, job_id):
    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    cmd = bus.send(CommandKind.TRAIN, [0])
    h = Recorder()
    lose_first_commit(recv)
    with pytest.raises(redis.ConnectionError):
        recv.process(h)
    drain(recv, h)  # the entry is read again (cursor not advanced): its ack is committed, the handler not re-run
    assert len(h.seen) == 1
    assert bus.await_acks(cmd.command_id, [0], 1).acks[0].result == {"n": 1}


def test_a_commit_lost_while_the_coordinator_was_replaced_is_acked_under_the_new_epoch(client, cfg, job_id):
    """The rank finished a command but could not commit its ack (Redis down, taking the coordinator with it); the
    new coordinator resends that command under its epoch with the same id. The rank rejects the old copy as stale
    and answers the new one with the result it already has, under the new epoch (else the new coordinator, which
    ignores older epochs, would wait for ever), and never runs it twice."""
    old = CommandBus(client("coord-old"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    cmd = old.send(CommandKind.TRAIN, [0], {"step": 2})
    h = Recorder()
    lose_first_commit(recv)
    with pytest.raises(redis.ConnectionError):
        recv.process(h)
    new = CommandBus(client("coord-new"), job_id, cfg)
    new.send(CommandKind.TRAIN, [0], {"step": 2}, command_id=cmd.command_id)
    drain(recv, h)
    assert len(h.seen) == 1, "applied once"
    ack = new.await_acks(cmd.command_id, [0], 1).acks[0]
    assert ack.ok and ack.epoch == new.epoch and ack.result == {"n": 1}


# --- who owns the job's epoch: a fenced coordinator takes none, a fresh start takes over nothing, the reason said ---

def test_a_fenced_coordinator_never_takes_a_new_epoch_and_is_told_who_took_over(client, cfg, job_id, tmp_path):
    """``Recovery.restart`` takes its new epoch with ``after=<its own>``: once a second coordinator took the run
    over with --resume, the first one's automatic restart raises FencedError, takes no epoch (the second keeps
    the job) and says who fenced it and how."""
    from dynaresize.control.commands import CommandBus, FencedError, owner_record

    run = str(tmp_path)
    first = CommandBus(client(), job_id, cfg, owner=owner_record("start", run), fresh=True)
    second = CommandBus(client(), job_id, cfg, owner=dict(owner_record("resume", run), pid=1), after=None)
    assert second.epoch == first.epoch + 1
    with pytest.raises(FencedError) as e:
        CommandBus(client(), job_id, cfg, owner=owner_record("restart", run), after=first.epoch)
    assert "took this run over with `dynaresize run --resume`" in str(e.value) and f"epoch {second.epoch}" in str(e.value)
    assert second.current_epoch() == second.epoch  # no epoch taken: the second coordinator still owns the job
    second.send("ping", [0])  # and can send
    with pytest.raises(FencedError, match="took this run over with `dynaresize run --resume`"):
        first.send("ping", [0])
    # the owner's own restart (after its own epoch) takes the next one
    third = CommandBus(client(), job_id, cfg, owner=owner_record("restart", run), after=second.epoch)
    assert third.epoch == second.epoch + 1
    with pytest.raises(FencedError, match="own restart took epoch"):
        second.check_epoch()  # same pid and host as the owner record: a stale handle of this very process


def test_a_job_id_collision_and_a_fresh_start_on_a_taken_job_are_named(client, cfg, job_id, tmp_path):
    from dynaresize.control.commands import CommandBus, EpochTaken, FencedError, owner_record

    a = CommandBus(client(), job_id, cfg, owner=owner_record("start", str(tmp_path / "a")), fresh=True)
    with pytest.raises(EpochTaken, match="taken over only with `dynaresize run --resume RUN_DIR`"):
        CommandBus(client(), job_id, cfg, owner=owner_record("start", str(tmp_path / "b")), fresh=True)
    assert a.current_epoch() == a.epoch  # the refused start took nothing
    CommandBus(client(), job_id, cfg, owner=dict(owner_record("resume", str(tmp_path / "b")), pid=1))
    with pytest.raises(FencedError, match=f"job-name collision: the run in {tmp_path / 'b'}"):
        a.check_epoch()


def test_the_automatic_restart_of_a_fenced_coordinator_stops_no_rank_and_writes_nothing(client, cfg, tmp_path):
    """``Recovery.restart`` after another coordinator took the run over (the case where the first one's restart
    used to take a new epoch and fence its successor): FencedError before any rank is stopped, any file of the run
    written or any epoch taken. The launcher is a stand-in that records whether it was told to stop the ranks."""
    from dynaresize.config.loader import load_config
    from dynaresize.control.commands import CommandBus, FencedError, owner_record
    from dynaresize.job.errors import RanksLost
    from dynaresize.job.recovery import Recovery
    from dynaresize.job.runtime import Job, Services
    from dynaresize.job.state import JobState

    job_cfg = load_config("configs/quickstart.yaml", ["faults.max_restarts=2"])
    job = Job(job_cfg, tmp_path, JobState(n_train=2, step=5))
    mine = CommandBus(client(), job.job_id, cfg, owner=owner_record("start", str(tmp_path)), fresh=True)

    class StandInLauncher:  # the first coordinator's rank processes (already killed by the takeover)
        relaunchable, stopped = True, False

        def stop(self, grace_s: float = 0.0) -> None:
            self.stopped = True

    svc = Services(srv=None, redis=client(), bus=mine, registry=None, queue=None, task=None, model_dir=tmp_path,
                   tokenizer=None, assembler=None, metrics=None, launcher=StandInLauncher())
    theirs = CommandBus(client(), job.job_id, cfg, owner=dict(owner_record("resume", str(tmp_path)), pid=1))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(FencedError, match="took this run over with `dynaresize run --resume`"):
        Recovery(job, svc, planner=None).restart(RanksLost([2, 3], "generate 5", "process exited"), None, lambda: None)
    assert not svc.launcher.stopped, "no rank stopped"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "no file of the run written"
    assert theirs.current_epoch() == theirs.epoch and svc.bus is mine, "no epoch taken"


def test_a_fenced_coordinator_fences_no_rank_of_its_successor(client, cfg, tmp_path):
    """``Recovery.shrink`` (a rollout rank lost) by a coordinator whose epoch is gone: FencedError, and the rank,
    which may be its successor's, stays unfenced."""
    from dynaresize.config.loader import load_config
    from dynaresize.control.commands import CommandBus, FencedError, owner_record
    from dynaresize.control.registry import Registry
    from dynaresize.job.recovery import Recovery
    from dynaresize.job.runtime import Job, Services
    from dynaresize.job.state import JobState

    job = Job(load_config("configs/quickstart.yaml"), tmp_path, JobState(n_train=2, step=5))
    mine = CommandBus(client(), job.job_id, cfg, owner=owner_record("start", str(tmp_path)), fresh=True)
    registry = Registry(client(), job.job_id, cfg)
    svc = Services(srv=None, redis=client(), bus=mine, registry=registry, queue=None, task=None, model_dir=tmp_path,
                   tokenizer=None, assembler=None, metrics=None)
    CommandBus(client(), job.job_id, cfg, owner=dict(owner_record("resume", str(tmp_path)), pid=1))
    with pytest.raises(FencedError):
        Recovery(job, svc, planner=None).shrink([3], "no heartbeat for 9.0 s")
    assert registry.fenced() == set() and job.state.lost == []


def test_a_rank_times_the_round_trip_of_a_command_that_answers_its_ack(client, cfg, job_id):
    """``Command.reply_to`` names the command whose ack caused it; the rank that acked that one and then waited idle
    reports the seconds from that ack to the new command's (``Ack.reply_s``: the control plane's round trip, the
    command's handling and its work; less the work, what the pipeline predictor plays as the command latency). Not
    timed: a command answering an older ack (the rank acked another since), none named, or a stored ack answered
    again."""
    import time

    bus = CommandBus(client("coord"), job_id, cfg)
    recv = CommandReceiver(client("rank"), job_id, 0, cfg)
    seen = Recorder()

    def h(cmd):  # 0.1 s of work each
        time.sleep(0.1)
        return seen(cmd)

    a = bus.send(CommandKind.PING, [0], {"i": 0})
    drain(recv, h, rounds=1)
    assert bus.await_acks(a.command_id, [0], timeout=1).acks[0].reply_s is None  # it answers nothing

    got = []

    def rank():  # waiting idle after its ack of ``a``
        got.append(recv.process(h, timeout=3))

    t = threading.Thread(target=rank)
    t.start()
    time.sleep(0.3)  # the round trip includes the coordinator's time to answer
    b = bus.send(CommandKind.PING, [0], {"i": 1}, reply_to=a.command_id)
    t.join()
    ack_b = bus.await_acks(b.command_id, [0], timeout=1).acks[0]
    assert got == [1] and b.reply_to == a.command_id
    assert ack_b.reply_s is not None and 0.3 + 0.1 <= ack_b.reply_s < 2.0, ack_b.reply_s  # the wait and the work

    c = bus.send(CommandKind.PING, [0], {"i": 2}, reply_to=a.command_id)  # answers ``a``, but ``b`` was acked since
    d = bus.send(CommandKind.PING, [0], {"i": 3})
    drain(recv, h, rounds=1)
    assert bus.await_acks(c.command_id, [0], timeout=1).acks[0].reply_s is None
    assert bus.await_acks(d.command_id, [0], timeout=1).acks[0].reply_s is None
    bus.resend(b)  # applied already: its stored ack again, as it was
    drain(recv, h, rounds=1)
    again = [x for x in bus.await_acks(b.command_id, [0], timeout=1).acks.values()]
    assert again and all(x.reply_s in (None, ack_b.reply_s) for x in again)
