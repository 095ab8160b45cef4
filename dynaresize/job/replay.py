"""The takeover's replay in the runtime's schedule: a coordinator started with ``--resume`` while the ranks live
replays the last segment of ``schedule.jsonl`` through the schedule's own code, from the job state it started from
(:mod:`dynaresize.job.takeover` says why that reproduces the old coordinator's commands and their ids).

While it replays, each logged line is the next step: the stored acks of the command whose ack the old coordinator
observed there (:meth:`Replay.next`), a loss it fenced off (returned as :class:`Fenced`, for the schedule to handle as
its own), or the drain's checkpoint; every line the schedule would write is compared with the logged one instead
(:meth:`Replay.record`). At the end of the log it goes live: the commands still in flight are sent again under their
ids. Without a takeover it is the schedule's log, written line by line.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dynaresize.job.core_io import ScheduleLog
from dynaresize.job.flight import Commands, Sent
from dynaresize.job.runtime import Job
from dynaresize.job.takeover import Drained, Fenced, Noted, Observed, Segment, StoredAcks, Takeover
from dynaresize.job.transport import Phase
from dynaresize.schedule import (
    GroupsDone, OptimizerStepDone, SchedulerConfig, SwitchDone, TrainChunkDone, ValidationDone, WeightsArrived,
)


class Replay:
    """``schedule.jsonl`` as the schedule writes it, or (a takeover) as it replays it first."""

    def __init__(self, job: Job, parts, commands: Commands, core_cfg: SchedulerConfig, policy_state,
                 segment: Segment | None):
        self.commands = commands
        path, st = job.run_dir / "schedule.jsonl", job.state
        self.takeover: Takeover | None = None  # a takeover of the live ranks: its segment replayed first
        if segment is None:
            self.log = ScheduleLog(path, core_cfg, st.incarnation, policy_state, state=asdict(st))
        else:
            stored = StoredAcks(parts.svc.redis, job.job_id, job.cfg.redis.max_message_bytes)
            self.takeover = Takeover(segment, stored, job, parts.tx, commands.sent)
            self.log = ScheduleLog(path, core_cfg, st.incarnation, None, header=False)

    @property
    def replaying(self) -> bool:
        """A takeover replaying its segment: commands computed, not sent; acks read from the ranks' stored copies."""
        return self.takeover is not None and self.takeover.replaying

    @property
    def live_at(self) -> float | None:
        """When a takeover went live (monotonic): the ranks' liveness is watched from then."""
        return self.takeover.live_at if self.takeover is not None else None

    def record(self, rec: dict) -> None:
        """A line of ``schedule.jsonl`` (while a takeover replays, compared with the logged one instead)."""
        if not (self.replaying and self.takeover.replays(rec)):
            self.log.write(rec)

    def next(self, drain: int | None) -> list[tuple[Sent, Any]] | Fenced:
        """The next logged event's cause: the stored acks of the command whose ack the old coordinator observed
        there, or a loss it fenced off (``Fenced``: the schedule handles it as its own); at the end of the log, live.
        ``drain``: the step the schedule drains to (the log's checkpoint there ends the drain)."""
        tk = self.takeover
        match tk.next_line():
            case None:
                self.go_live()
                return []
            case Drained(step) if step == drain:  # the drain reached its checkpoint here (the loop takes it)
                return []
            case Drained():
                raise tk.bug(f"is a checkpoint the replay does not drain to (drain: {drain})")
            case Fenced() as fenced:  # the old coordinator fenced these off (Recovery.shrink)
                return fenced
            case Noted(ranks):  # a switch's note to the other rollout ranks, acked
                s = next((x for x in self.commands.sent.values()
                          if x.kind == "switch_note" and tuple(x.flight.ranks) == ranks), None)
            case Observed(ev):
                s = self.cause(ev)
        if s is None:
            raise tk.bug("follows no command this replay sent")
        return [(s, ack) for ack in tk.stored_acks(s)]

    def cause(self, ev) -> Sent | None:
        """The command in flight whose ack gives event ``ev``."""
        for s in self.commands.sent.values():
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

    def at_checkpoint(self) -> bool:
        """Replaying a drain: it is over where the log says it was."""
        return self.takeover.at_checkpoint()

    def replays_checkpoint(self, k: int, at: Phase) -> bool:
        """A due checkpoint at step k the old coordinator wrote (nothing to do); False live."""
        return self.replaying and self.takeover.replays_checkpoint(k, at)

    def go_live(self) -> None:
        """A takeover's replay ends here: the commands in flight are sent again under their ids (a no-op when live)."""
        if self.replaying:
            self.takeover.go_live()

    def close(self) -> None:
        if self.takeover is not None:
            self.takeover.close()
        self.log.close()
