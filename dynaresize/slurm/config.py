"""Slurm submission settings (section ``slurm``): what ``dynaresize submit`` and the sbatch templates use.

The job is ONE heterogeneous allocation: component 0 (``cpu_partition``, one node, one task) runs the coordinator
and the embedded Redis; component 1 (``gpu_partition``, ``nodes`` x ``gpus_per_node`` tasks) runs one worker rank
per GPU. ``cluster.gpus`` must equal ``nodes * gpus_per_node`` (checked when the sbatch text is built).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynaresize.config.base import Section


class SlurmConfig(Section):
    cpu_partition: str | None = Field(None, description="Partition of het component 0 (coordinator + Redis, one node)")
    gpu_partition: str | None = Field(None, description="Partition of het component 1 (worker ranks)")
    nodes: int = Field(1, ge=1, description="Number of GPU nodes in component 1")
    gpus_per_node: int = Field(4, ge=1, description="GPUs per node in component 1; one worker rank per GPU")
    cpus_per_task: int = Field(1, ge=1, description="CPUs per worker rank")
    coordinator_cpus: int = Field(1, ge=1, description="CPUs of the coordinator task in component 0")
    mem_per_node: str | None = Field(None, description="Memory per node (sbatch --mem), e.g. '64G'; unset leaves the default")
    account: str | None = Field(None, description="Slurm account (--account)")
    qos: str | None = Field(None, description="Slurm QOS (--qos)")
    time: str = Field("01:00:00", pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$", description="Time limit of the allocation (--time), HH:MM:SS or D-HH:MM:SS")
    constraint: str | None = Field(None, description="Node feature constraint of the GPU component (--constraint)")
    gres_gpus: bool = Field(True, description="Request GPUs through --gpus-per-node (off for CPU-only test partitions)")
    signal_before_s: int = Field(120, ge=0, description="Seconds before the time limit at which Slurm sends USR2 (--signal); 0 disables")
    requeue: bool = Field(True, description="Requeue the job on preemption or time-out warning and resume from the checkpoint")
    max_requeues: int = Field(3, ge=0, description="Self-requeues on USR2 before the job only checkpoints and stops")
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra '#SBATCH' lines added verbatim to every component")
    shared_dir: str | None = Field(None, description="Shared directory for run directories on the cluster (default: run.output_dir)")
    python: str | None = Field(None, description="Python command on the compute nodes (default: the interpreter running submit)")
    setup: list[str] = Field(default_factory=list, description="Shell lines run in the batch script before srun (module load, venv)")
    worker_exit_grace_s: int = Field(60, ge=0, description="Seconds worker ranks get to exit after the coordinator ends, then they are stopped")
    worker_term_timeout_s: int = Field(
        300, ge=0, description="Seconds a worker rank keeps serving after SIGTERM (Slurm's preemption notice, an "
        "operator's stop; in local runs SIGINT too) so the coordinator can checkpoint it; it exits at the coordinator's "
        "shutdown, when the coordinator's Redis is gone, or then",
    )
    entry: Literal["job", "probe"] = Field(
        "job", description="What the components run: the main job, or the built-in probe that tests the Slurm plumbing"
    )
    probe_steps: int = Field(20, ge=1, description="Probe mode: counter steps the coordinator runs (persisted across requeues)")
    probe_step_s: float = Field(0.25, ge=0, description="Probe mode: seconds per counter step")
