"""Role switches: ranks move between training and rollout in place (no process restart, no new communicator), at
a training-batch boundary of the scheduler core's schedule (one ``switch_role`` over the old and new trainers).

A resize, from the policy's decision to the ranks: the core asks the policy at each measured step and returns
``Decided`` (each decision, logged as a ``decision`` event) and, for a resize, one ``Switch`` per moving rank under
one switch id (:mod:`dynaresize.schedule.core`); :class:`Resizes` turns them into ONE ``switch_role`` over the old
and new trainers (:meth:`Switching.begin`: the ``switch_start`` event, the job state's record) and a note to the
other rollout ranks; the ranks' acks end it (:meth:`Switching.finish`: ``role_change``, ``topology``, ``switch_end``).
"""

from __future__ import annotations

import logging
import time

from dataclasses import replace

from dynaresize.events import Role, format_ranks
from dynaresize.job.delivery import Delivery
from dynaresize.job.errors import JobError
from dynaresize.job.flight import Commands, Sent, Started
from dynaresize.job.runtime import Job
from dynaresize.job.transport import Phase, Transport
from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, ResizeAction
from dynaresize.schedule import Switch

log = logging.getLogger("dynaresize.job")


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


class Resizes:
    """One schedule's resizes: the core's decisions logged, its switches sent as one ``switch_role`` each."""

    def __init__(self, job: Job, switching: Switching, at: Phase, commands: Commands, delivery: Delivery):
        self.job, self.switching, self.at, self.commands, self.delivery = job, switching, at, commands, delivery
        self.decisions: dict[int, Decision] = {}  # the core's switch id -> its decision

    def decided(self, step: int, d: Decision, sid: int | None) -> None:
        self.job.events.emit("decision", step=step + 1, action=d.action.value, reason=d.reason,
                             imbalance=round(d.imbalance, 4), target_train=d.target.n_train,
                             target_rollout=d.target.n_rollout, expected_saving_s=round(d.expected_saving_s, 4),
                             cost_s=round(d.critical_cost_s, 4))
        if sid is not None:
            self.decisions[sid] = d

    def send(self, sid: int, switches: list[Switch]) -> None:
        """One resize: a ``switch_role`` over the old and new trainers (the collective reshards the optimizer
        state); the other rollout ranks learn the new count from a note queued behind their work."""
        job, st = self.job, self.job.state
        movers = sorted(s.rank for s in switches)
        if switches[0].to is Role.TRAIN:
            self.delivery.leaves(movers)
        old = st.n_train
        new = old + len(movers) if switches[0].to is Role.TRAIN else old - len(movers)
        if movers != list(range(min(old, new), max(old, new))):
            raise JobError(f"switch {sid}: ranks {movers} do not border the trainers 0..{old - 1}")
        n_alive = len(job.alive())
        d = self.decisions.get(sid) or Decision(ResizeAction.RESIZE, Topology(new, n_alive - new), "the core's resize")
        if d.target.n_train != new:
            d = replace(d, target=Topology(new, n_alive - new))
        union = [r for r in range(max(old, new)) if r not in st.lost]
        started = self.switching.begin(self.at, st.step, d, ranks=union)
        self.commands.add(Sent("switch_role", started.sent, started=started, movers=tuple(movers)))
        rest = [r for r in job.alive() if r >= max(old, new)]
        if rest:
            self.commands.send("switch_role", rest, dict(started.sent.payload), label="switch_note")
