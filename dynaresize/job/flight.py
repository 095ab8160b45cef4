"""The schedule's commands in flight: each sent command with the core's action it carries out (:class:`Sent`), and
the table of them every component of the schedule sends through (:class:`Commands`).

Why one table: the acks of every command in flight are read in one XREAD (each command's stream cursor is here), a
command caused by an ack names that ack's command (``reply_to``: the rank that acked times the round trip), and a
takeover's replay rebuilds the same table by observing the ranks' stored acks (:mod:`dynaresize.job.replay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynaresize.job.transport import InFlight, Phase, Transport


@dataclass(frozen=True)
class Started:
    """A switch sent and not finished: its id, the step it belongs to, the trainer counts, the command."""

    switch_id: str
    step: int
    old: int
    new: int
    sent: InFlight


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


class Commands:
    """The schedule's commands in flight by id, and how each component sends one."""

    def __init__(self, tx: Transport, at: Phase, bus):
        self.tx, self.at, self.bus = tx, at, bus
        self.sent: dict[str, Sent] = {}
        self.answering: tuple[int, str] | None = None  # (rank, command id) of the ack being observed: what it causes

    def send(self, kind: str, ranks, payload: dict, label: str | None = None, **what) -> Sent:
        ranks = list(ranks)
        cause = self.answering  # an ack of one of these ranks caused it: that rank times the round trip
        reply_to = cause[1] if cause is not None and cause[0] in ranks else None
        flight = self.tx.send(self.at, kind, ranks, payload, step=what.get("batch"), reply_to=reply_to)
        return self.add(Sent(label or kind, flight, **what))

    def add(self, s: Sent) -> Sent:
        self.sent[s.flight.cmd.command_id] = s
        return s

    def resend(self, sent: Sent, command_id: str) -> None:
        """``sent`` again under ``command_id`` (the next id of its chain: a generate aborted by a takeover, or one
        whose install failed on its relay's receive), its acks read from the new command's stream."""
        old = sent.flight.cmd.command_id
        cmd = self.bus.command(sent.flight.cmd.kind, sent.flight.ranks, sent.flight.cmd.payload, command_id=command_id)
        self.bus.resend(cmd)
        sent.flight.cmd, sent.cursor = cmd, b"0-0"
        del self.sent[old]
        self.sent[cmd.command_id] = sent

    def drop(self, ranks) -> None:
        """The commands of lost ranks: never answered."""
        for cid, s in list(self.sent.items()):
            if any(r in ranks for r in s.flight.ranks):
                del self.sent[cid]

    def owed(self) -> tuple[set[int], list[str]]:
        """The ranks that owe an ack, and the kinds of the commands they owe it for."""
        busy = {r for s in self.sent.values() for r in s.flight.ranks if r not in s.acks}
        kinds = sorted({s.kind for s in self.sent.values() for r in s.flight.ranks if r not in s.acks})
        return busy, kinds

    def any_of(self, *kinds: str) -> bool:
        return any(s.kind in kinds for s in self.sent.values())
