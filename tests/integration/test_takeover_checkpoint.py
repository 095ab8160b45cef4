"""A coordinator taking over (``--resume``) while the old one hangs in the middle of its checkpoint.

Real processes: the old coordinator is SIGSTOPped while it waits for the ranks' ``stage_state`` acks (rank 3
stops itself in the middle of staging, through the fault matrix's test hook, and is continued once the old
coordinator hangs, so it finishes writing into the old coordinator's directory).

- kept: the new coordinator neither deletes nor reuses the old one's checkpoint directory (byte-identical while
  that coordinator lives): it leaves it in place on resume and writes its own checkpoint under a new name.
- removed: the old directory is gone before the takeover; the new coordinator resends the same ``stage_state``
  (same command id), the ranks replay their stored acks, and the coordinator does not trust them: the files they
  name are gone, so it says so and the ranks stage again.

Either way the old coordinator, continued, is fenced off; no step is trained twice or lost.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from test_faults import assert_nothing_lost, controls, find_run_dir, n_batches, pid_of, wait_for  # noqa: E402
from test_job import SEED, run  # noqa: E402

pytestmark = pytest.mark.integration


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def state_of(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("old_dir", ["kept", "removed"])
def test_a_takeover_during_the_old_coordinators_checkpoint_neither_deletes_it_nor_trusts_replayed_acks(
        tmp_path, model_cache, old_dir):
    steps = 6
    faults = {"DYNARESIZE_TEST_STOP_AT": "3:stage_state.weights@step-4", "DYNARESIZE_TEST_KILL_ONCE": str(tmp_path / "markers")}
    # 60 s of heartbeat deadline: the hung rank is not declared lost meanwhile
    a = run(tmp_path / "runs", model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false",
            "run.checkpoint_every=2", "redis.dead_after_heartbeats=120", "pipeline.schedule=barrier",
            wait=False, faults=faults)
    pids: list[int] = [a.pid]
    b = None
    try:
        rd = wait_for(lambda: find_run_dir(tmp_path / "runs"), "the ranks to start", a)
        pids += [pid_of(rd, r) for r in range(4)]
        wait_for(lambda: (tmp_path / "markers" / "rank3-stage_state.weights").exists() and state_of(pids[4]) == "T",
                 "rank 3 to hang in the middle of staging step-4", a)
        os.kill(a.pid, signal.SIGSTOP)  # the old coordinator hangs while it waits for the acks
        os.kill(pids[4], signal.SIGCONT)  # rank 3 finishes writing into the old coordinator's directory
        old = rd / "checkpoints" / "step-4"
        assert not (old / "coordinator.json").exists()
        time.sleep(3)
        before = tree(old)
        assert "owner.json" in before and "rank3-weights/manifest.json" in before
        if old_dir == "removed":
            shutil.rmtree(old)
        b = run(tmp_path / "runs", model_cache, resume=rd, wait=False)
        pids.append(b.pid)
        mine = "step-4.2" if old_dir == "kept" else "step-4"
        wait_for(lambda: n_batches(rd) >= 5 and (rd / "checkpoints" / mine / "coordinator.json").exists(),
                 "the new coordinator's checkpoint of step 4", b)
        if old_dir == "kept":
            assert tree(old) == before, "the old coordinator's checkpoint was touched while it may still write it"
            # said at each reading of the checkpoints: the resume's, and its catch-up once it holds the epoch
            skips = [e for e in controls(rd, "checkpoint_skipped") if "step-4 skipped" in e["reason"]]
            assert len(skips) == 1, [e["reason"] for e in skips]
            assert f"left in place: coordinator pid {a.pid} on " in skips[0]["reason"], skips[0]
        else:
            failed = controls(rd, "checkpoint_failed")
            assert failed and all("stage_state ack was replayed" in e["reason"] and "not trusted" in e["reason"]
                                  and "the ranks stage again" in e["reason"] for e in failed), failed
            assert {e["rank"] for e in failed} == {0, 1, 2, 3}
    finally:
        os.kill(a.pid, signal.SIGCONT)
    out_a, _ = a.communicate(timeout=120)
    assert a.returncode == 3, out_a[-3000:]
    out_b, _ = b.communicate(timeout=600)
    assert b.returncode == 0, out_b[-4000:]
    assert "Traceback" not in out_b
    assert_nothing_lost(rd, steps)
    assert [pid_of(rd, r) for r in range(4)] == pids[1:5], "the same rank processes: nothing restarted"
    assert len(controls(rd, "attach")) == 1 and not controls(rd, "restart")
