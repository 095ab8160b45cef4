"""What each task of the het job runs: ``python -m dynaresize.slurm.entry {coordinator|worker} --run-dir DIR``.

Component 0 runs ``coordinator`` (one task), component 1 runs ``worker`` (one task per GPU). Both read the
resolved ``<run_dir>/config.yaml`` written at submit time, build a :class:`SlurmContext` (config, run directory,
Slurm identity, preemption hook) and hand it to the main job, found lazily so this module never imports torch:

==============  =====================================================================================
coordinator     ``dynaresize.slurm.coordinator_component.run_coordinator(ctx: SlurmContext) -> int``
worker          ``dynaresize.worker.main.run_worker(ctx: SlurmContext) -> int``
==============  =====================================================================================

The coordinator must start the run's Redis (``dynaresize.control.server.RedisServer(cfg.redis, run_dir)``),
then call :func:`dynaresize.slurm.rendezvous.publish`; workers call :func:`dynaresize.slurm.rendezvous.wait`
to get the endpoint file of the current job incarnation (see :mod:`dynaresize.slurm.rendezvous`). On a requeue
``ctx.resume`` is true and the job resumes from its checkpoint in the run directory. The coordinator registers
its checkpoint with ``ctx.preemption.on_checkpoint(fn)`` and calls ``ctx.preemption.poll()`` between steps
(see :mod:`dynaresize.slurm.preempt`). With ``slurm.entry=probe`` the built-in :mod:`dynaresize.slurm.probe` runs
instead (it tests the Slurm plumbing without the main job).

Signals and faults (checked on Slurm 22.05, see docs/slurm.md): the coordinator watches USR2 (time limit) and
SIGTERM on a thread with both blocked, so its embedded Redis survives them; a SIGTERM of Slurm's preemption becomes
checkpoint + self-requeue (:mod:`dynaresize.slurm.preempt`), any other goes to the coordinator's own handler. A
worker rank defers SIGTERM (:class:`~dynaresize.slurm.preempt.TermDeferral`) until the coordinator has checkpointed
it and sent ``shutdown``. A lost rollout rank is the coordinator's business (it shrinks the job; the worker srun
runs with ``--kill-on-bad-exit=0`` so the other tasks live on). When ``run_coordinator`` raises
``dynaresize.job.errors.RanksLost`` (a loss the job cannot absorb: a trainer, rank 0, a rank inside a
collective), every rank must start again from the last checkpoint; srun cannot relaunch the tasks of a running step,
so this entry requeues the whole job (``scontrol requeue``), at most ``faults.max_restarts`` times per run directory
(counted in ``<run_dir>/slurm/relaunches.json``), with a ``control`` event ``restart``.

``python -m dynaresize.slurm.entry prepare CONFIG [overrides] --job-id N`` prints the run directory for
``slurm/dynaresize.sbatch`` (created on the job's first start, reused after a requeue), and ``check --run-dir``
refuses an allocation whose shape does not match the config.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dynaresize import atomic
from dynaresize.config.loader import ConfigError
from dynaresize.config.schema import Config
from dynaresize.slurm import identity as identity_mod
from dynaresize.slurm.identity import SlurmIdentity
from dynaresize.slurm.preempt import PreemptAction, PreemptDecision, Preemption, TermDeferral
from dynaresize.slurm.jobdir import load_run_config, prepare_in_job
from dynaresize.slurm.spec import COORDINATOR_LISTENS_ENV, USR2_SEEN_ENV

log = logging.getLogger("dynaresize.slurm.entry")

RELAUNCH_FILE = "relaunches.json"  # <run_dir>/slurm/: the requeues this entry made after lost ranks

JOB_ENTRY_POINTS = {
    "coordinator": ("dynaresize.slurm.coordinator_component", "run_coordinator"),
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


def _preempt_time(leader: str) -> str | None:
    from dynaresize.slurm.adapter import preempt_time

    return preempt_time(leader)


def make_context(role: str, run_dir: str | Path, env: dict[str, str] | None = None) -> SlurmContext:
    run_dir = Path(run_dir).absolute()
    cfg = load_run_config(run_dir)
    ident = identity_mod.from_env(os.environ if env is None else env)
    pre = None
    if role == "coordinator":
        pre = Preemption(
            ident.job_id if ident else None, ident.restart_count if ident else 0,
            cfg.slurm.requeue, cfg.slurm.max_requeues, _requeue,
            is_preempted=(lambda: _preempt_time(ident.job_id)) if ident else None,
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


def take_early_warning(pre: Preemption, env) -> bool:
    """The batch shell's half of the USR2 hand-over (see ``sbatch.LAUNCH_BODY``): a warning can reach the shell before
    this coordinator listens (Slurm sends it 2-32 s after the start when ``signal_before_s`` is close to the time
    limit, e.g. during the environment check). The shell records it in ``DYNARESIZE_USR2_SEEN`` and forwards later
    ones only once ``DYNARESIZE_COORDINATOR_LISTENS`` exists; this side creates that file first, then looks for the
    record, so a warning is never lost between the two (it may be taken twice: :meth:`Preemption.trigger` is
    idempotent). Call after :meth:`Preemption.install`. True when an earlier warning was taken."""
    listens, seen = env.get(COORDINATOR_LISTENS_ENV), env.get(USR2_SEEN_ENV)
    if listens:
        Path(listens).touch()
    if seen and Path(seen).exists():
        log.warning("preemption: the batch shell received Slurm's warning before this coordinator listened")
        pre.trigger()
        return True
    return False


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
            ctx.preemption.install(watch_term=ctx.identity is not None)
            take_early_warning(ctx.preemption, os.environ)
        elif ctx.identity is not None:
            TermDeferral(ctx.cfg.slurm.worker_term_timeout_s, coordinator_gone(ctx.run_dir, ctx.identity.job_id,
                                                                              ctx.identity.restart_count)).install()
        who = ctx.identity.to_json() if ctx.identity else "outside Slurm"
        log.info("%s starting in %s as %s", args.role, ctx.run_dir, who)
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
        if _ranks_lost(e):
            return relaunch(ctx, str(e).splitlines()[0])
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        cur = rendezvous.read(ctx.run_dir)
        if cur is None or (cur.job_id, cur.restart_count) != (job, restart):
            rendezvous.publish(ctx.run_dir, job, restart, None, error=error)


def coordinator_gone(run_dir: Path, job_id: str, restart_count: int):
    """For a worker's :class:`TermDeferral`: True when this incarnation's coordinator is known to be gone (it
    published a failure, or its Redis refuses connections); False while it is not up yet or answers."""
    from dynaresize.control.server import Endpoint
    from dynaresize.slurm import rendezvous

    def gone() -> bool:
        rv = rendezvous.read(run_dir)
        if rv is None or (rv.job_id, rv.restart_count) != (job_id, restart_count):
            return False
        if rv.error or not rv.endpoint_file:
            return True
        ep = Endpoint.load(rv.endpoint_file)
        try:
            socket.create_connection((ep.host, ep.port), timeout=2.0).close()
            return False
        except OSError:
            return True

    return gone


def _ranks_lost(e: BaseException) -> bool:
    """Whether the main job's coordinator gave up on lost ranks (it relaunches them itself only in local runs)."""
    try:
        from dynaresize.job.errors import RanksLost
    except ImportError:
        return False
    return isinstance(e, RanksLost)


