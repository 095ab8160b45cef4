"""The local ranks' pre-imported parent (dynaresize.job.zygote): each child runs its module as __main__ in its own
session with its own log, its exit status (or signal) is reported, and the parent leaves no child unreaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dynaresize.control.server import pid_alive
from dynaresize.job.launcher import worker_env


def _start(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynaresize.job.zygote", "--module", "tests.support.zygote_child", "--run-dir", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "zygote.log", "ab"),
        env=worker_env("cpu"), cwd=Path(__file__).parents[2],
    )


def _ask(z: subprocess.Popen, rank: int, argv: list[str], log: Path) -> None:
    z.stdin.write((json.dumps({"rank": rank, "argv": argv, "log": str(log)}) + "\n").encode())
    z.stdin.flush()


def _read(z: subprocess.Popen) -> dict:
    return json.loads(z.stdout.readline())


def test_children_run_their_module_in_their_own_session_and_their_exits_are_reported(tmp_path):
    z = _start(tmp_path)
    try:
        assert _read(z) == {"ready": 1}  # one thread when it forks
        _ask(z, 0, ["--code", "3"], tmp_path / "r0.log")
        _ask(z, 1, ["--sleep", "60"], tmp_path / "r1.log")
        _ask(z, 2, ["--raise"], tmp_path / "r2.log")
        z.stdin.write(b"not json\n")
        z.stdin.flush()
        # the three spawns and the error come in order; a quick child's exit may come among them
        msgs, exits = [], {}
        deadline = time.monotonic() + 30
        while (len(msgs) < 4 or set(exits) != {0, 2}) and time.monotonic() < deadline:
            m = _read(z)
            if "exited" in m:
                exits[m["exited"]] = m["code"]
            else:
                msgs.append(m)
        pids = {m["spawned"]: m["pid"] for m in msgs if "spawned" in m}
        assert set(pids) == {0, 1, 2}
        assert [m["error"][:17] for m in msgs if "error" in m] == ["bad spawn request"]
        assert exits == {0: 3, 2: 1}
        out0 = json.loads((tmp_path / "r0.log").read_text().splitlines()[0])
        assert out0["pid"] == pids[0] and out0["sid"] == pids[0]  # a session leader: killpg(pid) reaches it
        assert out0["argv"] == ["--code", "3"] and out0["torch_loaded"]  # the imports came from the parent
        assert open(f"/proc/{pids[1]}/comm").read().strip() == "dynaresize-r1"
        assert open(f"/proc/{z.pid}/comm").read().strip() == "dynaresize-zyg"
        assert "RuntimeError: boom from the child" in (tmp_path / "r2.log").read_text()
        os.killpg(pids[1], signal.SIGKILL)
        m = _read(z)
        assert m == {"exited": 1, "pid": pids[1], "code": -9}
        z.stdin.close()
        assert z.wait(timeout=10) == 0
    finally:
        if z.poll() is None:
            z.kill()


def test_end_of_input_waits_for_the_children_and_reaps_them(tmp_path):
    z = _start(tmp_path)
    try:
        assert "ready" in _read(z)
        _ask(z, 0, ["--sleep", "1.5"], tmp_path / "r0.log")
        pid = _read(z)["pid"]
        z.stdin.close()  # the launcher is gone: the zygote stays until its child has exited, then reaps it
        time.sleep(0.5)
        assert z.poll() is None and pid_alive(pid)
        assert _read(z) == {"exited": 0, "pid": pid, "code": 0}
        assert z.wait(timeout=10) == 0
        assert not pid_alive(pid)  # reaped, not a zombie
    finally:
        if z.poll() is None:
            z.kill()


def test_a_relaunch_never_sees_the_previous_launchs_exits_and_stop_ends_its_ranks(tmp_path, monkeypatch):
    from dynaresize.job.launcher import LocalLauncher

    monkeypatch.chdir(Path(__file__).parents[2])
    launcher = LocalLauncher(tmp_path, 2, "job", module="tests.support.zygote_child")
    monkeypatch.setenv("ZYGOTE_CHILD_SLEEP", "0")
    launcher.start()
    deadline = time.monotonic() + 60
    while launcher.dead() != {0: 0, 1: 0} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launcher.dead() == {0: 0, 1: 0}
    launcher.stop()
    monkeypatch.setenv("ZYGOTE_CHILD_SLEEP", "60")
    launcher.start()  # the restart: a new zygote, a new record
    deadline = time.monotonic() + 60
    while len(launcher._launch.pids) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = dict(launcher._launch.pids)
    assert len(pids) == 2 and launcher.dead() == {}  # the first launch's exits are not this one's
    launcher.stop(grace_s=0.5)  # still running: terminated
    assert not any(pid_alive(p) for p in pids.values())
    assert set(launcher.dead()) == {0, 1}
