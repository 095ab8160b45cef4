"""Losing ranks: a lost rollout rank is fenced off and the job shrinks onto the live ranks; a loss the running job
cannot absorb restarts every rank from the last checkpoint (local launches, ``faults.max_restarts``)."""

from __future__ import annotations

import logging
from typing import Callable

from dynaresize.events import format_ranks
from dynaresize.job.checkpointer import next_incarnation, resume_state, rewind_batches
from dynaresize.job.errors import JobError, RanksLost
from dynaresize.job.planner import Planner
from dynaresize.job.runtime import Job, Services, StepTimes
from dynaresize.job.snapshots import Snapshots
from dynaresize.job.state import JobState

log = logging.getLogger("dynaresize.job")


class Recovery:
    def __init__(self, job: Job, svc: Services, planner: Planner, snapshots: Snapshots | None = None):
        self.job, self.svc, self.planner = job, svc, planner
        self.snapshots = snapshots  # in-memory snapshots (faults.snapshot_every): a newer resume point than the disk's
        self.restarts = 0  # automatic restarts of the ranks in this process (faults.max_restarts)

    def can_shrink(self, ranks) -> bool:
        """Only rollout ranks can go while the job runs on: a trainer holds a ZeRO shard nobody else has, rank 0 is
        the weight source, and a trainer count must stay possible."""
        lost = set(self.job.state.lost) | set(ranks)
        return (self.job.cfg.faults.shrink and 0 not in ranks and all(r >= self.job.state.n_train for r in ranks)
                and bool(self.planner.valid_counts(lost)))

    def shrink(self, ranks, why: str) -> None:
        """Fence the lost ranks off (a hung process that comes back is refused), put their claimed samples back,
        and re-plan over the live ranks."""
        job, svc = self.job, self.svc
        svc.bus.check_epoch()  # a fenced coordinator fences no rank: they may be its successor's (FencedError)
        for r in ranks:
            inc = svc.registry.fence(r)
            job.events.emit("control", what="rank_lost", reason=why, rank=r, epoch=svc.bus.epoch)
            log.warning("rank %d lost (%s): fenced off (incarnation now %d)", r, why, inc)
        job.state.lost = sorted(set(job.state.lost) | set(ranks))
        for j in job.live_steps():
            for r in ranks:
                svc.queue.release(j, r)
        self.planner.rebuild()
        job.events.emit("control", what="shrink", reason=f"running on {len(job.alive())} of {job.world} ranks "
                        f"({format_ranks(job.alive())}); possible trainer counts {self.planner.valid_counts()}")

    def restart(self, e: RanksLost, stopping: str | None, forget: Callable[[], None]) -> bool:
        """Restart every rank from the last checkpoint (local launches only; bounded by faults.max_restarts).
        A new epoch fences off whatever the killed processes had in flight. ``stopping``: why the run stops, if it
        does (then nothing is started again); ``forget`` drops what the rollout planned since the checkpoint.
        Returns False when no restart is possible (the caller raises ``e``); True: the caller starts the ranks."""
        from dynaresize.control.commands import CommandBus, owner_record

        job, svc, cfg = self.job, self.svc, self.job.cfg
        if stopping is not None:  # never start ranks again while the run stops
            raise JobError(f"{e}; not restarted: the run is stopping ({stopping})") from None
        relaunch = getattr(svc.launcher, "relaunchable", False)
        if not relaunch or self.restarts >= cfg.faults.max_restarts:
            return False
        # a fenced coordinator (another one took the run over, which is likely why its ranks are gone) restarts
        # nothing and takes no epoch: FencedError, before any rank is stopped or any file written
        svc.bus.check_epoch()
        self.restarts += 1
        self.from_snapshot(e)  # the survivors write the newest whole snapshot as a checkpoint (or say why not)
        old = resume_state(job.run_dir, job.world) or JobState(n_train=cfg.cluster.initial_train)  # the newest intact checkpoint
        where = f"checkpoint {old.checkpoint} (step {old.step})" if old.checkpoint else "the start"
        job.events.emit("control", what="restart", reason=f"{e}; restart {self.restarts}/{cfg.faults.max_restarts}: "
                        f"every rank again from {where}")
        log.warning("%s: restarting every rank from %s (restart %d/%d)", e, where, self.restarts, cfg.faults.max_restarts)
        svc.launcher.stop(grace_s=0.0)
        old.incarnation = next_incarnation(job.run_dir)
        old.elapsed_s, old.loop_s = job.state.elapsed_s, job.state.loop_s
        job.state = old
        rewind_batches(job.run_dir, job.state.step, job.events)
        forget()
        job.last = StepTimes()
        owner = owner_record("restart", str(job.run_dir.resolve()), incarnation=job.state.incarnation)
        # the new epoch only while this coordinator's is still the job's (one script: no takeover slips in between)
        svc.bus = CommandBus(svc.redis, job.job_id, cfg.redis, events=job.events, owner=owner, after=svc.bus.epoch)
        self.planner.reset()
        return True

    def from_snapshot(self, e: RanksLost) -> bool:
        """Before the ranks stop: the survivors write the newest in-memory snapshot held whole as a checkpoint of
        its step, which the restart then resumes from (one line and a ``control`` ``snapshot_restore`` event); when
        none can be used, why (``snapshot_unused``) and the restart goes on from the last disk checkpoint."""
        job = self.job
        if self.snapshots is None:
            return False
        try:
            state, line = self.snapshots.materialise(e.ranks, self.restarts)
        except (OSError, JobError) as err:  # a Redis or disk failure on the way: the disk checkpoint, as before
            state, line = None, f"writing it failed: {err}"
        self.snapshots.forget()
        if state is None:
            if self.snapshots.every:
                line = f"the in-memory snapshot cannot be used: {line}; going on from the last disk checkpoint"
                log.warning("%s", line)
                job.events.emit("control", what="snapshot_unused", reason=line)
            return False
        log.warning("%s", line)
        job.events.emit("control", what="snapshot_restore", reason=line, step=state.step)
        return True