def decide_relaunch(done: int, limit: int, requeue_enabled: bool) -> PreemptDecision:
    """Pure: ranks were lost and every rank must start again from the checkpoint; requeue the job or give up."""
    if not requeue_enabled:
        return PreemptDecision(PreemptAction.STOP, "ranks lost; slurm.requeue is off (or not under Slurm): the job fails, resubmit to resume")
    if done >= limit:
        return PreemptDecision(PreemptAction.STOP, f"ranks lost; the job was already requeued {done} times for lost ranks (faults.max_restarts={limit}): the job fails")
    return PreemptDecision(PreemptAction.REQUEUED, f"ranks lost; requeue {done + 1} of at most {limit} for lost ranks: every rank starts again from the last checkpoint")


def _relaunches(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "slurm" / RELAUNCH_FILE
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{p}: unreadable relaunch record ({e}); delete it to reset the count of relaunches") from None
    if not isinstance(data, dict) or not isinstance(data.get("relaunches"), list):
        raise RuntimeError(f"{p}: want {{\"relaunches\": [...]}}, got {str(data)[:200]!r}; delete it to reset the count")
    return data["relaunches"]


def relaunch(ctx: SlurmContext, why: str) -> int:
    """The coordinator lost ranks it cannot do without (``why``): requeue the whole job so that every rank starts
    again from the last checkpoint, at most ``faults.max_restarts`` times; else fail (exit 1)."""
    from dynaresize.events import EventLog

    ident = ctx.identity
    history = _relaunches(ctx.run_dir)
    d = decide_relaunch(len(history), ctx.cfg.faults.max_restarts, bool(ctx.cfg.slurm.requeue and ident is not None))
    log.error("%s: %s", why, d.reason)
    if d.action is not PreemptAction.REQUEUED:
        return 1
    assert ident is not None
    p = Path(ctx.run_dir) / "slurm" / RELAUNCH_FILE
    history.append({"job_id": ident.job_id, "restart_count": ident.restart_count, "t": time.time(), "why": why})
    atomic.write_json(p, {"relaunches": history}, indent=1)  # counted before the requeue: Slurm kills this process right after it
    with EventLog(Path(ctx.run_dir) / "events.jsonl") as events:
        events.emit("control", what="restart", reason=f"{why}; Slurm job {ident.job_id}: {d.reason}")
    try:
        _requeue(ident.job_id)
    except Exception as e:  # noqa: BLE001 - the run directory stays resumable by hand
        log.error("requeue of job %s failed: %s; resubmit the run directory to resume", ident.job_id, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
