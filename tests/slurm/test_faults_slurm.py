"""Fault matrix, row 8 (Slurm), on the real single-host cluster with the GRPO job: site preemption by a
higher-priority partition, and a worker rank's process killed (rollout: the job shrinks; trainer: the job requeues
itself and resumes from its checkpoint). "Nothing lost": the step counter is continuous, no step is trained twice
(``batches.jsonl`` holds each step once), and no job is left in squeue.

What Slurm 22.05 does, as recorded on this cluster (docs/slurm.md): on preemption (PreemptMode=REQUEUE,
GraceTime=60) every process of every step gets SIGTERM at once and the job stays RUNNING with PreemptTime set; a
job that ends within the grace time is not requeued by Slurm; with KillOnBadExit=1 a task killed by a signal takes
its whole step down unless srun has --kill-on-bad-exit=0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from dynaresize.slurm.state import SlurmJobState
from test_hetjob import wait_ended, wait_until  # tests/slurm is on sys.path (pytest rootdir-less import)
from test_job_slurm import job_id_of, submit

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


def _events(rd: Path) -> list[dict]:
    out = []
    for line in (rd / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _steps(rd: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (rd / "batches.jsonl").read_text().splitlines() if l.strip()]


def _steps_done(rd: Path) -> int:
    try:
        return len((rd / "batches.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _wall(rd: Path, ev: dict) -> float:
    t0 = next(e["wall_time"] for e in _events(rd) if e["type"] == "run_start")
    return t0 + ev["t"]


def test_preemption_by_an_urgent_job_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path, model_cache, jobs):
    # no periodic checkpoint: resuming at the step where the job was preempted proves the preemption checkpoint
    steps = 30  # steps take ~0.2 s: enough left for the fault to land mid-run
    p, rd = submit(tmp_path, f"run.steps={steps}", "run.checkpoint_every=0", "slurm.worker_term_timeout_s=120",
                   wait=False, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    wait_until(lambda: _steps_done(rd) >= 2, 300, "2 GRPO steps")
    urgent_out = tmp_path / "urgent.out"
    u = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", "gpu1", "--exclusive", f"--output={urgent_out}",
                        "--wrap", "date +%s.%N; sleep 2; date +%s.%N"], capture_output=True, text=True, check=True)
    urgent = u.stdout.strip().split(";")[0]
    jobs.append(urgent)
    summary = rd / "summary.json"
    wait_until(lambda: summary.exists() and json.loads(summary.read_text()).get("status") == "completed"
               and '"what":"resume"' in (rd / "events.jsonl").read_text(), 300, "the preempted job to resume and complete")
    assert wait_ended(job, 120) <= {SlurmJobState.COMPLETED}  # neither job left in squeue: both ended, and completed
    assert wait_ended(urgent, 120) <= {SlurmJobState.COMPLETED}

    s = json.loads(summary.read_text())
    assert s["steps"] == steps
    assert _steps(rd) == list(range(steps))  # same counter across the preemption; nothing lost, nothing trained twice
    events = _events(rd)
    whats = [e.get("what") for e in events if e["type"] == "control"]
    assert "rewind" not in whats  # resumed exactly where it was preempted: no step trained again
    resume = next(e for e in events if e.get("what") == "resume")
    start_urgent, end_urgent = (float(x) for x in urgent_out.read_text().split())
    assert _wall(rd, resume) > end_urgent  # the urgent job ran in between, on our nodes
    preempted_at = int(resume["reason"].rsplit(" ", 1)[1])  # "incarnation 2 from step N"
    assert 2 <= preempted_at < steps
    checkpoints = [e for e in events if e["type"] == "stage" and e.get("stage") == "checkpoint"]
    assert [e["step"] for e in checkpoints if _wall(rd, e) < start_urgent + 0.5] == [preempted_at]

    slurm_dir = rd / "slurm"
    coord0 = (slurm_dir / f"{job}.r0-coordinator.log").read_text(errors="replace")
    assert "Slurm preempted the job at" in coord0 and "preempted by Slurm; requeue now" in coord0
    assert (slurm_dir / f"{job}.r1-coordinator.log").exists()  # Slurm started incarnation 1 of the same job id
    # every rank got the preemption SIGTERM before the checkpoint, kept serving, and staged its state for it
    checkpoint_end = _wall(rd, next(e for e in checkpoints if e["step"] == preempted_at)) + 0.01  # log: ms
    for t in range(4):
        w = (slurm_dir / f"{job}.r0-worker-{t}.log").read_text(errors="replace")
        line = next((l for l in w.splitlines() if "SIGTERM: this rank keeps serving until the coordinator's shutdown" in l), None)
        assert line is not None, (t, w[-2000:])
        got_term = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert got_term < checkpoint_end, (t, line, checkpoint_end)


def _kill_rank(rd: Path, rank: int) -> dict:
    """SIGKILL one worker rank's process (all nodes of the local cluster are this host); its registration says where."""
    wait_until(lambda: (rd / "ranks.json").exists(), 300, "ranks.json")
    reg = json.loads((rd / "ranks.json").read_text())[str(rank)]
    os.kill(int(reg["pid"]), signal.SIGKILL)
    return reg


