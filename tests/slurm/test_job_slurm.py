"""The main job (tiny GRPO with resizing) as one het job on the real single-host Slurm cluster.

Component 0 runs the coordinator and Redis, component 1 the four worker ranks; the run directory has the same
artifacts as a local run; scancel stops everything and leaves a run directory that resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynaresize.slurm.state import SlurmJobState
from test_hetjob import in_squeue, wait_ended, wait_until  # tests/slurm is on sys.path (pytest rootdir-less import)

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_tokens=16", "model.tiny.warmstart_steps=20"]


def submit(tmp_path: Path, *overrides: str, wait: bool, models: Path | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """``dynaresize submit`` of the small GRPO job; ``models``: a shared model cache (the ``model_cache`` fixture)."""
    argv = [sys.executable, "-m", "dynaresize.cli", "submit", str(ROOT / "configs" / "slurm-local.yaml"),
            f"run.output_dir={tmp_path / 'runs'}", f"model.cache_dir={models or tmp_path / 'models'}", *SMALL, *overrides]
    if wait:
        argv.append("--wait")
    # the job inherits this environment (sbatch --export=ALL). One torch thread, as the local tests run: here the
    # coordinator's model warm-start shares 2 cores with the 4 ranks' start-up, and two threads each took 20-30 s
    # instead of 2-3 s when the model was built
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    dirs = [d for d in (tmp_path / "runs").iterdir() if d.is_dir()]
    assert len(dirs) == 1, (dirs, p.stdout[-3000:], p.stderr[-3000:])
    return p, dirs[0]


def job_id_of(run_dir: Path) -> str:
    from dynaresize.slurm.jobdir import JOB_ID_FILE
    from dynaresize.slurm.spec import SLURM_SUBDIR

    return (run_dir / SLURM_SUBDIR / JOB_ID_FILE).read_text().strip()


def test_grpo_job_runs_across_both_components(slurm_cluster, tmp_path, model_cache, jobs):
    p, rd = submit(tmp_path, "run.steps=6", "policy.forced_splits={2: 1, 4: 3}", wait=True, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    for name in ("config.yaml", "events.jsonl", "batches.jsonl", "summary.json", "ranks.json", "checkpoints/coordinator.json"):
        assert (rd / name).exists(), name
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert [(s["from"], s["to"]) for s in summary["switches"]] == [("2:2", "1:3"), ("1:3", "3:1")]
    ranks = json.loads((rd / "ranks.json").read_text())
    job = job_id_of(rd)
    jobs.append(job)
    assert sorted(int(r) for r in ranks) == [0, 1, 2, 3]
    for reg in ranks.values():  # registered with their Slurm identity, on the GPU nodes of component 1
        assert reg["slurm_job_id"] == job and reg["het_group"] == 1 and reg["node"] in ("gpu1", "gpu2")
    assert {reg["node"] for reg in ranks.values()} == {"gpu1", "gpu2"}
    assert not in_squeue(job)
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines() if l.strip()]
    left = {e["rank"] for e in events if e["type"] == "rank" and e.get("state") == "left"}
    assert left == {0, 1, 2, 3}  # every rank deregistered at the shutdown, before the coordinator stopped Redis


def test_scancel_stops_every_component_and_the_run_resumes(slurm_cluster, tmp_path, model_cache, jobs):
    p, rd = submit(tmp_path, "run.steps=200", "run.checkpoint_every=2", wait=False, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    state = rd / "checkpoints" / "coordinator.json"
    wait_until(lambda: state.exists() and json.loads(state.read_text())["step"] >= 2, 300, "a checkpoint at step >= 2")
    subprocess.run(["scancel", job], check=True)
    assert wait_ended(job, 120) <= {SlurmJobState.CANCELLED}  # every component ended (processes gone), not requeued
    step = json.loads(state.read_text())["step"]
    assert step >= 2
    # resumable: continue it here (same run directory, same step counter) for two more steps
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "dynaresize.cli", "run", "--resume", str(rd), f"run.steps={step + 2}", "--quiet"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    got = [json.loads(l)["step"] for l in (rd / "batches.jsonl").read_text().splitlines()]
    assert got == list(range(step + 2))  # nothing after the checkpoint counted twice, nothing missing


def test_scontrol_requeue_resumes_the_grpo_job_with_the_same_step_counter(slurm_cluster, tmp_path, model_cache, jobs):
    steps = 10
    p, rd = submit(tmp_path, f"run.steps={steps}", "run.checkpoint_every=2", wait=False, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    state = rd / "checkpoints" / "coordinator.json"
    wait_until(lambda: state.exists() and json.loads(state.read_text())["step"] >= 2, 300, "a checkpoint at step >= 2")
    subprocess.run(["scontrol", "requeue", job], check=True)
    summary = rd / "summary.json"
    wait_until(lambda: summary.exists() and json.loads(summary.read_text()).get("status") == "completed", 600,
               "the requeued job to complete")
    assert wait_ended(job, 120) <= {SlurmJobState.COMPLETED}  # not left in squeue: ended, and completed
    s = json.loads(summary.read_text())
    assert s["steps"] == steps
    got = [json.loads(l)["step"] for l in (rd / "batches.jsonl").read_text().splitlines()]
    assert got == list(range(steps))  # same counter across the requeue; nothing lost, nothing trained twice
    events = (rd / "events.jsonl").read_text()
    assert '"what":"resume"' in events


def test_time_limit_warning_checkpoints_requeues_and_resumes_the_grpo_job(slurm_cluster, tmp_path, model_cache, jobs):
    # --time=3 min, USR2 178 s before: the warning comes 2-32 s after each start (slurmctld checks limits every 30 s),
    # often before the ranks have registered; the job then has 2.5 min to reach its next step boundary (a 1-minute
    # limit left too little once a start-up was slow under load). The test does not wait for the limit itself.
    # Incarnation 1: USR2 -> checkpoint at the next step boundary -> `scontrol requeue <leader>`. Incarnation 2
    # (restart count 1 = slurm.max_requeues): USR2 -> checkpoint -> clean stop. The step counter never goes back.
    p, rd = submit(tmp_path, "run.steps=5000", "slurm.time=00:03:00", "slurm.signal_before_s=178", "slurm.max_requeues=1",
                   wait=False, models=model_cache)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    job = job_id_of(rd)
    jobs.append(job)
    summary = rd / "summary.json"
    wait_until(lambda: summary.exists() and '"what":"resume"' in (rd / "events.jsonl").read_text()
               and json.loads(summary.read_text()).get("status") == "interrupted", 420,
               "the requeued job to stop at its second warning")
    wait_ended(job, 120)  # not left in squeue: every component ended for good
    state = json.loads((rd / "checkpoints" / "coordinator.json").read_text())
    assert state["incarnation"] == 2
    got = [json.loads(l)["step"] for l in (rd / "batches.jsonl").read_text().splitlines()]
    assert got == list(range(state["step"])) and state["step"] >= 2  # progressed across the requeue, no step twice
    logs = "".join(f.read_text(errors="replace") for f in (rd / "slurm").glob(f"{job}.r*-coordinator.log"))
    assert "requeue 1 of at most 1" in logs and "already requeued 1 times" in logs
