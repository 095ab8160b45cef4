"""Launch fencing (issue 15, item 1), against a real redis-server and real rank processes.

A registration is bound to the launch that started its process. A process of an earlier launch, or one that asks
for a rank that a live process of the current launch holds, is refused at registration (one Lua script), told why,
and exits on its own; the live rank keeps its registration and incarnation. A new launch frees the slots of the
ranks lost in the earlier one without letting those old processes back in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynaresize.control.registry import Beat, Heartbeater, Registry, RegistrationRefused
from dynaresize.control.server import RedisServer
from dynaresize.events import read_events

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


def test_a_live_rank_of_the_current_launch_keeps_its_slot(client, cfg, job_id, registration):
    reg = Registry(client(), job_id, cfg)
    reg.begin_launch(1, world=2)
    live = reg.register(registration(job_id, 0, launch=1, pid=111))
    with pytest.raises(RegistrationRefused) as e:
        reg.register(registration(job_id, 0, launch=1, pid=222))
    assert "a live process of the current launch holds the rank (pid 111 on testhost" in e.value.reason
    assert "pid 222" in e.value.reason and "this process exits" in e.value.reason
    assert reg.heartbeat(0, live.incarnation) is Beat.OK, "the live rank must be untouched"
    assert reg.live()[0].pid == 111 and reg.live()[0].incarnation == live.incarnation


def test_a_retried_registration_recognises_itself(client, cfg, job_id, registration):
    reg = Registry(client(), job_id, cfg)
    reg.begin_launch(1, world=1)
    mine = registration(job_id, 0, launch=1)
    first = reg.register(mine)
    again = reg.register(mine)  # what redis-py's retry after a lost reply does: same process token
    assert again.incarnation == first.incarnation and reg.heartbeat(0, first.incarnation) is Beat.OK


def test_an_earlier_launch_is_refused_and_a_new_launch_does_not_readmit_the_fenced(client, cfg, job_id, registration):
    reg = Registry(client(), job_id, cfg)
    reg.begin_launch(1, world=2)
    a = reg.register(registration(job_id, 0, launch=1))
    reg.register(registration(job_id, 1, launch=1))
    reg.fence(1)
    with pytest.raises(RegistrationRefused, match="declared this rank lost"):
        reg.register(registration(job_id, 1, launch=1))
    assert reg.begin_launch(2, world=2) == 2
    assert reg.begin_launch(1, world=2) == 2, "a launch number never goes down"
    assert reg.heartbeat(0, a.incarnation) is Beat.LOST  # the old process is told, then refused when it re-registers
    for r in (0, 1):  # the fenced rank's old process, and a live one of launch 1: both over
        with pytest.raises(RegistrationRefused, match="belongs to launch 1, an earlier launch of the ranks .the job is at launch 2"):
            reg.register(registration(job_id, r, launch=1))
    with pytest.raises(RegistrationRefused, match="launch 3 was not started by the coordinator"):
        reg.register(registration(job_id, 0, launch=3))
    new = reg.register(registration(job_id, 1, launch=2))  # the new launch's process takes the freed slot
    assert new.launch == 2 and sorted(reg.live()) == [1]


def test_the_heartbeater_of_an_earlier_launch_gives_up_with_the_reason(client, cfg, job_id, registration, tmp_path):
    from dynaresize.events import EventLog

    coord = Registry(client("coord"), job_id, cfg)
    coord.begin_launch(1, world=1)
    events = EventLog(tmp_path / "events.jsonl")
    hb = Heartbeater(Registry(client("old"), job_id, cfg), registration(job_id, 0, launch=1), events=events)
    hb.start()
    try:
        coord.begin_launch(2, world=1)
        deadline = time.monotonic() + 5
        while not hb.superseded and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hb.superseded and "earlier launch" in (hb.refused or "")
    finally:
        hb.stop()
    events.close()
    assert any(e.get("what") == "superseded" and "earlier launch" in e["reason"] for e in read_events(tmp_path / "events.jsonl"))


# -- real rank processes ------------------------------------------------------------------------------------------


def _run_dir(tmp_path: Path, redis_binary: str, job_id: str, launch: int) -> tuple[Path, RedisServer]:
    run = tmp_path / "run"
    run.mkdir()
    cfg = (REPO / "tests/fixtures/real_cpu_run/config.yaml").read_text()
    (run / "config.yaml").write_text(cfg)
    (run / "launch.json").write_text(json.dumps({"job_id": job_id, "model_dir": str(tmp_path / "no-model"), "world": 2,
                                                 "n_train": 1, "version": 0, "checkpoint": None, "incarnation": launch,
                                                 "master_port": 1}))
    from dynaresize.config.loader import load_config

    rcfg = load_config(run / "config.yaml").redis.model_copy(update={"server_binary": redis_binary})
    srv = RedisServer(rcfg, run)
    srv.start()
    return run, srv


def _rank_process(run: Path, rank: int, job_id: str, launch: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    own = ["--launch", str(launch)] if launch is not None else []
    return subprocess.Popen([sys.executable, "-m", "dynaresize.worker.main", "--run-dir", str(run), "--rank", str(rank),
                             "--world", "2", "--master-port", "1", "--job-id", job_id, *own],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"the refused rank process did not exit within {timeout} s; stderr: {err[-2000:]}")
    return p.returncode, err


def test_real_rank_processes_of_an_earlier_launch_or_a_held_rank_exit_at_once(tmp_path, redis_binary, job_id, registration):
    from dynaresize.worker.main import REFUSED_EXIT

    run, srv = _run_dir(tmp_path, redis_binary, job_id, launch=2)
    try:
        cfg = srv.cfg
        coord = Registry(srv.client("coord"), job_id, cfg)
        coord.begin_launch(2, world=2)
        holder = Heartbeater(Registry(srv.client("holder"), job_id, cfg), registration(job_id, 0, launch=2, pid=4242))
        live = holder.start()  # the live rank 0 of launch 2
        try:
            p = _rank_process(run, 0, job_id)  # started by hand with the current launch file: rank 0 is held
            code, err = _finish(p, 60)
            assert code == REFUSED_EXIT, err[-2000:]
            assert "a live process of the current launch holds the rank (pid 4242 on testhost" in err
            assert "Traceback" not in err
            assert coord.live()[0].incarnation == live.incarnation and not holder.superseded

            coord.begin_launch(3, world=1)  # launch 3 starts (rank 1's slot is not part of it in this test)
            p = _rank_process(run, 1, job_id)  # a process that still reads launch 2's file
            code, err = _finish(p, 60)
            assert code == REFUSED_EXIT and "belongs to launch 2, an earlier launch" in err and "Traceback" not in err

            # a slow process of launch 2 that reads the launch file only after launch 3 rewrote it: it registers
            # as what it is (the launcher passes --launch), never as launch 3
            (run / "launch.json").write_text((run / "launch.json").read_text().replace('"incarnation": 2', '"incarnation": 3'))
            p = _rank_process(run, 1, job_id, launch=2)
            code, err = _finish(p, 60)
            assert code == REFUSED_EXIT and "launch 2) refused: it belongs to launch 2, an earlier launch" in err, err[-2000:]
        finally:
            holder.stop()
        refused = [e for e in read_events(run / "events.jsonl") if e.get("what") == "refused"]
        assert len(refused) == 3
    finally:
        srv.stop()
