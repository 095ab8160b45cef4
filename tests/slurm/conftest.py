"""Fixtures for tests on the real single-host Slurm cluster (``slurm/local-cluster.sh``).

They skip with a reason when the cluster cannot exist here (not root, no apt, no slurmctld) or is not started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = ROOT / "configs" / "slurm-local.yaml"


def _skip_reason() -> str | None:
    if shutil.which("slurmctld") is None:
        if os.geteuid() != 0:
            return "Slurm not installed and not root (slurm/local-cluster.sh install needs root)"
        if shutil.which("apt-get") is None:
            return "Slurm not installed and no apt-get to install it"
        return "slurmctld not installed: run 'bash slurm/local-cluster.sh install && bash slurm/local-cluster.sh start'"
    from dynaresize.slurm.adapter import unavailable_reason

    reason = unavailable_reason()
    if reason:
        return f"local Slurm cluster not running ({reason}): run 'bash slurm/local-cluster.sh start'"
    p = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    parts = {x.rstrip("*") for x in p.stdout.split()}
    if not {"cpu", "gpu"} <= parts:
        return f"Slurm answers but lacks partitions cpu and gpu (has {sorted(parts)}): not the local test cluster"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture()
def jobs():
    """Job ids a test started: cancelled at its end (a failed test must not leave a job that holds the nodes or
    the fake GPUs of the next test), and waited for until the controller lists them no more as active."""
    ids: list[str] = []
    yield ids

    def active(j: str) -> bool:
        p = subprocess.run(["squeue", "-h", "-j", j, "-o", "%i"], capture_output=True, text=True)
        return p.returncode == 0 and bool(p.stdout.strip())

    live = [j for j in ids if active(j)]
    for j in live:
        subprocess.run(["scancel", j], capture_output=True)
    deadline = time.monotonic() + 60
    while any(active(j) for j in live) and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture()
def submit_probe(slurm_cluster, tmp_path):
    """Submit the probe het job of configs/slurm-local.yaml (+ overrides) through the executor; cancel leftovers."""
    from dynaresize.config.loader import load_config
    from dynaresize.slurm.adapter import HetSlurmExecutor
    from dynaresize.slurm.jobdir import new_run_dir, record_job
    from dynaresize.slurm.spec import build_spec

    jobs = []

    def submit(*overrides: str):
        cfg = load_config(LOCAL_CONFIG, ["slurm.entry=probe", f"run.output_dir={tmp_path}", *overrides])
        run_dir = new_run_dir(cfg)
        job = HetSlurmExecutor(run_dir / "slurm").submit_spec(build_spec(cfg, run_dir))
        record_job(run_dir, job.job_id)
        jobs.append(job)
        return job, run_dir

    yield submit
    for job in jobs:
        subprocess.run(["scancel", job.job_id], capture_output=True)
