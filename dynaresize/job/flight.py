"""The schedule's commands in flight: each sent command with the core's action it carries out (:class:`Sent`), and
the table of them every component of the schedule sends through (:class:`Commands`).

Why a table of its own: the acks of every command in flight are read in one XREAD (:meth:`Commands.cursors`), a
command's ack may cause others (its id goes with them as ``reply_to``, so the rank that acked times the round trip),
and a takeover's replay rebuilds the same table by observing the ranks' stored acks (:mod:`dynaresize.job.replay`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynaresize.job.switching import Started
from dynaresize.job.transport import InFlight


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
