"""Redis refusing writes is a Redis problem, not a rank problem (issue 15, item 3), on a real redis-server.

``CONFIG SET maxmemory 1`` makes the server answer every write with ``-OOM`` (its eviction policy is noeviction),
``REPLICAOF`` a port where nothing listens makes it a read-only replica (``-READONLY``). Ranks heartbeat and apply
commands on their own threads and clients, as in a run. While writes are refused for several dead-rank deadlines:

- no rank is reported dead, during the refusal or after it (their heartbeats failed for a Redis reason);
- a command sent meanwhile waits, then goes through: applied once, acked;
- past ``redis.write_wait_s`` the wait ends with one :class:`RedisRefusesWrites` naming the cause.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.config import RedisConfig
from dynaresize.control.registry import Heartbeater, Registry
from dynaresize.control.server import REFUSALS, RedisRefusesWrites, RedisServer, connect
from dynaresize.contract.protocol import CommandKind

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

RANKS = [0, 1, 2]


def _cfg(redis_binary: str, wait_s: float) -> RedisConfig:
    return RedisConfig(server_binary=redis_binary, heartbeat_s=0.2, dead_after_heartbeats=2, socket_timeout_s=2.0,
                       connect_timeout_s=0.5, block_ms=100, write_wait_s=wait_s)


class Ranks:
    """Heartbeaters and command receivers of RANKS, each rank on its own thread and clients."""

    def __init__(self, srv: RedisServer, cfg: RedisConfig, job: str, registration):
        self.applied: dict[int, list[str]] = {r: [] for r in RANKS}
        self.stop = threading.Event()
        self.hbs = [Heartbeater(Registry(connect(srv.endpoint_file, f"hb{r}", cfg), job, cfg), registration(job, r))
                    for r in RANKS]
        for hb in self.hbs:
            hb.start()
        self.threads = []
        for r in RANKS:
            recv = CommandReceiver(connect(srv.endpoint_file, f"rank{r}", cfg), job, r, cfg, incarnation=1)
            t = threading.Thread(target=recv.run, args=(self._handler(r), self.stop.is_set, 0.1), daemon=True)
            t.start()
            self.threads.append(t)

    def _handler(self, r: int):
        def handle(cmd):
            self.applied[r].append(cmd.command_id)
            return {"rank": r}
        return handle

    def close(self) -> None:
        self.stop.set()
        for hb in self.hbs:
            hb.stop(deregister=False)
        for t in self.threads:
            t.join(timeout=10)


def _watch_deaths(registry: Registry, seen: dict, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.is_set():
            try:
                dead = registry.dead()
            except RedisRefusesWrites as e:
                seen.setdefault("refused", []).append(e)
                continue
            for r in dead:
                seen.setdefault("dead", set()).add(r)
            time.sleep(0.05)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("refusal", ["maxmemory", "replica"])
def test_writes_refused_for_a_while_kill_no_rank_and_lose_no_command(tmp_path, redis_binary, registration, refusal):
    cfg = _cfg(redis_binary, wait_s=20.0)
    with RedisServer(cfg, tmp_path) as srv:
        admin = connect(srv.endpoint_file, "admin", cfg)
        job = f"refuse-{refusal}"
        ranks = Ranks(srv, cfg, job, registration)
        coord = connect(srv.endpoint_file, "coord", cfg)
        registry, bus = Registry(coord, job, cfg), CommandBus(coord, job, cfg)
        watched, stop = {}, threading.Event()
        try:
            time.sleep(0.5)
            assert sorted(registry.live()) == RANKS
            watcher = _watch_deaths(Registry(connect(srv.endpoint_file, "watch", cfg), job, cfg), watched, stop)
            refused_for = 3.0  # 7.5 dead-rank deadlines
            if refusal == "maxmemory":
                admin.config_set("maxmemory", 1)
            else:
                admin.replicaof("127.0.0.1", 1)  # nothing listens there: it stays a read-only replica
            with pytest.raises(redis.RedisError):
                connect(srv.endpoint_file, "probe", cfg.model_copy(update={"write_wait_s": 0})).set("x", 1)
            silent = {}

            def restore():
                now = float(".".join(str(x) for x in admin.time()))
                silent.update({int(r): now - t for r, t in admin.zrange(f"dr:{job}:live", 0, -1, withscores=True)})
                if refusal == "maxmemory":
                    admin.config_set("maxmemory", 0)
                else:
                    admin.replicaof("NO", "ONE")

            timer = threading.Timer(refused_for, restore)
            t0 = time.monotonic()
            timer.start()
            cmd = bus.send(CommandKind.PING, RANKS, {})  # waits while writes are refused, then goes through
            waited = time.monotonic() - t0
            res = bus.await_acks(cmd.command_id, RANKS, timeout=15)
            assert waited >= refused_for - 0.5, f"the send did not wait for Redis ({waited:.2f} s)"
            assert res.missing == [] and all(a.ok for a in res.acks.values())
            assert all(ranks.applied[r] == [cmd.command_id] for r in RANKS)
            time.sleep(4 * cfg.dead_after_s)  # the ranks beat again; nobody turned dead after the refusal either
            stop.set()
            watcher.join(timeout=30)
            assert "dead" not in watched, f"ranks {watched.get('dead')} reported dead because Redis refused writes"
            if refusal == "replica":
                # (at maxmemory Redis 6.2 and 7.0 let a plain heartbeat through: its first write, PEXPIRE, is not a
                # "denyoom" command, and memory is checked only before a script's first write; a heartbeat that
                # carries a role change starts with HSET and is refused)
                assert min(silent.values()) > 2 * cfg.dead_after_s, f"the heartbeats must really have been refused: {silent}"
            assert sorted(registry.live()) == RANKS and registry.dead() == {}
        finally:
            stop.set()
            ranks.close()
            admin.config_set("maxmemory", 0)
            admin.replicaof("NO", "ONE")


def test_writes_refused_past_the_bound_end_in_one_error_naming_the_cause(tmp_path, redis_binary):
    cfg = _cfg(redis_binary, wait_s=1.5)
    with RedisServer(cfg, tmp_path) as srv:
        admin = connect(srv.endpoint_file, "admin", cfg)
        coord = connect(srv.endpoint_file, "coord", cfg)
        bus = CommandBus(coord, "bound", cfg)
        admin.config_set("maxmemory", 1)
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisRefusesWrites) as e:
                bus.send(CommandKind.PING, [0], {})
            took = time.monotonic() - t0
            assert 1.5 <= took < 5, took
            assert e.value.cause == REFUSALS["OOM"] and "maxmemory" in str(e.value)
            admin.config_set("maxmemory", 0)
            admin.replicaof("127.0.0.1", 1)
            with pytest.raises(RedisRefusesWrites, match="read-only replica"):
                bus.send(CommandKind.PING, [0], {})
        finally:
            admin.config_set("maxmemory", 0)
            admin.replicaof("NO", "ONE")
