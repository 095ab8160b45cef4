"""Weight delivery in the runtime's schedule: how each version the core sends (``SendWeights``) reaches the rollout
ranks, and what is done when a sender is lost or its copy is refused.

- barrier (``pipeline.schedule: barrier``): a version goes to the pool in ONE blocking ``sync_weights`` from trainer
  rank 0 over the pre-built sync group, once no switch is in flight; the optimizer step after it waits behind it.
- barrier-free, ``pipeline.weights_transport: comm``: a ``fetch_weights`` posts the rank's receive in the background
  (its ack is the core's WeightsArrived) and the rank's sender gets a ``push_weights``: rank 0 (from the copy it kept
  at its optimizer step), sent ahead of its next training command (:meth:`Delivery.push_first`), or a relay
  (``pipeline.weights_relay``: :mod:`dynaresize.job.relay`) once its own fetch went.
- barrier-free, ``file``: the fetch reads the snapshot rank 0 staged at its optimizer step.

A rank that installed a version and replaced it since receives it again before it generates with it
(:meth:`Delivery.again`); a receive that failed on its relay (``relay_failed``) or a lost relay (``relay_lost``)
gets the version again from another holder (the plan's choice: :class:`dynaresize.schedule.relay.RelayPlan`).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable

from dynaresize.job.flight import Commands, Sent
from dynaresize.job.relay import Routes
from dynaresize.job.runtime import Job
from dynaresize.job.tally import Tallies
from dynaresize.job.takeover import redo_id
from dynaresize.job.transport import Phase
from dynaresize.schedule import PipelineScheduler, Role, SendWeights, Step, WeightsArrived
from dynaresize.schedule.relay import RELAY_MARK, Transfer

log = logging.getLogger("dynaresize.job")


class Delivery:
    """The versions on their way to the rollout ranks, and what each rank installed."""

    def __init__(self, job: Job, parts, at: Phase, commands: Commands, core: PipelineScheduler, tallies: Tallies,
                 barrier: bool):
        self.job, self.p, self.at, self.commands, self.core, self.tallies = job, parts, at, commands, core, tallies
        self.barrier = barrier  # versions travel in one blocking sync
        self.syncs: dict[int, set[int]] = {}  # barrier: version -> rollout ranks the core sent it to, not yet synced
        self.held_step: Step | None = None  # barrier: an optimizer step waiting for its version's sync to be sent
        # barrier-free: how versions travel (comm: rank 0 -> each rank over the world group; file: the fallback)
        self.transport = job.cfg.pipeline.weights_transport
        # comm: who sends a version to whom (the star or the relay: dynaresize.schedule.relay, pipeline.weights_relay)
        self.routes = Routes(job.cfg.pipeline.weights_relay) if self.transport == "comm" and not barrier else None
        self.gen_version: dict[int, int] = {}  # rollout rank -> newest version of the generates sent to it
        self.gen_last: dict[int, int] = {}  # rollout rank -> the version of the last generate sent to it (installed)

    # --- the core's SendWeights -------------------------------------------------------------------------------------
    def plan_syncs(self, actions) -> None:
        """Barrier: the pool's version first, before any training command reaches rank 0 (``actions``: those not
        held back by a drain)."""
        for a in actions:
            if isinstance(a, SendWeights) and a.blocking:
                self.syncs.setdefault(a.version, set()).add(a.rank)

    def hold_step(self, a: Step) -> bool:
        """Barrier: rank 0 sends version k from its live weights: its step to k + 1 goes behind that sync."""
        if self.barrier and any(v <= a.batch for v in self.syncs):
            self.held_step = a
            return True
        return False

    def send_syncs(self) -> Step | None:
        """Barrier: a version the core sent to the rollout pool goes in ONE blocking ``sync_weights`` from trainer
        rank 0 over the pre-built sync group (every rollout rank of the split takes part in the collective), once no
        switch is in flight (a switch changes the group; its ranks learn the new split first). Returns the optimizer
        step held behind it, now free to go."""
        if not self.syncs or self.commands.any_of("switch_role", "switch_note", "sync_weights"):
            return None
        v = min(self.syncs)
        targets = self.syncs.pop(v)
        st = self.job.state
        s = self.commands.send("sync_weights", [0] + self.job.rollouts(),
                               {"version": v, "n_train": st.n_train, "lost": st.lost}, version=v)
        s.targets = tuple(sorted(targets))
        a = self.held_step
        if a is not None and not any(u <= a.batch for u in self.syncs):
            self.held_step = None
            return a
        return None

    def push_first(self, actions) -> None:
        """comm: the versions the core sends to rollout ranks in ``actions`` (those not held back by a drain) go to
        rank 0 as ``push_weights`` now, before any training command of this round, with each fetch marked ``pushed``
        (the rank posts one receive whatever it holds). Rank 0 runs its commands one at a time: a push sent after the
        fetch's ack waited behind the chunk of the next batch rank 0 had started meanwhile (seconds), and the rollout
        ranks with it."""
        if self.barrier or self.transport != "comm":
            return
        to: dict[int, list[int]] = {}
        for a in actions:
            if isinstance(a, SendWeights) and not a.blocking:
                to.setdefault(a.version, []).append(a.rank)
        for v, ranks in sorted(to.items()):
            for (src, _), dsts in self.routes.ask(v, ranks).items():
                self.send_push(v, dsts, src)

    def send_fetch(self, rank: int, version: int) -> None:
        """The core sent ``version`` to ``rank``: the rank starts receiving it in the background (its ack is the
        core's WeightsArrived). comm: ``push_first`` told rank 0 to send it already (the fetch says ``pushed``)."""
        keep = sorted(set(self.core.versions_counted(rank)) | {version})  # a version the core dropped frees its buffer
        payload = {"version": version, "transport": self.transport, "keep": keep}
        if self.transport == "comm":
            payload["pushed"] = True
            payload.update(self.routes.fetch(rank, version))
        self.commands.send("fetch_weights", [rank], payload, version=version)
        if self.transport == "comm":
            dsts = self.routes.fetched_now(rank, version)  # a relay forwards it to these once it holds it
            if dsts:
                self.send_push(version, dsts, rank)

    def send_push(self, version: int, ranks: list[int], src: int = 0) -> None:
        """comm: ``src`` sends ``version`` to ``ranks``, on background threads (acked once queued), point to point
        over the world group built at start-up: rank 0 from the copy it kept at its optimizer step, a relay from what
        it receives (one receiver after another)."""
        # a relay sends one receiver after another (its first receiver forwards soonest); rank 0 keeps a thread per
        # receiver (at most f per version with the relay): a lost receiver holds up no other of its sends
        relay = self.routes is not None and self.routes.fanout > 0 and src != 0
        self.commands.send("push_weights", [src],
                           {"version": version, "ranks": ranks, **({"one_at_a_time": True} if relay else {})},
                           version=version)

    def kept_for(self, batch: int, staleness: int) -> dict:
        """An optimizer step's payload of what rank 0 keeps (comm: copies of the versions a batch in flight may still
        need, as the file path keeps snapshots); the relay forgets the versions below."""
        if self.barrier:
            return {}
        keep = {"transport": self.transport, "keep_from": max(0, batch - staleness)}
        if self.routes is not None:
            self.routes.retire(keep["keep_from"])
        return keep

    # --- acks -----------------------------------------------------------------------------------------------------
    def arrived(self, sent: Sent, res: dict[int, dict]) -> list[WeightsArrived]:
        """A fetch or a blocking sync acked: the core's events (a fetch_again's ack brings none)."""
        if sent.kind == "sync_weights":  # blocking: every rollout rank of the split takes part from send to the last ack
            self.tallies.waited_for(sent.version, (time.monotonic() - sent.flight.sent_at) * (len(sent.flight.ranks) - 1))
            return [WeightsArrived(r, sent.version) for r in sent.targets if r not in self.job.state.lost]
        if (self.transport == "comm" and res[sent.rank].get("started")
                and not sent.flight.cmd.payload.get("pushed")):
            self.send_push(sent.version, [sent.rank])  # the receive is posted: rank 0 sends it (exactly once)
        return [WeightsArrived(sent.rank, sent.version)] if sent.kind == "fetch_weights" else []

    # --- a rank's installed version -------------------------------------------------------------------------------
    def again(self, rank: int, version: int) -> None:
        """comm: before a generate of ``version`` on ``rank`` that the rank installed before and replaced since (a lost
        rank's or an extra round's groups of an older version handed to it after a newer one, or the newer one again
        after those), the rank receives ``version`` again from rank 0 (the file fallback reads the snapshot again)."""
        newest, last = self.gen_version.get(rank, version), self.gen_last.get(rank, version)
        # installed before and replaced since (an older one handed out, or back to the newer one after it): gone
        if not self.barrier and self.transport == "comm" and version != last and version <= newest:
            self.commands.send("fetch_weights", [rank], {"version": version, "transport": "comm", "again": True},
                               label="fetch_again", version=version)
        self.gen_version[rank] = max(version, newest)
        self.gen_last[rank] = version

    def leaves(self, ranks) -> None:
        """Rollout ranks about to become trainers forward nothing new (their buffers go; their planned sends still go)."""
        for r in ranks if self.routes is not None else ():
            self.routes.leaves(r)

    def forget(self, rank: int) -> None:
        """``rank`` switched role: a former trainer holds the newest version (nothing to receive again)."""
        self.gen_version.pop(rank, None)
        self.gen_last.pop(rank, None)

    def deliver(self, ranks: list[int], version: int) -> None:
        """Bring ``ranks`` (rollout ranks) to ``version`` now, outside the core's plan (a resume, a checkpoint): one
        blocking sync over the pre-built group (barrier), else a fetch of the published snapshot and an install."""
        if not ranks:
            return
        tx = self.p.tx
        if self.barrier:
            st, t0 = self.job.state, time.monotonic()
            tx.call(self.at, "sync_weights", [0] + self.job.rollouts(), {"version": version, "n_train": st.n_train,
                                                                         "lost": st.lost})
            self.tallies.waited_for(version, (time.monotonic() - t0) * len(self.job.rollouts()))
            return
        # a no-op where the transfer is under way or done; comm: rank 0 sends where a receive started. ``version`` is
        # the newest one and the generate below installs it: a version a rank fetched and never installed (an idle
        # rank's, at the run's end) is dropped first, else a rank holding two failed the run at its last step
        fetched = tx.call(self.at, "fetch_weights", ranks, {"version": version, "transport": self.transport,
                                                            "keep": [version]})
        started = [r for r, a in sorted(fetched.acks.items()) if (a.result or {}).get("started")]
        if self.transport == "comm" and started:
            tx.call(self.at, "push_weights", [0], {"version": version, "ranks": started})
        installed = tx.call(self.at, "generate", ranks, self.p.rollout.payload(version, version=version, prompts=[]))
        self.tallies.waited_for(version, sum(float((a.result or {}).get("install_s", 0.0))
                                             for a in installed.acks.values()))
        for r in ranks:
            self.gen_version[r] = max(version, self.gen_version.get(r, version))
            self.gen_last[r] = version

    def behind(self, k: int) -> list[int]:
        """The rollout ranks whose installed version is not ``k`` (they say so: ``ping``)."""
        held = self.p.tx.call(self.at, "ping", self.job.rollouts(), {})
        return [r for r, a in sorted(held.acks.items()) if int((a.result or {}).get("version", k)) != k]

    def install_newest(self, k: int) -> None:
        """Before a checkpoint at step k every rollout rank holds version k, as after a barrier run's sync (a
        resume starts them there): fetched if it was not, then installed by a generate of no prompts."""
        self.deliver(self.behind(k), k)

    # --- the relay: a lost sender, a refused copy -----------------------------------------------------------------
    def relay_failed(self, sent: Sent, ack, watch: Callable[[], None]) -> bool:
        """A generate whose install failed on the receive from its relay (the relay was lost, or its copy refused)
        before the version was planned again: the rank gets it from another holder (the relay's loss is found now by
        ``watch``, the schedule's liveness check, or the refused copy re-planned), then the same generate goes again
        (nothing was claimed: the install comes first). False when the failure is another one."""
        if (self.routes is None or sent.kind not in ("generate", "validate") or sent.version is None
                or f"{RELAY_MARK}rank" not in (ack.error or "")):
            return False
        m = re.search(rf"{RELAY_MARK}rank (\d+)", ack.error or "")
        src = int(m.group(1)) if m else None
        rc = self.job.cfg.redis
        deadline = time.monotonic() + rc.dead_after_s + rc.heartbeat_s
        while src is not None and src not in self.job.state.lost and time.monotonic() < deadline:
            watch()  # the relay's loss: relay_lost plans the rank again and sends its fetch
            if src not in self.job.state.lost:
                time.sleep(0.5)
        if src is not None and src not in self.job.state.lost and self.routes.plan.source(ack.rank, sent.version) == src:
            for t in self.routes.plan.failed(Transfer(sent.version, src, ack.rank)):  # alive: its copy was refused
                self.refetch(t)
        log.warning("rank %d: version %d from relay rank %s failed (%s); received again from another holder, its "
                    "generate sent again", ack.rank, sent.version, src, (ack.error or "").splitlines()[0][:200])
        # the rank may have installed another version since (a lost rank's groups of an older one): it receives this
        # one again first (the same rule as any generate's, ``again``)
        self.again(ack.rank, sent.version)
        self.commands.resend(sent, redo_id(sent.flight.cmd.command_id))
        return True

    def refetch(self, t: Transfer) -> None:
        """``t.dst`` receives ``t.version`` again, from ``t.src``: a fetch naming it (the receive under way from
        another sender is dropped), and ``t.src``'s push (a relay's once its own fetch went)."""
        payload = {"version": t.version, "transport": "comm", "again": True, "pushed": True,
                   **self.routes.fetch(t.dst, t.version)}
        self.commands.send("fetch_weights", [t.dst], payload, label="fetch_again", version=t.version)
        dsts = self.routes.fetched_now(t.dst, t.version)
        if dsts:
            self.send_push(t.version, dsts, t.dst)
        if t.src == 0 or (t.src, t.version) in self.routes.fetched:
            self.send_push(t.version, [t.dst], t.src)
        else:
            self.routes.pending.setdefault((t.src, t.version), []).append(t.dst)

    def relay_lost(self, ranks) -> None:
        """comm: the receivers a lost rank was to forward a version to get it again from another holder (the plan's
        choice), each with a fetch naming its new sender; nothing is lost."""
        for rank in ranks if self.routes is not None else ():
            for t in self.routes.plan.lost(rank):
                if t.dst in self.job.state.lost or self.core.role(t.dst) is not Role.ROLLOUT:
                    continue
                log.info("relay rank %d lost: rank %d gets version %d from rank %d", rank, t.dst, t.version, t.src)
                self.refetch(t)
            for key in [k for k in self.routes.pending if k[0] == rank]:
                del self.routes.pending[key]
