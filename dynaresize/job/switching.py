"""Role switches: ranks move between training and rollout in place (no process restart, no new communicator), at
a training-batch boundary of the scheduler core's schedule (one ``switch_role`` over the old and new trainers)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dynaresize.events import Role, format_ranks
from dynaresize.job.runtime import Job
from dynaresize.job.transport import InFlight, Phase, Transport

log = logging.getLogger("dynaresize.job")


@dataclass(frozen=True)
class Started:
    """A switch sent and not finished: its id, the step it belongs to, the trainer counts, the command."""

    switch_id: str
    step: int
    old: int
    new: int
    sent: InFlight


class Switching:
    def __init__(self, job: Job, tx: Transport):
        self.job, self.tx = job, tx

    def begin(self, at: Phase, k: int, decision, ranks=None) -> "Started":
        """Send a switch to ``ranks`` (default: every live rank) without waiting for it (the schedule hears its acks
        with every other rank's); :meth:`finish` once every rank acked."""
        job, st, events = self.job, self.job.state, self.job.events
        old, new = st.n_train, decision.target.n_train
        sid = f"sw{len(st.switches)}-s{k}"
        ranks = job.alive() if ranks is None else [r for r in ranks if r not in st.lost]
        n_alive = len(job.alive())
        events.emit(
            "switch_start", switch_id=sid, step=k, from_train=old, from_rollout=n_alive - old, to_train=new,
            to_rollout=n_alive - new, planned_critical_s=round(decision.critical_cost_s, 4), mode="optimized",
        )
        payload = {"switch_id": sid, "step": k, "from_train": old, "to_train": new}
        st.switches.append({"switch_id": sid, "step": k, "from": f"{old}:{n_alive - old}", "to": f"{new}:{n_alive - new}",
                            "mode": "optimized", "critical_path_s": None, "hidden_s": 0.0})
        return Started(sid, k, old, new, self.tx.send(at, "switch_role", ranks, payload))

    def finish(self, started: "Started") -> str:
        job, st, events = self.job, self.job.state, self.job.events
        sid, k, old, new = started.switch_id, started.step, started.old, started.new
        critical = time.monotonic() - started.sent.sent_at
        moved = range(min(old, new), max(old, new))
        frm, to = (Role.TRAIN, Role.ROLLOUT) if new < old else (Role.ROLLOUT, Role.TRAIN)
        events.emit("role_change", step=k, ranks=format_ranks(moved), from_role=frm, to_role=to)
        st.n_train = new
        events.emit("topology", step=k, train_ranks=format_ranks(job.trainers()), rollout_ranks=format_ranks(job.rollouts()))
        # hidden seconds are not known yet (the optimizer stage-in runs at the next training step): the analysis
        # sums the switch's background ops from the log, and so does the summary
        events.emit("switch_end", switch_id=sid, critical_path_s=round(critical, 6))
        for rec in st.switches:
            if rec["switch_id"] == sid:
                rec["critical_path_s"] = round(critical, 4)
        log.info("switch %s at step %d: %d -> %d trainers, %.2f s on the critical path", sid, k, old, new, critical)
        return sid
