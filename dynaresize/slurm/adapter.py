"""The one module that talks to Slurm: submitit's SlurmExecutor extended for heterogeneous jobs, plus the few
Slurm commands (squeue, scontrol, scancel, sacct) the rest of the package needs.

submitit (1.5.4) has no het-job support (its issue #1741) and reads state only through ``sacct``, which fails
without slurmdbd. So here:

- :class:`HetSlurmExecutor` subclasses ``submitit.SlurmExecutor`` and reuses its submission path
  (``_submit_command``: write the script, ``sbatch`` it, parse the id, keep ``<id>_submission.sh`` in the folder)
  with our own script text (:func:`dynaresize.slurm.sbatch.render_sbatch`) and the total task count of all
  components. Nothing is pickled: every component runs ``python -m dynaresize.slurm.entry`` on the run directory.
- :class:`HetSlurmJob` (a ``submitit`` ``SlurmJob``) reads state through :class:`SqueueWatcher`: ``squeue``
  (one line per component, ``N+0``/``N+1``, folded into one state of the leader ``N``), then ``scontrol show
  job``, then ``sacct``; a job none of them knows is GONE. Cancel and requeue use the leader id.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import typing as tp
from pathlib import Path

from submitit.core import core
from submitit.slurm.slurm import SlurmExecutor, SlurmJob

from dynaresize.slurm.sbatch import render_sbatch
from dynaresize.slurm.spec import HetJobSpec
from dynaresize.slurm.state import SQUEUE_FORMAT, HetJobStatus, SlurmJobState, leader_of, parse_preempt_time, parse_sacct, parse_scontrol, parse_squeue

CMD_TIMEOUT_S = 30


class SlurmCommandError(RuntimeError):
    """A Slurm command failed (the message has the command and its stderr)."""


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmCommandError(f"{cmd[0]}: not found (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"{' '.join(cmd)}: no answer within {CMD_TIMEOUT_S} s") from None
    if check and p.returncode != 0:
        raise SlurmCommandError(f"{' '.join(cmd)} failed (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def unavailable_reason() -> str | None:
    """Why Slurm cannot be used from here (None when ``sinfo`` answers)."""
    for tool in ("sbatch", "squeue", "scontrol", "srun", "sinfo"):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH"
    p = subprocess.run(["sinfo", "-h", "-o", "%P %a %D %t"], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if p.returncode != 0:
        return f"sinfo failed: {p.stderr.strip() or p.stdout.strip()}"
    if not p.stdout.strip():
        return "sinfo lists no partitions"
    return None


def query_status(leader: str) -> HetJobStatus:
    """The state of one het job by its leader id: squeue, then scontrol, then sacct; GONE when none knows it."""
    leader = leader_of(leader)
    p = _run(["squeue", "-h", "-t", "all", "-j", leader, "-o", SQUEUE_FORMAT], check=False)
    if p.returncode == 0 and leader in (st := parse_squeue(p.stdout)):
        return st[leader]
    p = _run(["scontrol", "show", "job", "-o", leader], check=False)
    if p.returncode == 0 and leader in (st := parse_scontrol(p.stdout)):
        return st[leader]
    if shutil.which("sacct"):
        p = _run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", leader], check=False)
        if p.returncode == 0 and leader in (st := parse_sacct(p.stdout)):
            return st[leader]
    return HetJobStatus(leader, SlurmJobState.GONE, ())


def cancel(leader: str, signal: str | None = None) -> None:
    """``scancel <leader>`` (every component), or send ``signal`` to the batch shell with ``--batch``."""
    cmd = ["scancel", leader_of(leader)]
    if signal:
        cmd += ["--batch", f"--signal={signal}"]
    _run(cmd)


def requeue(leader: str) -> None:
    """``scontrol requeue <leader>``: every component goes back to PENDING with the same id (SLURM_RESTART_COUNT+1).

    Slurm then holds the job for ``AuthInfo=cred_expire`` seconds (default 120; the local cluster sets 5) before
    it may start again.
    """
    _run(["scontrol", "requeue", leader_of(leader)])


def preempt_time(leader: str) -> str | None:
    """When Slurm selected the job for preemption (its ``PreemptTime``), or None: not preempted, or not known.

    This is how a SIGTERM is told apart: with ``PreemptMode=REQUEUE`` and a ``GraceTime``, every process of every
    step gets SIGTERM at once while the job stays RUNNING with ``PreemptTime`` set; after ``scancel`` or at the
    time limit the field stays ``None``."""
    p = _run(["scontrol", "show", "job", "-o", leader_of(leader)], check=False)
    return parse_preempt_time(p.stdout) if p.returncode == 0 else None


class SqueueWatcher(core.InfoWatcher):
    """submitit's state cache, fed by squeue/scontrol instead of sacct (which needs slurmdbd)."""

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s)
        self.status: dict[str, HetJobStatus] = {}

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        info = self.get_info(job_id, mode=mode)
        return info.get("State") or "UNKNOWN"

    def update(self) -> None:
        pending = sorted(self._registered - self._finished)
        if not pending:
            return
        self._num_calls += 1
        for job_id in pending:
            try:
                st = query_status(job_id)
            except SlurmCommandError as e:
                core.logger.get_logger().warning(f"job {job_id}: state query failed ({e}); state may be stale")
                continue
            self.status[job_id] = st
            self._info_dict[job_id] = {"State": st.state.value, "Detail": st.describe()}
        self._last_status_check = time.time()
        for job_id in pending:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


