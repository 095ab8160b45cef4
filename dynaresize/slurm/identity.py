"""Who this process is inside a Slurm heterogeneous job, read from the environment Slurm sets (pure).

Checked on Slurm 22.05 inside ``srun --het-group=1`` of a het job with leader 12:
``SLURM_JOB_ID`` is the LEADER id (12) in every component, ``SLURM_JOB_ID_HET_GROUP_<g>`` holds each component's
own id (12, 13), ``SLURM_HET_SIZE`` the number of components. There is NO ``SLURM_HET_JOB_ID`` or
``SLURM_HET_JOB_OFFSET`` in a step, and nothing says which het group a task belongs to, so the batch script sets
``DYNARESIZE_HET_GROUP=<g>`` on each srun. ``SLURM_PROCID``/``SLURM_NTASKS`` count tasks within the component's
step, ``SLURM_LOCALID`` within the node, ``SLURM_NODEID`` the node within the step. With ``--gpus-per-task=1``
each rank sees exactly one GPU: ``CUDA_VISIBLE_DEVICES`` and ``SLURM_STEP_GPUS`` hold its index on the node.
``SLURM_RESTART_COUNT`` counts requeues (absent before the first).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

HET_GROUP_ENV = "DYNARESIZE_HET_GROUP"


class IdentityError(ValueError):
    """A Slurm variable holds something unexpected (the message names the variable and its value)."""


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise IdentityError(f"environment variable {key}={raw!r}: expected an integer") from None


@dataclass(frozen=True)
class SlurmIdentity:
    job_id: str  # leader id of the het job (what scancel/scontrol requeue take)
    component_job_id: str  # this component's own job id (== job_id for component 0)
    het_group: int | None  # component index (0 coordinator, 1 workers); None outside a het job
    het_size: int  # number of components (1 for a plain job)
    procid: int  # task rank within this component's step
    ntasks: int  # tasks in this component's step
    localid: int  # task index on its node
    nodeid: int  # node index within the step
    node: str  # SLURMD_NODENAME
    restart_count: int  # requeues so far
    gpus: tuple[str, ...]  # GPU indices on the node visible to this task (SLURM_STEP_GPUS / CUDA_VISIBLE_DEVICES)

    @property
    def gpu(self) -> str | None:
        """The GPU this rank drives: its only visible GPU, else the one at its local id, else None."""
        if not self.gpus:
            return None
        if len(self.gpus) == 1:
            return self.gpus[0]
        return self.gpus[self.localid % len(self.gpus)]

    @property
    def cuda_device(self) -> int:
        """Index to pass to ``torch.device('cuda', i)`` (indices are relative to CUDA_VISIBLE_DEVICES)."""
        return 0 if len(self.gpus) <= 1 else self.localid % len(self.gpus)

    def to_json(self) -> dict:
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        d["gpu"] = self.gpu
        return d


def _gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    raw = env.get("CUDA_VISIBLE_DEVICES") or env.get("SLURM_STEP_GPUS") or ""
    return tuple(x.strip() for x in raw.split(",") if x.strip() and x.strip() != "NoDevFiles")


def from_env(env: Mapping[str, str] | None = None) -> SlurmIdentity | None:
    """The identity of this task, or None when not running inside a Slurm job step."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    if not job_id.isdigit():
        raise IdentityError(f"environment variable SLURM_JOB_ID={job_id!r}: expected a job number")
    het_size = _int(env, "SLURM_HET_SIZE", 1) or 1
    group = _int(env, HET_GROUP_ENV)
    if group is not None and not 0 <= group < max(het_size, 1):
        raise IdentityError(f"environment variable {HET_GROUP_ENV}={group}: outside 0..{het_size - 1} (SLURM_HET_SIZE={het_size})")
    component = env.get(f"SLURM_JOB_ID_HET_GROUP_{group}", job_id) if group is not None else job_id
    return SlurmIdentity(
        job_id=job_id,
        component_job_id=component,
        het_group=group,
        het_size=het_size,
        procid=_int(env, "SLURM_PROCID", 0) or 0,
        ntasks=_int(env, "SLURM_NTASKS", 1) or 1,
        localid=_int(env, "SLURM_LOCALID", 0) or 0,
        nodeid=_int(env, "SLURM_NODEID", 0) or 0,
        node=env.get("SLURMD_NODENAME", ""),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0) or 0,
        gpus=_gpus(env),
    )
