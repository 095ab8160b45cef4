"""The coordinator's side of the weight relay (``pipeline.weights_relay`` > 0, comm transport, barrier-free schedule):
the pure plan's transfers (:class:`dynaresize.schedule.relay.RelayPlan`) become ``push_weights`` commands in an order
every rank can serve.

A relay's ``push_weights`` must reach it after its own ``fetch_weights`` (that fetch registers the receive it forwards
from), so pushes from a relay whose fetch is not sent yet wait here; rank 0's go at once (ahead of its next training
command, as the star's do). Every fetch is marked ``pushed``: it names its sender (``src``) and that sender gets
exactly one push for it, so every receive posted has exactly one send.
"""

from __future__ import annotations

from dynaresize.schedule.relay import RelayPlan, Transfer


class Routes:
    def __init__(self, fanout: int):
        self.plan = RelayPlan(0, fanout)
        self.fanout = fanout
        self.fetched: set[tuple[int, int]] = set()  # (rank, version) whose fetch was sent: it may be pushed to forward
        self.pending: dict[tuple[int, int], list[int]] = {}  # (relay, version) -> receivers waiting for its fetch

    def ask(self, version: int, ranks: list[int]) -> dict[tuple[int, int], list[int]]:
        """``ranks`` fetch ``version`` (the core's SendWeights): the pushes to send now, (sender, version) -> receivers. A rank
        the plan already counts (its copy was dropped, or it asks after a loss) is planned again from any holder."""
        out = self.plan.published(version)
        for r in ranks:
            out += self.plan.again(r, version) if self.plan.holds(r, version) else self.plan.ask(r, version)
        return self._route(out)

    def fetch(self, rank: int, version: int) -> dict:
        """The fetch's extra payload: its sender, and (relay) that it may forward what it receives."""
        return {"src": self.plan.source(rank, version) or 0, "forward": self.fanout > 0}

    def fetched_now(self, rank: int, version: int) -> list[int]:
        """``rank``'s fetch of ``version`` was sent: the receivers waiting for it to forward (push them now)."""
        self.fetched.add((rank, version))
        return self.pending.pop((rank, version), [])

    def leaves(self, rank: int) -> None:
        self.plan.leaves(rank)

    def retire(self, below: int) -> None:
        self.plan.retire(below)
        self.fetched = {k for k in self.fetched if k[1] >= below}
        self.pending = {k: v for k, v in self.pending.items() if k[1] >= below}

    def _route(self, transfers: list[Transfer]) -> dict[tuple[int, int], list[int]]:
        now: dict[tuple[int, int], list[int]] = {}
        for t in transfers:
            if t.src == self.plan.origin or (t.src, t.version) in self.fetched:
                now.setdefault((t.src, t.version), []).append(t.dst)
            else:
                self.pending.setdefault((t.src, t.version), []).append(t.dst)
        return now
