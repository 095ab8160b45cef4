"""Rollout: queue a batch's work items, let the rollout ranks pull them, put back what lost ranks left (top-up),
run the dynamic-sampling rounds (fill), and build the training batch from the samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dynaresize.events import format_ranks
from dynaresize.contract.batch import TrainBatch
from dynaresize.job.batching import reward_errors, work_items
from dynaresize.job.errors import JobError, RanksLost
from dynaresize.job.filtering import UnfilledBatchError
from dynaresize.job.recovery import Recovery
from dynaresize.job.runtime import Job, Services
from dynaresize.job.transport import InFlight, Phase, Transport

log = logging.getLogger("dynaresize.job")


@dataclass
class BuiltBatch:
    batch: TrainBatch
    stats: Any  # dynaresize.job.filtering.BatchStats (reward shaping, dynamic sampling)


class Rollout:
    def __init__(self, job: Job, svc: Services, tx: Transport, recovery: Recovery):
        self.job, self.svc, self.tx, self.recovery = job, svc, tx, recovery
        self.items: dict[int, tuple] = {}  # step -> (work items, prompt texts) until its batch is built
        self.results: dict[int, list] = {}  # step -> generated samples, from the end of its rollout to its batch
        self.filled: set[int] = set()  # steps whose dynamic-sampling rounds are all generated (dynaresize.job.filtering)
        self.shown_prompt = False  # the first prompt as the model gets it is in the event log

    def forget(self) -> None:
        """A restart from a checkpoint: nothing generated or planned since is kept here."""
        self.items.clear()
        self.results.clear()
        self.filled.clear()
        self.svc.assembler.forget()

    def payload(self, j: int, **extra) -> dict:
        ro = self.job.cfg.rollout
        return {"step": j, "version": self.job.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                "temperature": ro.temperature, "top_p": ro.top_p, **extra}

    def generate(self, at: Phase, j: int, wait: bool) -> InFlight | None:
        """Queue batch ``j`` and let the rollout ranks pull it. Returns the command in flight, or waits for it."""
        queue = self.svc.queue
        items, _ = self.work(j)
        queue.publish(j, items)  # claims of an earlier launch's processes were released by start_ranks
        if queue.done(j) >= queue.total(j):
            return None
        sent = self.tx.send(at, "generate", self.job.rollouts(), self.payload(j), step=j)
        if wait:
            self.await_generate(at, sent)
            return None
        return sent

    def await_generate(self, at: Phase, *sent: InFlight) -> float:
        """Wait for the generate command(s) of one batch (two in a mixed step: the old pool's and the newcomers');
        only when all have acked must every sample be there. Returns the rollout's wall time from the first send."""
        queue = self.svc.queue
        j, t0, acked = sent[0].step, min(x.sent_at for x in sent), []
        for x in sent:
            acked += self.await_rollout(x.cmd, x.ranks, j)
        if queue.done(j) < queue.total(j) and not self.top_up(at, j, sent[0].payload):
            return max([a.acked_at for a in acked], default=time.time()) - (time.time() - (time.monotonic() - t0))
        if self.fill(at, j, sent[0].payload):  # extra rounds ran: the rollout ended with the last of them
            acked = []
        self.results[j] = queue.results(j)  # read once: the tokens now, the training batch next step
        self.job.last.tokens_generated = sum(len(r.response_ids) for r in self.results[j])
        return max([a.acked_at for a in acked], default=time.time()) - (time.time() - (time.monotonic() - t0))

    def await_rollout(self, cmd, ranks, j: int) -> list:
        """Acks of one generate command. A rollout rank lost meanwhile is fenced off and removed (``faults.shrink``):
        its claimed samples go back to the queue and the survivors' acks are awaited."""
        lost = self.job.state.lost
        ranks, acked = [r for r in ranks if r not in lost], []
        while ranks:
            try:
                return acked + list(self.tx.wait(cmd, ranks, "generate").acks.values())
            except RanksLost as e:
                if not self.recovery.can_shrink(e.ranks):
                    raise
                self.recovery.shrink(e.ranks, e.why)
                ranks = [r for r in ranks if r not in self.job.state.lost]
        return acked

    def top_up(self, at: Phase, j: int, payload: dict) -> bool:
        """Samples of batch j are missing after every rollout rank acked: claims orphaned by a lost rank, or by a
        claim whose reply was lost to a Redis restart. Put them back and let the live rollout ranks pull them (with
        the weights they hold now: the same version, or after a boundary switch a newer one, within the staleness
        bound). Returns False when no rollout rank is left (the next step moves a trainer, then tops up)."""
        queue = self.svc.queue
        for attempt in range(3):
            missing = queue.total(j) - queue.done(j)
            if missing <= 0:
                return True
            rollouts = self.job.rollouts()
            if not rollouts:
                return False
            for r in range(self.job.world):  # every rank that generated for j acked (or is lost): nothing is in flight
                queue.release(j, r)
            self.job.events.emit("control", what="redispatch", reason=f"batch {j}: {missing} sample(s) put back to the "
                                 f"queue and pulled by rank(s) {format_ranks(rollouts)}")
            sent = self.tx.send(at, "generate", rollouts, {**payload, "version": self.job.state.version})
            self.await_rollout(sent.cmd, rollouts, j)
        missing = queue.total(j) - queue.done(j)
        if missing > 0:
            raise JobError(f"generate {j}: {missing} samples still missing after 3 re-dispatches")
        return True

    def fill(self, at: Phase, j: int, payload: dict) -> bool:
        """Dynamic sampling: while batch j has too few groups with unequal rewards, queue an extra round of prompts
        under step j and let the rollout ranks pull it (same policy version). A replay of the plan from the stored
        samples (after a resume) adds and generates nothing twice. Returns whether a round was generated now."""
        assembler, queue, cfg = self.svc.assembler, self.svc.queue, self.job.cfg
        if j in self.filled or not assembler.filtering:
            return False
        ran = False
        while True:
            items, texts = self.work(j)
            n = assembler.next_round(j, items, texts, queue.results(j))
            if not n:
                break
            more, more_texts = work_items(self.svc.task, self.svc.tokenizer, cfg.run.seed, j, n, cfg.rollout.group_size,
                                          first=len(texts), stride=self.stride())
            self.items[j] = (items + more, texts + more_texts)
            queue.extend(j, assembler.rounds_of(len(texts) + n), more)
            if queue.done(j) < queue.total(j):
                if not self.job.rollouts():
                    return ran  # no rollout rank left: make_batch tops up once a trainer has moved
                sent = self.tx.send(at, "generate", self.job.rollouts(), {**payload, "version": self.job.state.version})
                self.await_rollout(sent.cmd, self.job.rollouts(), j)
                if queue.done(j) < queue.total(j) and not self.top_up(at, j, payload):
                    return ran
                ran = True
        self.filled.add(j)
        return ran

    def add_round(self, j: int, round_: int, prompts: int) -> None:
        """Dynamic sampling: extra round ``round_`` of batch ``j`` (``prompts`` more prompts, the next indices), in
        this coordinator's plan and in the run's queue (once: a round already queued adds nothing there)."""
        items, texts = self.work(j)
        a = self.svc.assembler
        if len(texts) != a.need + (round_ - 1) * a.round_prompts:
            return  # planned already (a replay of the rounds from the stored samples)
        cfg = self.job.cfg
        more, more_texts = work_items(self.svc.task, self.svc.tokenizer, cfg.run.seed, j, prompts, cfg.rollout.group_size,
                                      first=len(texts), stride=self.stride())
        self.items[j] = (items + more, texts + more_texts)
        self.svc.queue.extend(j, round_, more)

    def replay_rounds(self, j: int) -> None:
        """Dynamic sampling after a resume: the rounds batch ``j`` had, planned again from its stored samples (every
        one of them is in the run's Redis); nothing is generated."""
        a, q = self.svc.assembler, self.svc.queue
        while a.filtering:
            items, texts = self.work(j)
            n = a.next_round(j, items, texts, q.results(j))
            if not n:
                return
            self.add_round(j, a.rounds_of(len(texts)) + 1, n)

    def stride(self) -> int:
        """Prompts a step may use at most: the step's own, plus every extra round dynamic sampling may add. A dataset
        task's step ``k`` reads records ``k * stride ..``, so no round ever takes a record of another step."""
        a = self.svc.assembler
        return self.job.cfg.rollout.prompts_per_step + (a.max_rounds * a.round_prompts if a.filtering else 0)

    def work(self, j: int):
        """Batch j's work items and prompt texts, built (prompts sampled, tokenised) once per step."""
        cfg, tok = self.job.cfg, self.svc.tokenizer
        if j not in self.items:
            self.items[j] = work_items(self.svc.task, tok, cfg.run.seed, j, cfg.rollout.prompts_per_step,
                                       cfg.rollout.group_size, stride=self.stride())
            if j == self.job.state.step and not self.shown_prompt:  # what the model is really given
                self.shown_prompt = True
                first = self.items[j][0][0]
                self.job.events.emit("control", what="prompt_rendered", reason=tok.decode(first.prompt_ids),
                                     key=first.key, tokens=len(first.prompt_ids))
        return self.items[j]

    def make_batch(self, at: Phase, k: int) -> BuiltBatch:
        queue, assembler = self.svc.queue, self.svc.assembler
        items, texts = self.work(k)
        if queue.done(k) < queue.total(k):  # lost ranks left it short and no rollout rank was left then
            self.top_up(at, k, self.payload(k))
            self.results.pop(k, None)
        results = self.results.pop(k, None) or queue.results(k)  # not cached after a resume
        if assembler.filtering and k not in self.filled:  # after a resume: replay (and finish) its rounds
            self.fill(at, k, self.payload(k))
            items, texts = self.work(k)  # with the rounds' prompts
            results = queue.results(k)
        self.check_rewards(k, results)
        try:
            batch, stats = assembler.build(k, items, texts, results)
        except UnfilledBatchError as e:
            raise JobError(str(e)) from None
        self.items.pop(k, None)
        self.filled.discard(k)
        if stats.groups_filler:
            self.job.events.emit("control", what="dynamic_sampling_unfilled", reason=f"batch {k}: {stats.groups_kept} "
                                 f"groups with unequal rewards in {stats.groups_generated} prompts; "
                                 f"{stats.groups_filler} dropped group(s) trained on to keep the batch size")
        self.svc.redis.set(batch_key(self.job.job_id, k), batch.to_json(), ex=24 * 3600)
        return BuiltBatch(batch, stats)

    def check_rewards(self, k, results) -> None:
        """Reward failures the rollout ranks reported: each one an event and a warning naming the sample (its
        score is 0); with ``reward.on_error: fail`` the first one fails the run."""
        errors = reward_errors(results)
        for err in errors[:20]:
            self.job.events.emit("control", what="reward_error", reason=err, step=k)
        if errors:
            log.warning("batch %s: %d reward failure(s) scored 0, e.g. %s", k, len(errors), errors[0])
            if self.job.cfg.reward.on_error == "fail":
                raise JobError(f"reward failed ({len(errors)} sample(s) of batch {k}; reward.on_error=fail): {errors[0]}")


def batch_key(job_id: str, k: int) -> str:
    from dynaresize.contract.keys import Keys

    return f"{Keys(job_id).ns}:batch:{k}"
