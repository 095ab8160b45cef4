"""The fault matrix, rows 1-4, on real runs: 4 worker processes, a real redis-server, DeepSpeed on CPU, GRPO.

"Nothing lost" is checked the same way in every test: ``batches.jsonl`` holds every step exactly once, each with
the full batch (every sample key of the step, once), and samples only from policy versions within the staleness
bound.

- A rollout rank killed (SIGKILL) while it holds claimed samples: they go back to the queue, the step completes,
  the rank is fenced off and removed, and the policy plans over the ranks left. Then a second rollout rank hangs
  (SIGSTOP): missed heartbeats make it lost too, a trainer moves to rollout since none is left, and when the hung
  process is continued it is refused (its heartbeat says superseded, its results are rejected) and exits.
- A trainer killed in the middle of a switch, and rank 0 killed in the middle of staging a checkpoint: every rank
  restarts from the last checkpoint, and the run trains the same samples from the same versions with the same
  losses as a run without faults.
- The coordinator killed: a new one takes over the live ranks (same processes, same state) from the journal in
  Redis and the run directory; an old coordinator that comes back is fenced off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_job import B, G, SEED, batches, run, run_dir_of  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

from dynaresize.rundir import job_id

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def no_strays(tmp_path):
    """Whatever a failed test left running (coordinator, ranks, redis-server of its run dir) is killed."""
    yield
    subprocess.run(["pkill", "-CONT", "-f", str(tmp_path)], check=False)
    subprocess.run(["pkill", "-KILL", "-f", str(tmp_path)], check=False)


def n_batches(run_dir: Path) -> int:
    try:
        return len((run_dir / "batches.jsonl").read_text().splitlines())
    except OSError:
        return 0


def events(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def controls(run_dir: Path, what: str) -> list[dict]:
    return [e for e in events(run_dir) if e.get("type") == "control" and e.get("what") == what]


def assert_nothing_lost(run_dir: Path, steps: int) -> list[dict]:
    got = batches(run_dir)
    assert [b["step"] for b in got] == list(range(steps)), "every step exactly once, in order"
    for b in got:
        assert sorted(b["keys"]) == sorted(f"{b['step']}.{p}.{i}" for p in range(B) for i in range(G)), b["step"]
        assert min(b["versions"]) >= b["step"] - 1, "staleness bound"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    return got


def wait_for(pred, what: str, p: subprocess.Popen, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if p.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {p.stdout.read()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def redis_of(run_dir: Path):
    from dynaresize.control.server import connect

    return connect(run_dir / "redis" / "redis.json", role="test")


def holding_claims(run_dir: Path, rank: int):
    """True while ``rank`` holds claimed, unfinished samples (it is generating them)."""
    try:
        r = redis_of(run_dir)
        keys = list(r.scan_iter(match=f"dr:{job_id(run_dir)}:wq:*:inflight:{rank}", count=100))
        return any(r.hlen(k) for k in keys)
    except Exception:  # noqa: BLE001 - Redis not up yet
        return False


def pid_of(run_dir: Path, rank: int) -> int | None:
    try:
        return int(json.loads((run_dir / "ranks.json").read_text())[str(rank)]["pid"])
    except (OSError, ValueError, KeyError):
        return None


def find_run_dir(tmp: Path):
    dirs = [d for d in tmp.iterdir() if d.is_dir()] if tmp.exists() else []
    return dirs[0] if dirs and (dirs[0] / "ranks.json").exists() else None


def test_lost_rollout_ranks_are_fenced_off_and_the_job_goes_on(tmp_path, model_cache):
    # enough steps that rank 2, the last rollout rank after rank 3's loss, is still generating when the test looks for
    # it (with 9 a loaded machine once saw the whole run end first: the test polls Redis at most every 50 ms)
    steps = 20
    p = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "cluster.initial_train=1", "policy.enabled=false",
            "rollout.pull_batch=2", wait=False)
    rd = wait_for(lambda: find_run_dir(tmp_path), "the ranks to start", p)
    # 1. SIGKILL rank 3 while it generates (it holds claimed samples)
    wait_for(lambda: n_batches(rd) >= 1 and holding_claims(rd, 3), "rank 3 generating", p)
    os.kill(pid_of(rd, 3), signal.SIGKILL)
    wait_for(lambda: controls(rd, "shrink"), "the shrink after rank 3", p)
    # 2. SIGSTOP rank 2 while it generates: it is alive but silent
    wait_for(lambda: holding_claims(rd, 2), "rank 2 generating", p)
    hung = pid_of(rd, 2)
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_for(lambda: len(controls(rd, "shrink")) >= 2, "the shrink after rank 2", p)
        stopped_at = n_batches(rd)
    finally:
        os.kill(hung, signal.SIGCONT)  # it comes back: it must be refused and leave
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    assert_nothing_lost(rd, steps)

    lost = controls(rd, "rank_lost")
    assert [e["rank"] for e in lost] == [3, 2]
    assert "process exited" in lost[0]["reason"] and "no heartbeat" in lost[1]["reason"]
    shrinks = controls(rd, "shrink")
    assert "3 of 4 ranks" in shrinks[0]["reason"] and "2 of 4 ranks" in shrinks[1]["reason"]
    # the policy re-planned over the ranks left: with 2 and 3 gone the only possible split is 1 trainer : 1 rollout
    assert "possible trainer counts [1, 2]" in shrinks[0]["reason"] and "possible trainer counts [1]" in shrinks[1]["reason"]
    state = json.loads((rd / "checkpoints" / "coordinator.json").read_text())
    assert state["lost"] == [2, 3] and state["n_train"] == 1
    summary = json.loads((rd / "summary.json").read_text())  # the split over the live ranks (before: "1:3")
    assert summary["final_split"] == "1:1" and "split now 1:1 " in out, out[-2000:]
    log2 = (rd / "logs" / "rank2.log").read_text(errors="replace")
    assert "superseded" in log2 or "declared lost" in log2, log2[-3000:]
    assert stopped_at < steps, "rank 2 was stopped before the run ended"


# the run's one switch (the forced split; on the core the batch it lands on is timing) and step 4's checkpoint
KILLS = "1:switch_role.offload,0:stage_state.weights@step-4"
# (faults.snapshot_every=0: the disk checkpoint's restart; the in-memory snapshot's is test_continuous_schedule.py's)
RESTART = [f"run.seed={SEED}", "run.checkpoint_every=2", "policy.enabled=false", "policy.forced_splits={3: 3}",
           "faults.snapshot_every=0"]


def test_ranks_killed_mid_switch_and_mid_staging_restart_from_the_checkpoint_with_the_same_training(tmp_path, model_cache):
    """FAULTS row 2 on the barrier schedule: a trainer killed in the middle of the run's switch (2 -> 3 trainers),
    rank 0 in the middle of staging the checkpoint of step 4; a trainer killed mid-chunk on the barrier-free schedule is
    test_continuous_schedule.py's."""
    steps = 6
    run(tmp_path / "ref", model_cache, f"run.steps={steps}", *RESTART, "pipeline.schedule=barrier")
    faults = {"DYNARESIZE_TEST_KILL_AT": KILLS, "DYNARESIZE_TEST_KILL_ONCE": str(tmp_path / "markers")}
    run(tmp_path / "faulty", model_cache, f"run.steps={steps}", *RESTART, "pipeline.schedule=barrier", faults=faults)
    assert sorted(os.listdir(tmp_path / "markers")) == ["rank0-stage_state.weights", "rank1-switch_role.offload"]
    rd, ref = run_dir_of(tmp_path / "faulty"), run_dir_of(tmp_path / "ref")
    got, want = assert_nothing_lost(rd, steps), batches(ref)
    restarts = controls(rd, "restart")
    assert len(restarts) == 2, restarts
    assert "switch_role" in restarts[0]["reason"] and "stage_state" in restarts[1]["reason"]
    assert all("checkpoint checkpoints/step-2 (step 2)" in r["reason"] for r in restarts)  # step-4's never completed
    for g, w in zip(got, want):  # the training a run without faults does (the split each batch trains on is timing)
        assert g["keys"] == w["keys"] and g["versions"] == w["versions"] and g["rewards"] == w["rewards"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-3, abs=1e-5), g["step"]
    for run_ in (got, want):
        n_train = [b["n_train"] for b in run_]
        assert n_train[0] == 2 and n_train[-1] == 3 and n_train == sorted(n_train), n_train  # one switch, 2 -> 3


