"""Fault-matrix row 5, control plane: the run's redis-server is SIGKILLed while traffic flows; the supervised
server comes back on the same port from its append-only file and nothing is lost.

Real processes and a real redis-server throughout: command receivers, heartbeaters and rollout pullers run as
threads with their own clients, as ranks do; the coordinator's CommandBus and Registry run in the test thread.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter

import pytest
import redis

from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.config import RedisConfig
from dynaresize.control.registry import Beat, Heartbeater, Registry
from dynaresize.control.server import RedisServer, connect
from dynaresize.contract.protocol import CommandKind
from dynaresize.events import EventLog, EventType, read_events
from dynaresize.contract.workqueue import RolloutQueue, SampleResult, WorkItem

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

RANKS = [0, 1, 2]


def fast_cfg(redis_binary: str, **kw) -> RedisConfig:
    base = dict(server_binary=redis_binary, heartbeat_s=0.5, dead_after_heartbeats=2, socket_timeout_s=2.0,
                connect_timeout_s=0.5, block_ms=100)
    return RedisConfig(**(base | kw))


def sigkill(srv: RedisServer) -> int:
    """SIGKILL the server process from outside (as the OOM killer would) and wait until it is gone."""
    proc = srv.proc
    assert proc is not None and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.pid


def crash(srv: RedisServer, down_s: float) -> None:
    """SIGKILL the server; keep it down ``down_s`` seconds before the watchdog may restart it."""
    time.sleep(0.05)  # let the command just sent be in flight
    with srv._lock:  # noqa: SLF001 - the watchdog restarts under this lock: holding it delays the restart
        sigkill(srv)
        time.sleep(down_s)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigkill_mid_traffic_loses_nothing(tmp_path, redis_binary, registration):
    cfg = fast_cfg(redis_binary, appendfsync=os.environ.get("XX_FSYNC", "always"))
    job = f"crash-{uuid.uuid4().hex[:6]}"
    restarts: list[str] = []
    srv = RedisServer(cfg, tmp_path, supervise=True, on_restart=restarts.append)
    srv.start()
    port = srv.port
    events = EventLog(tmp_path / "events.jsonl")
    stop = threading.Event()
    applied: dict[int, list[str]] = {r: [] for r in RANKS}
    claimed: dict[int, list[str]] = {r: [] for r in RANKS}
    errors: list[BaseException] = []
    hbs, threads, pullers, clients = [], [], [], []

    def client(role: str) -> redis.Redis:
        c = connect(srv.endpoint_file, role, cfg)
        clients.append(c)
        return c

    # the rollout queue of one step, pulled by every rank while commands flow
    total = 240
    items = [WorkItem(0, p, i, [1, 2, p % 7], seed=p * 16 + i) for p in range(total // 4) for i in range(4)]
    RolloutQueue(client("publisher"), job).publish(0, items)

    def pull(r: int) -> None:
        q = RolloutQueue(client(f"rank{r}-data"), job)
        try:
            while not stop.is_set():
                got = q.claim(0, r, 3)
                if not got:
                    return
                claimed[r] += [it.key for it in got]
                time.sleep(0.01)  # "generation"
                q.complete(0, r, [SampleResult(it.step, it.prompt, it.index, [it.seed], [-0.5], 0, r) for it in got])
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    try:
        for r in RANKS:
            hb = Heartbeater(Registry(client(f"rank{r}-hb"), job, cfg), registration(job, r), events=events)
            hb.start()
            hbs.append(hb)
            recv = CommandReceiver(client(f"rank{r}-cmd"), job, r, cfg,
                                   incarnation=lambda hb=hb: hb.registration.incarnation, events=events)

            def handler(cmd, r=r):
                applied[r].append(cmd.command_id)
                time.sleep(0.005)  # widen the window between claim and commit
                return {"i": cmd.payload["i"]}

            threads.append(threading.Thread(target=recv.run, args=(handler, stop.is_set, 0.1), daemon=True))
            pullers.append(threading.Thread(target=pull, args=(r,), daemon=True))
        for t in threads + pullers:
            t.start()

        coord = client("coordinator")
        bus = CommandBus(coord, job, cfg)
        registry = Registry(coord, job, cfg)
        sent, dead_seen, chaos = [], {}, []
        for i in range(40):
            # two crashes in the middle of traffic, from another thread while this one sends: a quick restart by
            # the watchdog (~0.1 s), and a slow one (the watchdog held off for 2 s, as while a big AOF replays)
            if i in (8, 20):
                chaos.append(threading.Thread(target=crash, args=(srv, 0.0 if i == 8 else 2.0)))
                chaos[-1].start()
            cmd, res = bus.request(CommandKind.PING, RANKS, {"i": i}, timeout=20)
            assert res.missing == [], f"command {i}: no ack from {res.missing} (restarts: {restarts})"
            assert all(a.ok for a in res.acks.values()), {r: a.error for r, a in res.acks.items()}
            assert all(a.result == {"i": i} for a in res.acks.values())
            sent.append(cmd.command_id)
            dead_seen |= registry.dead()  # a restart is no silence of the ranks: nobody is reported dead

        for t in chaos:
            t.join()
        wait_for(lambda: len(restarts) == 2, 10, "two on_restart calls")
        assert srv.port == port and srv.restarts == 2 and srv.failure is None
        assert all("SIGKILL" in why and "restarted on the same port" in why for why in restarts), restarts
        assert dead_seen == {}, f"ranks reported dead across a Redis restart: {dead_seen}"

        # every command applied exactly once per rank, in order
        for r in RANKS:
            assert applied[r] == sent, f"rank {r}: applied {Counter(applied[r]).most_common(3)} vs {len(sent)} sent"

        # every sample generated exactly once: no claim lost in flight, none handed out twice
        for t in pullers:
            t.join(timeout=30)
        assert not errors, errors
        q = RolloutQueue(coord, job)
        keys = [k for r in RANKS for k in claimed[r]]
        dup = [k for k, n in Counter(keys).items() if n > 1]
        assert dup == [], f"samples claimed twice: {dup[:5]}"
        assert sorted(keys) == sorted(it.key for it in items)
        assert q.done(0) == q.total(0) == total and q.pending(0) == 0
        assert [(s.prompt, s.index) for s in q.results(0)] == [(it.prompt, it.index) for it in items]
        assert all(coord.hlen(f"dr:{job}:wq:0:inflight:{r}") == 0 for r in RANKS)

        # every rank is still registered (its registration survived, or it re-registered and said so)
        live = wait_for(lambda: (lv := registry.live()) and sorted(lv) == RANKS and lv, 10, "all ranks live")
        rejoined = {e["rank"] for e in read_events(tmp_path / "events.jsonl", types={EventType.RANK})
                    if e["state"] == "rejoined"}
        for r, reg in live.items():
            assert reg.incarnation == 1 or r in rejoined, (r, reg.incarnation, rejoined)
        assert all(hb.beat_once() is Beat.OK for hb in hbs)
        # the receivers' wake-up subscriptions came back too (pub/sub is not persisted: they re-subscribed)
        wake = f"dr:{job}:wake"
        wait_for(lambda: dict(coord.pubsub_numsub(wake)).get(wake.encode()) == len(RANKS), 10, "re-subscriptions")
    finally:
        stop.set()
        for t in threads + pullers:
            t.join(timeout=10)
        for hb in hbs:
            hb.stop()
        srv.stop()
        for c in clients:
            c.close()
        events.close()
    assert srv.proc is None and len(restarts) == 2, "stop() is not a crash: nothing restarted it"


def test_lua_scripts_reload_after_the_restart_emptied_the_script_cache(tmp_path, redis_binary, registration):
    cfg = fast_cfg(redis_binary)
    job = "scripts"
    restarted = threading.Event()
    with RedisServer(cfg, tmp_path, supervise=True, on_restart=lambda why: restarted.set()) as srv:
        c = connect(srv.endpoint_file, "t", cfg)
        registry, bus, queue = Registry(c, job, cfg), CommandBus(c, job, cfg), RolloutQueue(c, job)
        recv = CommandReceiver(c, job, 0, cfg, incarnation=1, wake=False)
        scripts = [registry._register, registry._heartbeat, registry._deregister, registry._liveness, bus._send,
                   recv._claim, queue._publish, queue._claim, queue._complete, queue._release]  # noqa: SLF001

        def use_every_script(step: int) -> None:
            reg = registry.register(registration(job, 0))
            assert registry.heartbeat(0, reg.incarnation) is Beat.OK
            assert sorted(registry.live()) == [0]
            cmd = bus.send(CommandKind.PING, [0], {"step": step})
            assert recv.process(lambda cmd: {"ok": 1}) == 1
            assert bus.await_acks(cmd.command_id, [0], timeout=5).missing == []
            assert queue.publish(step, [WorkItem(step, 0, i, [1], seed=i) for i in range(3)]) == 3
            got = queue.claim(step, 0, 2)
            assert queue.complete(step, 0, [SampleResult(step, 0, got[0].index, [1], [-1.0], 0, 0)]) == 1
            assert queue.release(step, 0) == 1
            assert registry.deregister(0, reg.incarnation)

        use_every_script(0)
        assert all(c.script_exists(s.sha)[0] for s in scripts)
        sigkill(srv)
        assert restarted.wait(15)
        use_every_script(1)  # every script works on the restarted server
        # Whether a restarted server still holds the scripts is a Redis-version detail (6.2 replays the scripts
        # its append-only file carries, 7.x starts with an empty cache): empty it, as 7.x does, and ask again.
        c.script_flush()
        assert not any(c.script_exists(s.sha)[0] for s in scripts)
        use_every_script(2)  # redis-py loads each script again on NOSCRIPT
        assert all(c.script_exists(s.sha)[0] for s in scripts)
        c.close()


def test_liveness_allows_for_the_outage_then_finds_a_silent_rank(tmp_path, redis_binary, registration):
    cfg = fast_cfg(redis_binary, heartbeat_s=0.1)  # dead after 0.2 s of silence
    with RedisServer(cfg, tmp_path, supervise=True) as srv:
        c = connect(srv.endpoint_file, "coord", cfg)
        registry = Registry(c, "live", cfg)
        registry.register(registration("live", 0))
        sigkill(srv)
        time.sleep(1.0)  # the watchdog restarts the server meanwhile; no rank can beat while it is down
        c.ping()
        assert 0 not in registry.dead(), "silence during the outage counted against the rank"
        t0 = time.monotonic()
        ages = wait_for(registry.dead, 8, "the silent rank reported dead")  # it never beats again
        assert 0 in ages and ages[0] > cfg.dead_after_s
        assert time.monotonic() - t0 < 6
        c.close()


def test_stop_is_not_a_crash_and_the_default_keeps_every_write(tmp_path, redis_binary):
    restarts: list[str] = []
    srv = RedisServer(RedisConfig(server_binary=redis_binary), tmp_path, supervise=True, on_restart=restarts.append)
    with srv:
        c = srv.client("t")
        assert c.config_get("appendfsync")["appendfsync"] in (b"always", "always")
        c.set("dr:k", "v")
        sigkill(srv)
        wait_for(lambda: restarts, 15, "the restart")
        assert c.get("dr:k") == b"v"  # acknowledged before the crash: replayed from the AOF
        c.close()
        watchdog = srv._watchdog  # noqa: SLF001
        assert watchdog is not None and watchdog.is_alive()
        port, restarted = srv.port, srv.proc
        # the restarted server gets SIGTERM when the thread that forked it (the watchdog) ends: between the start
        # of stop() and the server's SHUTDOWN, the watchdog must stay (here: stop() held at that point for 0.5 s)
        srv._stopping.set()  # noqa: SLF001 - the first thing stop() does
        time.sleep(0.5)
        assert restarted.poll() is None and watchdog.is_alive(), "the watchdog ended before its server"
    assert srv.proc is None and not watchdog.is_alive() and len(restarts) == 1
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "stopped for good: nothing listens on the port"
    # the server the watchdog started was stopped by SHUTDOWN, not by the parent-death signal of a watchdog that
    # ended before it
    log_text = (tmp_path / "redis" / "redis.log").read_text()
    assert "User requested shutdown" in log_text.split("Ready to accept connections")[-1]
    assert "Received SIGTERM" not in log_text


def test_port_taken_while_down_gives_up_with_a_clear_error(tmp_path, redis_binary):
    cfg = fast_cfg(redis_binary, restart_attempts=2, restart_backoff_s=0.05)
    restarts: list[str] = []
    srv = RedisServer(cfg, tmp_path, supervise=True, on_restart=restarts.append)
    srv.start()
    squatter = socket.socket()
    try:
        with srv._lock:  # noqa: SLF001 - hold the watchdog off until the port is taken (no race)
            sigkill(srv)
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", srv.port))
            squatter.listen(1)
        wait_for(lambda: srv.failure, 20, "the watchdog to give up")
        assert restarts == []
        assert f"127.0.0.1:{srv.port}" in srv.failure and "in use by another process" in srv.failure, srv.failure
        assert "gave up after 2 restart attempts" in srv.failure and "SIGKILL" in srv.failure, srv.failure
        with pytest.raises(Exception, match="in use by another process"):
            srv.check()
        quick = cfg.model_copy(update={"retries": 0})
        with pytest.raises(redis.RedisError):
            connect(srv.endpoint_file, "late", quick).ping()  # clients fail on their next call
        assert not srv._watchdog.is_alive()  # noqa: SLF001
    finally:
        squatter.close()
        srv.stop()


def test_an_adopted_server_is_supervised_too(tmp_path, redis_binary):
    # a coordinator that takes over a run (fault row 4) adopts the run's server, a child of the old coordinator:
    # when it dies (the old coordinator exited: parent-death signal; or a crash), the new one restarts it
    cfg = fast_cfg(redis_binary)
    old = RedisServer(cfg, tmp_path)  # the old coordinator's server (unsupervised here)
    old.start()
    restarts: list[str] = []
    new = RedisServer(cfg, tmp_path, supervise=True, on_restart=restarts.append)
    try:
        new.start()
        assert new.adopted_pid == old.proc.pid and new.proc is None and new.port == old.port
        c = connect(new.endpoint_file, "t", cfg)
        c.set("dr:k", "v")
        os.kill(old.proc.pid, signal.SIGKILL)
        wait_for(lambda: restarts, 15, "the restart of the adopted server")
        assert f"pid {old.proc.pid}, adopted" in restarts[0] and "is gone" in restarts[0], restarts
        assert new.proc is not None and new.adopted_pid is None and new.port == old.port
        assert c.get("dr:k") == b"v"
        c.close()
    finally:
        new.stop()
        old.stop()


def test_detach_leaves_the_server_running_and_unsupervised(tmp_path, redis_binary):
    # a fenced-off coordinator leaves the run's server to the newer one, also a server its watchdog restarted
    restarts: list[str] = []
    srv = RedisServer(fast_cfg(redis_binary), tmp_path, supervise=True, on_restart=restarts.append)
    srv.start()
    sigkill(srv)
    wait_for(lambda: restarts, 15, "the restart")
    child = srv.proc  # started by the watchdog thread
    try:
        srv.detach()
        srv.stop()  # what the coordinator's with-block does after detach(): nothing
        time.sleep(0.5)
        assert child.poll() is None, "a detached server must keep running"
        c = connect(srv.endpoint_file, "t", fast_cfg(redis_binary))
        assert c.ping()
        c.close()
        child.kill()
        child.wait(timeout=10)
        time.sleep(0.5)
        assert len(restarts) == 1, "nobody supervises a detached server"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
