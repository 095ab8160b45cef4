"""The hand-out of rollout work in the runtime's schedule: a rollout rank with room for groups says so to the core
(``RankReady``, :meth:`HandOut.ready`); the core's ``Assign`` becomes ``generate`` commands of that batch's prompts
with that version, its ``Validate`` a validation pass's; a generate's acked groups are judged (reward failures, and with
dynamic sampling whether each group carries a signal) before the core selects the batch from them.

And a resume's batches: those generated before the checkpoint (k .. k+s-1) are published again and checked complete
(:func:`resumed_batches`); an extended run knows the first batch its earlier run never generated
(:func:`generated_before`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from dynaresize.job.delivery import Delivery
from dynaresize.job.errors import JobError
from dynaresize.job.filtering import UnfilledBatchError
from dynaresize.job.flight import Commands
from dynaresize.job.runtime import Job
from dynaresize.job.takeover import last_segment
from dynaresize.schedule import Assign, PipelineScheduler, RankReady, Role, Validate
from dynaresize.schedule.codec import decode

log = logging.getLogger("dynaresize.job")

# Groups a rollout rank holds beyond its KV slots' worth: one, so its refill never waits a control-plane round trip,
# and no more, so a batch's last groups go to the rank that frees first instead of queueing behind a busy one's (a
# whole second command queued: 0.7-0.9% less throughput on the emulated 8-GPU job, none queued: 2.7% less;
# docs/schedule.md "What a rollout rank holds").
QUEUED_GROUPS = 1


class HandOut:
    """Rollout work from the core's plan to the ranks' ``generate`` commands, and the acked groups back to it."""

    def __init__(self, job: Job, parts, commands: Commands, core: PipelineScheduler, delivery: Delivery,
                 published: set[int], replaying: Callable[[], bool]):
        self.job, self.cfg, self.p = job, job.cfg, parts
        self.commands, self.core, self.delivery = commands, core, delivery
        self.published = published  # the batches whose work items are in the work queue
        self.replaying = replaying  # a takeover's replay: what the old coordinator recorded is not recorded again
        self.validating: dict[int, float] = {}  # version -> when its validation pass was first handed out

    def ready(self, rank: int, queued: int = QUEUED_GROUPS) -> RankReady | None:
        """The rank has room for groups: its KV slots' worth (``rollout.kv_slots`` / ``group_size``, at least one
        command's ``pipeline.groups_per_command``) and ``queued`` more. At the start its first hand-out fills the slots
        only: every rank is free then, and a group queued behind one rank's first groups would wait there while another
        rank frees first. None: no room (or not a live rollout rank)."""
        if self.core.role(rank) is not Role.ROLLOUT or rank in self.job.state.lost:
            return None
        r = self.cfg.rollout
        held = max(self.cfg.pipeline.groups_per_command, r.kv_slots // r.group_size) + queued
        free = held - self.core.groups_in_flight(rank)  # the core's count
        return RankReady(rank, free) if free > 0 else None

    def send_generate(self, a: Assign) -> None:
        if a.batch not in self.published:
            items, _ = self.p.rollout.work(a.batch)
            self.p.svc.queue.publish(a.batch, items)
            self.published.add(a.batch)
        self.delivery.again(a.rank, a.version)
        n = self.cfg.pipeline.groups_per_command
        for i in range(0, len(a.groups), n):
            part = a.groups[i:i + n]
            self.commands.send("generate", [a.rank], self.p.rollout.payload(a.batch, version=a.version, prompts=list(part)),
                               batch=a.batch, groups=part, version=a.version)

    def send_validate(self, a: Validate) -> None:
        """Validation groups (prompts of the held-out set) of version ``a.version``'s pass, generated with it."""
        if a.version not in self.validating:
            self.p.validation.publish(a.version)
            vq = self.p.validation.queue()
            for r in range(self.job.world) if not self.replaying() else ():  # an earlier launch's claims (none yet)
                vq.release(a.version, r)
            self.validating[a.version] = time.monotonic()
        self.delivery.again(a.rank, a.version)
        payload = self.p.rollout.payload(a.version, version=a.version, prompts=list(a.groups), validation=True)
        self.commands.send("generate", [a.rank], payload, label="validate", version=a.version, groups=a.groups)

    def validated(self) -> None:
        """Record every validation pass the core has complete (an abandoned one is reported, not recorded)."""
        for v, t0 in sorted(self.validating.items()):
            if self.core.validated(v):
                del self.validating[v]
                if v in self.core.vals_abandoned:
                    log.warning("validation at version %d: a rank holding the version was lost before it finished its "
                                "prompts and no other rank holds that version any more; the pass is not recorded", v)
                elif not self.replaying():  # a takeover's replay: recorded by the old coordinator
                    self.p.validation.record(v, time.monotonic() - t0)

    def release(self, rank: int) -> None:
        """A lost rank's validation prompts go to another rank holding the version."""
        if not self.replaying():
            vq = self.p.validation.queue()
            for v in self.validating:
                vq.release(v, rank)

    def judge(self, j: int, groups: tuple[int, ...]) -> tuple[bool, ...]:
        """Complete groups of batch ``j``: their reward failures reported (every generated sample, trained or not),
        and with dynamic sampling whether each carries a signal (its rewards, after shaping, differ): the core selects
        the batch from these. Empty without dynamic sampling."""
        a = self.p.svc.assembler
        items, texts = self.p.rollout.work(j)
        want = set(groups)
        mine = [it for it in items if it.prompt in want]
        results = self.p.svc.queue.results_of(j, [it.key for it in mine])
        self.p.rollout.check_rewards(j, results)
        if not a.filtering:
            return ()
        if len(results) != len(mine):
            raise JobError(f"batch {j}: the rollout ranks acked groups {list(groups)}, but {len(mine) - len(results)} of "
                           f"their {len(mine)} samples are not in the run's Redis")
        return a.judge(j, mine, texts, results, list(groups))

    def unfilled(self, j: int) -> None:
        """Dynamic sampling with ``on_unfilled: fail`` found too few informative groups after the last round."""
        a, q = self.p.svc.assembler, self.p.svc.queue
        items, texts = self.p.rollout.work(j)
        try:
            a.select(j, items, texts, q.results(j))
        except UnfilledBatchError as e:
            raise JobError(str(e)) from None
        raise JobError(f"batch {j}: dynamic sampling found too few groups with unequal rewards")