def test_a_new_coordinator_takes_over_the_live_ranks_and_the_old_one_is_fenced_off(tmp_path, model_cache):
    steps = 8
    # a takeover of the live ranks on the barrier schedule (both schedules, two batches in flight: test_takeover_core.py)
    a = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false", "policy.forced_splits={4: 3}",
            "pipeline.schedule=barrier", wait=False)
    rd = wait_for(lambda: find_run_dir(tmp_path), "the ranks to start", a)
    wait_for(lambda: n_batches(rd) >= 3, "step 3", a)
    pids = {r: pid_of(rd, r) for r in range(4)}
    os.kill(a.pid, signal.SIGSTOP)  # the coordinator hangs (or its node is partitioned away); ranks and Redis live on
    try:
        b = run(tmp_path, model_cache, resume=rd, wait=False)
        wait_for(lambda: n_batches(rd) >= 6, "the new coordinator to run steps", b)
    finally:
        os.kill(a.pid, signal.SIGCONT)  # the old one comes back
    out_a, _ = a.communicate(timeout=120)
    assert a.returncode == 3, out_a[-3000:]
    assert "another coordinator took this run over with `dynaresize run --resume`" in out_a, out_a[-3000:]
    assert "Traceback" not in out_a
    out_b, _ = b.communicate(timeout=600)
    assert b.returncode == 0, out_b[-4000:]
    got = assert_nothing_lost(rd, steps)
    n_train = [g["n_train"] for g in got]  # the forced split after the takeover happened once (its batch is timing)
    assert n_train[:4] == [2] * 4 and n_train[-1] == 3 and n_train == sorted(n_train), n_train
    assert len([e for e in events(rd) if e.get("type") == "switch_start"]) == 1
    # the same rank processes all along: no restart, no second start-up, state kept
    assert {r: pid_of(rd, r) for r in range(4)} == pids
    for r in range(4):
        assert (rd / "logs" / f"rank{r}.log").read_text(errors="replace").count(" ready: ") == 1
    attach = controls(rd, "attach")
    assert len(attach) == 1 and "took over 4 live rank(s)" in attach[0]["reason"]
    assert controls(rd, "fenced"), "the old coordinator's refused send is in the log"
    ends = [e for e in events(rd) if e.get("type") == "run_end"]
    assert len(ends) == 1 and ends[0]["status"] == "completed", "the fenced coordinator wrote no run_end"


def test_a_killed_coordinator_is_replaced_and_its_ranks_outlive_it(tmp_path, model_cache):
    """SIGKILL of the coordinator: its redis-server dies with it (parent-death signal, no orphans); the ranks live
    on, retrying Redis. `--resume` brings Redis back on the same port from its append-only file (journal and
    registry included) and takes the ranks over; a command interrupted by the outage is waited out, not failed."""
    steps = 6
    a = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false",
            "pipeline.schedule=barrier", wait=False)  # a takeover of the live ranks
    rd = wait_for(lambda: find_run_dir(tmp_path), "the ranks to start", a)
    wait_for(lambda: n_batches(rd) >= 2, "step 2", a)
    pids = {r: pid_of(rd, r) for r in range(4)}
    os.killpg(a.pid, signal.SIGKILL)  # the coordinator's own session: ranks and Redis run in theirs
    a.communicate(timeout=60)
    run(tmp_path, model_cache, resume=rd)
    assert_nothing_lost(rd, steps)
    assert {r: pid_of(rd, r) for r in range(4)} == pids, "the same rank processes finished the run"
    assert len(controls(rd, "attach")) == 1
