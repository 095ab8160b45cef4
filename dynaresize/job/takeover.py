"""A coordinator takeover of a live run on the scheduler core (``dynaresize run --resume`` while the ranks live).

What the new coordinator has: ``schedule.jsonl`` (the start of the schedule's segment: the core's configuration, the
policy state and the job state it started from; then every event fed to the core and the actions it returned, in
order) and, in Redis, every rank's stored acks (``dr:<job>:applied:<r>``, the at-most-once record). Command ids are
deterministic: launch incarnation, the segment's phase (``c<k>``), the command's kind, how many of that kind the
segment sent before and a digest of its ranks and payload (:class:`dynaresize.job.transport.Phase`). So feeding the
logged events, in logged order, to a fresh core from the segment's start (and through the same pipeline code) gives
the same actions and the same commands with the same ids; the pipeline's own state (commands in flight, tallies,
groups per rank, switches) is rebuilt by observing each command's stored ack where the log says it was observed.

Then the reconciliation: every command still in flight is sent again under its id with the new epoch (in the order it
was first sent): a rank that applied it answers its stored ack, one that had not read it (the old copy is refused as
a stale epoch) applies it now, once. A streamed ``generate`` the rank was decoding when the new epoch appeared was
aborted by the rank (``aborted: fenced: epoch ...``, stored): nothing of it is lost (its finished samples are in the
work queue, the rest go back to the rank's claim), and it is sent again under the next id of its chain
(:func:`redo_id`), which a later takeover finds the same way.

Where the old coordinator may have stopped: the log line of an event is written before the commands of its actions
are sent, so a command is never sent without its cause in the log; a command logged but not sent is sent by the
takeover; an ack observed but not logged is observed again from its stored copy. The old coordinator, if it comes
back, writes into a ``schedule.jsonl`` the takeover replaced (a new file: its late lines go to the old one), and its
next command, journal or checkpoint write raises ``FencedError`` (exit 3).

:class:`Takeover` holds what the replay needs (the segment's records, the position in them, the ranks' stored acks,
the commands computed and held back); the schedule's replay component (:class:`dynaresize.job.replay.Replay`, for
:class:`dynaresize.job.core_driver.ContinuousSchedule`) asks it as named steps, and the transport holds it while it
replays (:attr:`dynaresize.job.transport.Transport.replay`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynaresize.contract.keys import Keys
from dynaresize.job.errors import JobError

if TYPE_CHECKING:
    from dynaresize.control.commands import AckResult, Command
    from dynaresize.job.flight import Sent
    from dynaresize.job.runtime import Job
    from dynaresize.job.transport import InFlight, Phase, Transport

log = logging.getLogger("dynaresize.job")

FENCE_ABORT = "aborted: fenced: epoch "  # a streamed command the rank aborted when a newer coordinator took over


@dataclass
class Segment:
    """The last start of the schedule in ``schedule.jsonl``: its config line and the records after it."""

    header: dict  # {"config", "incarnation", "policy_state", "state"}
    records: list[dict]
    lines: list[str]  # the file's intact lines (a torn last line left out)

    @property
    def state(self) -> dict | None:
        return self.header.get("state")


def last_segment(run_dir) -> Segment | None:
    """The schedule's last segment, or None when there is none with a recorded start state (an older log)."""
    path = Path(run_dir) / "schedule.jsonl"
    try:
        text = path.read_text()
    except OSError:
        return None
    lines, recs = [], []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            break  # a line torn by the kill: nothing after it was written
        lines.append(line)
        recs.append(rec)
    starts = [i for i, r in enumerate(recs) if "config" in r]
    if not starts or recs[starts[-1]].get("state") is None:
        return None
    i = starts[-1]
    return Segment(recs[i], recs[i + 1:], lines)