class HetSlurmJob(SlurmJob):
    """A submitted het job, addressed by its leader id."""

    watcher = SqueueWatcher(delay_s=30)

    def status(self, force: bool = True) -> HetJobStatus:
        self.watcher.get_info(self.job_id, mode="force" if force else "standard")
        return self.watcher.status.get(self.job_id, HetJobStatus(self.job_id, SlurmJobState.UNKNOWN, ()))

    def job_state(self, force: bool = True) -> SlurmJobState:
        return self.status(force).state

    def requeue(self) -> None:
        requeue(self.job_id)
        self.watcher._finished.discard(self.job_id)  # it runs again

    def wait_for(self, predicate: tp.Callable[[HetJobStatus], bool], timeout_s: float, poll_s: float = 0.5) -> HetJobStatus:
        """Poll until ``predicate(status)`` holds; raises TimeoutError with the last status otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if predicate(st):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id}: condition not met within {timeout_s:.0f} s; last status {st.describe()}")
            time.sleep(poll_s)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's SlurmExecutor for one DynaResize het job (folder: ``<run_dir>/slurm``)."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path) -> None:
        super().__init__(folder, max_num_timeout=0)
        self._spec: HetJobSpec | None = None

    def submit_spec(self, spec: HetJobSpec) -> HetSlurmJob:
        """sbatch the het job of ``spec``; returns the job (its id is the leader id)."""
        self._spec = spec
        try:
            job = self._submit_command("")  # our script does not run submitit's pickled-function command
        except Exception as e:  # submitit raises its own FailedJobError with sbatch's stderr
            raise SlurmCommandError(f"sbatch failed: {e}") from None
        finally:
            self._spec = None
        assert isinstance(job, HetSlurmJob)
        return job

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        if self._spec is None:
            raise RuntimeError("HetSlurmExecutor submits only through submit_spec(spec)")
        return render_sbatch(self._spec)

    def _num_tasks(self) -> int:
        return self._spec.total_tasks if self._spec else 1

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["sbatch", "--parsable", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        first = text.strip().splitlines()[-1].split(";")[0].strip() if text.strip() else ""
        if not first.isdigit():
            raise SlurmCommandError(f"could not read a job id from sbatch's output {text!r}")
        return first


def attach(run_dir: str | Path, job_id: str) -> HetSlurmJob:
    """A handle on an already submitted job (e.g. from ``<run_dir>/slurm/job_id``)."""
    return HetSlurmJob(folder=Path(run_dir) / "slurm", job_id=leader_of(job_id))
