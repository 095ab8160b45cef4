"""The runtime's schedule: the coordinator drives the pure scheduler core (:mod:`dynaresize.schedule`) from the
ranks' acks, for ``pipeline.schedule: barrier_free`` (the default: no step barrier) and ``barrier`` (the core's step
barrier: the static one-step-off baseline; a version reaches the pool in one blocking ``sync_weights``).

The loop reads::

    start    -> the core (resumed at the checkpoint's step), every rollout rank's version, its first claims
    wait     -> the next acks of any command in flight (one XREAD over every ack stream), or a lost rank
    observe  -> each ack becomes the core's event: GroupsDone + RankReady, WeightsArrived, TrainChunkDone,
                OptimizerStepDone (+ StepMeasured for the resize policy), SwitchDone
    act      -> each action the core returns becomes a command: Assign -> ``generate`` (those prompts, that
                version), SendWeights -> ``fetch_weights`` (received in the background into a second buffer: with
                ``pipeline.weights_transport: comm`` from rank 0 point to point over the world group built at
                start-up, rank 0 told by a ``push_weights`` sent with a new version's fetches, ahead of its next
                training command (``push_first``); with the ``file`` fallback read from the snapshot rank 0 staged
                at its optimizer step), Train -> ``train_chunk`` (a chunk of complete GRPO groups), Step ->
                ``optimizer_step`` (the batch's token or sequence count as the normaliser), Switch -> one
                ``switch_role`` over the old and new trainers (the core's collective mode)
    drain    -> at a checkpoint, a stop or a time-out warning: the state of a step boundary of the static run
                (batches k .. k+s-1 generated, nothing in flight), the checkpoint, then on

What keeps the RL semantics of the static barrier run (``tests/integration/test_continuous_schedule.py`` compares
them):
the core assigns batch ``j``'s groups only to a rank holding version ``max(0, j - s)``; a rank refuses to generate
with another version; every sample is seeded by its key; a chunk's advantages are its groups' (GRPO normalises
within a group); the optimizer step divides the gradients summed over every chunk and trainer by the whole batch's
token (or sequence) count, as the whole-batch step does.

Every event fed to the core and every action it returned go to ``schedule.jsonl`` (its first line: the core's
configuration), so replaying the events through a fresh core reproduces the run's decisions
(:func:`dynaresize.job.core_io.replay_log`).

A coordinator started with ``--resume`` while the ranks live takes them over (``takeover``): the segment of
``schedule.jsonl`` is replayed through this very code from the job state it started from, each logged event from
the stored ack of the command that caused it, every command computed with its first id and not sent; then the
commands still in flight are sent again under their ids and the loop goes on. What the replay needs (the records,
where it is in them, the stored acks, the commands held back) is a :class:`dynaresize.job.takeover.Takeover`; the
loop asks it whether this is a replay, for the next observed acks, to compare each line and to go live.

Not here: gradient helpers (within-step role flow), a simulator-only mechanism (:mod:`dynaresize.sim.mechanisms`).
"""

from __future__ import annotations

import logging
import re
import shutil
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from dynaresize.contract.decode import DecodeSums
from dynaresize.control.commands import AckResult
from dynaresize.events import format_ranks
from dynaresize.job.core_io import PlannedPolicy, ScheduleLog, scheduler_config
from dynaresize.job.errors import JobError, RanksLost
from dynaresize.job.relay import Routes
from dynaresize.schedule.relay import RELAY_MARK, Transfer
from dynaresize.job.filtering import UnfilledBatchError
from dynaresize.metrics import chunk_loss_means
from dynaresize.job.rollout import BuiltBatch, batch_key
from dynaresize.job.reporting import TrainedBatch
from dynaresize.job.runtime import Job, StepTimes
from dynaresize.job.state import policy_from_dict, policy_to_dict
from dynaresize.job.takeover import (
    Drained, Fenced, Noted, Observed, Segment, StoredAcks, Takeover, fence_aborted, last_segment, redo_id,
)
from dynaresize.job.switching import Started
from dynaresize.job.transport import InFlight, Phase
from dynaresize.job.workload import batch_workload
from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, Observation, PipelineWorkload, ResizeAction
from dynaresize.rl.mismatch import reduce_stats
from dynaresize.schedule import (
    Assign, Decided, GroupsDone, OptimizerStepDone, PipelineScheduler, RankLost, RankReady, Restart,
    Extend, Role, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone, Validate, ValidationDone,
    WeightsArrived,
)
from dynaresize.schedule.codec import decode, encode

log = logging.getLogger("dynaresize.job")

# Groups a rollout rank holds beyond its KV slots' worth: one, so its refill never waits a control-plane round trip,
# and no more, so a batch's last groups go to the rank that frees first instead of queueing behind a busy one's (a
# whole second command queued: 0.7-0.9% less throughput on the emulated 8-GPU job, none queued: 2.7% less;
# docs/schedule.md "What a rollout rank holds").
QUEUED_GROUPS = 1
# The rollout ranks' decode model (the pipeline predictor's) is fitted on the timed iterations of this many recent
# batches: a batch of short responses alone may hold fewer than a fit needs (the quickstart's: 5-20 iterations)
DECODE_WINDOW = 4


@dataclass
class Sent:
    """A command in flight and the core's action it carries out."""

    kind: str
    flight: InFlight
    batch: int | None = None
    groups: tuple[int, ...] = ()
    version: int | None = None
    started: Started | None = None  # a switch_role over the old and new trainers
    movers: tuple[int, ...] = ()
    acks: dict[int, Any] = field(default_factory=dict)
    cursor: bytes = b"0-0"
    targets: tuple[int, ...] = ()  # a blocking sync_weights: the rollout ranks the core sent the version to

    @property
    def rank(self) -> int:
        return self.flight.ranks[0]

    def complete(self) -> bool:
        return all(r in self.acks for r in self.flight.ranks)


