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


def resume_plan(step: int, checkpoint: str | None) -> str:
    """What a resume does from here: the last checkpoint on disk (the resume point) and how many steps it trains
    again. ``step``: the next step to train; ``checkpoint``: the state's checkpoint (``checkpoints/step-<k>``)."""
    from dynaresize.job.checkpoint_files import tag_step

    try:
        at = tag_step(checkpoint.rsplit("/", 1)[-1]) if checkpoint else 0
    except ValueError:
        at = 0
    where = f"the last checkpoint is {checkpoint} (step {at})" if checkpoint else "no checkpoint was written yet"
    if at >= step:
        return f"{where}: a resume continues at step {step} and trains no step again"
    again = f"step {at}" if step - at == 1 else f"steps {at}..{step - 1}"
    return (f"{where}: a resume starts {'there' if checkpoint else 'from step 0'} and trains {step - at} step(s) "
            f"again ({again})")


def where_stopped(step: int, checkpoint: str | None) -> str:
    """``the run stopped before step 12; the last checkpoint is checkpoints/step-10 (step 10): a resume starts
    there and trains 2 step(s) again (steps 10..11)``."""
    return f"the run stopped before step {step}; {resume_plan(step, checkpoint)}"


@dataclass
class OperatorStop:
    """An operator's stop (the first SIGTERM/SIGINT) and how it ended: for the event log, the summary, the CLI."""

    signal: str  # SIGTERM or SIGINT
    at_step: int  # the step in flight when it arrived
    checkpoint: str | None = None  # the checkpoint the stop wrote (tag)
    abandoned: str | None = None  # why the checkpoint in progress was abandoned (a second signal)

    def describe(self, step: int, resume_point: str | None) -> str:
        """One line: the stop, where the run ended (``step``: the next step to train) and what a resume does."""
        if step == 0:
            head = f"{self.signal} (an operator's stop) before the first step: stopped before step 0"
        elif step <= self.at_step:  # it came between two steps: the next one never started
            head = f"{self.signal} (an operator's stop) after step {step - 1}: stopped before step {step}"
        elif step == self.at_step + 1:
            head = f"{self.signal} (an operator's stop) during step {self.at_step}: step {self.at_step} finished, stopped before step {step}"
        else:  # steps already in flight finished (the continuous schedule)
            head = (f"{self.signal} (an operator's stop) during step {self.at_step}: the steps in flight finished "
                    f"({self.at_step}..{step - 1}), stopped before step {step}")
        if self.checkpoint:
            return (f"{head}, checkpoint {self.checkpoint} written, ranks shut down; a resume continues at step {step} "
                    f"and trains no step twice")
        why = self.abandoned or "no checkpoint could be taken"
        return f"{head}, ranks shut down; {why}; {resume_plan(step, resume_point)}"