def _kill_while_generating(rd: Path, rank: int, timeout_s: float = 120) -> dict:
    """SIGKILL ``rank`` while it holds claimed samples of a rollout (inside its generate command, so the loss is met
    by the coordinator's wait for that command: the shrink path). Under Slurm a death is only seen by the heartbeat
    deadline (5 s), so a rank killed between its generate ack and the weight sync would be met inside that collective
    instead (a restart). SIGSTOP freezes the moment: claims still held after it are held at death."""
    from dynaresize.control.server import connect

    wait_until(lambda: (rd / "ranks.json").exists(), 300, "ranks.json")
    reg = json.loads((rd / "ranks.json").read_text())[str(rank)]
    pid = int(reg["pid"])
    r = connect(rd / "redis" / "redis.json", role="test")

    def holding() -> bool:  # dr:<job id>:wq:<step>:inflight:<rank> (dynaresize.contract.workqueue); the run's own Redis
        return any(r.hlen(k) for k in r.scan_iter(match=f"dr:*:wq:*:inflight:{rank}", count=100))

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if holding():
            os.kill(pid, signal.SIGSTOP)
            if holding():
                os.kill(pid, signal.SIGKILL)
                return reg
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"rank {rank} was never seen generating within {timeout_s} s")


def test_killed_rollout_rank_is_removed_and_the_job_finishes_on_the_others(slurm_cluster, tmp_path, model_cache, jobs):
    steps, per_step = 30, 16  # SMALL: 4 prompts x 4 samples
    p, rd = submit(tmp_path, f"run.steps={steps}", "run.checkpoint_every=0", "rollout.pull_batch=2", wait=False,
                   models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    wait_until(lambda: _steps_done(rd) >= 2, 300, "2 GRPO steps")
    reg = _kill_while_generating(rd, 3)  # the highest rank: always a rollout rank (trainer sets are prefixes)
    assert reg["node"] == "gpu2"
    summary = rd / "summary.json"
    wait_until(lambda: summary.exists() and json.loads(summary.read_text()).get("status") in ("completed", "failed"), 300,
               "the job to finish")
    assert wait_ended(job, 120) <= {SlurmJobState.COMPLETED}  # not left in squeue: ended, and completed

    s = json.loads(summary.read_text())
    assert s["status"] == "completed" and s["steps"] == steps
    batches = [json.loads(l) for l in (rd / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == list(range(steps))  # nothing lost, nothing trained twice
    for b in batches:  # every batch complete: no sample dropped or duplicated by the loss
        assert len(b["keys"]) == per_step and len(set(b["keys"])) == per_step, b["step"]
    control = [(e["what"], e.get("rank")) for e in _events(rd) if e["type"] == "control"]
    lost = control.index(("rank_lost", 3))
    assert [w for w, _ in control[lost:]][:2] == ["rank_lost", "shrink"]
    assert not any(w in ("restart", "resume") for w, _ in control)  # absorbed: no restart, no requeue
    assert not (rd / "slurm" / f"{job}.r1-coordinator.log").exists()
    # srun kept the step's other tasks (the cluster has KillOnBadExit=1; the worker srun says --kill-on-bad-exit=0)
    err = (rd / "slurm" / f"{job}_0_log.err").read_text(errors="replace")
    assert "task 3: Killed" in err and "Terminating StepId" not in err, err[-2000:]
    for t in range(3):  # the survivors ended at the coordinator's shutdown, not by a signal
        w = (rd / "slurm" / f"{job}.r0-worker-{t}.log").read_text(errors="replace")
        assert "SIGTERM" not in w, (t, w[-1500:])


def test_killed_trainer_rank_requeues_the_job_which_resumes_from_its_checkpoint(slurm_cluster, tmp_path, model_cache, jobs):
    steps = 30  # steps take ~0.2 s: enough left for the fault to land mid-run
    p, rd = submit(tmp_path, f"run.steps={steps}", "run.checkpoint_every=2", "faults.max_restarts=1", wait=False, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    state = rd / "checkpoints" / "coordinator.json"
    wait_until(lambda: state.exists() and json.loads(state.read_text())["step"] >= 2, 300, "a checkpoint at step >= 2")
    _kill_rank(rd, 1)  # a trainer: its ZeRO shard is gone, the job cannot go on without it
    summary = rd / "summary.json"
    wait_until(lambda: summary.exists() and json.loads(summary.read_text()).get("status") == "completed", 420,
               "the requeued job to complete")
    assert wait_ended(job, 120) <= {SlurmJobState.COMPLETED}  # not left in squeue: ended, and completed

    assert json.loads(summary.read_text())["steps"] == steps
    assert _steps(rd) == list(range(steps))  # steps after the checkpoint were rewound and trained once more
    events = _events(rd)
    restart = [e for e in events if e.get("what") == "restart"]
    assert len(restart) == 1 and "rank(s) 1 lost" in restart[0]["reason"] and "requeue 1 of at most 1" in restart[0]["reason"]
    resume = next(e for e in events if e.get("what") == "resume")
    assert _wall(rd, resume) > _wall(rd, restart[0])
    assert (rd / "slurm" / f"{job}.r1-coordinator.log").exists()  # the same job id, started again by Slurm
    record = json.loads((rd / "slurm" / "relaunches.json").read_text())["relaunches"]
    assert [r["restart_count"] for r in record] == [0] and record[0]["job_id"] == job
