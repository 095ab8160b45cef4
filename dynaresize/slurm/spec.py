"""What one DynaResize allocation asks Slurm for: a heterogeneous job spec built from the config (pure, no Slurm).

Component 0 is the coordinator + embedded Redis (one node, one task, ``cpu_partition``); component 1 holds the
worker ranks (``nodes`` x ``gpus_per_node`` tasks, ``gpu_partition``, one rank per GPU). The spec is what
:mod:`dynaresize.slurm.sbatch` renders and what the submitit adapter submits; it never touches Slurm itself.
"""

from __future__ import annotations

import enum
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize.config.loader import ConfigError
from dynaresize.config.schema import Config

SLURM_SUBDIR = "slurm"  # <run_dir>/slurm: sbatch text, submitit's job files, per-component logs
# The batch shell -> coordinator hand-over of Slurm's USR2 warning (sbatch.LAUNCH_BODY writes them, entry reads them)
USR2_SEEN_ENV = "DYNARESIZE_USR2_SEEN"  # a file the shell creates when USR2 reached it
COORDINATOR_LISTENS_ENV = "DYNARESIZE_COORDINATOR_LISTENS"  # a file the coordinator creates once it handles USR2


class Component(enum.IntEnum):
    """Het-group index of each component (``srun --het-group=<value>``)."""

    COORDINATOR = 0
    WORKERS = 1


@dataclass(frozen=True)
class HetComponent:
    """One component of the heterogeneous job: its resources and the command each of its tasks runs."""

    component: Component
    partition: str | None
    nodes: int
    ntasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int | None = None  # --gpus-per-node (None: no GPU request)
    gpus_per_task: int | None = None  # srun --gpus-per-task: binds one GPU to each rank
    mem: str | None = None
    constraint: str | None = None
    argv: tuple[str, ...] = ()  # the command of each task (python -m dynaresize.slurm.entry ...)

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node

    @property
    def role(self) -> str:
        return "coordinator" if self.component == Component.COORDINATOR else "worker"


@dataclass(frozen=True)
class HetJobSpec:
    """The whole allocation: job-wide settings plus the components in het-group order."""

    job_name: str
    run_dir: str
    time: str
    components: tuple[HetComponent, ...]
    account: str | None = None
    qos: str | None = None
    signal_before_s: int = 0  # 0: no --signal
    requeue: bool = True
    extra_sbatch: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    worker_exit_grace_s: int = 60
    env: tuple[tuple[str, str], ...] = field(default=())  # exported before srun

    @property
    def total_tasks(self) -> int:
        return sum(c.ntasks for c in self.components)

    @property
    def log_dir(self) -> str:
        return str(Path(self.run_dir) / SLURM_SUBDIR)


def entry_argv(python: str, role: str, run_dir: str | Path) -> tuple[str, ...]:
    """The command of one component's tasks: ``<python> -m dynaresize.slurm.entry <role> --run-dir <dir>``."""
    return (*shlex.split(python), "-m", "dynaresize.slurm.entry", role, "--run-dir", str(run_dir))


def build_spec(cfg: Config, run_dir: str | Path, python: str | None = None) -> HetJobSpec:
    """The het-job spec of ``cfg`` for ``run_dir`` (absolute, on shared storage). Raises ConfigError on a mismatch."""
    s = cfg.slurm
    ranks = s.nodes * s.gpus_per_node
    if cfg.cluster.gpus != ranks:
        raise ConfigError(
            f"cluster.gpus = {cfg.cluster.gpus} but slurm.nodes x slurm.gpus_per_node = {s.nodes} x {s.gpus_per_node} = {ranks}:"
            " one worker rank runs per GPU, so they must match"
        )
    if cfg.cluster.gpus_per_node != s.gpus_per_node:
        raise ConfigError(
            f"cluster.gpus_per_node = {cfg.cluster.gpus_per_node} but slurm.gpus_per_node = {s.gpus_per_node}: they must match"
        )
    for i, line in enumerate(s.extra_sbatch):
        if not line.strip().startswith("--") and not line.strip().startswith("-"):
            raise ConfigError(f"slurm.extra_sbatch[{i}] = {line!r}: expected an sbatch option such as '--mail-type=END'")
    run_dir = str(Path(run_dir).absolute())
    py = python or s.python or shlex.quote(sys.executable)
    gpu = s.gres_gpus
    components = (
        HetComponent(
            component=Component.COORDINATOR,
            partition=s.cpu_partition,
            nodes=1,
            ntasks_per_node=1,
            cpus_per_task=s.coordinator_cpus,
            argv=entry_argv(py, "coordinator", run_dir),
        ),
        HetComponent(
            component=Component.WORKERS,
            partition=s.gpu_partition,
            nodes=s.nodes,
            ntasks_per_node=s.gpus_per_node,
            cpus_per_task=s.cpus_per_task,
            gpus_per_node=s.gpus_per_node if gpu else None,
            gpus_per_task=1 if gpu else None,
            mem=s.mem_per_node,
            constraint=s.constraint,
            argv=entry_argv(py, "worker", run_dir),
        ),
    )
    return HetJobSpec(
        job_name=f"dynaresize-{cfg.run.name}",
        run_dir=run_dir,
        time=s.time,
        components=components,
        account=s.account,
        qos=s.qos,
        signal_before_s=s.signal_before_s,
        requeue=s.requeue,
        extra_sbatch=tuple(line.strip() for line in s.extra_sbatch),
        setup=tuple(s.setup),
        worker_exit_grace_s=s.worker_exit_grace_s,
        env=(("DYNARESIZE_RUN_DIR", run_dir), ("PYTHONUNBUFFERED", "1")),
    )
