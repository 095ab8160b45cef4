"""Commands to the ranks: send with a repeatable id, wait for the acks while watching the ranks' liveness (a rank
that exited or went silent raises :class:`RanksLost`), and require that every ack is a success."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from dynaresize.control.health import lost_ranks, stall_grace_s
from dynaresize.control.server import RedisRefusesWrites, redis_error_text
from dynaresize.disk import is_disk_full
from dynaresize.events import format_ranks
from dynaresize.job.errors import JobError, RanksLost, where_stopped
from dynaresize.job.runtime import Job, Services

log = logging.getLogger("dynaresize.job")

# a Redis stall is announced when its slowest reply took this many heartbeat periods (the ranks missed a beat and
# more): a reply a little late is scheduling noise on a loaded machine. Not 2: a call already blocked in the server
# when Redis stalls is not delayed, so the coordinator measures a stall of 3 periods as about 2
ANNOUNCE_PERIODS = 1.5

@dataclass
class Phase:
    """Where in the schedule commands are sent from (``start``, ``f<j>``: filling the pipeline with batch j,
    ``s<k>``: step k): with the launch incarnation and how many commands of a kind the phase sent before, the key of
    a command's id. A coordinator re-running the same phase from the journal computes the same ids."""

    name: str
    sent: dict[str, int] = field(default_factory=dict)  # kind -> how many of that kind so far

    def command_id(self, incarnation: int, kind: str, ranks: list[int], payload: dict) -> str:
        n = self.sent.get(kind, 0)
        self.sent[kind] = n + 1
        digest = hashlib.blake2b(json.dumps([ranks, payload], sort_keys=True).encode(), digest_size=4).hexdigest()
        return f"i{incarnation}.{self.name}.{kind}.{n}.{digest}"


@dataclass
class InFlight:
    """A command sent and not awaited yet."""

    cmd: Any  # dynaresize.control.commands.Command
    ranks: list[int]  # the ranks it went to
    step: int | None = None  # the batch it generates or trains
    sent_at: float = field(default_factory=time.monotonic)

    @property
    def payload(self) -> dict:
        return self.cmd.payload


class Replay(Protocol):
    """What the transport asks of a takeover while it replays the schedule (:class:`dynaresize.job.takeover.Takeover`
    is the one): named here so that the transport, which every component sends through, imports nothing above it."""

    def hold(self, flight: InFlight) -> InFlight:
        """A command computed while replaying: held with its id, sent when the replay goes live."""

    def answer(self, cmd: Any, ranks: list[int]) -> Any:
        """A call's acks from the ranks' stored copies (an AckResult); None: live from this call on."""


