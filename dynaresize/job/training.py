"""Training in the runtime's schedule: the core's ``Train`` becomes a ``train_chunk`` of complete GRPO groups (a
group's advantages are its own), its ``Step`` an ``optimizer_step`` that divides the gradients summed over every chunk
and trainer by the whole batch's token (or sequence) count, as the whole-batch step does. A step's acks make the
batch's report (``batches.jsonl``) and the resize policy's observation (:meth:`Training.measured`), from what the
batch measured (:mod:`dynaresize.job.tally`).

The loop's clock is here too: its seconds count from the first batch to train being complete (the pipeline's fill is
not a step), so loop seconds per step compare across schedules.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from dynaresize.contract.decode import DecodeSums
from dynaresize.job.delivery import Delivery
from dynaresize.job.errors import JobError
from dynaresize.job.flight import Commands
from dynaresize.job.reporting import TrainedBatch
from dynaresize.job.rollout import BuiltBatch, batch_key
from dynaresize.job.runtime import Job, StepTimes
from dynaresize.job.tally import Tallies, Tally
from dynaresize.job.workload import batch_workload
from dynaresize.metrics import chunk_loss_means
from dynaresize.policy import Topology
from dynaresize.policy.types import Observation, PipelineWorkload
from dynaresize.rl.mismatch import reduce_stats
from dynaresize.schedule import PipelineScheduler, SchedulerConfig, Step, StepMeasured, Train

# The rollout ranks' decode model (the pipeline predictor's) is fitted on the timed iterations of this many recent
# batches: a batch of short responses alone may hold fewer than a fit needs (the quickstart's: 5-20 iterations)
DECODE_WINDOW = 4


@dataclass(frozen=True)
class Stepped:
    """Batch k's optimizer step, reported: what the policy's observation of it is made of."""

    k: int
    tally: Tally
    generated: list  # every sample generated for the batch (with dynamic sampling: of every round)
    step_s: float  # the optimizer step's seconds (its slowest trainer)


class Training:
    """Chunks and optimizer steps from the core's plan to the trainers, and their acks back to a step's report."""

    def __init__(self, job: Job, parts, commands: Commands, core: PipelineScheduler, core_cfg: SchedulerConfig,
                 tallies: Tallies, delivery: Delivery, replaying: Callable[[], bool]):
        self.job, self.cfg, self.p = job, job.cfg, parts
        self.commands, self.core, self.core_cfg, self.tallies, self.delivery = commands, core, core_cfg, tallies, delivery
        self.replaying = replaying  # a takeover's replay: what the old coordinator reported is not reported again
        self.decode_recent: deque[DecodeSums] = deque(maxlen=DECODE_WINDOW)  # the last batches' decode sums
        self.replies_recent: deque[tuple[list, list]] = deque(maxlen=DECODE_WINDOW)  # and their round trips
        self.t_step: float | None = None  # the loop's clock: from the first batch to train complete

    # --- the core's actions -> commands ---------------------------------------------------------------------------
    def send_chunk(self, a: Train) -> None:
        """A chunk of batch k's complete groups, as the whole batch has them (a group's advantages are its own)."""
        job, svc, rollout = self.job, self.p.svc, self.p.rollout
        if list(a.ranks) != job.trainers():
            raise JobError(f"the core trains batch {a.batch} on ranks {list(a.ranks)}, the job's trainers are {job.trainers()}")
        items, texts = rollout.work(a.batch)
        want = set(a.groups)
        mine = [it for it in items if it.prompt in want]
        results = svc.queue.results_of(a.batch, [it.key for it in mine])
        chunk = svc.assembler.build_groups(a.batch, mine, texts, results)
        t = self.tallies.of(a.batch)
        t.results.extend(results)
        key = f"{batch_key(job.job_id, a.batch)}:c{t.chunks}"
        t.chunks += 1
        t.tokens += chunk.tokens
        t.samples += len(chunk.keys)
        svc.redis.set(key, chunk.to_json(), ex=24 * 3600)
        # the batch's groups are prompts 0 .. B - 1 unless dynamic sampling selects them (then known at its end)
        known = {} if svc.assembler.filtering else {"batch_groups": self.cfg.rollout.prompts_per_step}
        self.commands.send("train_chunk", list(a.ranks), {"step": a.batch, "batch_key": key, "n_train": len(a.ranks),
                                                          "version": a.batch, **known}, batch=a.batch, groups=a.groups)

    def send_step(self, a: Step) -> None:
        t = self.tallies.of(a.batch)
        keep = self.delivery.kept_for(a.batch, self.core_cfg.staleness)
        barrier = self.delivery.barrier
        self.commands.send("optimizer_step", list(a.ranks),
                           {"step": a.batch, "n_train": len(a.ranks), "version_after": a.batch + 1,
                            "denominator": self.denominator(t), "publish": not barrier, **keep}, batch=a.batch)

    def denominator(self, t: Tally) -> float:
        return float(t.tokens if self.cfg.train.loss_norm == "token" else t.samples)

    # --- a step's acks -> its report ------------------------------------------------------------------------------
    def stepped(self, k: int, res: dict[int, dict]) -> Stepped:
        """T_k took its optimizer step: version k+1 exists (rank 0 staged it for the rollout ranks). The step's
        times and report, the job state at step k+1, the weight snapshots no batch needs any more."""
        job, st = self.job, self.job.state
        t = self.tallies.pop(k)
        den = self.denominator(t)
        generated = self.p.svc.queue.results(k) if self.p.svc.assembler.filtering else t.results
        built = self.whole_batch(k, generated)
        step_s = max(float(x.get("busy_s", 0.0)) for x in res.values())  # the optimizer step (its slowest trainer)
        job.last = StepTimes(rollout_s=t.gen_busy_s / max(1, len(job.rollouts())), train_s=t.train_s + step_s,
                             sync_s=t.sync_s / max(1, len(job.rollouts())), tokens_generated=t.tokens_generated,
                             tokens_trained=t.tokens)
        # a trainer's figures of the batch: its chunks' mismatch sums (reduced as the whole-batch train reports them)
        # (mini-batches: the first pass's loss sums, from the chunks that stepped them or from the step itself)
        results = [{"loss": (t.loss_sum.get(r, 0.0) + float((x.get("metrics") or {}).get("loss_sum", 0.0))) / den,
                    "version": x.get("version"),
                    "metrics": {**(x.get("metrics") or {}), **reduce_stats(t.chunk_stats.get(r, [])),
                                **chunk_loss_means(t.chunk_stats.get(r, []))}}
                   for r, x in sorted(res.items())]
        trained = TrainedBatch(sum(x["loss"] for x in results), results)
        st.step, st.version = k + 1, k + 1
        now = time.monotonic()
        st.loop_s += now - (self.t_step if self.t_step is not None else now)
        self.t_step = now
        st.elapsed_s = job.elapsed()
        if not self.replaying():  # a takeover's replay: reported by the old coordinator (batches.jsonl has it)
            self.p.reporter.report(k, built, trained)
        self.forget_old_weights(k + 1)
        return Stepped(k, t, generated, step_s)

    def measured(self, s: Stepped) -> StepMeasured:
        """The resize policy's observation of batch k (not of the run's last batch: nothing is left to resize)."""
        job, t, k = self.job, s.tally, s.k
        n_t = max(1, job.state.n_train)
        obs = Observation(step=k, topology=Topology(n_t, max(1, len(job.rollouts()))), rollout_s=job.last.rollout_s,
                          train_s=job.last.train_s, tokens_generated=t.tokens_generated, tokens_trained=t.tokens,
                          mixed=t.mixed, workload=self.workload(k, t, s.generated, n_t, s.step_s))
        # (no weight_sync_s: sync_s is the coordinator's wall clock, which a takeover's replay cannot reproduce; the
        # simulator's barrier observations carry it, the runtime's do not: docs/schedule.md)
        per_group = job.last.train_s * n_t / max(1, self.cfg.rollout.prompts_per_step)
        return StepMeasured(obs, self.cfg.run.steps - k - 1, per_group)

    def workload(self, k: int, t: Tally, generated: list, n_train: int, step_s: float) -> PipelineWorkload | None:
        """Batch k as the policy's pipeline predictor replays it (:mod:`dynaresize.job.workload`), in the barrier-free
        schedule with streaming training (as the simulator fills it) and with ``policy.predictor: pipeline`` or
        ``policy.rollout_model: decode`` (the observation goes into ``schedule.jsonl`` with its lengths). Its decode
        model is fitted on the timed iterations of the last ``DECODE_WINDOW`` batches of this segment (one batch of
        short responses may hold too few; a takeover's replay observes the same acks, so it fits the same), logged as
        a metric either way."""
        mech = self.core_cfg.mechanisms
        if not (mech.continuous_rollout and mech.streaming_training):
            return None
        self.decode_recent.append(t.decode)
        sums = DecodeSums()
        for d in self.decode_recent:
            sums.merge(d)
        self.replies_recent.append((t.train_replies, t.gen_replies))
        trains = [x for tr, _ in self.replies_recent for x in tr]
        replies = trains or [x for _, g in self.replies_recent for x in g]  # the trainers' where there are any
        latency = statistics.median(replies) if replies else 0.0
        wl, fit = batch_workload(self.cfg, self.core_cfg, generated, {r.prompt for r in t.results}, sums, t.train_s,
                                 n_train, step_s, self.job.last.sync_s, latency)
        if fit is not None and not self.replaying():
            self.job.events.emit("metric", name="rollout.iteration_s", value=round(fit.iteration_s, 9), step=k,
                                 seq_iteration_s=round(fit.seq_iteration_s, 9),
                                 prefill_s_per_seq=round(fit.prefill_s_per_seq, 9), iterations=fit.iterations)
        if replies and not self.replaying():
            self.job.events.emit("metric", name="control.round_trip_s", value=round(latency, 6), step=k,
                                 samples=len(replies), of="train" if trains else "generate")
        pol = self.cfg.policy  # (only its users carry it into schedule.jsonl: the pipeline predictor, the decode profile)
        return wl if pol.predictor == "pipeline" or pol.rollout_model == "decode" else None

    def whole_batch(self, k: int, results: list) -> BuiltBatch:
        """Batch k as the whole-batch assembly builds it (the report's rewards, scores and statistics), from the samples
        its chunks read (every group went through one chunk; with dynamic sampling every sample generated: the
        selection's statistics see every prompt of its rounds)."""
        rollout, svc = self.p.rollout, self.p.svc
        items, texts = rollout.work(k)
        batch, stats = svc.assembler.build(k, items, texts, results)
        if stats.groups_filler:
            self.job.events.emit("control", what="dynamic_sampling_unfilled", reason=f"batch {k}: {stats.groups_kept} "
                                 f"groups with unequal rewards in {stats.groups_generated} prompts; "
                                 f"{stats.groups_filler} dropped group(s) trained on to keep the batch size")
        rollout.items.pop(k, None)
        return BuiltBatch(batch, stats)

    def forget_old_weights(self, newest: int) -> None:
        """Weight snapshots no batch in flight needs: a batch j needs version j - s, a resume version ``newest``."""
        keep = newest - self.core_cfg.staleness - 1
        root = self.job.run_dir / "weights"
        for path in root.glob("v*") if root.is_dir() else ():
            v = path.name[1:]
            if v.isdigit() and int(v) < keep:
                shutil.rmtree(path, ignore_errors=True)

    def clock_starts(self) -> None:
        """The loop's time counts from the first batch to train being complete (the pipeline's fill is not a step),
        so loop seconds per step compare across schedules."""
        k = self.job.state.step
        if self.t_step is None and k < self.cfg.run.steps and self.core.complete(k):
            self.t_step = time.monotonic()
