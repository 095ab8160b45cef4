"""One supervisor per run's redis-server: a coordinator whose server a newer one adopted (a second ``--resume`` while
it hung) leaves that server to the newer one.

- the newer coordinator (another process) adopts the server and, at its end, shuts it down: the older one's watchdog
  does not bring it back (it would serve a finished run again, and the older coordinator would log a crash);
- the newer one's server crashes: only the newer one's watchdog restarts it (never two watchdogs on one port);
- the older one can say who took over, from the supervisor record, with the server gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer, pid_alive

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

ADOPT = """
import sys, time
from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer
srv = RedisServer(RedisConfig.model_validate_json(sys.argv[1]), sys.argv[2], supervise=True, owner_stopping=lambda: False,
                  supervisor={"how": "resume"})
srv.start()
print("adopted" if srv.adopted_pid else "spawned", srv.adopted_pid or srv.proc.pid, flush=True)
if sys.argv[3] == "stop":
    srv.stop()
else:
    sys.stdin.readline()  # supervise until told to end
    srv.stop()
"""


def _cfg(redis_binary: str) -> RedisConfig:
    return RedisConfig(server_binary=redis_binary, restart_backoff_s=0.1, connect_timeout_s=0.5, socket_timeout_s=2.0)


def _newer(cfg: RedisConfig, run_dir, how: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ADOPT, cfg.model_dump_json(), str(run_dir), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_server_adopted_and_shut_down_by_a_newer_coordinator_is_not_restarted_by_the_older(redis_binary, tmp_path):
    cfg = _cfg(redis_binary)
    old = RedisServer(cfg, tmp_path, supervise=True, owner_stopping=lambda: False, supervisor={"how": "start"})
    old.start()
    try:
        pid = old.proc.pid
        assert old.superseded_by() is None
        newer = _newer(cfg, tmp_path, "stop")
        out, _ = newer.communicate(timeout=60)
        assert newer.returncode == 0 and out.split() == ["adopted", str(pid)], out
        deadline = time.monotonic() + 5  # longer than the owner-stop grace and the first restart's backoff
        while time.monotonic() < deadline:
            assert old.restarts == 0, "the older coordinator's watchdog restarted a server another one shut down"
            time.sleep(0.1)
        assert not pid_alive(pid) and old.failure is None
        took = old.superseded_by()
        assert took is not None and took["how"] == "resume" and took["pid"] == newer.pid, took
        with pytest.raises(Exception):
            old.client().ping()  # nobody serves the run any more
    finally:
        old.stop()


def test_a_crash_after_the_handover_is_restarted_by_the_newer_coordinator_only(redis_binary, tmp_path):
    cfg = _cfg(redis_binary)
    old = RedisServer(cfg, tmp_path, supervise=True, owner_stopping=lambda: False, supervisor={"how": "start"})
    old.start()
    newer = None
    try:
        pid = old.proc.pid
        newer = _newer(cfg, tmp_path, "stay")
        assert newer.stdout.readline().split() == ["adopted", str(pid)]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the newer one's watchdog brings it back on the same port
            try:
                if old.client().ping():
                    break
            except Exception:  # noqa: BLE001 - still down
                time.sleep(0.1)
        assert old.client().ping()
        time.sleep(1.0)
        assert old.restarts == 0 and old.proc is None, "two watchdogs restarted one server"
        assert json.loads((tmp_path / "redis" / "supervisor.json").read_text())["pid"] == newer.pid
    finally:
        if newer is not None:
            newer.communicate("\n", timeout=60)
        old.stop()
