"""The run's redis-server during an operator's stop (SIGTERM/SIGINT to every process of a local job at once).

- started the way the coordinator starts it (``dynaresize.job.bootstrap.shielded``: both signals blocked meanwhile), the
  server and the one its watchdog starts again inherit them blocked: the operator's signal leaves it serving;
- a clean shutdown (exit code 0: it took a SIGTERM) while the owner is stopping is not a crash: the watchdog does
  not restart it and ``failure`` says why; the same exit while the owner is not stopping is restarted as before.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]


def _cfg(redis_binary: str) -> RedisConfig:
    return RedisConfig(server_binary=redis_binary, restart_backoff_s=0.1, connect_timeout_s=0.5, socket_timeout_s=2.0)


def _exit_code(srv: RedisServer, timeout: float = 10) -> int | None:
    proc = srv.proc
    try:
        return proc.wait(timeout=timeout)
    except Exception:  # noqa: BLE001
        return None


def _blocked(pid: int) -> set[int]:
    line = next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigBlk:"))
    mask = int(line.split()[1], 16)
    return {s for s in (signal.SIGTERM, signal.SIGINT) if mask & (1 << (s - 1))}


def test_a_clean_shutdown_during_the_owners_stop_is_not_restarted(redis_binary, tmp_path):
    stopping = {"now": False}
    srv = RedisServer(_cfg(redis_binary), tmp_path, supervise=True, owner_stopping=lambda: stopping["now"])
    srv.start()
    try:
        pid = srv.proc.pid
        stopping["now"] = True  # the operator's signal reached the coordinator too
        os.kill(pid, signal.SIGTERM)
        assert _exit_code(srv) == 0
        time.sleep(1.0)
        assert srv.restarts == 0 and (srv.proc is None or srv.proc.pid == pid), "restarted a server that was shut down"
        assert "shut down cleanly (exit code 0" in (srv.failure or "") and "not restarted" in srv.failure
    finally:
        srv.stop()


def test_a_clean_exit_while_the_owner_goes_on_is_restarted_as_before(redis_binary, tmp_path):
    srv = RedisServer(_cfg(redis_binary), tmp_path, supervise=True, owner_stopping=lambda: False)
    srv.start()
    try:
        old = srv.proc.pid
        os.kill(old, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while srv.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.restarts == 1 and srv.proc.pid != old and srv.failure is None
        assert srv.client().ping()
    finally:
        srv.stop()


def test_the_coordinators_server_keeps_serving_through_the_operators_signal(redis_binary, tmp_path):
    from dynaresize.job.bootstrap import shielded

    srv = RedisServer(_cfg(redis_binary), tmp_path, supervise=True, owner_stopping=lambda: False)
    with shielded(srv):
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, ())  # only meanwhile
        pid = srv.proc.pid
        assert _blocked(pid) == {signal.SIGTERM, signal.SIGINT}
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert srv.proc.poll() is None and srv.client().ping()
        srv.kill()  # a real crash: the watchdog's new server has them blocked too
        deadline = time.monotonic() + 20
        while (srv.restarts == 0 or srv.proc is None) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.restarts == 1 and _blocked(srv.proc.pid) == {signal.SIGTERM, signal.SIGINT}
    assert srv.proc is None or srv.proc.poll() is not None  # SHUTDOWN at the end: gone
