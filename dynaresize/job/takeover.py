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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dynaresize.contract.keys import Keys

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
