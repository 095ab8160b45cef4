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
commands still in flight are sent again under their ids and the loop goes on (:mod:`dynaresize.job.replay`).

The loop owns the order of things (acks observed, events fed, actions acted on, the drain); each part of the work is
a component of its own, which owns its decisions:

    hand-out        :mod:`dynaresize.job.handout`   RankReady, Assign -> generate, Validate, a generate's groups judged
    weight delivery :mod:`dynaresize.job.delivery`  SendWeights -> fetch/push (the relay: a lost or refused sender)
                                                    or one blocking sync; a rank's installed version
    training        :mod:`dynaresize.job.training`  Train -> train_chunk, Step -> optimizer_step, the step's report
                                                    and the policy's observation (from :mod:`dynaresize.job.tally`)
    switching       :mod:`dynaresize.job.switching` Decided and Switch -> one switch_role, its end
    replay          :mod:`dynaresize.job.replay`    schedule.jsonl written, or replayed by a takeover
    commands        :mod:`dynaresize.job.flight`    the commands in flight, sent through one table

Not here: gradient helpers (within-step role flow), a simulator-only mechanism (:mod:`dynaresize.sim.mechanisms`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from dynaresize.control.commands import AckResult
from dynaresize.events import format_ranks
from dynaresize.job.core_io import PlannedPolicy, scheduler_config
from dynaresize.job.delivery import Delivery
from dynaresize.job.errors import JobError, RanksLost
from dynaresize.job.flight import Commands, Sent
from dynaresize.job.handout import QUEUED_GROUPS, HandOut, generated_before, resumed_batches
from dynaresize.job.replay import Replay
from dynaresize.job.runtime import Job
from dynaresize.job.state import policy_from_dict, policy_to_dict
from dynaresize.job.switching import Resizes
from dynaresize.job.takeover import Fenced, Segment, fence_aborted, redo_id
from dynaresize.job.tally import Tallies
from dynaresize.job.training import Training
from dynaresize.job.transport import Phase
from dynaresize.schedule import (
    Assign, Decided, Extend, GroupsDone, OptimizerStepDone, PipelineScheduler, RankLost, Restart, Role, SendWeights,
    Step, Switch, SwitchDone, Train, TrainChunkDone, Validate, ValidationDone,
)
from dynaresize.schedule.codec import decode, encode


class ContinuousSchedule:
    """One pass of the continuous schedule from ``job.state.step`` to the end of the run (or a stop)."""

    def __init__(self, job: Job, parts, at: Phase, stop_requested: Callable[[], bool], preemption=None,
                 takeover: Segment | None = None):
        self.job, self.p, self.at = job, parts, at
        self.stop_requested, self.preemption = stop_requested, preemption
        self.cfg = job.cfg
        st = job.state
        self.commands = Commands(parts.tx, at, parts.svc.bus)
        self.sent = self.commands.sent  # the commands in flight by id
        published: set[int] = set()
        if takeover is not None:  # the core's configuration as the segment's coordinator started it
            self.core_cfg = decode(takeover.header["config"])
            resumed_batches(job, parts, self.core_cfg.generated, published)
        else:
            generated = generated_before(job)  # an extended run: the batches from there on were never generated
            resumed = resumed_batches(job, parts, generated, published)
            self.core_cfg = scheduler_config(self.cfg, st.n_train, st.step, parts.validation.passes(st.step), resumed,
                                             generated)
        self.policy = PlannedPolicy(parts.planner.policy, self.cfg.policy.forced_splits, self.cfg.policy.enabled)
        self.core = PipelineScheduler(self.core_cfg, self.policy)
        self.core.policy_state = parts.planner.pstate  # a resume goes on with the checkpoint's policy state
        if takeover is not None and takeover.header.get("policy_state") is not None:
            self.core.policy_state = policy_from_dict(takeover.header["policy_state"])
        self.replay = Replay(job, parts, self.commands, self.core_cfg, self.core.policy_state, takeover)

        def replaying() -> bool:  # the components ask as they go: a takeover's replay goes live at some point
            return self.replay.replaying

        self.tallies = Tallies(job, self.core_cfg.staleness)
        barrier = not self.core_cfg.mechanisms.continuous_rollout  # versions travel in one blocking sync
        self.delivery = Delivery(job, parts, at, self.commands, self.core, self.tallies, barrier)
        self.handout = HandOut(job, parts, self.commands, self.core, self.delivery, published, replaying)
        self.training = Training(job, parts, self.commands, self.core, self.core_cfg, self.tallies, self.delivery,
                                 replaying)
        self.resizes = Resizes(job, parts.switching, at, self.commands, self.delivery)
        self.drain: int | None = None  # the step a drain stops at (a checkpoint, a stop)
        self.parked: list = []  # actions held back while draining
        self.stopping = False
        self.checked = time.monotonic()  # when the ranks' liveness was last checked

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
            self.replay.go_live()  # a takeover whose log reached the run's end or a stop
            self.wait_for_the_rest()
            if self.core.finished:  # the end's checkpoint: every rollout rank holds the last version
                self.delivery.install_newest(self.job.state.step)
        finally:
            self.replay.close()

    @property
    def replaying(self) -> bool:
        return self.replay.replaying

    def start(self) -> None:
        job, k = self.job, self.job.state.step
        self.act(self.core.start(), "start")
        self.training.clock_starts()
        if job.state.lost:
            self.replay.record({"lost": sorted(job.state.lost)})
        for r in job.state.lost:  # lost before a restart or a resume: never given work
            self.feed(RankLost(r))
        if k > 0:  # a restored rank may hold another version than the checkpoint's
            self.delivery.install_newest(k)
        for r in job.rollouts():
            self.ready(r, queued=0)

    def next_acks(self) -> list[tuple[Sent, Any]]:
        """The acks to observe next: those that arrived, or (a takeover's replay) the next ones the log observed (a
        loss the old coordinator fenced off there is handled as this coordinator's own)."""
        if not self.replaying:
            return self.wait()
        got = self.replay.next(self.drain)
        if isinstance(got, Fenced):
            new = sorted(set(got.lost) - set(self.job.state.lost))
            self.job.state.lost = sorted(set(self.job.state.lost) | set(new))
            self.p.planner.rebuild()
            self.lost(new)
            return []
        return got

    def wait(self) -> list[tuple[Sent, Any]]:
        """The acks that arrived (up to 1 s), each with its command; a rank lost meanwhile is handled first."""
        cursors = {cid: s.cursor for cid, s in self.sent.items()}
        acks = self.p.svc.bus.read_acks(cursors, timeout=1.0)
        self.p.tx.check_redis()  # a Redis stall: announced once over, or the run stops past redis.write_wait_s
        for cid, cur in cursors.items():
            self.sent[cid].cursor = cur
        if self.replay.live_at is not None:  # watched from the takeover on
            self.checked = max(self.checked, self.replay.live_at)
        if not acks or time.monotonic() - self.checked > 2.0:
            self.checked = time.monotonic()
            self.check_ranks()
        out = []
        for ack in acks:
            s = self.sent.get(ack.command_id)
            if s is not None and ack.rank in s.flight.ranks and ack.rank not in s.acks:
                out.append((s, ack))
        return out

    def drained(self) -> bool:
        """Draining to step k: the drain is over, nothing in flight and batches k .. k+s-1 generated (a takeover's
        replay: where the log says it was)."""
        if self.replaying:
            return self.replay.at_checkpoint()
        k, q = self.drain, self.p.svc.queue
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

    # --- acks -> the core's events ----------------------------------------------------------------------------------
    def observe(self, sent: Sent, ack) -> None:
        if self.sent.get(sent.flight.cmd.command_id) is not sent or ack.rank in sent.acks:
            return  # the same answer again (a command resent under its id by a takeover is acked twice on the stream)
        if fence_aborted(ack) and sent.kind in ("generate", "validate"):
            # aborted because this coordinator took the run over: sent again under the next id of its chain (its
            # finished samples are in the work queue; the rest are generated now)
            self.commands.resend(sent, redo_id(sent.flight.cmd.command_id))
            return
        if not ack.ok and self.delivery.relay_failed(sent, ack, self.check_ranks):
            return
        if not ack.ok:
            self.failed(sent, ack)
        sent.acks[ack.rank] = ack
        if not sent.complete():
            return
        del self.sent[sent.flight.cmd.command_id]
        self.commands.answering = (ack.rank, sent.flight.cmd.command_id)  # the commands it causes answer it (reply_to)
        try:
            self.completed(sent)
        finally:
            self.commands.answering = None

    def completed(self, sent: Sent) -> None:
        """Every rank acked ``sent``: its results become the core's events."""
        res = {r: a.result or {} for r, a in sent.acks.items()}
        self.tallies.replied(sent, res)
        match sent.kind:
            case "generate":
                r = sent.rank
                self.tallies.generated(sent, res[r], self.replaying)
                self.feed(GroupsDone(r, sent.batch, sent.groups, kept=self.handout.judge(sent.batch, sent.groups)))
                if self.core.unfilled(sent.batch):
                    self.handout.unfilled(sent.batch)
                self.training.clock_starts()
                self.ready(r)
            case "validate":  # a pass handed out before its version's training work may install the version
                self.tallies.waited_for(sent.version, float(res[sent.rank].get("install_s", 0.0)))
                self.feed(ValidationDone(sent.rank, sent.version, sent.groups))
                self.handout.validated()
                self.ready(sent.rank)
            case "fetch_weights" | "fetch_again" | "sync_weights":
                for ev in self.delivery.arrived(sent, res):
                    self.feed(ev)
                if sent.kind == "sync_weights":
                    self.send_syncs()
            case "push_weights":
                pass
            case "train_chunk":
                self.tallies.trained(sent.batch, res)
                self.feed(TrainChunkDone(sent.batch))
            case "optimizer_step":
                self.stepped(sent.batch, res)
            case "switch_role":
                self.p.switching.finish(sent.started)
                self.tallies.switched()
                for r in sent.movers:
                    self.feed(SwitchDone(r))
                    self.delivery.forget(r)
                    if self.core.role(r) is Role.ROLLOUT:
                        self.ready(r)
            case "switch_note":  # no event of its own, but it frees the versions held back (send_syncs): logged,
                self.replay.record({"noted": list(sent.flight.ranks)})  # so that a takeover's replay sends them in order
        if sent.kind in ("switch_role", "switch_note"):
            self.send_syncs()  # a version held back while the split changed

    def stepped(self, k: int, res: dict[int, dict]) -> None:
        """T_k took its optimizer step: version k+1 exists. The step's report, whether a drain starts here, the
        core's events (the policy's observation of the step last)."""
        done = self.training.stepped(k, res)
        p = self.p
        if self.drain is None and k + 1 < self.cfg.run.steps and (
                p.checkpointer.due(k + 1) or self.stop_requested() or (self.preemption is not None and self.preemption.requested)):
            self.drain = k + 1  # before the step's actions go out: the next batch's training waits for the checkpoint
        self.feed(OptimizerStepDone(k))
        if k + 1 < self.cfg.run.steps:
            self.feed(self.training.measured(done))
            if self.core.policy_state is not None:
                self.job.state.policy = policy_to_dict(self.core.policy_state)
        p.snapshots.kept(k + 1)  # the trainers snapshot at this step too (faults.snapshot_every): its state is kept

    # --- failures, lost ranks -------------------------------------------------------------------------------------
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
        busy, owed = self.commands.owed()
        watched = sorted(busy | set(self.core.rollout_ranks()) - set(self.job.state.lost))  # an idle one too
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
        self.commands.drop(ranks)
        self.replay.record({"lost": sorted(self.job.state.lost)})  # a replay re-plans over the live ranks here too
        for r in ranks:
            self.handout.release(r)
            self.feed(RankLost(r))
        self.handout.validated()
        self.delivery.relay_lost(ranks)

    # --- the core: its events in, its actions out as commands -----------------------------------------------------
    def feed(self, ev) -> None:
        actions = self.core.handle(ev)
        self.replay.record({"event": encode(ev), "actions": encode(actions)})
        self.act(actions)

    def act(self, actions, what: str | None = None) -> None:
        if what is not None:
            self.replay.record({what: encode(actions)})
        going = [a for a in actions if not (self.drain is not None and self.parks(a))]
        self.delivery.plan_syncs(going)  # barrier: the pool's version first, before any training command reaches rank 0
        self.send_syncs()
        self.delivery.push_first(going)
        done_switch: set[int] = set()
        for a in actions:
            if self.drain is not None and self.parks(a):
                self.parked.append(a)
                continue
            match a:
                case Assign():
                    self.handout.send_generate(a)
                case Validate():
                    self.handout.send_validate(a)
                case Extend(batch, round_, groups):
                    self.p.rollout.add_round(batch, round_, len(groups))
                case Train():
                    self.training.send_chunk(a)
                case Step() if self.delivery.hold_step(a):
                    pass  # barrier: behind its version's sync (send_syncs sends it)
                case Step():
                    self.training.send_step(a)
                case SendWeights(rank, version, blocking):
                    if not blocking:
                        self.delivery.send_fetch(rank, version)
                case Decided(step, decision, sid):
                    self.resizes.decided(step, decision, sid)
                case Switch(_, _, sid) if sid not in done_switch:
                    done_switch.add(sid)
                    self.resizes.send(sid, [x for x in actions if isinstance(x, Switch) and x.switch_id == sid])
                case Switch():
                    pass
                case Restart(rank, reason):  # every rank from the checkpoint: the restart path of a lost trainer
                    raise RanksLost(self.job.state.lost or [rank], "continuous schedule", reason)

    def parks(self, a) -> bool:
        """While draining to step k: work of batches from k + s on, and training of batch k, wait for the checkpoint."""
        k = self.drain
        return (isinstance(a, Assign) and a.batch >= k + self.core_cfg.staleness) or (isinstance(a, (Train, Step)) and a.batch >= k)

    def send_syncs(self) -> None:
        """Barrier: the next version's blocking sync, once no switch is in flight; the optimizer step held behind it
        goes once it is sent."""
        step = self.delivery.send_syncs()
        if step is not None:
            self.training.send_step(step)

    def ready(self, rank: int, queued: int = QUEUED_GROUPS) -> None:
        """The rank has room for groups: the core hands it work (``RankReady``)."""
        ev = self.handout.ready(rank, queued)
        if ev is not None:
            self.feed(ev)

    # --- drain, checkpoint ----------------------------------------------------------------------------------------
    def checkpoint_and_go_on(self) -> None:
        k, p = self.drain, self.p
        self.replay.record({"checkpoint": k})  # where the drain ended, for a takeover's replay (parked actions go out now)
        stop = self.stop_requested()
        self.delivery.install_newest(k)  # whichever checkpoint follows (this one, the preemption's, the stop's)
        if self.preemption is not None and self.preemption.requested:
            if self.preemption.poll().value != "continue":  # checkpointed by the preemption hook
                self.stopping = True
                return
        if stop:
            self.stopping = True  # the final checkpoint is taken when the ranks shut down
            return
        if p.checkpointer.due(k) and not self.replay.replays_checkpoint(k, self.at):
            p.checkpointer.periodic(self.at)  # (a takeover's replay: one the old coordinator did not write)
        if not self.replaying:
            p.journal.write()
        self.drain = None
        parked, self.parked = self.parked, []
        self.act(parked)