def replace_log(run_dir, seg: Segment) -> None:
    """Write ``schedule.jsonl`` again as a new file with the intact lines: an old coordinator that comes back keeps
    writing into the file it opened (now unlinked), never into the new coordinator's."""
    path = Path(run_dir) / "schedule.jsonl"
    tmp = path.with_name(path.name + ".takeover")
    tmp.write_text("".join(line + "\n" for line in seg.lines))
    os.replace(tmp, path)


def redo_id(command_id: str) -> str:
    """The id a command aborted by a takeover is sent again under (then that one's, and so on)."""
    return command_id + "+"


def fence_aborted(ack) -> bool:
    """The rank aborted this streamed command because a newer coordinator took the run over: not done."""
    return ack is not None and not ack.ok and FENCE_ABORT in (ack.error or "")


class StoredAcks:
    """The ranks' at-most-once records of a run: what each applied command answered, by command id."""

    def __init__(self, redis, job_id: str, max_bytes: int):
        self.r, self.keys, self.max_bytes = redis, Keys(job_id), max_bytes

    def get(self, command_id: str, rank: int):
        """The stored ack of ``command_id`` on ``rank`` (an Ack), or None: not applied, or being applied now."""
        from dynaresize.control.commands import STARTED
        from dynaresize.control.wire import Ack, decode

        raw = self.r.hget(self.keys.applied(rank), command_id)
        if raw is None or raw.startswith(STARTED):
            return None
        return decode(Ack, raw, self.max_bytes)

    def final(self, command_id: str, rank: int) -> tuple[str, object]:
        """Follow the chain of a command aborted by earlier takeovers: the id it runs under now, and that id's
        stored ack (None: not applied yet; a fence-aborted ack: the next id of the chain is to be sent)."""
        cid = command_id
        ack = self.get(cid, rank)
        while fence_aborted(ack):
            nxt = self.get(redo_id(cid), rank)
            if nxt is None and self.r.hget(self.keys.applied(rank), redo_id(cid)) is None:
                return cid, ack  # the chain ends here: the next id was never sent
            cid, ack = redo_id(cid), nxt
        return cid, ack


# --- the replay ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Drained:
    """The old coordinator's drain ended here: the checkpoint at ``step`` (``{"checkpoint": step}``)."""

    step: int


@dataclass(frozen=True)
class Fenced:
    """The old coordinator fenced rollout ranks off here (``Recovery.shrink``): the run's lost ranks after it."""

    lost: tuple[int, ...]


