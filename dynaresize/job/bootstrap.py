"""A run's start-up: the task, the reward and the model checked and loaded before any rank starts; the run's Redis
started shielded from an operator's stop; the services and the coordinator's components built from them."""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dynaresize.job.checkpointer import Checkpointer
from dynaresize.job.filtering import BatchAssembler
from dynaresize.job.journal import Journal
from dynaresize.job.planner import Planner
from dynaresize.job.ranks import Ranks
from dynaresize.job.recovery import Recovery
from dynaresize.job.reporting import Reporter
from dynaresize.job.rollout import RolloutWork
from dynaresize.job.snapshots import Snapshots
from dynaresize.job.runtime import Job, Services
from dynaresize.job.switching import Switching
from dynaresize.job.transport import Transport
from dynaresize.job.validation import Validation

log = logging.getLogger("dynaresize.job")


@dataclass
class Prepared:
    """What is loaded before the run's Redis starts (a bad task, reward or model fails here, before any rank)."""

    task: Any
    model_dir: Path
    tokenizer: Any
    assembler: BatchAssembler


@dataclass
class Parts:
    """The coordinator's components, each owning its decisions, built once the services are up."""

    svc: Services
    planner: Planner
    tx: Transport
    recovery: Recovery
    rollout: RolloutWork
    switching: Switching
    validation: Validation
    checkpointer: Checkpointer
    journal: Journal
    ranks: Ranks
    reporter: Reporter
    snapshots: Snapshots  # the coordinator's side of the in-memory snapshots (faults.snapshot_every)


def prepare(job: Job) -> Prepared:
    from dynaresize.models.store import ensure_model, load_tokenizer
    from dynaresize.rewards import load_reward
    from dynaresize.tasks.registry import load_task

    cfg = job.cfg
    task = load_task(cfg.task)
    if callable(getattr(task, "check_run", None)):
        task.check_run(cfg.run.steps, cfg.rollout.prompts_per_step)
    load_reward(cfg, task)  # an import path that does not resolve fails here, before any rank starts
    model_dir = ensure_model(cfg)
    _check_precision(cfg, model_dir)
    tokenizer = load_tokenizer(model_dir)
    _check_prompts(task, tokenizer, model_dir)
    _check_prompt_lengths(job, task, tokenizer, model_dir)
    if cfg.rollout.engine == "vllm":
        _check_vllm(job, model_dir)
    return Prepared(task, model_dir, tokenizer, BatchAssembler.from_config(cfg, task, tokenizer))


def _check_precision(cfg, model_dir: Path) -> None:
    """``train.precision`` against the model directory's dtype (``model.dtype: auto``): one message, not every
    trainer's error at its first engine build."""
    from dynaresize.engines.precision import resolve_precision
    from dynaresize.models.hf import model_dtype

    resolve_precision(cfg.train.precision, model_dtype(model_dir, cfg.model.dtype))


def _check_prompts(task, tokenizer, model_dir: Path) -> None:
    """Chat-message prompts need the model's chat template: one message naming the record, before ranks start."""
    from dynaresize.models.hf import check_chat_template

    where = task.chat_record() if callable(getattr(task, "chat_record", None)) else None
    if where is not None:
        check_chat_template(tokenizer, model_dir, where)


def _check_prompt_lengths(job: Job, task, tokenizer, model_dir: Path) -> None:
    """Every dataset prompt fits the model's context with rollout.max_tokens (dynaresize.tasks.prompt_length):
    overlong ones dropped and counted (on_overlong: filter) or one message naming the record (fail), never a
    failure mid-run."""
    from dynaresize.tasks.prompt_length import apply_prompt_limit, model_context, prompt_limit

    ro = job.cfg.rollout
    context, source = model_context(model_dir), "the model's context (max_position_embeddings)"
    if ro.engine == "vllm" and ro.vllm.max_model_len and (context is None or ro.vllm.max_model_len < context):
        context, source = ro.vllm.max_model_len, "rollout.vllm.max_model_len"
    limit = prompt_limit(context, ro.max_tokens, ro.max_prompt_tokens, source)
    report = apply_prompt_limit(task, tokenizer, limit, ro.on_overlong) if limit is not None else None
    if report is None:
        return
    log.warning("%s", report.describe())
    job.events.emit("control", what="prompts_filtered", reason=report.describe(), limit=limit.tokens,
                    dropped=report.dropped, kept=report.kept)
    if callable(getattr(task, "check_run", None)):  # fewer records now: the run's length checked again
        task.check_run(job.cfg.run.steps, ro.prompts_per_step)


