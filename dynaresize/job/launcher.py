"""Start the worker ranks of a local run: one OS process per device slot, each ``dynaresize worker ...``.

On Slurm the ranks are started by ``srun`` instead (``dynaresize.slurm``); both paths run the same worker entry
with the same arguments, so a rank cannot tell how it was launched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize.net import free_port


def worker_env(device: str) -> dict[str, str]:
    """Environment of a worker on this machine: one intra-op thread per rank, offline HF, CPU DeepSpeed."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device in ("cpu", "emulated"):  # an emulated accelerator computes on the CPU
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def worker_argv(run_dir: Path, rank: int, world: int, master_port: int, job_id: str, master_addr: str = "127.0.0.1",
                module: str = "dynaresize.worker.main") -> list[str]:
    return [
        sys.executable, "-m", module,
        "--run-dir", str(run_dir), "--rank", str(rank), "--world", str(world),
        "--master-addr", master_addr, "--master-port", str(master_port), "--job-id", job_id,
    ]


def log_tail(run_dir: Path, rank: int, lines: int = 20) -> str:
    """The last lines of a rank's log (``<run_dir>/logs/rank<r>.log``), for the error that names a dead rank."""
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class LocalLauncher:
    """Worker processes on this machine; their output goes to ``<run_dir>/logs/rank<r>.log``."""

    run_dir: Path
    world: int
    job_id: str
    device: str = "cpu"
    master_port: int = 0
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    relaunchable: bool = True  # the coordinator may stop every rank and start them again (automatic restart)
    module: str = "dynaresize.worker.main"  # the rank entry (``python -m``; a test's launcher names its own)
    external = False  # the ranks are this host's processes: once stopped, nothing of theirs writes any more

    def start(self) -> None:
        self.master_port = self.master_port or free_port()
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        env = worker_env(self.device)
        for r in range(self.world):
            out = open(logs / f"rank{r}.log", "ab")
            self.procs[r] = subprocess.Popen(
                worker_argv(self.run_dir, r, self.world, self.master_port, self.job_id, module=self.module),
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
            out.close()

    def dead(self) -> dict[int, int]:
        """Ranks whose process has exited, with their exit codes."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return log_tail(self.run_dir, rank, lines)

    def stop(self, grace_s: float = 20.0) -> None:
        """Wait for the ranks to exit (they were told to shut down), then terminate, then kill what is left."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs.values() if p.poll() is None]
            if not alive:
                break
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            for p in alive:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass


class AttachedRanks:
    """Ranks started by an earlier coordinator of this run (killed or hung), still alive and registered: a
    coordinator that takes over watches and stops them by the pid each one registered with. Only ranks on this
    host can be watched by pid; others are watched by their heartbeats alone."""

    def __init__(self, run_dir: Path, registrations: dict):
        import socket

        self.run_dir = Path(run_dir)
        here = socket.gethostname()
        self.pids = {r: int(reg.pid) for r, reg in registrations.items() if reg.pid and reg.host == here}
        self.relaunchable = len(self.pids) == len(registrations)  # a restart starts local processes again
        self.external = False

    def start(self) -> None:
        pass

    def dead(self) -> dict[int, int]:
        from dynaresize.control.server import pid_alive

        return {r: -1 for r, pid in self.pids.items() if not pid_alive(pid)}

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return log_tail(self.run_dir, rank, lines)

    def stop(self, grace_s: float = 20.0) -> None:
        from dynaresize.control.server import pid_alive

        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids.values()):
            time.sleep(0.1)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.pids.values() if pid_alive(p)]
            if not alive:
                return
            for p in alive:
                try:
                    os.killpg(p, sig)  # each rank leads its own session (start_new_session)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + 5
            while time.monotonic() < end and any(pid_alive(p) for p in alive):
                time.sleep(0.1)