def resumed_batches(job: Job, parts, generated: int | None, published: set[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A resume at step k trains batches k .. k+s-1 first: they were generated before the checkpoint (published again
    into ``published``). With dynamic sampling their rounds are planned again from the stored samples; returns each
    one's (prompts, selected groups), what the core starts from (``SchedulerConfig.resumed``)."""
    cfg, k = job.cfg, job.state.step
    q, rollout, a = parts.svc.queue, parts.rollout, parts.svc.assembler
    out = []
    last = min(k + cfg.pipeline.staleness_bound, cfg.run.steps, cfg.run.steps if generated is None else generated)
    for j in range(k, last) if k > 0 else ():
        items, _ = rollout.work(j)
        q.publish(j, items)
        published.add(j)
        rollout.replay_rounds(j)
        if q.done(j) < q.total(j):
            raise JobError(f"resume at step {k}: batch {j} should have been generated before the checkpoint, but "
                           f"{q.total(j) - q.done(j)} of its {q.total(j)} samples are not in the run's Redis")
        if a.filtering:
            items, texts = rollout.work(j)
            out.append((len(texts), tuple(a.select(j, items, texts, q.results(j)).trained)))
    return tuple(out)


def generated_before(job: Job) -> int | None:
    """A resume past the end of the run that wrote its checkpoint (an extended run): the first batch that run never
    generated (its ``run.steps``), from the checkpoint's state (``JobState.run_steps``) or, for a state written before
    that field, from the core's configuration at the start of the last ``schedule.jsonl`` segment. None: a fresh
    start, or every batch the resume needs was generated before the checkpoint (batches k .. k+s-1)."""
    st, steps = job.state, job.cfg.run.steps
    if st.step == 0:
        return None
    made = st.run_steps
    if made is None:
        seg = last_segment(job.run_dir)
        made = decode(seg.header["config"]).steps if seg is not None and "config" in seg.header else steps
    if made >= min(st.step + job.bound, steps):
        return None
    return made