def _check_vllm(job: Job, model_dir: Path) -> None:
    """rollout.engine=vllm: import vLLM and (on CPU) build the ranks' engine once in a child process, so that a
    missing install, an engine that cannot be built or a model directory vLLM cannot load is one message naming
    the cause and the setting (dynaresize.engines.rollout_vllm.VllmCheckError), not rank tracebacks and restarts."""
    from dynaresize.engines.rollout_vllm import preflight
    from dynaresize.models.hf import model_dtype

    cfg = job.cfg
    dtype = str(model_dtype(model_dir, cfg.model.dtype)).removeprefix("torch.")
    res = preflight(str(model_dir), cfg.rollout.vllm, cfg.cluster.device, seed=cfg.run.seed, dtype=dtype,
                    max_seqs=cfg.rollout.kv_slots)
    job.events.emit("control", what="vllm_check", reason=f"vLLM imports and builds on {cfg.cluster.device}",
                    import_s=round(res.get("import_s", 0.0), 2), build_s=round(res.get("build_s", 0.0), 2))


def redis_server(job: Job, stop_requested: threading.Event, resume: bool = False):
    """The run's redis-server, supervised (a crash comes back from its append-only file), started shielded. This
    coordinator is recorded as its supervisor, with how it came to the run: a coordinator it replaces leaves the
    server alone from then on, and can say who took the run over even once the server is gone."""
    from dynaresize.control.commands import owner_record
    from dynaresize.control.server import RedisServer

    return shielded(RedisServer(job.cfg.redis, job.run_dir, supervise=True,
                                on_restart=lambda why: job.events.emit("control", what="redis_restarted", reason=why),
                                owner_stopping=stop_requested.is_set,  # not a stop's shutdown
                                supervisor=owner_record("resume" if resume else "start", str(job.run_dir.resolve()))))


@contextmanager
def shielded(srv):
    """Start the run's redis-server with SIGTERM and SIGINT blocked, so that it, and every server its watchdog
    starts again (the watchdog thread is created meanwhile and keeps the mask), inherits them blocked: an
    operator's stop sent to every process of the job leaves Redis serving the stop's checkpoint; the coordinator
    SHUTDOWNs it at the end. Only this thread's mask changes, and only while the server starts."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        srv.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        yield srv
    finally:
        srv.stop()


def connect(job: Job, srv, prepared: Prepared, metrics, on_redis_ready: Callable[[Any], None] | None,
            resume: bool = False) -> Services:
    """The coordinator's clients of the run's Redis; taking the command bus fences off any older coordinator. Only a
    ``resume`` may take over a job that has an epoch already (a fresh start there is refused: ``EpochTaken``)."""
    from dynaresize.control.commands import CommandBus, owner_record
    from dynaresize.control.health import RoundTrips
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import connect as connect_redis
    from dynaresize.contract.workqueue import RolloutQueue

    cfg = job.cfg
    # while the watchdog brings a crashed server back (a full disk waited out included) the coordinator waits too
    # every round trip measured: a window in which Redis was slow is nobody's silence (dynaresize.control.health)
    health = RoundTrips(slow_after_s=cfg.redis.heartbeat_s)
    r = connect_redis(srv.endpoint_file, role="coordinator", cfg=cfg.redis, outage=srv.reviving.is_set, round_trips=health)
    if on_redis_ready is not None:
        on_redis_ready(srv)
    owner = owner_record("resume" if resume else "start", str(job.run_dir.resolve()), incarnation=job.state.incarnation)
    bus = CommandBus(r, job.job_id, cfg.redis, events=job.events, owner=owner, fresh=not resume)  # fences any older one
    return Services(srv=srv, redis=r, bus=bus, registry=Registry(r, job.job_id, cfg.redis), queue=RolloutQueue(r, job.job_id),
                    task=prepared.task, model_dir=prepared.model_dir, tokenizer=prepared.tokenizer,
                    assembler=prepared.assembler, metrics=metrics, health=health)


def wire(job: Job, svc: Services, planner: Planner, launcher_factory: Callable[..., Any] | None,
         stop_requested: threading.Event, on_step: Callable[[dict], None] | None) -> Parts:
    tx = Transport(job, svc)
    snapshots = Snapshots(job, svc, tx)
    recovery = Recovery(job, svc, planner, snapshots)
    checkpointer = Checkpointer(job, svc, tx)
    return Parts(svc=svc, planner=planner, tx=tx, recovery=recovery, rollout=RolloutWork(job, svc),
                 switching=Switching(job, tx), validation=Validation(job, svc),
                 checkpointer=checkpointer, journal=Journal(job, svc),
                 ranks=Ranks(job, svc, tx, planner, launcher_factory, stop_requested), reporter=Reporter(job, svc, on_step),
                 snapshots=snapshots)
