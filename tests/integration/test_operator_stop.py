"""An operator's stop of a local run: SIGTERM (or SIGINT) sent to EVERY process of the job at once, as ``pkill``
or a ``kill`` of the whole process list does. Real processes throughout: the coordinator, its redis-server, 4 worker
ranks with DeepSpeed on CPU.

The ranks defer the signal until the coordinator's shutdown, the redis-server (started with both signals blocked)
keeps serving, the step in flight finishes and every rank is checkpointed; nothing is restarted while the run
stops, the exit says why it stopped, and ``--resume`` then trains no step twice and loses none.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.procs import children
from test_job import B, G, SEED, batches, run, wait_for_batches  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = pytest.mark.integration


def job_processes(root: int) -> dict[int, str]:
    """The process ``root`` and all its descendants, with their command lines."""
    kids, out, todo = children(), {}, [root]
    while todo:
        pid = todo.pop()
        try:
            out[pid] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo += kids.get(pid, [])
    return out


def _comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def started():
    """Processes a test saw; whatever of them a failed test left running is killed, by pid."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def controls(run_dir: Path, what: str) -> list[dict]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("type") == "control" and e.get("what") == what:
            out.append(e)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_every_process_checkpoints_cleanly_and_the_resume_trains_no_step_twice(
        tmp_path, model_cache, started, sig):
    steps = 6
    p = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false", wait=False)
    started.add(p.pid)
    rd = wait_for_batches(tmp_path, p, poll_s=0.1)
    procs = job_processes(p.pid)
    started.update(procs)
    ranks = [pid for pid in procs if _comm(pid).startswith("dynaresize-r")]  # forked by the launcher's zygote
    servers = [pid for pid, cmd in procs.items() if "redis-server" in cmd]
    assert len(ranks) == 4 and len(servers) == 1, procs
    for pid in procs:  # every process of the job, at once
        os.kill(pid, sig)
    out, _ = p.communicate(timeout=300)
    name = signal.Signals(sig).name
    assert p.returncode == 130, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    state = json.loads((rd / "checkpoints" / "coordinator.json").read_text())
    done = len(batches(rd))
    assert 2 <= state["step"] == done < steps, (state, done)
    tag = Path(state["checkpoint"]).name
    assert f"stopped: {name} (an operator's stop) " in out and f"checkpoint {tag} written" in out, out[-3000:]
    assert f"resume with: dynaresize run --resume {rd}" in out
    [stop] = controls(rd, "operator_stop")
    assert f"stopped before step {done}, checkpoint {tag} written" in stop["reason"], stop
    assert f"a resume continues at step {done} and trains no step twice" in stop["reason"], stop
    assert not controls(rd, "restart") and not controls(rd, "redis_restarted"), "nothing restarted while stopping"
    for r in range(4):
        log = (rd / "logs" / f"rank{r}.log").read_text(errors="replace")
        assert f"{name}: this rank keeps serving until the coordinator's shutdown" in log, log[-2000:]
    gone = time.monotonic() + 30
    while any(alive(pid) for pid in procs) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not [pid for pid in procs if alive(pid)], "a process of the job outlived the stop"

    run(tmp_path, model_cache, resume=rd)
    got = batches(rd)
    assert [b["step"] for b in got] == list(range(steps)), "every step once: none trained twice, none lost"
    for b in got:
        assert sorted(b["keys"]) == sorted(f"{b['step']}.{q}.{i}" for q in range(B) for i in range(G))
    assert not controls(rd, "rewind"), "the resume started from the stop's checkpoint, not an older one"
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps


def test_a_second_signal_abandons_the_stops_checkpoint_cleanly(tmp_path, model_cache, started):
    """The second SIGTERM arrives while the stop's checkpoint waits for a rank (rank 3 hangs in the middle of
    staging, through the fault matrix's test hook): the checkpoint is abandoned (logged, its directory removed once
    the ranks have exited), the ranks are still shut down, nothing is restarted, and the resume says which steps
    it trains again and loses none."""
    steps = 5
    faults = {"DYNARESIZE_TEST_STOP_AT": ",".join(f"3:stage_state.weights@step-{k}" for k in range(1, steps)),
              "DYNARESIZE_TEST_KILL_ONCE": str(tmp_path / "markers")}
    # no periodic checkpoint: the stop's is the only one; 60 s of heartbeat deadline for the hung rank
    p = run(tmp_path / "runs", model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false",
            "redis.dead_after_heartbeats=120", wait=False, faults=faults)
    started.add(p.pid)
    deadline = time.monotonic() + 400
    rd = None
    while time.monotonic() < deadline and rd is None:
        dirs = [d for d in (tmp_path / "runs").iterdir()] if (tmp_path / "runs").exists() else []
        if dirs and (dirs[0] / "batches.jsonl").exists() and (dirs[0] / "ranks.json").exists():
            rd = dirs[0]
        assert p.poll() is None, p.stdout.read()[-4000:]
        time.sleep(0.1)
    assert rd is not None
    procs = job_processes(p.pid)
    started.update(procs)
    rank3 = int(json.loads((rd / "ranks.json").read_text())["3"]["pid"])
    os.kill(p.pid, signal.SIGTERM)  # the first: finish the step, then checkpoint
    marker = tmp_path / "markers" / "rank3-stage_state.weights"
    while not (marker.exists() and open(f"/proc/{rank3}/stat").read().rsplit(")", 1)[1].split()[0] == "T"):
        assert p.poll() is None and time.monotonic() < deadline, "rank 3 never hung in the stop's checkpoint"
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGTERM)  # the second, during the checkpoint
    time.sleep(1)
    os.kill(rank3, signal.SIGCONT)  # it finishes what it was staging, then takes the shutdown
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    [ab] = controls(rd, "checkpoint_abandoned")
    assert "abandoned (a second stop signal cut it short); resume point stays none" in ab["reason"], ab
    tag = ab["reason"].split()[1]
    assert not (rd / "checkpoints" / tag).exists(), "the abandoned checkpoint's directory is removed"
    assert "stopped: SIGTERM (an operator's stop)" in out, out[-3000:]
    assert "no checkpoint was written yet: a resume starts from step 0 and trains" in out, out[-3000:]
    assert not controls(rd, "restart") and not controls(rd, "redis_restarted")
    gone = time.monotonic() + 30
    while any(alive(pid) for pid in procs) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not [pid for pid in procs if alive(pid)], "a process of the job outlived the stop"
    trained = len(batches(rd))

    run(tmp_path / "runs", model_cache, resume=rd)
    got = batches(rd)
    assert [b["step"] for b in got] == list(range(steps)), "every step once in the record: none lost"
    [rw] = controls(rd, "rewind")
    assert f"steps 0..{trained - 1} ran after the last checkpoint" in rw["reason"], rw