@dataclass(frozen=True)
class Noted:
    """A switch's note to the other rollout ranks was acked here (``{"noted": ranks}``)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Observed:
    """The old coordinator fed the core this event here, from the ack of a command in flight."""

    event: Any  # a dynaresize.schedule event


Logged = Drained | Fenced | Noted | Observed


class Takeover:
    """A coordinator taking the live ranks over: its segment replayed through the driver, then live.

    The driver asks, as named steps: :attr:`replaying` (is this a replay?), :meth:`next_line` (what the old
    coordinator logged next) and :meth:`stored_acks` (the stored acks that caused it), :meth:`replays` (a line the
    driver would write: the logged one?), :meth:`at_checkpoint` and :meth:`replays_checkpoint` (the drain's
    checkpoint where the log says, written or not) and :meth:`go_live`. While it replays the transport holds it
    (``Transport.replay``) and asks :meth:`hold` (a command computed, not sent) and :meth:`answer` (a call answered
    from the stored acks; none: the old coordinator stopped in it, live from there)."""

    def __init__(self, segment: Segment, stored: StoredAcks, job: Job, tx: Transport, in_flight: dict[str, Sent]):
        self.records: list[dict] = list(segment.records)  # the segment's lines after its config line, to replay
        self.at = 0  # the next record the replay reaches; len(records): the log ends here
        self.stored = stored  # the ranks' at-most-once records: each logged ack's cause
        self.held: list[InFlight] = []  # the commands computed while replaying, in the order they were first sent
        self.live = False
        self.live_at: float | None = None  # when it went live (monotonic): the ranks' liveness is watched from then
        self.job, self.tx = job, tx
        self.in_flight = in_flight  # the driver's commands in flight by id (going live re-keys the ones resent)
        self.events = job.events  # the run's event log, muted while replaying what the old coordinator logged
        replace_log(job.run_dir, segment)  # the old coordinator, if it comes back, writes to the file it opened
        job.events = _Muted(self.events)
        tx.replay = self

    @property
    def replaying(self) -> bool:
        return not self.live

    # --- what the old coordinator logged ------------------------------------------------------------------------
    def next_line(self) -> Logged | None:
        """The next logged line the driver reaches by observing (None: the log ends here, the replay goes live)."""
        from dynaresize.schedule.codec import decode

        if self.at >= len(self.records):
            return None
        rec = self.records[self.at]
        if "checkpoint" in rec:
            return Drained(rec["checkpoint"])
        if "lost" in rec:
            return Fenced(tuple(rec["lost"]))
        if "noted" in rec:
            return Noted(tuple(rec["noted"]))
        if "event" in rec:
            return Observed(decode(rec["event"]))
        raise self.bug("follows no command this replay sent")

    def stored_acks(self, sent: Sent) -> list:
        """The stored acks of ``sent`` (a command whose ack the log says was observed) from the ranks not answered yet,
        each under the id it runs under now (:meth:`StoredAcks.final`)."""
        out = []
        for r in sent.flight.ranks:
            if r in sent.acks:
                continue
            _, ack = self.stored.final(sent.flight.cmd.command_id, r)
            if ack is None or fence_aborted(ack):
                raise JobError(f"taking over the live ranks: the log says {sent.kind} {sent.flight.cmd.command_id} was "
                               f"answered, but rank {r} has no stored ack of it (the run's Redis lost it?)")
            out.append(ack)
        return out

    def replays(self, rec: dict) -> bool:
        """A line the driver writes to ``schedule.jsonl``. Replaying: True, the log has the same line there (another
        one: the replay diverged, stop with the ranks left as they are). False: live, the driver writes it (at the
        end of the log first: the old coordinator stopped in the middle of an ack's events, the rest are new)."""
        if self.replaying and self.at >= len(self.records):
            self.go_live()
        if self.live:
            return False
        want = self.records[self.at]
        if json.loads(json.dumps(rec)) != want:
            run_dir = self.job.run_dir
            raise JobError(f"taking over the live ranks: replaying {run_dir / 'schedule.jsonl'} gave {rec} "
                           f"where the log has {want} (line {self.at + 2} of the segment); this is a DynaResize bug: "
                           f"please report it with the run directory. To go on from the last checkpoint instead, stop "
                           f"the ranks (kill the processes in {run_dir / 'launch.json'}) and resume again")
        self.at += 1
        return True

    def bug(self, what: str) -> JobError:
        """The replay met a line it cannot follow (``what`` it is)."""
        return JobError(f"taking over the live ranks: line {self.at + 2} of the segment of "
                        f"{self.job.run_dir / 'schedule.jsonl'} ({self.records[self.at]}) {what}; this is a DynaResize "
                        f"bug: please report it with the run directory")

    # --- the drain's checkpoint ---------------------------------------------------------------------------------
    def at_checkpoint(self) -> bool:
        """The drain is over where the log says it was (when the old coordinator found nothing in flight depends on
        when acks arrived, which the replay cannot see: the log line says it)."""
        return self.at < len(self.records) and "checkpoint" in self.records[self.at]

    def replays_checkpoint(self, k: int, at: Phase) -> bool:
        """The replay reaches a due checkpoint at step k. True: the old coordinator wrote it (its ``stage_state`` id
        counted as sent; nothing to do). False: it is taken now (at the end of the log live first: the old
        coordinator stopped in this checkpoint; a checkpoint it gave up and went on from is replayed as it was)."""
        if self.live:
            return False
        if self.checkpointed(k):
            at.sent["stage_state"] = at.sent.get("stage_state", 0) + 1  # its id, as it was sent
            return True
        if self.at >= len(self.records):
            self.go_live()  # its claims, the ranks' stored acks judged and the events said by this coordinator
        return False

    def checkpointed(self, k: int) -> bool:
        """Whether the old coordinator wrote the checkpoint at step k (the job state then names it)."""
        from dynaresize.job.checkpoint_files import tag_step
        from dynaresize.job.state import load_state

        try:
            st = load_state(self.job.run_dir)
            done = st is not None and st.checkpoint and tag_step(st.checkpoint.rsplit("/", 1)[-1]) >= k
        except (OSError, ValueError):
            return False
        if done and st.checkpoint != self.job.state.checkpoint:
            self.job.state.checkpoint = st.checkpoint
        return bool(done)

    # --- the transport while replaying --------------------------------------------------------------------------
    def hold(self, flight: InFlight) -> InFlight:
        """A command the old coordinator sent (or was about to): computed with its id, sent again when live."""
        self.held.append(flight)
        return flight

    def answer(self, cmd: Command, ranks: list[int]) -> AckResult | None:
        """A call's acks from the ranks' stored copies; None: one has none, the old coordinator stopped in this call:
        live from here (this command sent again with the rest)."""
        from dynaresize.control.commands import AckResult

        acks = {r: self.stored.get(cmd.command_id, r) for r in ranks}
        if all(a is not None for a in acks.values()):
            return AckResult(acks, [])
        self.go_live(call=cmd)
        return None

    # --- live ------------------------------------------------------------------------------------------------------
    def go_live(self, call: Command | None = None) -> None:
        """The end of the replay: every command still in flight (and ``call``, one the old coordinator stopped in) is
        sent again under its id with this coordinator's epoch, in the order first sent: a rank that applied it
        answers its stored ack, one that did not applies it now; a generate the rank aborted at the takeover goes
        under the next id of its chain. Then the steps the old coordinator reported past the replay are rewound."""
        if self.live:
            return
        from dynaresize.job.checkpointer import rewind_batches

        job, bus = self.job, self.tx.svc.bus
        self.close()
        by_cid = {s.flight.cmd.command_id: (cid, s) for cid, s in self.in_flight.items()}
        resent = 0
        for f in self.held:
            cid = f.cmd.command_id
            if cid not in by_cid and f.cmd is not call:  # answered in the replay (call: the one in progress)
                continue
            now, ack = self.stored.final(cid, f.ranks[0]) if f.cmd.kind.value == "generate" and f.ranks else (cid, None)
            if fence_aborted(ack):
                now = redo_id(now)
            cmd = bus.command(f.cmd.kind, f.ranks, f.cmd.payload, command_id=now)
            bus.resend(cmd)
            f.cmd = cmd
            if cid in by_cid:
                old, s = by_cid[cid]
                s.cursor = b"0-0"
                del self.in_flight[old]
                self.in_flight[now] = s
            resent += 1
        self.held = []
        rewind_batches(job.run_dir, job.state.step, job.events)
        job.events.emit("control", what="takeover", reason=f"replayed {self.at} line(s) of schedule.jsonl to step "
                        f"{job.state.step}; {resent} command(s) in flight sent again under their ids; no rank restarted",
                        epoch=bus.epoch)
        log.warning("took the live ranks over at step %d: %d command(s) in flight sent again under their ids",
                    job.state.step, resent)
        self.live_at = time.monotonic()

    def close(self) -> None:
        """Live (or stopped): the run's event log speaks again and the transport sends."""
        self.live = True
        self.job.events = self.events
        self.tx.replay = None


class _Muted:
    """The run's event log while a takeover replays: what the old coordinator logged is not logged twice."""

    def __init__(self, events):
        self._events = events

    def emit(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._events, name)
