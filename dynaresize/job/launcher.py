"""Start the worker ranks of a local run: one OS process per device slot, each running ``dynaresize worker ...``
(forked from one pre-imported parent, :mod:`dynaresize.job.zygote`).

On Slurm the ranks are started by ``srun`` instead (``dynaresize.slurm``); both paths run the same worker entry
with the same arguments, so a rank cannot tell how it was launched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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
                module: str = "dynaresize.worker.main", launch: int | None = None) -> list[str]:
    """``launch``: the launch the process belongs to (it registers as that launch whatever ``launch.json`` says
    by the time it reads it: a slow process of an earlier launch is refused as what it is)."""
    return [
        sys.executable, "-m", module,
        "--run-dir", str(run_dir), "--rank", str(rank), "--world", str(world),
        "--master-addr", master_addr, "--master-port", str(master_port), "--job-id", job_id,
        *(["--launch", str(int(launch))] if launch is not None else []),
    ]


def launch_of(run_dir: Path) -> int | None:
    """The launch number in ``<run_dir>/launch.json`` (written by the coordinator just before it starts ranks)."""
    try:
        return int(json.loads((Path(run_dir) / "launch.json").read_text())["incarnation"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def log_tail(run_dir: Path, rank: int, lines: int = 20) -> str:
    """The last lines of a rank's log (``<run_dir>/logs/rank<r>.log``), for the error that names a dead rank."""
    return _tail(Path(run_dir) / "logs" / f"rank{rank}.log", lines)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class LocalLauncher:
    """Worker processes on this machine, forked by one pre-imported parent (:mod:`dynaresize.job.zygote`: the
    third-party imports are paid once, not once per rank); their output goes to ``<run_dir>/logs/rank<r>.log``,
    the parent's to ``logs/zygote.log``. Each rank leads its own session, as a ``python -m <module>`` process
    would; ``zygote=False`` starts each rank as such a process instead."""

    run_dir: Path
    world: int
    job_id: str
    device: str = "cpu"
    master_port: int = 0
    relaunchable: bool = True  # the coordinator may stop every rank and start them again (automatic restart)
    module: str = "dynaresize.worker.main"  # the rank entry (``python -m``; a test's launcher names its own)
    zygote: bool = True
    external = False  # the ranks are this host's processes: once stopped, nothing of theirs writes any more
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # zygote=False: the rank processes
    _parent: subprocess.Popen | None = None
    _launch: "_Forked" = field(default_factory=lambda: _Forked())  # what this launch's zygote reported

    def start(self) -> None:
        self.master_port = free_port()  # each launch its own: a restart never meets a port taken at the last one
        launch_no = launch_of(self.run_dir)
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        env = worker_env(self.device)
        if not self.zygote:
            for r in range(self.world):
                out = open(logs / f"rank{r}.log", "ab")
                self.procs[r] = subprocess.Popen(
                    worker_argv(self.run_dir, r, self.world, self.master_port, self.job_id, module=self.module, launch=launch_no),
                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )
                out.close()
            return
        self._launch = launch = _Forked()  # a fresh record: a stopped launch's late reports cannot reach it
        with open(logs / "zygote.log", "ab") as err:
            self._parent = subprocess.Popen(
                [sys.executable, "-m", "dynaresize.job.zygote", "--module", self.module, "--run-dir", str(self.run_dir)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
            )
        for r in range(self.world):  # read once its imports are done
            argv = worker_argv(self.run_dir, r, self.world, self.master_port, self.job_id, module=self.module,
                               launch=launch_no)[3:]
            self._parent.stdin.write((json.dumps({"rank": r, "argv": argv, "log": str(logs / f"rank{r}.log")}) + "\n").encode())
        self._parent.stdin.flush()
        threading.Thread(target=launch.read, args=(self._parent.stdout,), name="zygote-reader", daemon=True).start()

    def dead(self) -> dict[int, int]:
        """Ranks whose process has exited, with their exit codes (-1: gone, status unknown; a rank the zygote
        could not start counts as exited with the zygote's status)."""
        if not self.zygote:
            return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
        from dynaresize.control.server import pid_alive

        parent, launch = self._parent, self._launch
        parent_rc = parent.poll() if parent is not None else 1
        with launch.lock:
            out = dict(launch.exits)
            for r in range(self.world):
                if r in out:
                    continue
                pid = launch.pids.get(r)
                if pid is None:
                    if launch.failed is not None or parent_rc is not None:
                        out[r] = parent_rc if parent_rc else 1  # never started
                elif parent_rc is not None and not pid_alive(pid):
                    out[r] = -1  # its parent is gone, so is it: no status to read
        return out

    def log_tail(self, rank: int, lines: int = 20) -> str:
        tail = log_tail(self.run_dir, rank, lines)
        if self.zygote and rank not in self._launch.pids:
            why, zt = self._launch.failed or "", _tail(self.run_dir / "logs" / "zygote.log", lines)
            tail = "\n".join(x for x in (tail, why, zt) if x)
        return tail

    def _alive(self) -> list[int]:
        if not self.zygote:
            return [p.pid for p in self.procs.values() if p.poll() is None]
        from dynaresize.control.server import pid_alive

        dead, launch = self.dead(), self._launch
        with launch.lock:
            return [pid for r, pid in launch.pids.items() if r not in dead and pid_alive(pid)]

    def stop(self, grace_s: float = 20.0) -> None:
        """Wait for the ranks to exit (they were told to shut down), then terminate, then kill what is left; then
        the zygote, which exits once it has reaped them."""
        deadline = time.monotonic() + grace_s
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = self._alive()
            if not alive:
                break
            for pid in alive:
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + 5
            while self._alive() and time.monotonic() < end:
                time.sleep(0.05)
        for p in self.procs.values():
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        parent, self._parent = self._parent, None
        if parent is not None:
            try:
                parent.stdin.close()
            except OSError:
                pass
            try:
                parent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                parent.kill()
                parent.wait()


@dataclass
class _Forked:
    """What one launch's zygote reported (read on its own thread): rank -> pid, rank -> exit status, a failure."""

    pids: dict[int, int] = field(default_factory=dict)
    exits: dict[int, int] = field(default_factory=dict)  # negative: killed by that signal
    failed: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, stream) -> None:
        for raw in stream:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                if "spawned" in msg:
                    self.pids[int(msg["spawned"])] = int(msg["pid"])
                elif "exited" in msg:
                    self.exits[int(msg["exited"])] = int(msg["code"])
                elif "error" in msg:
                    self.failed = str(msg["error"])


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
