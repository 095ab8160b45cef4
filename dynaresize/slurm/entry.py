"""What each task of the het job runs: ``python -m dynaresize.slurm.entry {coordinator|worker} --run-dir DIR``.

Component 0 runs ``coordinator`` (one task), component 1 runs ``worker`` (one task per GPU). Both read the
resolved ``<run_dir>/config.yaml`` written at submit time, build a :class:`SlurmContext` (config, run directory,
Slurm identity, preemption hook) and hand it to the main job, found lazily so this module never imports torch:

==============  =====================================================================================
coordinator     ``dynaresize.job.coordinator.run_coordinator(ctx: SlurmContext) -> int``
worker          ``dynaresize.worker.main.run_worker(ctx: SlurmContext) -> int``
==============  =====================================================================================

The coordinator must start the run's Redis (``dynaresize.control.server.RedisServer(cfg.redis, run_dir)``),
then call :func:`dynaresize.slurm.rendezvous.publish`; workers call :func:`dynaresize.slurm.rendezvous.wait`
to get the endpoint file of the current job incarnation (see :mod:`dynaresize.slurm.rendezvous`). On a requeue
``ctx.resume`` is true and the job resumes from its checkpoint in the run directory. The coordinator registers
its checkpoint with ``ctx.preemption.on_checkpoint(fn)`` and calls ``ctx.preemption.poll()`` between steps
(see :mod:`dynaresize.slurm.preempt`). With ``slurm.entry=probe`` the built-in :mod:`dynaresize.slurm.probe` runs
instead (it tests the Slurm plumbing without the main job).

``python -m dynaresize.slurm.entry prepare CONFIG [overrides] --job-id N`` prints the run directory for
``slurm/dynaresize.sbatch`` (created on the job's first start, reused after a requeue), and ``check --run-dir``
refuses an allocation whose shape does not match the config.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dynaresize.config.loader import ConfigError
from dynaresize.config.schema import Config
from dynaresize.slurm import identity as identity_mod
from dynaresize.slurm.identity import SlurmIdentity
from dynaresize.slurm.preempt import Preemption
from dynaresize.slurm.rundir import load_run_config, prepare_in_job

JOB_ENTRY_POINTS = {
    "coordinator": ("dynaresize.job.coordinator", "run_coordinator"),
    "worker": ("dynaresize.worker.main", "run_worker"),
}


@dataclass(frozen=True)
class SlurmContext:
    """Everything a component needs from the Slurm layer."""

    cfg: Config
    run_dir: Path
    identity: SlurmIdentity | None  # None when run outside Slurm (tests)
    preemption: Preemption | None  # coordinator only: the USR2 -> checkpoint -> requeue hook
    resume: bool  # True after a requeue (SLURM_RESTART_COUNT > 0) or when the run dir holds a checkpoint


def _requeue(leader: str) -> None:
    from dynaresize.slurm.adapter import requeue

    requeue(leader)


def make_context(role: str, run_dir: str | Path, env: dict[str, str] | None = None) -> SlurmContext:
    run_dir = Path(run_dir).absolute()
    cfg = load_run_config(run_dir)
    ident = identity_mod.from_env(os.environ if env is None else env)
    pre = None
    if role == "coordinator":
        pre = Preemption(
            ident.job_id if ident else None, ident.restart_count if ident else 0,
            cfg.slurm.requeue, cfg.slurm.max_requeues, _requeue,
        )
    resume = bool(ident and ident.restart_count > 0) or (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    return SlurmContext(cfg, run_dir, ident, pre, resume)


def resolve(role: str, cfg: Config) -> Callable[[SlurmContext], int]:
    """The function that runs ``role`` for this config (probe or main job). Raises RuntimeError when missing."""
    if cfg.slurm.entry == "probe":
        from dynaresize.slurm import probe

        return probe.run_coordinator if role == "coordinator" else probe.run_worker
    module, name = JOB_ENTRY_POINTS[role]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise RuntimeError(f"{module} is not available in this build: the main job cannot run under Slurm yet (slurm.entry=probe tests the plumbing)") from None
        raise
    fn = getattr(mod, name, None)
    if fn is None:
        raise RuntimeError(f"{module}.{name}(ctx) is missing: the main job does not provide its Slurm entry point yet (slurm.entry=probe tests the plumbing)")
    return fn


def allocation_problems(cfg: Config, env: dict[str, str]) -> list[str]:
    """Pure: why this allocation cannot run ``cfg`` (empty when it can). For hand-edited sbatch headers."""
    problems = []
    if env.get("SLURM_HET_SIZE") != "2":
        problems.append(f"SLURM_HET_SIZE={env.get('SLURM_HET_SIZE')!r}: the job needs 2 het components (an '#SBATCH hetjob' line)")
        return problems
    workers = env.get("SLURM_NTASKS_HET_GROUP_1") or env.get("SLURM_NPROCS_HET_GROUP_1")
    if workers != str(cfg.cluster.gpus):
        problems.append(f"component 1 has {workers} tasks but cluster.gpus = {cfg.cluster.gpus} (one rank per GPU): fix --nodes/--ntasks-per-node")
    coord = env.get("SLURM_NTASKS_HET_GROUP_0") or env.get("SLURM_NPROCS_HET_GROUP_0")
    if coord not in (None, "1"):
        problems.append(f"component 0 has {coord} tasks; the coordinator needs exactly 1")
    if cfg.cluster.device == "cuda" and not env.get("SLURM_GPUS_PER_NODE_HET_GROUP_1"):
        problems.append("cluster.device = cuda but component 1 requests no GPUs (--gpus-per-node)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynaresize.slurm.entry", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("coordinator", "worker"):
        s = sub.add_parser(role)
        s.add_argument("--run-dir", required=True)
    s = sub.add_parser("check")
    s.add_argument("--run-dir", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--job-id", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(name)s %(levelname)s: %(message)s")
    try:
        if args.role == "prepare":
            print(prepare_in_job(args.config, args.overrides, args.job_id))
            return 0
        if args.role == "check":
            problems = allocation_problems(load_run_config(args.run_dir), dict(os.environ))
            for msg in problems:
                print(f"dynaresize: allocation does not match the config: {msg}", file=sys.stderr)
            return 2 if problems else 0
        ctx = make_context(args.role, args.run_dir)
        if ctx.preemption is not None:
            ctx.preemption.install()
        who = ctx.identity.to_json() if ctx.identity else "outside Slurm"
        logging.getLogger("dynaresize.slurm.entry").info("%s starting in %s as %s", args.role, ctx.run_dir, who)
        if args.role == "coordinator":
            return _run_coordinator(ctx)
        return int(resolve(args.role, ctx.cfg)(ctx) or 0)
    except (ConfigError, identity_mod.IdentityError, RuntimeError, TimeoutError) as e:
        print(f"dynaresize.slurm.entry {args.role}: {e}", file=sys.stderr)
        return 2


def _run_coordinator(ctx: SlurmContext) -> int:
    """Run the coordinator; if it ends without publishing its endpoint, tell the ranks (they stop, not time out)."""
    from dynaresize.slurm import rendezvous

    job = ctx.identity.job_id if ctx.identity else "local"
    restart = ctx.identity.restart_count if ctx.identity else 0
    error = "the coordinator ended before publishing its Redis endpoint"
    try:
        return int(resolve("coordinator", ctx.cfg)(ctx) or 0)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        cur = rendezvous.read(ctx.run_dir)
        if cur is None or (cur.job_id, cur.restart_count) != (job, restart):
            rendezvous.publish(ctx.run_dir, job, restart, None, error=error)


if __name__ == "__main__":
    sys.exit(main())
