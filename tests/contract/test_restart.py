"""A Redis restart in the middle of a command stream (append-only file): ranks re-register, nothing acked is lost."""

from __future__ import annotations

import threading
import time

import pytest

from dynaresize.control.commands import CommandBus, CommandReceiver
from dynaresize.control.config import RedisConfig
from dynaresize.control.registry import Heartbeater, Registry
from dynaresize.control.server import RedisServer, connect
from dynaresize.contract.protocol import CommandKind

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]

RANKS = [0, 1, 2]


def test_redis_restart_mid_stream_loses_nothing_acknowledged(tmp_path, redis_binary, registration):
    cfg = RedisConfig(server_binary=redis_binary, heartbeat_s=0.1, socket_timeout_s=2.0, connect_timeout_s=0.5,
                      block_ms=100, retries=2)
    job = "restart"
    srv = RedisServer(cfg, tmp_path)
    srv.start()
    stop = threading.Event()
    applied: dict[int, list[str]] = {r: [] for r in RANKS}
    hbs, threads = [], []
    try:
        for r in RANKS:
            hb = Heartbeater(Registry(connect(srv.endpoint_file, f"rank{r}", cfg), job, cfg), registration(job, r))
            hb.start()
            hbs.append(hb)
            recv = CommandReceiver(connect(srv.endpoint_file, f"rank{r}-cmd", cfg), job, r, cfg,
                                   incarnation=lambda hb=hb: hb.registration.incarnation)
            handler = lambda cmd, r=r: applied[r].append(cmd.command_id) or {"i": cmd.payload["i"]}  # noqa: E731
            t = threading.Thread(target=recv.run, args=(handler, stop.is_set, 0.1), daemon=True)
            t.start()
            threads.append(t)
        coord = connect(srv.endpoint_file, "coord", cfg)
        bus = CommandBus(coord, job, cfg)
        registry = Registry(coord, job, cfg)

        before = []
        for i in range(3):
            cmd, res = bus.request(CommandKind.SWITCH_ROLE, RANKS, {"i": i}, timeout=5)
            assert res.missing == [] and all(a.ok for a in res.acks.values())
            before.append(cmd)
        in_flight = [bus.send(CommandKind.PING, RANKS, {"i": i}) for i in (3, 4)]  # not awaited

        port = srv.port
        srv.stop()  # SHUTDOWN: the AOF is flushed; ranks see connection errors from now on
        time.sleep(3 * cfg.dead_after_s + 0.2)  # longer than the registration TTL: registrations expire
        srv.start()
        assert srv.port == port, "restarted on the same port (ranks keep their endpoint file)"

        deadline = time.monotonic() + 10
        while True:  # every rank notices it was lost and re-registers with a new incarnation
            live = registry.live()
            if sorted(live) == RANKS and all(reg.incarnation == 2 for reg in live.values()):
                break
            assert time.monotonic() < deadline, f"ranks did not re-register: {live}"
            time.sleep(0.05)

        for cmd in before:  # acknowledged before the restart: still there
            res = bus.await_acks(cmd.command_id, RANKS, timeout=0.5)
            assert res.missing == [] and all(a.ok and a.incarnation == 1 for a in res.acks.values())
        for cmd in in_flight:  # sent before the restart: delivered after it (ok, or 'interrupted', never twice)
            res = bus.await_acks(cmd.command_id, RANKS, timeout=5)
            assert res.missing == []
            assert all(a.ok or "interrupted" in (a.error or "") for a in res.acks.values())
        after, res = bus.request(CommandKind.PING, RANKS, {"i": 5}, timeout=5)  # the same coordinator epoch works
        assert res.missing == [] and all(a.ok and a.incarnation == 2 for a in res.acks.values())

        order = [c.command_id for c in before + in_flight] + [after.command_id]
        for r in RANKS:
            seen = applied[r]
            assert len(seen) == len(set(seen)), f"rank {r} applied a command twice: {seen}"
            assert seen == [c for c in order if c in seen], f"rank {r} applied out of order"
            assert seen[:3] == order[:3] and seen[-1] == order[-1]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        for hb in hbs:
            hb.stop()
        srv.stop()