@dataclass
class Tally:
    """What one batch measured, from its first generate command to its optimizer step."""

    gen_busy_s: float = 0.0
    tokens_generated: int = 0
    tokens: int = 0  # response tokens of the chunks built: the token normaliser
    samples: int = 0  # sequences of the chunks built: the sequence normaliser
    chunks: int = 0
    train_s: float = 0.0  # the trainers' compute: chunks and the step (the slowest rank of each)
    sync_s: float = 0.0  # rollout-rank seconds waiting for the version it is generated with (StepTimes.sync_s)
    loss_sum: dict[int, float] = field(default_factory=dict)  # trainer -> its summed loss over the chunks
    chunk_stats: dict[int, list] = field(default_factory=dict)  # trainer -> its chunks' mismatch/TIS sums
    results: list = field(default_factory=list)  # the samples of the chunks built (read once from Redis)
    mixed: bool = False  # a switch ran while this batch was generated or trained
    decode: DecodeSums = field(default_factory=DecodeSums)  # the rollout ranks' timed iterations (its generate acks)
    # the dead time of its commands (Ack.reply_s less the command's busy_s: the round trip and the command's handling
    # outside its work; the least over a command's ranks, the one that acked last), of its training commands
    # (train_chunk, optimizer_step) and of its generates
    train_replies: list[float] = field(default_factory=list)
    gen_replies: list[float] = field(default_factory=list)


