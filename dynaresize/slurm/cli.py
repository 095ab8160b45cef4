"""``dynaresize submit CONFIG [overrides] [--wait] [--dry-run]``: the job as ONE heterogeneous Slurm allocation.

Creates the run directory on shared storage (resolved ``config.yaml`` inside), renders the het-job sbatch text
(component 0: coordinator + embedded Redis on ``slurm.cpu_partition``; component 1: one worker rank per GPU on
``slurm.gpu_partition``), submits it through submitit and prints the job id, the run directory and how to follow
it. ``--wait`` follows the job with a progress bar (Slurm state, then the steps in ``events.jsonl``) until it
leaves the queue. ``--dry-run`` prints the sbatch text and submits nothing (no Slurm needed).

Examples::

    dynaresize submit configs/slurm-local.yaml --wait             # the single-host cluster (slurm/local-cluster.sh)
    dynaresize submit configs/gpu-32x4.yaml slurm.account=abc --dry-run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dynaresize.config.loader import load_config
from dynaresize.slurm.sbatch import render_sbatch
from dynaresize.slurm.spec import build_spec
from dynaresize.slurm.state import SlurmJobState


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML (e.g. configs/slurm-local.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. slurm.time=02:00:00 slurm.account=abc")
    p.add_argument("--wait", action="store_true", help="follow the job until it leaves the queue; exit code from its end state")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch text only (nothing is created or submitted)")
    p.add_argument("--timeout", type=float, default=None, help="with --wait: give up waiting after this many seconds")


def _steps_done(run_dir: Path) -> int:
    """Steps finished so far: from ``events.jsonl`` (main job) or ``probe/state.json`` (probe)."""
    import json

    from dynaresize.events import EventType, ReadStats, read_events

    if not (run_dir / "events.jsonl").exists():
        try:
            return int(json.loads((run_dir / "probe" / "state.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0
    steps = 0
    for ev in read_events(run_dir, ReadStats(), types={EventType.STEP_END}):
        steps = max(steps, int(ev.data.get("step", 0)) + 1)
    return steps


def follow(job, run_dir: Path, total_steps: int, timeout_s: float | None = None, poll_s: float = 1.0,
           progress: bool = True) -> SlurmJobState:
    """Poll the job until it is finished or gone; show its state and steps. Returns the last known end state."""
    from tqdm import tqdm

    bar = tqdm(total=total_steps, unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    last_end = SlurmJobState.UNKNOWN
    start = time.monotonic()
    try:
        while True:
            st = job.status()
            bar.set_description_str(f"job {job.job_id} {st.state.value}")
            try:
                steps = _steps_done(run_dir)
            except Exception:
                steps = bar.n
            if steps > bar.n:
                bar.update(steps - bar.n)
            if st.state.finished and st.state is not SlurmJobState.GONE:
                last_end = st.state
            if st.state.finished:
                return last_end if last_end is not SlurmJobState.UNKNOWN else st.state
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                print(f"\ndynaresize submit: still {st.describe()} after {timeout_s:.0f} s; stopped waiting (the job keeps running)", file=sys.stderr)
                return st.state
            time.sleep(poll_s)
    finally:
        bar.close()


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        spec = build_spec(cfg, Path(cfg.slurm.shared_dir or cfg.run.output_dir) / f"{cfg.run.name}-<timestamp>")
        sys.stdout.write(render_sbatch(spec))
        return 0
    from dynaresize.slurm import adapter
    from dynaresize.slurm.jobdir import new_run_dir, record_job

    reason = adapter.unavailable_reason()
    if reason:
        print(f"dynaresize submit: Slurm is not usable from here: {reason}", file=sys.stderr)
        return 2
    build_spec(cfg, "/validate")  # config mismatches fail before anything is created
    run_dir = new_run_dir(cfg)
    spec = build_spec(cfg, run_dir)
    job = adapter.HetSlurmExecutor(run_dir / "slurm").submit_spec(spec)
    record_job(run_dir, job.job_id)
    print(f"job id:  {job.job_id}  ({len(spec.components)} components, {spec.total_tasks} tasks)")
    print(f"run dir: {run_dir}")
    print(f"follow:  squeue -j {job.job_id}; tail -f {run_dir}/slurm/{job.job_id}_0_log.out {run_dir}/slurm/{job.job_id}.r0-coordinator.log")
    print(f"cancel:  scancel {job.job_id}   (every component; the run directory stays resumable)")
    if not args.wait:
        return 0
    end = follow(job, run_dir, cfg.run.steps if cfg.slurm.entry == "job" else cfg.slurm.probe_steps,
                 timeout_s=args.timeout, progress=cfg.run.progress)
    print(f"job {job.job_id}: {end.value}")
    return 0 if end in (SlurmJobState.COMPLETED, SlurmJobState.GONE) else 1
