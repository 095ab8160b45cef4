"""Pure logic of the Slurm layer: state parsing and leader-id mapping, identity from env, preemption decisions,
rendezvous per job incarnation, allocation checks. Inputs are text/env captured from Slurm 22.05 here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.slurm import rendezvous
from dynaresize.slurm.entry import allocation_problems
from dynaresize.slurm.identity import IdentityError, from_env
from dynaresize.slurm.preempt import PreemptAction, Preemption, decide
from dynaresize.slurm.state import SlurmJobState, aggregate, leader_of, offset_of, parse_scontrol, parse_squeue

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

SQUEUE = """5+0|COMPLETING|None|cpu1
5+1|PENDING|BeginTime|gpu[1-2]
7+0|CANCELLED|None|cpu1
7+1|CANCELLED|None|gpu[1-2]
garbage line
9|RUNNING|None|cpu1
"""

SCONTROL = (
    "JobId=11 HetJobId=11 HetJobOffset=0 JobName=rq JobState=RUNNING Reason=None NodeList=cpu1 Requeue=1\n"
    "JobId=12 HetJobId=11 HetJobOffset=1 JobName=rq JobState=PENDING Reason=Resources NodeList=(null)\n"
)


def test_leader_id_mapping() -> None:
    assert leader_of("12+1") == "12" and leader_of("12+0") == "12" and leader_of(" 12 ") == "12"
    assert offset_of("12+1") == 1 and offset_of("12") == 0
    with pytest.raises(ValueError, match="not a Slurm job id: 'x12'"):
        leader_of("x12")


def test_parse_squeue_folds_components_into_leader() -> None:
    st = parse_squeue(SQUEUE)
    assert set(st) == {"5", "7", "9"}
    assert st["5"].state is SlurmJobState.COMPLETING and [c.job_id for c in st["5"].components] == ["5+0", "5+1"]
    assert st["5"].components[1].reason == "BeginTime"
    assert st["7"].state is SlurmJobState.CANCELLED and st["7"].state.finished
    assert st["9"].state is SlurmJobState.RUNNING and not st["9"].state.finished


def test_parse_scontrol_maps_component_job_ids() -> None:
    st = parse_scontrol(SCONTROL)
    assert list(st) == ["11"] and st["11"].state is SlurmJobState.RUNNING
    assert [c.job_id for c in st["11"].components] == ["11+0", "11+1"]


def test_aggregate_prefers_activity_then_worst_end() -> None:
    assert aggregate([SlurmJobState.PENDING, SlurmJobState.RUNNING]) is SlurmJobState.RUNNING
    assert aggregate([SlurmJobState.COMPLETED, SlurmJobState.FAILED]) is SlurmJobState.FAILED
    assert aggregate([SlurmJobState.COMPLETED, SlurmJobState.CANCELLED]) is SlurmJobState.CANCELLED
    assert aggregate([SlurmJobState.COMPLETED, SlurmJobState.COMPLETED]) is SlurmJobState.COMPLETED
    assert aggregate([]) is SlurmJobState.UNKNOWN
    assert SlurmJobState.parse("CANCELLED by 0") is SlurmJobState.CANCELLED and SlurmJobState.parse("WEIRD") is SlurmJobState.UNKNOWN
    assert SlurmJobState.GONE.finished and not SlurmJobState.UNKNOWN.finished


# what srun --het-group=1 --gpus-per-task=1 set for task 3 of het job 3 (component id 4) on Slurm 22.05
WORKER_ENV = {
    "SLURM_JOB_ID": "3", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "3", "SLURM_JOB_ID_HET_GROUP_1": "4",
    "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu2",
    "CUDA_VISIBLE_DEVICES": "1", "SLURM_STEP_GPUS": "1", "DYNARESIZE_HET_GROUP": "1",
}


def test_identity_of_a_worker_rank() -> None:
    ident = from_env(WORKER_ENV)
    assert ident is not None
    assert (ident.job_id, ident.component_job_id, ident.het_group, ident.het_size) == ("3", "4", 1, 2)
    assert (ident.procid, ident.ntasks, ident.localid, ident.nodeid, ident.node) == (3, 4, 1, 1, "gpu2")
    assert ident.gpu == "1" and ident.cuda_device == 0 and ident.restart_count == 0
    several = from_env({**WORKER_ENV, "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_RESTART_COUNT": "2"})
    assert several.gpu == "1" and several.cuda_device == 1 and several.restart_count == 2
    assert from_env({}) is None
    with pytest.raises(IdentityError, match="SLURM_PROCID='x'"):
        from_env({**WORKER_ENV, "SLURM_PROCID": "x"})
    with pytest.raises(IdentityError, match="DYNARESIZE_HET_GROUP=2"):
        from_env({**WORKER_ENV, "DYNARESIZE_HET_GROUP": "2"})


def test_preemption_decisions() -> None:
    assert decide(False, True, 0, 3).action is PreemptAction.CONTINUE
    assert decide(True, True, 0, 3).action is PreemptAction.REQUEUED
    assert decide(True, True, 3, 3).action is PreemptAction.STOP
    assert decide(True, False, 0, 3).action is PreemptAction.STOP


def test_real_usr2_checkpoints_then_requeues_the_leader() -> None:
    assert threading.current_thread() is threading.main_thread()
    calls: list[str] = []
    pre = Preemption("42", 0, True, 2, requeue_fn=lambda leader: calls.append(f"requeue {leader}"))
    pre.on_checkpoint(lambda reason: calls.append("checkpoint"))
    pre.install()
    try:
        assert pre.poll() is PreemptAction.CONTINUE and calls == []
        # a child started after install() inherits the blocked signal: USR2 must not kill it (like redis-server)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        os.kill(os.getpid(), signal.SIGUSR2)
        child.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not pre.requested and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pre.requested
        assert child.poll() is None, "a child of the coordinator died of USR2"
        child.kill()
        child.wait()
        assert pre.poll() is PreemptAction.REQUEUED
        assert calls == ["checkpoint", "requeue 42"]
        assert pre.poll() is PreemptAction.REQUEUED and len(calls) == 2  # handled once
    finally:
        pre.uninstall()
    assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_failed_requeue_stops_after_checkpoint() -> None:
    def boom(leader: str) -> None:
        raise RuntimeError("scontrol: Invalid job id")

    calls: list[str] = []
    pre = Preemption("42", 0, True, 2, requeue_fn=boom)
    pre.on_checkpoint(calls.append)
    pre.trigger()
    assert pre.poll() is PreemptAction.STOP and len(calls) == 1 and "requeue failed" in pre.handled.reason


def test_rendezvous_matches_job_incarnation(tmp_path: Path) -> None:
    rendezvous.publish(tmp_path, "7", 0, tmp_path / "redis" / "redis.json")
    with pytest.raises(rendezvous.RendezvousTimeout, match="restart 1"):
        rendezvous.wait(tmp_path, "7", 1, timeout_s=0.3, poll_s=0.05)
    rendezvous.publish(tmp_path, "7", 1, tmp_path / "redis" / "redis.json")
    rv = rendezvous.wait(tmp_path, "7", 1, timeout_s=1)
    assert rv.restart_count == 1 and rv.endpoint_file.endswith("redis.json")


def test_allocation_check_names_the_mismatch() -> None:
    cfg = load_config(ROOT / "configs" / "slurm-local.yaml")
    good = {"SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "4"}
    assert allocation_problems(cfg, good) == []
    assert "cluster.gpus = 4" in allocation_problems(cfg, {**good, "SLURM_NTASKS_HET_GROUP_1": "8"})[0]
    assert "hetjob" in allocation_problems(cfg, {})[0]


def test_rendezvous_reports_a_failed_coordinator(tmp_path: Path) -> None:
    rendezvous.publish(tmp_path, "7", 0, None, error="RuntimeError: no main job")
    with pytest.raises(rendezvous.RendezvousFailed, match="no main job"):
        rendezvous.wait(tmp_path, "7", 0, timeout_s=1)
