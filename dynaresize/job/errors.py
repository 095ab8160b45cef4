"""How a job ends early: the errors the coordinator's components raise, and an operator's stop."""

from __future__ import annotations

from dataclasses import dataclass

from dynaresize.events import format_ranks


class JobError(RuntimeError):
    """The job cannot go on (a rank died, a command failed); the message says which rank and why."""


class RanksLost(JobError):
    """Ranks died (process exited) or went silent (no heartbeat within the deadline) while a command waited on them."""

    def __init__(self, ranks, what: str, why: str):
        self.ranks = sorted(ranks)
        self.what = what
        self.why = why
        super().__init__(f"{what}: rank(s) {format_ranks(self.ranks)} lost ({why})")


@dataclass
class OperatorStop:
    """An operator's stop (the first SIGTERM/SIGINT) and how it ended: for the event log, the summary, the CLI."""

    signal: str  # SIGTERM or SIGINT
    at_step: int  # the step in flight when it arrived
    checkpoint: str | None = None  # the checkpoint the stop wrote (tag)
    abandoned: str | None = None  # why the checkpoint in progress was abandoned (a second signal)

    def describe(self, step: int, resume_point: str | None) -> str:
        """One line: the stop, where the run ended (``step``: the next step to train) and what a resume does."""
        head = f"{self.signal} (an operator's stop) during step {self.at_step}: stopped before step {step}"
        if self.checkpoint:
            return (f"{head}, checkpoint {self.checkpoint} written, ranks shut down; a resume continues at step {step} "
                    f"and trains no step twice")
        why = self.abandoned or "no checkpoint could be taken"
        return f"{head}, ranks shut down; {why}; a resume starts from {resume_point or 'the start'} (the steps after it are trained again)"
