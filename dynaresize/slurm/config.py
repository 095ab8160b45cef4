"""Slurm submission settings (section ``slurm``): what ``dynaresize submit`` and the sbatch templates use."""

from __future__ import annotations

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
    time: str = Field("01:00:00", description="Time limit of the allocation (--time), HH:MM:SS or D-HH:MM:SS")
    constraint: str | None = Field(None, description="Node feature constraint of the GPU component (--constraint)")
    gres_gpus: bool = Field(True, description="Request GPUs through --gpus-per-node (off for CPU-only test partitions)")
    signal_before_s: int = Field(120, ge=0, description="Seconds before the time limit at which Slurm sends USR2 (--signal)")
    requeue: bool = Field(True, description="Requeue the job on preemption or time-out warning and resume from the checkpoint")
    extra_sbatch: list[str] = Field(default_factory=list, description="Extra '#SBATCH' lines added verbatim to every component")
    shared_dir: str | None = Field(None, description="Shared directory for run directories on the cluster (default: run.output_dir)")