class Transport:
    def __init__(self, job: Job, svc: Services):
        self.job, self.svc = job, svc
        self.writes_refused = False  # Redis refused writes: the final shutdown does not wait for it once more
        # a takeover replaying the schedule (it sets and clears this): a command is computed and held, not sent; a
        # wait is answered from the ranks' stored acks, and one that has none is where the old coordinator stopped
        self.replay: Replay | None = None
        self._lost_announced: set[int] = set()  # the lost ranks at the last Redis-stall announcement

    def send(self, at: Phase, kind: str, ranks, payload: dict, step: int | None = None,
             reply_to: str | None = None) -> InFlight:
        """Send with an id that a coordinator re-running the same step from the journal computes again: the ranks
        answer such a resent command with the stored result of its first application instead of applying it twice
        (launch incarnation, step, kind, how many of that kind so far in the step, digest of ranks and payload).
        ``reply_to``: the command whose ack caused this one (not in the id: a rank times the round trip)."""
        ranks = list(ranks)
        cid = at.command_id(self.job.state.incarnation, kind, ranks, payload)
        if self.replay is not None:  # the old coordinator sent it (or was about to): sent again when the replay ends
            return self.replay.hold(InFlight(self.svc.bus.command(kind, ranks, payload, command_id=cid, reply_to=reply_to),
                                             ranks, step))
        return InFlight(self.svc.bus.send(kind, ranks, payload, command_id=cid, reply_to=reply_to), ranks, step)

    def call(self, at: Phase, kind: str, ranks, payload: dict):
        """Send a command and wait for every rank's ack, watching the ranks' liveness while waiting."""
        ranks = [r for r in ranks if r not in self.job.state.lost]
        return self.wait(self.send(at, kind, ranks, payload).cmd, ranks, kind)

    def wait(self, cmd, ranks, what: str):
        """Wait for acks, watching the ranks waited on: one whose process exited or whose heartbeat is older than
        the deadline (hung, SIGSTOPped, its node gone) raises :class:`RanksLost`."""
        ranks = [r for r in ranks if r not in self.job.state.lost]
        stored = self.replay.answer(cmd, ranks) if self.replay is not None else None  # None: live (from here)
        if stored is not None:
            self.require(stored, what, ranks)
            return stored
        while True:
            res = self.svc.bus.await_acks(cmd.command_id, ranks, timeout=2.0)
            self.check_redis()
            if not res.missing:
                self.require(res, what, ranks)
                return res
            self.check_alive(res.missing, what)

    def check_alive(self, ranks, what: str) -> None:
        """Raise :class:`RanksLost` for the ranks among ``ranks`` whose process exited or whose heartbeat is older
        than the deadline (and wait, bounded, while Redis refuses writes). A window in which Redis itself was slow
        or unreachable is not a rank's silence (:mod:`dynaresize.control.health`); a stall longer than
        ``redis.write_wait_s`` stops the run naming Redis."""
        launcher, registry = self.svc.launcher, self.svc.registry
        registry.check_writable()  # ranks wait while Redis refuses writes: so do we (bounded), then stop
        exited = launcher.dead() if hasattr(launcher, "dead") else {}
        gone = {r: f"process exited with code {exited[r]}" for r in ranks if r in exited}
        silent = registry.dead()
        now = time.monotonic()
        silent = {r: age for r, age in silent.items() if r in ranks and r not in gone}
        health = getattr(self.svc, "health", None)
        if health is None:
            gone.update({r: f"no heartbeat for {age:.1f} s" for r, age in silent.items()})
        else:
            stalls = self.check_redis()
            rc = self.job.cfg.redis
            lost = lost_ranks({r: now - age for r, age in silent.items()}, now, stalls, rc.dead_after_s,
                              stall_grace_s(rc))
            gone.update({r: v.why() for r, v in lost.items()})
        if gone:
            err = RanksLost(gone, what, "; ".join(f"rank {r}: {w}" for r, w in sorted(gone.items())))
            if hasattr(launcher, "log_tail") and any(r in exited for r in gone):
                r0 = next(r for r in sorted(gone) if r in exited)
                err.args = (f"{err}; last lines of rank {r0}'s log:\n{launcher.log_tail(r0)}",)
            raise err

    def check_redis(self, final: bool = False) -> list:
        """Announce each Redis stall once it is over (one line, one event); stop when a reply took longer than
        ``redis.write_wait_s`` (the bound the ranks' and the coordinator's waits on Redis share). Called wherever
        the coordinator waits (its loop, every wait for acks, every liveness check), and at the end of the run
        (``final``: what is left is announced, nothing stops); returns the stalls seen."""
        if getattr(self.svc, "health", None) is None:
            return []
        stalls = self.svc.health.stalls()
        rc, st = self.job.cfg.redis, self.job.state
        worst = max(stalls, key=lambda s: s.slowest_s, default=None)
        if worst is not None and worst.slowest_s > rc.write_wait_s and not final:
            self.writes_refused = True  # the shutdown does not wait for Redis once more
            raise JobError(f"Redis replies took {worst.slowest_s:.1f} s{' and still wait' if worst.ongoing else ''}, "
                           f"longer than redis.write_wait_s ({rc.write_wait_s:g} s): the run's Redis was slow or "
                           f"unreachable (not a rank: no rank was declared lost for it); "
                           f"{where_stopped(st.step, st.checkpoint)}; check Redis first")
        at_least = ANNOUNCE_PERIODS * rc.heartbeat_s  # shorter: not counted as silence, but not announced either
        if not self.svc.health.pending(at_least):  # the lost ranks before a stall: those lost after it are named with it
            self._lost_announced = set(st.lost)
        over = 0.0 if final else stall_grace_s(rc) + rc.dead_after_s  # a loss had time to show
        for s in self.svc.health.finished(stall_grace_s(rc), over, at_least):
            lost = sorted(set(st.lost) - self._lost_announced)
            tail = "no rank lost" if not lost else f"rank(s) {format_ranks(lost)} lost meanwhile"
            theirs = self._ranks_view() if not final else ""
            text = f"Redis replies took {s.slowest_s:.1f} s{theirs}; ranks waited; {tail}"
            log.warning("%s", text)
            if self.job.events is not None:
                self.job.events.emit("control", what="redis_slow", reason=text, delay_s=round(s.slowest_s, 2))
        return stalls

    def _ranks_view(self) -> str:
        """The ranks' own measure of the stall (their slowest heartbeat round trips), as a clause; empty when none
        reported one or it cannot be read."""
        try:
            seen = self.svc.registry.reported_slow()
        except redis.RedisError:
            return ""
        if not seen:
            return ""
        r = max(seen, key=seen.get)
        return f" (the ranks' heartbeats up to {seen[r]:.1f} s, rank {r})"

    def require(self, res, what: str, ranks) -> None:
        if res.missing:
            raise JobError(f"{what}: no ack from rank(s) {format_ranks(res.missing)}")
        bad = {r: a.error for r, a in res.acks.items() if not a.ok}
        if bad:
            r, err = next(iter(sorted(bad.items())))
            st = self.job.state
            if (err or "").startswith(RedisRefusesWrites.__name__):  # the rank's Redis writes were refused: not the rank's fault
                self.writes_refused = True
                raise JobError(f"{err.split(': ', 1)[-1]} (while rank {r} ran {what}); "
                               f"{where_stopped(st.step, st.checkpoint)}; fix Redis first")
            if is_disk_full(err):  # the rank's disk is full (a staging failure is handled where it can be)
                raise JobError(f"{what} failed on rank {r} on a full disk: {err}; {where_stopped(st.step, st.checkpoint)}; "
                               "free space first")
            raise JobError(f"{what} failed on rank {r}: {redis_error_text(err or 'no error text')}")

    def failures(self, sent: InFlight, marker: str) -> dict[int, str]:
        """After ``sent`` failed: the ranks whose ack error names ``marker``, with its text; empty when any rank did
        not ack (dead) or failed for another reason."""
        res = self.svc.bus.await_acks(sent.cmd.command_id, sent.ranks, timeout=1.0)
        bad = {r: a.error or "" for r, a in res.acks.items() if not a.ok}
        if res.missing or not bad or not all(marker in e for e in bad.values()):
            return {}
        return bad
