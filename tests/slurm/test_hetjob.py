"""The het job on a real Slurm (22.05, single host): submit through the submitit-based executor, both components
run, worker ranks register in the run's Redis with their Slurm identity, state via squeue/scontrol under the leader
id, scancel stops every component, requeue (scontrol and time-limit USR2) resumes the persisted counter, and no job
is left in squeue. Uses the probe entry (``slurm.entry=probe``), which exercises exactly the main job's hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynaresize.slurm.state import SlurmJobState

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def wait_until(pred, timeout_s: float, what: str, poll_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def in_squeue(job_id: str, all_states: bool = False) -> bool:
    """Whether ``squeue`` (as a user runs it: active jobs; ``all_states``: also finished ones not yet purged) lists it."""
    p = subprocess.run(["squeue", "-h", *(["-t", "all"] if all_states else []), "-j", job_id, "-o", "%i"], capture_output=True, text=True)
    return p.returncode == 0 and bool(p.stdout.strip())


def wait_ended(job_id: str, timeout_s: float) -> set[SlurmJobState]:
    """Wait until every component of the job has ended for good and return their final states (empty: the
    controller purged the record already). A job pending, running, completing (processes still being killed),
    requeued or held has not ended; its record stays listed in its final state for MinJobAge, which this does not
    wait for (test_both_components_run_and_ranks_register_with_slurm_identity checks that purge)."""
    got: set[SlurmJobState] = set()

    def ended() -> bool:
        p = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        if p.returncode != 0:
            return "Invalid job id" in p.stderr  # purged (MinJobAge); another error: look again
        states = {SlurmJobState.parse(s) for s in p.stdout.split()}
        if all(s.finished for s in states):
            got.update(states)
            return True
        return False

    wait_until(ended, timeout_s, f"job {job_id} to end for good")
    return got


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_both_components_run_and_ranks_register_with_slurm_identity(submit_probe) -> None:
    job, run_dir = submit_probe("slurm.probe_steps=4", "slurm.probe_step_s=0.1")
    seen = set()
    st = job.wait_for(lambda s: seen.add(s.state) or s.state.finished, timeout_s=60)
    assert st.state is SlurmJobState.COMPLETED, st.describe()
    assert SlurmJobState.RUNNING in seen
    assert [c.job_id for c in st.components] == [f"{job.job_id}+0", f"{job.job_id}+1"]
    coord = read_json(run_dir / "probe" / "coordinator-r0.json")["identity"]
    assert coord["het_group"] == 0 and coord["node"] == "cpu1" and coord["job_id"] == job.job_id
    ranks = read_json(run_dir / "probe" / "ranks-r0.json")["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert all(r["het_group"] == 1 and r["slurm_job_id"] == job.job_id for r in ranks)
    by_node = {(r["node"], r["local_id"]): r["gpu"] for r in ranks}
    assert by_node == {("gpu1", 0): "0", ("gpu1", 1): "1", ("gpu2", 0): "0", ("gpu2", 1): "1"}  # one GPU per rank
    assert read_json(run_dir / "probe" / "done.json")["step"] == 4
    assert not in_squeue(job.job_id)
    wait_until(lambda: not in_squeue(job.job_id, all_states=True), 45, "the controller to purge the job (MinJobAge)")
    assert job.job_state() is SlurmJobState.COMPLETED  # the final state seen is kept after the controller forgets the job
    from dynaresize.slurm.adapter import query_status

    assert query_status(job.job_id).state is SlurmJobState.GONE


def test_scancel_stops_every_component_and_leaves_a_resumable_run_dir(submit_probe) -> None:
    job, run_dir = submit_probe("slurm.probe_steps=10000", "slurm.probe_step_s=0.1")
    ranks = wait_until(lambda: read_json(run_dir / "probe" / "ranks-r0.json"), 60, "ranks to register")["ranks"]
    wait_until(lambda: (read_json(run_dir / "probe" / "state.json") or {}).get("step", 0) >= 3, 30, "probe steps")
    pids = [r["pid"] for r in ranks] + [read_json(run_dir / "probe" / "coordinator-r0.json")["pid"]]
    job.cancel()
    st = job.wait_for(lambda s: s.state.finished, timeout_s=30)
    assert st.state in (SlurmJobState.CANCELLED, SlurmJobState.GONE), st.describe()
    assert all(c.state is SlurmJobState.CANCELLED for c in st.components), st.describe()
    wait_until(lambda: not any(_pid_alive(p) for p in pids), 20, "every rank and the coordinator to exit")
    state = read_json(run_dir / "probe" / "state.json")
    assert state["step"] >= 3 and (run_dir / "config.yaml").exists() and not (run_dir / "probe" / "done.json").exists()
    wait_until(lambda: not in_squeue(job.job_id), 20, "the cancelled job to leave squeue")


def test_scontrol_requeue_resumes_the_persisted_counter(submit_probe) -> None:
    job, run_dir = submit_probe("slurm.probe_steps=30", "slurm.probe_step_s=0.2")
    wait_until(lambda: (read_json(run_dir / "probe" / "state.json") or {}).get("step", 0) >= 5, 60, "5 probe steps")
    job.requeue()
    done = wait_until(lambda: read_json(run_dir / "probe" / "done.json"), 90, "the requeued job to finish")
    state = read_json(run_dir / "probe" / "state.json")
    assert [s["restart"] for s in state["starts"]] == [0, 1]
    assert state["starts"][1]["step"] >= 5  # resumed, not restarted from 0
    assert done["step"] == 30 and done["restart"] == 1
    assert len(read_json(run_dir / "probe" / "ranks-r1.json")["ranks"]) == 4  # ranks re-registered after requeue
    st = job.wait_for(lambda s: s.state.finished, timeout_s=30)
    assert st.state in (SlurmJobState.COMPLETED, SlurmJobState.GONE), st.describe()
    wait_until(lambda: not in_squeue(job.job_id), 20, "the job to leave squeue")


def test_time_limit_usr2_checkpoints_and_self_requeues(submit_probe) -> None:
    # --time=1 min with --signal=B:USR2@58: slurmctld delivers the warning 2-32 s after start (it checks time limits
    # every 30 s). Run 0: USR2 -> checkpoint -> `scontrol requeue <leader>` by the coordinator itself. Run 1 (restart
    # count 1 = slurm.max_requeues): the next USR2 -> checkpoint -> clean stop. The counter never goes back.
    job, run_dir = submit_probe("slurm.time=00:01:00", "slurm.signal_before_s=58", "slurm.max_requeues=1",
                                "slurm.probe_steps=100000", "slurm.probe_step_s=0.1")
    done = wait_until(lambda: read_json(run_dir / "probe" / "done.json"), 110, "the self-requeued job to stop")
    state = read_json(run_dir / "probe" / "state.json")
    assert [s["restart"] for s in state["starts"]] == [0, 1], state
    assert state["starts"][1]["step"] > 0 and done["step"] > state["starts"][1]["step"]  # resumed, then progressed
    assert done["restart"] == 1 and "already requeued 1 times" in done["stopped"]
    assert "already requeued 1 times" in state["checkpoint_reason"]
    log0 = (run_dir / "slurm" / f"{job.job_id}.r0-coordinator.log").read_text()
    assert "probe: requeued at step" in log0 and "requeue 1 of at most 1" in log0
    batch = (run_dir / "slurm" / f"{job.job_id}_0_log.out").read_text()
    assert batch.count("USR2 received, forwarded to the coordinator") == 2
    st = job.wait_for(lambda s: s.state.finished, timeout_s=30)
    assert st.state in (SlurmJobState.COMPLETED, SlurmJobState.GONE), st.describe()
    wait_until(lambda: not in_squeue(job.job_id), 30, "the job to leave squeue")


def test_submit_cli_wait_on_local_cluster(slurm_cluster, tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "dynaresize.cli", "submit", str(ROOT / "configs" / "slurm-local.yaml"),
         "slurm.entry=probe", "slurm.probe_steps=3", "slurm.probe_step_s=0.1", f"run.output_dir={tmp_path}", "--wait", "--timeout", "60"],
        capture_output=True, text=True, timeout=90,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split(":", 1) for line in p.stdout.splitlines() if ":" in line)
    job_id = lines["job id"].split()[0]
    run_dir = lines["run dir"].strip()
    assert f"job {job_id}: COMPLETED" in p.stdout and run_dir.startswith(str(tmp_path))
    assert read_json(Path(run_dir) / "probe" / "done.json")["step"] == 3
