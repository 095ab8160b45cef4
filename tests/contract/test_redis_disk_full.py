"""The run's redis-server on a full disk (issue 27): its directory on a real, small tmpfs (``tmpfs`` fixture: needs
root to mount; skips with the reason where it cannot), filled by a file until an append-only-file write fails.

With ``appendfsync always`` redis-server exits on the failed write ("Short write while writing to the AOF file",
"Can't recover from AOF write error"). The watchdog names the condition (the path, the space left), waits for space
(``redis.write_wait_s``, like a refused write) instead of restarting into the same failure or dying itself, and
brings the server back from its append-only file once the disk allows it; a client made with ``outage=`` waits
meanwhile, so the write that met the crash completes. When the disk stays full past the bound, the watchdog gives
up with one reason naming the disk (``failure``) and is not left dead with a traceback.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer, connect

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]


def fill(path, leave: int = 64 << 10):
    """A file that leaves about ``leave`` bytes free on the filesystem of ``path``."""
    st = os.statvfs(path)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    filler = path / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * size)
    return filler


def write_until_the_server_dies(srv: RedisServer, client) -> int:
    """SET 16 KiB values until a write fails (the server exited on its failed AOF write); returns the keys kept."""
    proc = srv.proc
    n = 0
    value = b"x" * (16 << 10)
    for i in range(1000):
        try:
            client.set(f"k{i}", value)
            n += 1
        except redis.RedisError:
            break
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is not None, "redis-server should have exited on the failed append-only-file write"
    return n


def test_a_full_disk_is_waited_out_and_redis_comes_back_from_its_aof(tmp_path, tmpfs, redis_binary):
    run = tmpfs(tmp_path / "run", 4 << 20)
    cfg = RedisConfig(server_binary=redis_binary, retries=2, socket_timeout_s=2.0, connect_timeout_s=0.5,
                      block_ms=100, write_wait_s=60)
    srv = RedisServer(cfg, run, supervise=True, on_restart=lambda why: restarted.append(why))
    restarted: list[str] = []
    srv.start()
    try:
        plain = connect(srv.endpoint_file, role="plain", cfg=cfg.model_copy(update={"write_wait_s": 0}))
        filler = fill(run)
        kept = write_until_the_server_dies(srv, plain)
        assert kept > 0
        deadline = time.monotonic() + 10
        while srv.waiting_for_disk is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = srv.waiting_for_disk
        assert text is not None, "the watchdog should wait for space, not restart into the same failure"
        assert "disk full (ENOSPC)" in text and str(srv.dir) in text and "free on its filesystem" in text, text
        assert srv.reviving.is_set() and srv.failure is None and srv._watchdog.is_alive()

        # a client of the coordinator's kind waits for the server meanwhile: its write completes once space is back
        waiting = connect(srv.endpoint_file, role="coordinator", cfg=cfg, outage=srv.reviving.is_set)
        done: list[object] = []
        t = threading.Thread(target=lambda: done.append(waiting.set("after", b"1")))
        t.start()
        time.sleep(1.5)
        assert not done, "no server to write to while the disk is full"
        filler.unlink()  # the operator frees space
        t.join(timeout=30)
        assert done == [True]
        deadline = time.monotonic() + 10  # the watchdog reports the restart once the server answers: maybe after the write
        while not restarted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(restarted) == 1 and "restarted on the same port" in restarted[0]
        assert srv.waiting_for_disk is None and srv.failure is None
        check = connect(srv.endpoint_file, role="check", cfg=cfg)
        assert check.exists(*[f"k{i}" for i in range(kept)]) == kept  # every acknowledged write survived
        assert check.get("after") == b"1"
    finally:
        srv.stop()


def test_a_disk_that_stays_full_ends_supervision_with_the_reason(tmp_path, tmpfs, redis_binary):
    run = tmpfs(tmp_path / "run", 4 << 20)
    cfg = RedisConfig(server_binary=redis_binary, retries=1, socket_timeout_s=2.0, connect_timeout_s=0.5,
                      block_ms=100, write_wait_s=2)
    srv = RedisServer(cfg, run, supervise=True)
    srv.start()
    try:
        plain = connect(srv.endpoint_file, role="plain", cfg=cfg.model_copy(update={"write_wait_s": 0}))
        fill(run)
        write_until_the_server_dies(srv, plain)
        deadline = time.monotonic() + 20
        while srv.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.failure is not None
        assert "stayed full" in srv.failure and "redis.write_wait_s" in srv.failure and "free on its filesystem" in srv.failure
        assert not srv.reviving.is_set()  # clients waiting on it stop waiting: the owner reads the failure
        with pytest.raises(Exception, match="stayed full"):
            srv.check()
    finally:
        srv.stop()
