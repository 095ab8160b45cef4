"""A Slurm job's run directory on shared storage: create one at submit time, find it again after a requeue.

``dynaresize submit`` creates ``<slurm.shared_dir or run.output_dir>/<run.name>-<YYYYmmdd-HHMMSS>/`` with the
resolved ``config.yaml`` before sbatch, and every component reads that file (so the job runs exactly the config
that was submitted). ``slurm/dynaresize.sbatch`` creates it inside the job instead (``entry prepare``) and leaves
``<parent>/.slurm-jobs/<job id>`` pointing at it, so a requeued run of the same job id reuses it.
"""

from __future__ import annotations

from pathlib import Path

from dynaresize.config.loader import ConfigError, load_config, write_resolved
from dynaresize.config.schema import Config
from dynaresize.slurm.spec import SLURM_SUBDIR

JOB_ID_FILE = "job_id"  # <run_dir>/slurm/job_id: the leader id of the job that runs this directory
JOBS_INDEX = ".slurm-jobs"


def parent_dir(cfg: Config) -> Path:
    return Path(cfg.slurm.shared_dir or cfg.run.output_dir).absolute()


def new_run_dir(cfg: Config, now: float | None = None) -> Path:
    """Create a fresh run directory with the resolved config; a name collision gets a numeric suffix."""
    from dynaresize.rundir import create_run_dir

    parent = parent_dir(cfg)
    try:
        run_dir = create_run_dir(parent, cfg.run.name, now)
    except OSError as e:
        raise ConfigError(f"run.output_dir / slurm.shared_dir = {str(parent)!r}: cannot create: {e.strerror or e}") from None
    (run_dir / SLURM_SUBDIR).mkdir()
    write_resolved(cfg, run_dir)
    return run_dir


def record_job(run_dir: str | Path, job_id: str) -> None:
    p = Path(run_dir) / SLURM_SUBDIR / JOB_ID_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(job_id + "\n")


def recorded_job(run_dir: str | Path) -> str | None:
    p = Path(run_dir) / SLURM_SUBDIR / JOB_ID_FILE
    return p.read_text().strip() or None if p.exists() else None


def load_run_config(run_dir: str | Path) -> Config:
    """The config a component runs: ``<run_dir>/config.yaml`` written at submit time."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{path}: no resolved config in the run directory (was it created by `dynaresize submit`?)")
    return load_config(path)


def prepare_in_job(config: str, overrides: list[str], job_id: str) -> Path:
    """For ``slurm/dynaresize.sbatch``: the run directory of job ``job_id`` (created on its first start)."""
    from dynaresize.rundir import RunDirError, require_run_dir

    cfg = load_config(config, overrides)
    index = parent_dir(cfg) / JOBS_INDEX / job_id
    if index.exists():
        try:  # reused only when it is a run directory dynaresize created (its marker): never anything else
            return require_run_dir(index.read_text().strip())
        except RunDirError:
            pass
    run_dir = new_run_dir(cfg)
    record_job(run_dir, job_id)
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(str(run_dir) + "\n")
    return run_dir