class ContinuousSchedule:
    """One pass of the continuous schedule from ``job.state.step`` to the end of the run (or a stop)."""

    def __init__(self, job: Job, parts, at: Phase, stop_requested: Callable[[], bool], preemption=None,
                 takeover: Segment | None = None):
        self.job, self.p, self.at = job, parts, at
        self.stop_requested, self.preemption = stop_requested, preemption
        self.cfg = job.cfg
        st = job.state
        self.published: set[int] = set()
        if takeover is not None:  # the core's configuration as the segment's coordinator started it
            self.core_cfg = decode(takeover.header["config"])
            self.generated = self.core_cfg.generated
            self.check_generated_before(st.step)
        else:
            self.generated = generated_before(job)  # an extended run: the batches from there on were never generated
            resumed = self.check_generated_before(st.step)
            self.core_cfg = scheduler_config(self.cfg, st.n_train, st.step, parts.validation.passes(st.step), resumed,
                                             self.generated)
        self.policy = PlannedPolicy(parts.planner.policy, self.cfg.policy.forced_splits, self.cfg.policy.enabled)
        self.core = PipelineScheduler(self.core_cfg, self.policy)
        self.core.policy_state = parts.planner.pstate  # a resume goes on with the checkpoint's policy state
        if takeover is not None and takeover.header.get("policy_state") is not None:
            self.core.policy_state = policy_from_dict(takeover.header["policy_state"])
        self.sent: dict[str, Sent] = {}
        self.tally: dict[int, Tally] = {}
        self.decode_recent: deque[DecodeSums] = deque(maxlen=DECODE_WINDOW)  # the last batches' decode sums
        self.replies_recent: deque[tuple[list, list]] = deque(maxlen=DECODE_WINDOW)  # and their round trips
        self.answering: tuple[int, str] | None = None  # (rank, command id) of the ack being observed: what it causes
        self.validating: dict[int, float] = {}  # version -> when its validation pass was first handed out
        self.barrier = not self.core_cfg.mechanisms.continuous_rollout  # versions travel in one blocking sync
        self.syncs: dict[int, set[int]] = {}  # barrier: version -> rollout ranks the core sent it to, not yet synced
        self.held_step: Step | None = None  # barrier: an optimizer step waiting for its version's sync to be sent
        # barrier-free: how versions travel (comm: rank 0 -> each rank over the world group; file: the fallback)
        self.transport = job.cfg.pipeline.weights_transport
        # comm: who sends a version to whom (the star or the relay: dynaresize.schedule.relay, pipeline.weights_relay)
        self.routes = Routes(job.cfg.pipeline.weights_relay) if self.transport == "comm" and not self.barrier else None
        self.gen_version: dict[int, int] = {}  # rollout rank -> newest version of the generates sent to it
        self.gen_last: dict[int, int] = {}  # rollout rank -> the version of the last generate sent to it (installed)
        self.decisions: dict[int, Decision] = {}  # the core's switch id -> its decision
        self.drain: int | None = None  # the step a drain stops at (a checkpoint, a stop)
        self.parked: list = []  # actions held back while draining
        self.stopping = False
        self.t_step: float | None = None  # the loop's clock: from the first batch to train complete
        self.checked = time.monotonic()  # when the ranks' liveness was last checked
        self.takeover: Takeover | None = None  # a takeover of the live ranks: its segment replayed first
        if takeover is None:
            self.log = ScheduleLog(job.run_dir / "schedule.jsonl", self.core_cfg, st.incarnation, self.core.policy_state,
                                   state=asdict(st))
        else:
            stored = StoredAcks(parts.svc.redis, job.job_id, self.cfg.redis.max_message_bytes)
            self.takeover = Takeover(takeover, stored, job, parts.tx, self.sent)
            self.log = ScheduleLog(job.run_dir / "schedule.jsonl", self.core_cfg, st.incarnation, None, header=False)

    # --- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.start()
            while not self.core.finished and not self.stopping:
                for sent, ack in self.next_acks():
                    self.observe(sent, ack)
                if self.drain is not None and self.drained():
                    self.checkpoint_and_go_on()
                elif not self.sent and not self.core.finished and not self.stopping and not self.replaying:
                    self.stalled()
            self.go_live()  # a takeover whose log reached the run's end or a stop
            self.wait_for_the_rest()
            if self.core.finished:
                self.install_newest(self.job.state.step)  # the end's checkpoint: every rollout rank holds the last version
        finally:
            if self.takeover is not None:
                self.takeover.close()
            self.log.close()

    @property
    def replaying(self) -> bool:
        """A takeover replaying its segment: commands computed, not sent; acks read from the ranks' stored copies."""
        return self.takeover is not None and self.takeover.replaying

    def next_acks(self) -> list[tuple[Sent, Any]]:
        """The acks to observe next: those that arrived, or (a takeover's replay) the next ones the log observed."""
        return self.replayed() if self.replaying else self.wait()

    def drained(self) -> bool:
        """Draining: the drain is over (a takeover's replay: where the log says it was)."""
        return self.takeover.at_checkpoint() if self.replaying else self.quiescent()

    def start(self) -> None:
        job, k = self.job, self.job.state.step
        self.act(self.core.start(), "start")
        self.clock_starts()
        if job.state.lost:
            self.record({"lost": sorted(job.state.lost)})
        for r in job.state.lost:  # lost before a restart or a resume: never given work
            self.feed(RankLost(r))
        if k > 0:  # a restored rank may hold another version than the checkpoint's
            self.deliver(self.behind(k), k)
        for r in job.rollouts():
            self.ready(r, queued=0)

    def check_generated_before(self, k: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """A resume at step k trains batches k .. k+s-1 first: they were generated before the checkpoint. With dynamic
        sampling their rounds are planned again from the stored samples; returns each one's (prompts, selected
        groups), what the core starts from (``SchedulerConfig.resumed``)."""
        q, rollout, a = self.p.svc.queue, self.p.rollout, self.p.svc.assembler
        out = []
        last = min(k + self.cfg.pipeline.staleness_bound, self.cfg.run.steps,
                   self.cfg.run.steps if self.generated is None else self.generated)
        for j in range(k, last) if k > 0 else ():
            items, _ = rollout.work(j)
            q.publish(j, items)
            self.published.add(j)
            rollout.replay_rounds(j)
            if q.done(j) < q.total(j):
                raise JobError(f"resume at step {k}: batch {j} should have been generated before the checkpoint, but "
                               f"{q.total(j) - q.done(j)} of its {q.total(j)} samples are not in the run's Redis")
            if a.filtering:
                items, texts = rollout.work(j)
                out.append((len(texts), tuple(a.select(j, items, texts, q.results(j)).trained)))
        return tuple(out)

    def wait(self) -> list[tuple[Sent, Any]]:
        """The acks that arrived (up to 1 s), each with its command; a rank lost meanwhile is handled first."""
        cursors = {cid: s.cursor for cid, s in self.sent.items()}
        acks = self.p.svc.bus.read_acks(cursors, timeout=1.0)
        self.p.tx.check_redis()  # a Redis stall: announced once over, or the run stops past redis.write_wait_s
        for cid, cur in cursors.items():
            self.sent[cid].cursor = cur
        if self.takeover is not None and self.takeover.live_at is not None:  # watched from the takeover on
            self.checked = max(self.checked, self.takeover.live_at)
        if not acks or time.monotonic() - self.checked > 2.0:
            self.checked = time.monotonic()
            self.check_ranks()
        out = []
        for ack in acks:
            s = self.sent.get(ack.command_id)
            if s is not None and ack.rank in s.flight.ranks and ack.rank not in s.acks:
                out.append((s, ack))
        return out

    def quiescent(self) -> bool:
        """Draining to step k: nothing in flight, batches k .. k+s-1 generated."""
        k = self.drain
        q = self.p.svc.queue
        return not self.sent and all(q.done(j) >= q.total(j) > 0 and self.core.complete(j)
                                     for j in range(k, min(k + self.core_cfg.staleness, self.cfg.run.steps)))

    def stalled(self) -> None:
        """Nothing in flight and the run not done: the core waits for an event no command will bring (a bug). Say
        so, what was kept and how to go on, instead of waiting forever."""
        from dynaresize.job.errors import where_stopped

        st = self.job.state
        ranks = f"trainers {format_ranks(self.core.trainers())}, rollout ranks {format_ranks(self.core.rollout_ranks()) or 'none'}"
        raise JobError(f"the scheduler has no work to hand out and nothing is running ({ranks}); this is a DynaResize "
                       f"bug: please report it with {self.job.run_dir / 'schedule.jsonl'}. Every finished step is kept: "
                       f"{where_stopped(st.step, st.checkpoint)} (dynaresize run --resume {self.job.run_dir})")

    def wait_for_the_rest(self) -> None:
        """The run's last optimizer step is done: what is still in flight (weight reads) is awaited, not cut."""
        deadline = time.monotonic() + 60.0
        while self.sent and time.monotonic() < deadline:
            for sent, ack in self.wait():
                self.observe(sent, ack)

    # --- a takeover: the segment replayed, then live -------------------------------------------------------------------
    def record(self, rec: dict) -> None:
        """A line of ``schedule.jsonl`` (while a takeover replays, compared with the logged one instead)."""
        if not (self.replaying and self.takeover.replays(rec)):
            self.log.write(rec)

    def replayed(self) -> list[tuple[Sent, Any]]:
        """The next logged event's cause: the stored acks of the command whose ack the old coordinator observed
        there (or a loss it handled); at the end of the log, live."""
        tk = self.takeover
        match tk.next_line():
            case None:
                self.go_live()
                return []
            case Drained(step) if step == self.drain:  # the drain reached its checkpoint here (run() takes it)
                return []
            case Drained():
                raise tk.bug(f"is a checkpoint the replay does not drain to (drain: {self.drain})")
            case Fenced(lost):  # the old coordinator fenced these off (Recovery.shrink): only this coordinator's part
                new = sorted(set(lost) - set(self.job.state.lost))
                self.job.state.lost = sorted(set(self.job.state.lost) | set(new))
                self.p.planner.rebuild()
                self.lost(new)
                return []
            case Noted(ranks):  # a switch's note to the other rollout ranks, acked
                s = next((x for x in self.sent.values() if x.kind == "switch_note" and tuple(x.flight.ranks) == ranks), None)
            case Observed(ev):
                s = self.cause(ev)
        if s is None:
            raise tk.bug("follows no command this replay sent")
        return [(s, ack) for ack in tk.stored_acks(s)]

    def cause(self, ev) -> Sent | None:
        """The command in flight whose ack gives event ``ev``."""
        for s in self.sent.values():
            match ev:
                case GroupsDone(rank, batch, groups) if (s.kind, s.rank, s.batch, s.groups) == ("generate", rank, batch, groups):
                    return s
                case ValidationDone(rank, version, groups) if (s.kind, s.rank, s.version, s.groups) == ("validate", rank, version, groups):
                    return s
                case WeightsArrived(rank, version) if s.version == version and (
                        (s.kind == "fetch_weights" and s.rank == rank) or (s.kind == "sync_weights" and rank in s.targets)):
                    return s
                case TrainChunkDone(batch) if s.kind == "train_chunk" and s.batch == batch:
                    return s
                case OptimizerStepDone(batch) if s.kind == "optimizer_step" and s.batch == batch:
                    return s
                case SwitchDone(rank) if s.kind == "switch_role" and rank in s.movers:
                    return s
        return None

    def go_live(self) -> None:
        """A takeover's replay ends here: the commands in flight are sent again under their ids (a no-op when live)."""
        if self.replaying:
            self.takeover.go_live()

    def redo(self, sent: Sent, ack) -> None:
        """A generate the rank aborted because this coordinator took the run over: sent again under the next id
        of its chain (its finished samples are in the work queue; the rest are generated now)."""
        bus = self.p.svc.bus
        old = sent.flight.cmd.command_id
        cmd = bus.command(sent.flight.cmd.kind, sent.flight.ranks, sent.flight.cmd.payload, command_id=redo_id(old))
        bus.resend(cmd)
        sent.flight.cmd, sent.cursor = cmd, b"0-0"
        del self.sent[old]
        self.sent[cmd.command_id] = sent

    # --- acks -> the core's events ----------------------------------------------------------------------------------
    def observe(self, sent: Sent, ack) -> None:
        if self.sent.get(sent.flight.cmd.command_id) is not sent or ack.rank in sent.acks:
            return  # the same answer again (a command resent under its id by a takeover is acked twice on the stream)
        if fence_aborted(ack) and sent.kind in ("generate", "validate"):
            self.redo(sent, ack)
            return
        if not ack.ok and self.relay_failed(sent, ack):
            return
        if not ack.ok:
            self.failed(sent, ack)
        sent.acks[ack.rank] = ack
        if not sent.complete():
            return
        del self.sent[sent.flight.cmd.command_id]
        self.answering = (ack.rank, sent.flight.cmd.command_id)  # the commands this ack causes answer it (reply_to)
        try:
            self.completed(sent)
        finally:
            self.answering = None

    def completed(self, sent: Sent) -> None:
        """Every rank acked ``sent``: its results become the core's events."""
        res = {r: a.result or {} for r, a in sent.acks.items()}
        # the dead time a command costs: from the ack it answers to its own, less its work (Ack.reply_s - busy_s)
        replies = [max(0.0, a.reply_s - float(res[r].get("busy_s", 0.0))) for r, a in sent.acks.items()
                   if getattr(a, "reply_s", None) is not None]
        if replies and sent.batch is not None and sent.kind in ("train_chunk", "optimizer_step", "generate"):
            t = self.tally.setdefault(sent.batch, Tally())
            (t.gen_replies if sent.kind == "generate" else t.train_replies).append(min(replies))
        match sent.kind:
            case "generate":
                r = sent.rank
                t = self.tally.setdefault(sent.batch, Tally())
                t.gen_busy_s += float(res[r].get("busy_s", 0.0))
                t.tokens_generated += int(res[r].get("tokens", 0))
                self.add_decode(t, r, res[r].get("decode"))
                self.waited_for(sent.version, float(res[r].get("install_s", 0.0)))
                self.feed(GroupsDone(r, sent.batch, sent.groups, kept=self.judge(sent.batch, sent.groups)))
                if self.core.unfilled(sent.batch):
                    self.unfilled(sent.batch)
                self.clock_starts()
                self.ready(r)
            case "validate":  # a pass handed out before its version's training work may install the version
                self.waited_for(sent.version, float(res[sent.rank].get("install_s", 0.0)))
                self.feed(ValidationDone(sent.rank, sent.version, sent.groups))
                self.validated()
                self.ready(sent.rank)
            case "fetch_weights" | "fetch_again":
                if (self.transport == "comm" and res[sent.rank].get("started")
                        and not sent.flight.cmd.payload.get("pushed")):
                    self.send_push(sent.version, [sent.rank])  # the receive is posted: rank 0 sends it (exactly once)
                if sent.kind == "fetch_weights":
                    self.feed(WeightsArrived(sent.rank, sent.version))
            case "push_weights":
                pass
            case "sync_weights":  # blocking: every rollout rank of the split takes part from send to the last ack
                self.waited_for(sent.version, (time.monotonic() - sent.flight.sent_at) * (len(sent.flight.ranks) - 1))
                for r in sent.targets:
                    if r not in self.job.state.lost:
                        self.feed(WeightsArrived(r, sent.version))
                self.send_syncs()
            case "train_chunk":
                t = self.tally.setdefault(sent.batch, Tally())
                t.train_s += max(float(x.get("busy_s", 0.0)) for x in res.values())
                for r, x in res.items():
                    t.loss_sum[r] = t.loss_sum.get(r, 0.0) + float(x.get("loss_sum", 0.0))
                    if x.get("metrics"):  # (a chunk held for its mini-batch trained nothing yet: no figures)
                        t.chunk_stats.setdefault(r, []).append(x["metrics"])
                self.feed(TrainChunkDone(sent.batch))
            case "optimizer_step":
                self.stepped(sent.batch, res)
            case "switch_role":
                self.p.switching.finish(sent.started)
                for t in self.tally.values():
                    t.mixed = True
                for r in sent.movers:
                    self.feed(SwitchDone(r))
                    self.gen_version.pop(r, None)  # a former trainer holds the newest version: nothing to receive again
                    self.gen_last.pop(r, None)
                    if self.core.role(r) is Role.ROLLOUT:
                        self.ready(r)
            case "switch_note":  # no event of its own, but it frees the versions held back (send_syncs): logged,
                self.record({"noted": list(sent.flight.ranks)})  # so that a takeover's replay sends them in order
        if sent.kind in ("switch_role", "switch_note"):
            self.send_syncs()  # a version held back while the split changed

    def stepped(self, k: int, res: dict[int, dict]) -> None:
        """T_k took its optimizer step: version k+1 exists (rank 0 staged it for the rollout ranks). The step's
        report, the core's events, then whether a drain starts here."""
        job, st, p = self.job, self.job.state, self.p
        t = self.tally.pop(k, Tally())
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
        if not self.replaying:  # a takeover's replay: reported by the old coordinator (batches.jsonl has it)
            p.reporter.report(k, built, trained)
        self.forget_old_weights(k + 1)
        if self.drain is None and k + 1 < self.cfg.run.steps and (
                p.checkpointer.due(k + 1) or self.stop_requested() or (self.preemption is not None and self.preemption.requested)):
            self.drain = k + 1  # before the step's actions go out: the next batch's training waits for the checkpoint
        self.feed(OptimizerStepDone(k))
        if k + 1 < self.cfg.run.steps:
            n_t = max(1, st.n_train)
            obs = Observation(step=k, topology=Topology(n_t, max(1, len(job.rollouts()))), rollout_s=job.last.rollout_s,
                              train_s=job.last.train_s, tokens_generated=t.tokens_generated, tokens_trained=t.tokens,
                              mixed=t.mixed, workload=self.workload(k, t, generated, n_t, step_s))
            # (no weight_sync_s: sync_s is the coordinator's wall clock, which a takeover's replay cannot reproduce; the
            # simulator's barrier observations carry it, the runtime's do not: docs/schedule.md)
            per_group = job.last.train_s * n_t / max(1, self.cfg.rollout.prompts_per_step)
            self.feed(StepMeasured(obs, self.cfg.run.steps - k - 1, per_group))
            if self.core.policy_state is not None:
                st.policy = policy_to_dict(self.core.policy_state)
        p.snapshots.kept(k + 1)  # the trainers snapshot at this step too (faults.snapshot_every): its state is kept

    def add_decode(self, t: Tally, rank: int, sums) -> None:
        """A generate ack's decode sums (``GenerateResult.decode``) added to its batch's; a malformed one is left out
        of the fit, with a control event saying which rank sent what (the samples it acked are kept)."""
        if sums is None:
            return
        try:
            t.decode.merge(DecodeSums.from_wire(sums))
        except ValueError as e:
            if not self.replaying:
                self.job.events.emit("control", what="decode_sums_ignored", reason=f"rank {rank}: {e}")

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
        if fit is not None and not self.replaying:
            self.job.events.emit("metric", name="rollout.iteration_s", value=round(fit.iteration_s, 9), step=k,
                                 seq_iteration_s=round(fit.seq_iteration_s, 9),
                                 prefill_s_per_seq=round(fit.prefill_s_per_seq, 9), iterations=fit.iterations)
        if replies and not self.replaying:
            self.job.events.emit("metric", name="control.round_trip_s", value=round(latency, 6), step=k,
                                 samples=len(replies), of="train" if trains else "generate")
        pol = self.cfg.policy  # (only its users carry it into schedule.jsonl: the pipeline predictor, the decode profile)
        return wl if pol.predictor == "pipeline" or pol.rollout_model == "decode" else None

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

    def clock_starts(self) -> None:
        """The loop's time counts from the first batch to train being complete (the pipeline's fill is not a step),
        so loop seconds per step compare across schedules."""
        k = self.job.state.step
        if self.t_step is None and k < self.cfg.run.steps and self.core.complete(k):
            self.t_step = time.monotonic()

    def waited_for(self, version: int | None, seconds: float) -> None:
        """Rollout-rank seconds spent waiting for ``version`` to arrive (an install before a generate, a blocking
        sync): the batch generated with it (``version + s``) reports them, per rollout rank, as its ``sync_s``."""
        j = (version or 0) + self.core_cfg.staleness
        if seconds > 0 and self.job.state.step <= j < self.cfg.run.steps:
            self.tally.setdefault(j, Tally()).sync_s += seconds

    def denominator(self, t: Tally) -> float:
        return float(t.tokens if self.cfg.train.loss_norm == "token" else t.samples)

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

    def failed(self, sent: Sent, ack) -> None:
        """A rank's command failed. A collective one (a switch, a sync, a chunk, a step) fails on the survivors when a
        peer dies in the middle of it (gloo: "Connection reset by peer"): the peer's loss (``RanksLost``: the restart
        path), not the survivor's error. So the peers still owing an ack are watched past the heartbeat deadline (a
        dead peer's silence counts from its last beat, up to one period before it died, and the survivor's error comes
        at once: one period more, and a last look after the wait); when they answer or live on, the failure is the
        rank's own (one message)."""
        rc = self.cfg.redis
        peers = [r for r in sent.flight.ranks if r != ack.rank and r not in sent.acks]
        deadline = time.monotonic() + rc.dead_after_s + rc.heartbeat_s
        while peers and time.monotonic() < deadline:
            self.p.tx.check_alive(peers, sent.kind)
            peers = list(self.p.svc.bus.await_acks(sent.flight.cmd.command_id, peers, timeout=0.5).missing)
        if peers:
            self.p.tx.check_alive(peers, sent.kind)
        self.p.tx.require(AckResult({ack.rank: ack}, []), sent.kind, [ack.rank])

    def check_ranks(self) -> None:
        """A rank lost while commands wait on it: a rollout rank is fenced off and its groups handed out again (the
        core's RankLost); a trainer, or a loss the job cannot absorb, goes to the restart path."""
        busy = {r for s in self.sent.values() for r in s.flight.ranks if r not in s.acks}
        watched = sorted(busy | set(self.core.rollout_ranks()) - set(self.job.state.lost))  # an idle one too
        owed = sorted({s.kind for s in self.sent.values() for r in s.flight.ranks if r not in s.acks})
        try:  # the message names the commands in flight (a trainer lost in a switch: switch_role)
            self.p.tx.check_alive(watched, ", ".join(owed) or "the schedule")
        except RanksLost as e:
            if not self.p.recovery.can_shrink(e.ranks):
                raise
            self.p.recovery.shrink(e.ranks, e.why)
            if any(r in e.ranks for s in self.sent.values() for r in s.flight.ranks
                   if s.kind not in ("generate", "validate", "fetch_weights", "fetch_again", "switch_note", "push_weights")):
                raise
            self.lost(sorted(e.ranks))

    def lost(self, ranks: list[int]) -> None:
        """Rollout ranks fenced off (``Recovery.shrink``, done: by this coordinator, or by the one a takeover
        replays): their commands dropped, their groups handed to the others (the core's RankLost)."""
        self.policy.policy = self.p.planner.policy  # the policy plans over the live ranks
        for cid, s in list(self.sent.items()):
            if any(r in ranks for r in s.flight.ranks):
                del self.sent[cid]
        self.record({"lost": sorted(self.job.state.lost)})  # a replay re-plans over the live ranks here too
        vq = self.p.validation.queue()
        for r in ranks:
            if not self.replaying:
                for v in self.validating:
                    vq.release(v, r)  # its validation prompts go to another rank holding the version
            self.feed(RankLost(r))
        self.validated()
        for r in ranks if self.routes is not None else ():
            self.relay_lost(r)

    def relay_failed(self, sent: Sent, ack) -> bool:
        """A generate whose install failed on the receive from its relay (the relay was lost, or its copy refused)
        before the version was planned again: the rank gets it from another holder (the relay's loss is found now,
        or the refused copy re-planned), then the same generate goes again (nothing was claimed: the install comes
        first). False when the failure is another one."""
        if (self.routes is None or sent.kind not in ("generate", "validate") or sent.version is None
                or f"{RELAY_MARK}rank" not in (ack.error or "")):
            return False
        m = re.search(rf"{RELAY_MARK}rank (\d+)", ack.error or "")
        src = int(m.group(1)) if m else None
        rc = self.cfg.redis
        deadline = time.monotonic() + rc.dead_after_s + rc.heartbeat_s
        while src is not None and src not in self.job.state.lost and time.monotonic() < deadline:
            self.check_ranks()  # the relay's loss: relay_lost plans the rank again and sends its fetch
            if src not in self.job.state.lost:
                time.sleep(0.5)
        if src is not None and src not in self.job.state.lost and self.routes.plan.source(ack.rank, sent.version) == src:
            for t in self.routes.plan.failed(Transfer(sent.version, src, ack.rank)):  # alive: its copy was refused
                self.refetch(t)
        log.warning("rank %d: version %d from relay rank %s failed (%s); received again from another holder, its "
                    "generate sent again", ack.rank, sent.version, src, (ack.error or "").splitlines()[0][:200])
        # the rank may have installed another version since (a lost rank's groups of an older one): it receives this
        # one again first (the same rule as any generate's, ``again``)
        self.again(ack.rank, sent.version)
        self.redo(sent, ack)
        return True

    def refetch(self, t: Transfer) -> None:
        """``t.dst`` receives ``t.version`` again, from ``t.src``: a fetch naming it (the receive under way from
        another sender is dropped), and ``t.src``'s push (a relay's once its own fetch went)."""
        payload = {"version": t.version, "transport": "comm", "again": True, "pushed": True,
                   **self.routes.fetch(t.dst, t.version)}
        self.send("fetch_weights", [t.dst], payload, label="fetch_again", version=t.version)
        dsts = self.routes.fetched_now(t.dst, t.version)
        if dsts:
            self.send_push(t.version, dsts, t.dst)
        if t.src == 0 or (t.src, t.version) in self.routes.fetched:
            self.send_push(t.version, [t.dst], t.src)
        else:
            self.routes.pending.setdefault((t.src, t.version), []).append(t.dst)

    def relay_lost(self, rank: int) -> None:
        """comm: the receivers a lost rank was to forward a version to get it again from another holder (the plan's
        choice), each with a fetch naming its new sender; nothing is lost."""
        for t in self.routes.plan.lost(rank):
            if t.dst in self.job.state.lost or self.core.role(t.dst) is not Role.ROLLOUT:
                continue
            log.info("relay rank %d lost: rank %d gets version %d from rank %d", rank, t.dst, t.version, t.src)
            self.refetch(t)
        for key in [k for k in self.routes.pending if k[0] == rank]:
            del self.routes.pending[key]

    # --- the core ------------------------------------------------------------------------------------------------
    def feed(self, ev) -> None:
        actions = self.core.handle(ev)
        self.record({"event": encode(ev), "actions": encode(actions)})
        self.act(actions)

    def act(self, actions, what: str | None = None) -> None:
        if what is not None:
            self.record({what: encode(actions)})
        done_switch: set[int] = set()
        for a in actions:  # barrier: the pool's version first, before any training command reaches rank 0
            if isinstance(a, SendWeights) and a.blocking and not (self.drain is not None and self.parks(a)):
                self.syncs.setdefault(a.version, set()).add(a.rank)
        self.send_syncs()
        self.push_first(actions)
        for a in actions:
            if self.drain is not None and self.parks(a):
                self.parked.append(a)
                continue
            match a:
                case Assign():
                    self.send_generate(a)
                case Validate():
                    self.send_validate(a)
                case Extend(batch, round_, groups):
                    self.p.rollout.add_round(batch, round_, len(groups))
                case Train():
                    self.send_chunk(a)
                case Step() if self.barrier and any(v <= a.batch for v in self.syncs):
                    # rank 0 sends version k from its live weights: its step to k + 1 goes behind that sync
                    self.held_step = a
                case Step():
                    self.send_step(a)
                case SendWeights(rank, version, blocking):
                    if not blocking:
                        self.send_fetch(rank, version)
                case Decided(step, decision, sid):
                    self.decided(step, decision, sid)
                case Switch(_, _, sid) if sid not in done_switch:
                    done_switch.add(sid)
                    self.send_switch(sid, [x for x in actions if isinstance(x, Switch) and x.switch_id == sid])
                case Switch():
                    pass
                case Restart(rank, reason):  # every rank from the checkpoint: the restart path of a lost trainer
                    raise RanksLost(self.job.state.lost or [rank], "continuous schedule", reason)

    def parks(self, a) -> bool:
        """While draining to step k: work of batches from k + s on, and training of batch k, wait for the checkpoint."""
        k = self.drain
        return (isinstance(a, Assign) and a.batch >= k + self.core_cfg.staleness) or (isinstance(a, (Train, Step)) and a.batch >= k)

    def ready(self, rank: int, queued: int = QUEUED_GROUPS) -> None:
        """The rank has room for groups: its KV slots' worth (``rollout.kv_slots`` / ``group_size``, at least one
        command's ``pipeline.groups_per_command``) and ``queued`` more. At the start its first hand-out fills the slots
        only: every rank is free then, and a group queued behind one rank's first groups would wait there while another
        rank frees first."""
        if self.core.role(rank) is not Role.ROLLOUT or rank in self.job.state.lost:
            return
        r = self.cfg.rollout
        held = max(self.cfg.pipeline.groups_per_command, r.kv_slots // r.group_size) + queued
        free = held - self.core.groups_in_flight(rank)  # the core's count
        if free > 0:
            self.feed(RankReady(rank, free))

    # --- the core's actions -> commands ---------------------------------------------------------------------------
    def send(self, kind: str, ranks, payload: dict, label: str | None = None, **what) -> Sent:
        ranks = list(ranks)
        cause = self.answering  # an ack of one of these ranks caused it: that rank times the round trip
        reply_to = cause[1] if cause is not None and cause[0] in ranks else None
        flight = self.p.tx.send(self.at, kind, ranks, payload, step=what.get("batch"), reply_to=reply_to)
        s = Sent(label or kind, flight, **what)
        self.sent[flight.cmd.command_id] = s
        return s

    def send_generate(self, a: Assign) -> None:
        if a.batch not in self.published:
            items, _ = self.p.rollout.work(a.batch)
            self.p.svc.queue.publish(a.batch, items)
            self.published.add(a.batch)
        self.again(a.rank, a.version)
        n = self.cfg.pipeline.groups_per_command
        for i in range(0, len(a.groups), n):
            part = a.groups[i:i + n]
            self.send("generate", [a.rank], self.p.rollout.payload(a.batch, version=a.version, prompts=list(part)),
                      batch=a.batch, groups=part, version=a.version)

    def send_validate(self, a: Validate) -> None:
        """Validation groups (prompts of the held-out set) of version ``a.version``'s pass, generated with it."""
        if a.version not in self.validating:
            self.p.validation.publish(a.version)
            vq = self.p.validation.queue()
            for r in range(self.job.world) if not self.replaying else ():  # an earlier launch's claims (none yet)
                vq.release(a.version, r)
            self.validating[a.version] = time.monotonic()
        self.again(a.rank, a.version)
        payload = self.p.rollout.payload(a.version, version=a.version, prompts=list(a.groups), validation=True)
        self.send("generate", [a.rank], payload, label="validate", version=a.version, groups=a.groups)

    def validated(self) -> None:
        """Record every validation pass the core has complete (an abandoned one is reported, not recorded)."""
        for v, t0 in sorted(self.validating.items()):
            if self.core.validated(v):
                del self.validating[v]
                if v in self.core.vals_abandoned:
                    log.warning("validation at version %d: a rank holding the version was lost before it finished its "
                                "prompts and no other rank holds that version any more; the pass is not recorded", v)
                elif not self.replaying:  # a takeover's replay: recorded by the old coordinator
                    self.p.validation.record(v, time.monotonic() - t0)

    def push_first(self, actions) -> None:
        """comm: the versions the core sends to rollout ranks in ``actions`` go to rank 0 as ``push_weights`` now,
        before any training command of this round, with each fetch marked ``pushed`` (the rank posts one receive
        whatever it holds). Rank 0 runs its commands one at a time: a push sent after the fetch's ack waited behind
        the chunk of the next batch rank 0 had started meanwhile (seconds), and the rollout ranks with it."""
        if self.barrier or self.transport != "comm":
            return
        to: dict[int, list[int]] = {}
        for a in actions:
            if isinstance(a, SendWeights) and not a.blocking and not (self.drain is not None and self.parks(a)):
                to.setdefault(a.version, []).append(a.rank)
        for v, ranks in sorted(to.items()):
            for (src, _), dsts in self.routes.ask(v, ranks).items():
                self.send_push(v, dsts, src)

    def send_fetch(self, rank: int, version: int) -> None:
        """The core sent ``version`` to ``rank``: the rank starts receiving it in the background (its ack is the
        core's WeightsArrived). comm: ``push_first`` told rank 0 to send it already (the fetch says ``pushed``)."""
        keep = sorted(set(self.core.versions_counted(rank)) | {version})  # a version the core dropped frees its buffer
        payload = {"version": version, "transport": self.transport, "keep": keep}
        if self.transport == "comm":
            payload["pushed"] = True
            payload.update(self.routes.fetch(rank, version))
        self.send("fetch_weights", [rank], payload, version=version)
        if self.transport == "comm":
            dsts = self.routes.fetched_now(rank, version)  # a relay forwards it to these once it holds it
            if dsts:
                self.send_push(version, dsts, rank)

    def send_push(self, version: int, ranks: list[int], src: int = 0) -> None:
        """comm: ``src`` sends ``version`` to ``ranks``, on background threads (acked once queued), point to point
        over the world group built at start-up: rank 0 from the copy it kept at its optimizer step, a relay from what
        it receives (one receiver after another)."""
        # a relay sends one receiver after another (its first receiver forwards soonest); rank 0 keeps a thread per
        # receiver (at most f per version with the relay): a lost receiver holds up no other of its sends
        relay = self.routes is not None and self.routes.fanout > 0 and src != 0
        self.send("push_weights", [src], {"version": version, "ranks": ranks, **({"one_at_a_time": True} if relay else {})},
                  version=version)

    def again(self, rank: int, version: int) -> None:
        """comm: before a generate of ``version`` on ``rank`` that the rank installed before and replaced since (a lost
        rank's or an extra round's groups of an older version handed to it after a newer one, or the newer one again
        after those), the rank receives ``version`` again from rank 0 (the file fallback reads the snapshot again)."""
        newest, last = self.gen_version.get(rank, version), self.gen_last.get(rank, version)
        # installed before and replaced since (an older one handed out, or back to the newer one after it): gone
        if not self.barrier and self.transport == "comm" and version != last and version <= newest:
            self.send("fetch_weights", [rank], {"version": version, "transport": "comm", "again": True},
                      label="fetch_again", version=version)
        self.gen_version[rank] = max(version, newest)
        self.gen_last[rank] = version

    def send_syncs(self) -> None:
        """Barrier: a version the core sent to the rollout pool goes in ONE blocking ``sync_weights`` from trainer
        rank 0 over the pre-built sync group (every rollout rank of the split takes part in the collective), once no
        switch is in flight (a switch changes the group; its ranks learn the new split first)."""
        if not self.syncs or any(s.kind in ("switch_role", "switch_note", "sync_weights") for s in self.sent.values()):
            return
        v = min(self.syncs)
        targets = self.syncs.pop(v)
        st = self.job.state
        s = self.send("sync_weights", [0] + self.job.rollouts(), {"version": v, "n_train": st.n_train, "lost": st.lost},
                      version=v)
        s.targets = tuple(sorted(targets))
        a = self.held_step
        if a is not None and not any(u <= a.batch for u in self.syncs):
            self.held_step = None
            self.send_step(a)

    def deliver(self, ranks: list[int], version: int) -> None:
        """Bring ``ranks`` (rollout ranks) to ``version`` now, outside the core's plan (a resume, a checkpoint): one
        blocking sync over the pre-built group (barrier), else a fetch of the published snapshot and an install."""
        if not ranks:
            return
        if self.barrier:
            st, t0 = self.job.state, time.monotonic()
            self.p.tx.call(self.at, "sync_weights", [0] + self.job.rollouts(), {"version": version, "n_train": st.n_train,
                                                                              "lost": st.lost})
            self.waited_for(version, (time.monotonic() - t0) * len(self.job.rollouts()))
            return
        # a no-op where the transfer is under way or done; comm: rank 0 sends where a receive started. ``version`` is
        # the newest one and the generate below installs it: a version a rank fetched and never installed (an idle
        # rank's, at the run's end) is dropped first, else a rank holding two failed the run at its last step
        fetched = self.p.tx.call(self.at, "fetch_weights", ranks, {"version": version, "transport": self.transport,
                                                                   "keep": [version]})
        started = [r for r, a in sorted(fetched.acks.items()) if (a.result or {}).get("started")]
        if self.transport == "comm" and started:
            self.p.tx.call(self.at, "push_weights", [0], {"version": version, "ranks": started})
        installed = self.p.tx.call(self.at, "generate", ranks, self.p.rollout.payload(version, version=version, prompts=[]))
        self.waited_for(version, sum(float((a.result or {}).get("install_s", 0.0)) for a in installed.acks.values()))
        for r in ranks:
            self.gen_version[r] = max(version, self.gen_version.get(r, version))
            self.gen_last[r] = version

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
        t = self.tally.setdefault(a.batch, Tally())
        t.results.extend(results)
        key = f"{batch_key(job.job_id, a.batch)}:c{t.chunks}"
        t.chunks += 1
        t.tokens += chunk.tokens
        t.samples += len(chunk.keys)
        svc.redis.set(key, chunk.to_json(), ex=24 * 3600)
        # the batch's groups are prompts 0 .. B - 1 unless dynamic sampling selects them (then known at its end)
        known = {} if svc.assembler.filtering else {"batch_groups": self.cfg.rollout.prompts_per_step}
        self.send("train_chunk", list(a.ranks), {"step": a.batch, "batch_key": key, "n_train": len(a.ranks),
                                                 "version": a.batch, **known}, batch=a.batch, groups=a.groups)

    def send_step(self, a: Step) -> None:
        t = self.tally.setdefault(a.batch, Tally())
        # comm: rank 0 keeps copies of the versions a batch in flight may still need (as the file path keeps snapshots)
        keep = {"transport": self.transport, "keep_from": max(0, a.batch - self.core_cfg.staleness)}
        if self.routes is not None:
            self.routes.retire(keep["keep_from"])
        self.send("optimizer_step", list(a.ranks), {"step": a.batch, "n_train": len(a.ranks), "version_after": a.batch + 1,
                                                    "denominator": self.denominator(t), "publish": not self.barrier,
                                                    **(keep if not self.barrier else {})}, batch=a.batch)

    def decided(self, step: int, d: Decision, sid: int | None) -> None:
        self.job.events.emit("decision", step=step + 1, action=d.action.value, reason=d.reason,
                             imbalance=round(d.imbalance, 4), target_train=d.target.n_train,
                             target_rollout=d.target.n_rollout, expected_saving_s=round(d.expected_saving_s, 4),
                             cost_s=round(d.critical_cost_s, 4))
        if sid is not None:
            self.decisions[sid] = d

    def send_switch(self, sid: int, switches: list[Switch]) -> None:
        """One resize: a ``switch_role`` over the old and new trainers (the collective reshards the optimizer
        state); the other rollout ranks learn the new count from a note queued behind their work."""
        job, st = self.job, self.job.state
        movers = sorted(s.rank for s in switches)
        if self.routes is not None and switches[0].to is Role.TRAIN:
            for r in movers:  # their buffers go: they forward nothing new (their planned sends still go)
                self.routes.leaves(r)
        old = st.n_train
        new = old + len(movers) if switches[0].to is Role.TRAIN else old - len(movers)
        if movers != list(range(min(old, new), max(old, new))):
            raise JobError(f"switch {sid}: ranks {movers} do not border the trainers 0..{old - 1}")
        n_alive = len(job.alive())
        d = self.decisions.get(sid) or Decision(ResizeAction.RESIZE, Topology(new, n_alive - new), "the core's resize")
        if d.target.n_train != new:
            d = replace(d, target=Topology(new, n_alive - new))
        union = [r for r in range(max(old, new)) if r not in st.lost]
        started = self.p.switching.begin(self.at, st.step, d, ranks=union)
        s = Sent("switch_role", started.sent, started=started, movers=tuple(movers))
        self.sent[started.sent.cmd.command_id] = s
        rest = [r for r in job.alive() if r >= max(old, new)]
        if rest:
            self.send("switch_role", rest, dict(started.sent.payload), label="switch_note")

    # --- drain, checkpoint ----------------------------------------------------------------------------------------
    def behind(self, k: int) -> list[int]:
        """The rollout ranks whose installed version is not ``k`` (they say so: ``ping``)."""
        held = self.p.tx.call(self.at, "ping", self.job.rollouts(), {})
        return [r for r, a in sorted(held.acks.items()) if int((a.result or {}).get("version", k)) != k]

    def install_newest(self, k: int) -> None:
        """Before a checkpoint at step k every rollout rank holds version k, as after a barrier run's sync (a
        resume starts them there): fetched if it was not, then installed by a generate of no prompts."""
        self.deliver(self.behind(k), k)

    def checkpoint_and_go_on(self) -> None:
        k, p = self.drain, self.p
        self.record({"checkpoint": k})  # where the drain ended, for a takeover's replay (parked actions go out now)
        stop = self.stop_requested()
        self.install_newest(k)  # whichever checkpoint follows (this one, the preemption's, the stop's)
        if self.preemption is not None and self.preemption.requested:
            if self.preemption.poll().value != "continue":  # checkpointed by the preemption hook
                self.stopping = True
                return
        if stop:
            self.stopping = True  # the final checkpoint is taken when the ranks shut down
            return
        if p.checkpointer.due(k) and not (self.replaying and self.takeover.replays_checkpoint(k, self.at)):
            p.checkpointer.periodic(self.at)  # (a takeover's replay: one the old coordinator did not write)
        if not self.replaying:
            p.journal.write()
        self.drain = None
        parked, self.parked = self.parked, []
        self.act(parked)


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
