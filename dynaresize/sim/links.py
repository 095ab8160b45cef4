"""Weight delivery with charged links (``sim.pipeline.link_model: star|relay``): who sends a version and how many
transfers share the sender's link decide when it arrives.

The plan (who sends to whom) is the runtime's: :class:`dynaresize.schedule.relay.RelayPlan`, the star
(``star``) or the relay (``relay``, fan-out ``sim.pipeline.relay_fanout``). This module only prices its transfers:

- a rank's link carries ``sim.pipeline.link_gbps`` (ASSUMPTION: 50 GB/s, one 400 Gb/s NIC per GPU as on H100/H20
  nodes; NVLink within a node, faster, is not used: a receiver may be on any node);
- a sender's link carries its transfers one after another, each ``weight_bytes / link_gbps`` (ASSUMPTION: the same
  last delivery as sharing the link fairly among them, which the runtime's one thread per receiver does; the first
  receivers get it earlier than under fair sharing, so the star is priced generously);
- a relay forwards a version once it holds all of it (store and forward: a receiver checks the checksum of the whole
  version before it forwards or installs it), to its receivers one after another in the order the plan made them.

``free`` (the default, the model before issue 46) charges every rank ``weight_bytes / nccl_gbps`` on its own, as if
the sender's link were free: it keeps the golden fixture, and it is what the barrier's broadcast costs per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaresize.schedule.relay import RelayPlan, Transfer


@dataclass
class LinkStats:
    """What the delivery cost, for the comparison's columns."""

    transfers: int = 0
    origin_busy_s: float = 0.0  # seconds rank 0's link carried weights
    most_sends: int = 0  # the most transfers one rank sent of one version
    delays: list[float] = field(default_factory=list)  # per delivery: from the fetch to the arrival
    spreads: dict[int, list[float]] = field(default_factory=dict)  # version -> [first fetch, last arrival]


class Links:
    """The senders' links: per sender the time its link is next free, and the plan that picks the senders."""

    def __init__(self, fanout: int, transfer_s: float, origin: int = 0):
        self.plan = RelayPlan(origin, fanout)
        self.transfer_s, self.origin = transfer_s, origin
        self.free_at: dict[int, float] = {}
        self.have_at: dict[tuple[int, int], float] = {}  # (rank, version) -> when it holds the whole version
        self.asked_at: dict[tuple[int, int], float] = {}  # (rank, version) -> when it asked
        self.sends: dict[tuple[int, int], int] = {}  # (sender, version) -> transfers
        self.stats = LinkStats()
        self.published: set[int] = set()

    def request(self, t: float, rank: int, version: int) -> list[tuple[float, Transfer]]:
        """``rank`` fetches ``version`` at ``t``; returns the transfers that start, each with its arrival time."""
        out: list[Transfer] = []
        if version not in self.published:  # the origin holds a version from the optimizer step that made it
            self.published.add(version)
            self.plan.retire(version - 2)  # a rank asks for an older version only a step or two behind
            self.have_at = {k: x for k, x in self.have_at.items() if k[1] >= version - 2}
            self.have_at[(self.origin, version)] = t
            out += self.plan.published(version)
        if self.plan.holds(rank, version):  # it holds it (or will) already (asked again after a switch back)
            return self._start(t, out) + [(max(t, self.have_at[(rank, version)]), Transfer(version, rank, rank))]
        self.asked_at.setdefault((rank, version), t)
        sp = self.stats.spreads.setdefault(version, [t, t])
        sp[0] = min(sp[0], t)
        out += self.plan.ask(rank, version)
        return self._start(t, out)

    def arrived(self, t: float, tr: Transfer) -> list[tuple[float, Transfer]]:
        """``tr`` ended at ``t``: its receiver holds the version (its own sends were planned, and timed, when it
        asked: they start once it holds the version). Returns the transfers that start now: none."""
        if tr.src == tr.dst:
            return []
        asked = self.asked_at.pop((tr.dst, tr.version), t)
        self.stats.delays.append(t - asked)
        sp = self.stats.spreads[tr.version]
        sp[1] = max(sp[1], t)
        return []

    def leaves(self, rank: int) -> None:
        self.plan.leaves(rank)

    def _start(self, t: float, transfers: list[Transfer]) -> list[tuple[float, Transfer]]:
        out = []
        for tr in transfers:
            begin = max(t, self.free_at.get(tr.src, 0.0), self.have_at[(tr.src, tr.version)])
            end = begin + self.transfer_s
            self.free_at[tr.src] = end
            self.have_at[(tr.dst, tr.version)] = end
            if tr.src == self.origin:
                self.stats.origin_busy_s += self.transfer_s
            n = self.sends[(tr.src, tr.version)] = self.sends.get((tr.src, tr.version), 0) + 1
            self.stats.most_sends = max(self.stats.most_sends, n)
            self.stats.transfers += 1
            out.append((end, tr))
        return out
