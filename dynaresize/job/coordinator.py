"""The coordinator: starts the run, hands the schedule to the scheduler core, ends the run.

One-step-off pipeline with staleness bound ``s`` (``pipeline.staleness_bound``, default 1): while trainers train
on batch ``k`` (producing policy version ``k+1``), rollout ranks already generate batch ``k+s`` with version ``k``.
The pure scheduler core (:mod:`dynaresize.schedule`) decides every command, driven by
:class:`dynaresize.job.core_driver.ContinuousSchedule`: ``pipeline.schedule: barrier_free`` (the default: continuous
rollout, streaming training) or ``barrier`` (the static one-step-off baseline); docs/schedule.md. Resizes go
through the pure resizing policy (the simulator runs the very same code); ranks change role in place (no process
restart, no new communicator), each switch a short list of fine-grained operations in the event log.

Invariants (tested): batch ``k`` only holds samples of versions ``>= k - s``; every sample is seeded by (seed, step,
prompt, index), so which rank generates it never changes it; a resize in the middle of a rollout neither drops nor
duplicates a sample (the work queue is keyed by sample).

Stop and resume: SIGINT/SIGTERM ask for a stop; the step in flight finishes, the ranks stage their state under
``checkpoints/``, the coordinator writes ``checkpoints/coordinator.json``, and ``dynaresize run --resume RUN_DIR``
continues with the same step counter. A second signal stops at once (resume then starts from the last checkpoint;
samples already generated stay in the run's Redis and are reused, never generated twice); during the final
checkpoint it abandons that checkpoint (the ranks are still shut down cleanly). An operator's stop reaches EVERY
process of the job at once (``pkill``, ``kill`` of the process list): the ranks defer it until the coordinator's
``shutdown`` (like under Slurm), the embedded redis-server is started with both signals blocked (it serves the
stop's checkpoint; it is SHUTDOWN at the end), and nothing is restarted while the run stops.

This module is the loop only; each decision lives in a component of its own (built by
:func:`dynaresize.job.bootstrap.wire`, sharing the typed :class:`~dynaresize.job.runtime.Job` and
:class:`~dynaresize.job.runtime.Services`): ``transport`` (command ids from an explicit :class:`Phase`, acks,
liveness), ``ranks``, ``planner``, ``recovery``, ``rollout``, ``training``, ``switching``, ``validation``,
``checkpointer``, ``journal``, ``reporting``. The Slurm entry point is :mod:`dynaresize.slurm.coordinator_component`.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from dynaresize.config.loader import write_resolved
from dynaresize.config.schema import Config
from dynaresize.control.commands import FencedError, who_took_over
from dynaresize.control.server import RedisRefusesWrites, redis_error_text
from dynaresize.disk import describe, is_disk_full
from dynaresize.events import EventLog, format_ranks
from dynaresize.job import bootstrap
from dynaresize.job.bootstrap import Parts
from dynaresize.job.checkpointer import next_incarnation, resume_state, rewind_batches
from dynaresize.job.errors import JobError, OperatorStop, RanksLost, where_stopped
from dynaresize.job.core_driver import ContinuousSchedule
from dynaresize.job.planner import Planner
from dynaresize.job.ranks import kill_leftovers
from dynaresize.job.reporting import open_metrics, summary
from dynaresize.job.runtime import Job
from dynaresize.job.state import JobState
from dynaresize.job.transport import Phase

log = logging.getLogger("dynaresize.job")


@dataclass
class Coordinator:
    cfg: Config
    run_dir: Path
    resume: bool = False
    launcher_factory: Callable[..., Any] | None = None  # (run_dir, world, job_id, device) -> launcher; default local
    on_step: Callable[[dict], None] | None = None  # progress callback (the CLI's progress bar)
    on_redis_ready: Callable[[Any], None] | None = None  # called with the RedisServer once it answers (Slurm rendezvous)
    preemption: Any | None = None  # dynaresize.slurm.preempt.Preemption: USR2 -> checkpoint -> requeue, polled per step
    stop_requested: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        st = resume_state(self.run_dir, self.cfg.cluster.gpus) if self.resume else None
        st = st or JobState(n_train=self.cfg.cluster.initial_train)
        st.incarnation = next_incarnation(self.run_dir)  # counts starts, checkpointed or not
        self.job = Job(self.cfg, self.run_dir, st)
        self.at = Phase("start")  # where in the schedule commands are sent from now (part of their ids)
        self.parts: Parts | None = None  # the components, built once the run's Redis answers
        self.operator_stop: OperatorStop | None = None  # set by the first SIGTERM/SIGINT
        self.segment = None  # a takeover on the core: the schedule.jsonl segment to replay (dynaresize.job.takeover)

    @property
    def state(self) -> JobState:
        return self.job.state

    def install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, exit. Second: stop now (while the ranks are being shut
        down: abandon the checkpoint in progress, if any, and go on shutting them down)."""

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if not self.stop_requested.is_set():
                self.operator_stop = OperatorStop(name, self.job.state.step)
                log.warning("%s: an operator's stop: the step in flight finishes, then every rank is checkpointed and "
                            "shut down (send it again to stop sooner)", name)
                self.stop_requested.set()
                return
            in_progress = self.parts.checkpointer.in_progress if self.parts else None
            if self.parts and self.parts.ranks.stopping and in_progress is None:
                log.warning("%s again: already shutting the ranks down", name)
                return
            log.warning("%s again: stopping now%s", name, " (the checkpoint in progress is abandoned)" if in_progress else "")
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # ---------------------------------------------------------------------------------------------------------
    # the run: bootstrap, start (or take over) the ranks, the loop, the end

    def run(self) -> dict[str, Any]:
        job = self.job
        write_resolved(self.cfg, self.run_dir)
        job.events = EventLog(self.run_dir / "events.jsonl")
        self._announce()
        status, fenced, metrics, incomplete = "failed", False, None, None
        try:
            metrics = open_metrics(job)
            prepared = bootstrap.prepare(job)
            planner = Planner(job)
            with bootstrap.redis_server(job, self.stop_requested, resume=self.resume) as srv:
                svc = bootstrap.connect(job, srv, prepared, metrics, self.on_redis_ready, resume=self.resume)
                if self.resume:
                    self._catch_up(planner)
                p = self.parts = bootstrap.wire(job, svc, planner, self.launcher_factory, self.stop_requested, self.on_step)
                attached = self._take_over(p)
                try:
                    self._start_and_loop(p, attached)
                    status = "interrupted" if job.state.step < self.cfg.run.steps else "completed"
                    checkpoint = True
                except KeyboardInterrupt:  # a second signal: stop now; resume from the last checkpoint
                    status, checkpoint = "interrupted", False
                    if self.operator_stop is not None:
                        self.operator_stop.abandoned = "a second signal stopped it at once, without a checkpoint"
                except RedisRefusesWrites as e:  # a Redis problem, not a rank's: stop cleanly, say why and how to go on
                    checkpoint, p.tx.writes_refused = False, True
                    raise JobError(f"{e}; {self._where_stopped()}; fix Redis first") from None
                except BaseException as e:  # a rank died or a command failed: the last checkpoint stays the resume point
                    superseded = fenced_by(e, srv, job)
                    if superseded is not None:  # a newer coordinator owns the run: leave its ranks and its Redis alone
                        fenced = True
                        srv.detach()
                        p.ranks.stop_superseded()  # only this one's own processes of a launch the job left behind
                        if superseded is e:
                            raise
                        raise superseded from None
                    checkpoint = False
                    if isinstance(e, redis.ConnectionError) and srv.failure is not None:
                        # the watchdog gave up restarting Redis: why, not the client's symptom
                        raise JobError(f"the run's Redis is gone: {srv.failure}; {self._where_stopped()}") from None
                    if isinstance(e, redis.ConnectionError):
                        raise JobError(f"the run's Redis does not answer ({e}); {self._where_stopped()}") from None
                    if is_disk_full(e):  # a file of the run could not be written: named, with the space left
                        what = describe(e.filename, e) if isinstance(e, OSError) else str(e)
                        raise JobError(f"{what}; {self._where_stopped()}; free space first") from None
                    if isinstance(e, redis.ResponseError):  # never a raw Lua error
                        raise JobError(f"{redis_error_text(e)}; {self._where_stopped()}") from None
                    raise
                finally:
                    if not fenced:
                        p.ranks.shut_down(self.at, checkpoint, p.checkpointer, self.operator_stop)
                if status == "completed":  # never 'completed' while the final checkpoint (its weights) is not on disk
                    incomplete = p.checkpointer.unsaved()
                    if incomplete is not None:
                        status = "incomplete"
                        log.error("%s", incomplete)
                        job.events.emit("control", what="incomplete", reason=incomplete)
        finally:
            if metrics is not None:
                metrics.close()
            try:
                if not fenced:
                    job.events.emit("run_end", status=status, steps=job.state.step)
                job.events.close()
            except OSError as e:  # the run directory's disk may be the full one: the error above says what happened
                log.warning("could not log the run's end: %s", e)
        return summary(job, status, self.operator_stop, incomplete)

    def _where_stopped(self) -> str:
        return where_stopped(self.job.state.step, self.job.state.checkpoint)

    def _announce(self) -> None:
        job, st = self.job, self.job.state
        if not self.resume:
            job.events.emit("run_start", run_id=job.run_dir.name, job_id=job.job_id, source="runtime", world_size=job.world, wall_time=job.events.t0,
                            train_ranks=format_ranks(job.trainers()), rollout_ranks=format_ranks(job.rollouts()))
            job.events.emit("topology", step=0, train_ranks=format_ranks(job.trainers()), rollout_ranks=format_ranks(job.rollouts()))
        else:
            job.events.emit("control", what="resume", reason=f"incarnation {st.incarnation} from step {st.step}")

    def _catch_up(self, planner: Planner) -> None:
        """A resume holds the run's epoch now (the coordinator it replaces is fenced off at its next write to Redis),
        but it read the checkpoint before: a coordinator still running meanwhile may have written a newer one (or
        finished the run). Start from the newest, never from an older one (that would train its steps again)."""
        from dynaresize.job import checkpoint_files as ckpt

        newest = ckpt.select_resume(self.run_dir, self.cfg.cluster.gpus)  # looks only: resume_state reports and repairs
        if newest is None or newest.state.step <= self.job.state.step:
            return
        st = resume_state(self.run_dir, self.cfg.cluster.gpus)
        if st is None or st.step <= self.job.state.step:
            return
        st.incarnation = self.job.state.incarnation
        self.job.state = st
        planner.reset()
        self.job.events.emit("control", what="resume", reason=f"incarnation {st.incarnation} from step {st.step}: the "
                             "checkpoint the previous coordinator wrote before this one took the run over")
        log.warning("resume: the previous coordinator checkpointed step %d before this one took the run over: "
                    "going on from there", st.step)

    def _take_over(self, p: Parts) -> bool:
        """A resume takes the ranks of a live earlier launch over (the journal), or clears what is left of it."""
        attached = self.resume and p.journal.attach(p.planner, own_launcher=self.launcher_factory is not None)
        if attached:  # the core's schedule goes on from the start of its segment, replayed
            from dynaresize.job.takeover import last_segment

            self.segment = last_segment(self.run_dir)
            st = JobState(**self.segment.state)
            st.elapsed_s, st.loop_s = max(st.elapsed_s, self.job.state.elapsed_s), max(st.loop_s, self.job.state.loop_s)
            self.job.state = st
            p.planner.reset()
        if self.resume and not attached:
            kill_leftovers(self.run_dir)  # an incomplete earlier launch cannot be used
            rewind_batches(self.run_dir, self.job.state.step, self.job.events)
        if self.preemption is not None:
            self.preemption.on_checkpoint(lambda reason="": p.checkpointer.checkpoint(self.at, reason))
        return attached

    def _start_and_loop(self, p: Parts, attached: bool) -> None:
        """Start the ranks (unless taken over), then the loop. A loss the running job cannot absorb restarts every
        rank from the checkpoint (``faults.max_restarts``)."""
        while True:
            try:
                if not attached:
                    p.ranks.start(self.at)
                attached = False
                p.journal.write()
                self.loop()
                return
            except RanksLost as e:  # a loss the running job cannot absorb: all ranks from the checkpoint
                if not p.recovery.restart(e, self._stopping(), p.rollout.forget):
                    raise

    def _stopping(self) -> str | None:
        if not self.stop_requested.is_set():
            return None
        return f"{self.operator_stop.signal}, an operator's stop" if self.operator_stop else "a stop was requested"

    # ---------------------------------------------------------------------------------------------------------
    # the schedule

    def loop(self) -> None:
        """The schedule on the scheduler core (``job.core_driver``), with or without its step barrier."""
        self.at = Phase(f"c{self.job.state.step}")
        segment, self.segment = self.segment, None  # a takeover replays it once; a restart starts a new one
        ContinuousSchedule(self.job, self.parts, self.at, self.stop_requested.is_set, self.preemption, takeover=segment).run()


def fenced_by(err: BaseException, srv, job: Job) -> FencedError | None:
    """The error as a fence when it means a newer coordinator owns the run: a ``FencedError`` (it fenced this one
    off in Redis), or the run's Redis gone after a newer coordinator adopted it (it may have finished the run and shut
    the server down while this one hung: the supervisor record in the Redis directory says who)."""
    if isinstance(err, FencedError):
        return err
    if not isinstance(err, redis.ConnectionError):
        return None
    newer = srv.superseded_by()
    if newer is None:
        return None
    return FencedError(f"job {job.job_id}: {who_took_over(newer, None, job.job_id, str(job.run_dir.resolve()))} "
                       f"(it adopted the run's Redis, which no longer answers)")
