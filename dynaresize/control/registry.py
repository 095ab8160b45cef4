"""Rank registry: who is in the job, where, in which role, and who stopped answering.

Protocol (keys in ``dynaresize/contract/keys.py``):

- ``register(reg)`` runs one Lua script: ``INCR dr:<job>:inc:<r>`` (the new incarnation), ``HSET dr:<job>:rank:<r>
  inc <n> m <json> launch <l> tok <process token>`` with a PEXPIRE TTL, and ``ZADD dr:<job>:live <server TIME> <r>``.
  **Launch fencing**, in the same script: a registration carries the launch that started its process (the
  coordinator's ``launch.json``; :meth:`Registry.begin_launch` sets ``dr:<job>:launch`` before it starts the ranks);
  the script refuses a rank declared lost, a launch other than the job's current one, and a rank that a live
  process of the current launch holds (heartbeat younger than the dead-rank deadline). The refused process gets
  :class:`RegistrationRefused` saying why and exits; the live one is untouched. A process of the current launch
  that takes a free slot (its holder's registration expired or went silent) gets a higher incarnation, and the
  older process is fenced out: its heartbeats answer :attr:`Beat.SUPERSEDED`.
- ``heartbeat(rank, incarnation)`` (Lua): if the stored incarnation matches, refresh the TTL and the zset score
  (server TIME, so host clocks never matter) and answer ``OK``; if the registration is gone (TTL expired while the
  rank or Redis was away) answer ``LOST`` (the rank re-registers); if a newer incarnation exists, ``SUPERSEDED``.
  ``heartbeat_many({rank: incarnation})`` runs the same script for several ranks in one pipeline (a process that
  serves many ranks, e.g. ``tools/bench_control_load.py``).
- Dead-rank detection needs no keyspace notifications: the coordinator asks :meth:`Registry.liveness`, one script
  that reads server TIME, splits the zset at ``now - heartbeat_s * dead_after_heartbeats`` and returns the live
  ranks' registrations (:meth:`Registry.dead` runs a smaller script that returns only the dead ranks, cheap to
  poll at thousands of ranks). A dead rank stays in the zset (reported dead) until it heartbeats again,
  deregisters, or the coordinator calls :meth:`forget`.
- A Redis restart is not a silence of the ranks: no heartbeat can arrive while the server is down, and a client
  retries with a backoff of up to ``BACKOFF_CAP_S``. So a rank is only reported dead when it has also been silent
  for ``dead_after_s`` since the server came back plus that backoff (server uptime from ``INFO server``, read only
  when some rank looks dead). A rank that died during the outage is reported that much later.
- Nor is Redis refusing writes (``-OOM`` at ``maxmemory``, ``-MISCONF`` after a failed save, ``-READONLY`` on a
  replica): the ranks' heartbeats fail then, for a Redis reason. When some rank looks dead the registry writes a
  probe key (which waits while writes are refused, up to ``redis.write_wait_s``, then raises
  :class:`~.server.RedisRefusesWrites` naming the cause) and reads the server's count of refused writes
  (``INFO errorstats``); a rank is only dead when it was also silent for ``dead_after_s`` since the last refusal.

Every write here is idempotent under redis-py's retry-on-connection-error (a retried register recognises its own
process token and answers the same incarnation; a retried heartbeat refreshes twice).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import redis

from dynaresize.contract.fencing import FencedRankError
from dynaresize.control.config import RedisConfig
from dynaresize.contract.keys import Keys
from dynaresize.control.server import BACKOFF_CAP_S
from dynaresize.control.wire import RankState, Registration, WireError, decode, encode
from dynaresize.events import EventLog

log = logging.getLogger("dynaresize.control.registry")

_REGISTER = """
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then return {-1} end
local cur = tonumber(redis.call('GET', KEYS[5]) or '0')
local want = tonumber(ARGV[4])
if want < cur then return {-2, cur} end
if want > cur then return {-4, cur} end
local h = redis.call('HMGET', KEYS[2], 'inc', 'launch', 'tok', 'm')
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if h[1] and tonumber(h[2] or '0') == want then
  if h[3] == ARGV[5] then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    redis.call('ZADD', KEYS[3], now, ARGV[1])
    return {tonumber(h[1])}
  end
  local seen = redis.call('ZSCORE', KEYS[3], ARGV[1])
  if seen and now - tonumber(seen) <= tonumber(ARGV[6]) then return {-3, tonumber(h[1]), h[4] or ''} end
end
local inc = redis.call('INCR', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'inc', inc, 'm', ARGV[2], 'launch', want, 'tok', ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], now, ARGV[1])
return {inc}
"""

_BEGIN_LAUNCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want <= cur then return cur end
redis.call('SET', KEYS[1], want)
redis.call('DEL', KEYS[2])
for r = 0, tonumber(ARGV[2]) - 1 do
  redis.call('DEL', ARGV[3] .. r)
  redis.call('ZREM', KEYS[3], r)
end
return want
"""

_HEARTBEAT = """
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return -1 end
local cur = redis.call('HGET', KEYS[1], 'inc')
if not cur then return 0 end
if tonumber(cur) > tonumber(ARGV[2]) then return -1 end
if tonumber(cur) < tonumber(ARGV[2]) then return 0 end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'm', ARGV[4]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local t = redis.call('TIME')
redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
return 1
"""

_FENCE = """
redis.call('SADD', KEYS[1], ARGV[1])
local inc = redis.call('INCR', KEYS[2])
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[1])
return inc
"""

_DEREGISTER = """
local cur = redis.call('HGET', KEYS[1], 'inc')
if cur and tonumber(cur) ~= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

_LIVENESS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cut = now - tonumber(ARGV[1])
local alive = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. cut, '+inf')
local regs = {}
for _, r in ipairs(alive) do
  local v = redis.call('HMGET', ARGV[2] .. r, 'inc', 'm')
  regs[#regs + 1] = {r, v[1], v[2]}
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cut, 'WITHSCORES')
return {tostring(now), regs, dead}
"""

_DEAD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return {tostring(now), redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), 'WITHSCORES')}
"""


_REPORT_SLOW = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


class RegistrationRefused(FencedRankError):
    """The registry refused this process the rank (declared lost, an earlier launch, or a live process of the
    current launch holds it); :attr:`reason` says which in one line. The process must exit."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Beat(enum.IntEnum):
    """Answer to a heartbeat."""

    SUPERSEDED = -1  # a newer incarnation of this rank registered: this process must stop acting as the rank
    LOST = 0  # no registration (expired or lost): register again
    OK = 1


@dataclass(frozen=True, slots=True)
class Liveness:
    """A snapshot: live ranks with their registration, dead ranks with the age (s) of their last heartbeat."""

    now: float
    live: dict[int, Registration]
    dead: dict[int, float]


class Registry:
    """Register, heartbeat, list and deregister the ranks of one job."""

    def __init__(self, client: redis.Redis, job_id: str, cfg: RedisConfig):
        self.r = client
        self.keys = Keys(job_id)
        self.job_id = job_id
        self.cfg = cfg
        self.ttl_ms = max(1, int(cfg.dead_after_s * 3 * 1000))  # registration GC; liveness is the zset's job
        # a rank still starting: its registration outlives its grace (its state is read there)
        self.start_ttl_ms = max(self.ttl_ms, int((cfg.start_grace_s + cfg.dead_after_s) * 1000))
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._liveness = client.register_script(_LIVENESS)
        self._dead = client.register_script(_DEAD)
        self._fence = client.register_script(_FENCE)
        self._begin_launch = client.register_script(_BEGIN_LAUNCH)
        self._report_slow = client.register_script(_REPORT_SLOW)
        self._refused_count: int | None = None  # Redis's count of refused writes at the last look (INFO errorstats)
        self._refused_at: float | None = None  # monotonic time at which that count was last seen to grow
        self._server_major: int | None = None  # Redis's major version (which errors count as refused writes)

    def register(self, reg: Registration) -> Registration:
        """Store ``reg`` and return it with its new incarnation. Raises :class:`RegistrationRefused` (one line
        saying why) for a rank declared lost, a process of another launch than the job's current one, and a rank
        that a live process of the current launch holds (whose heartbeat is younger than the dead-rank deadline):
        that process keeps the rank untouched. A registration retried after a lost reply (same ``process``
        token) gets its own incarnation back."""
        if reg.job_id != self.job_id:
            raise ValueError(f"registration of job {reg.job_id!r} sent to the registry of job {self.job_id!r}")
        raw = encode(reg.model_copy(update={"incarnation": 0}), self.cfg.max_message_bytes)
        k = self.keys
        out = self._register(keys=[k.incarnation(reg.rank), k.rank(reg.rank), k.live, k.fenced, k.launch],
                             args=[reg.rank, raw, self._ttl(reg.state), reg.launch, reg.process, self.cfg.dead_after_s])
        code = int(out[0])
        if code > 0:
            return reg.model_copy(update={"incarnation": code})
        who = f"job {self.job_id}: rank {reg.rank} (pid {reg.pid} on {reg.host}, launch {reg.launch}) refused"
        if code == -1:
            why = "the coordinator declared this rank lost (fenced) in the current launch"
        elif code == -2:
            why = f"it belongs to launch {reg.launch}, an earlier launch of the ranks (the job is at launch {int(out[1])})"
        elif code == -4:
            why = f"launch {reg.launch} was not started by the coordinator (the job is at launch {int(out[1])})"
        else:
            holder = "another process"
            try:
                h = decode(Registration, out[2], self.cfg.max_message_bytes)
                holder = f"pid {h.pid} on {h.host}"
            except WireError:
                pass
            why = (f"a live process of the current launch holds the rank ({holder}, incarnation {int(out[1])}, "
                   "heartbeating); it keeps the rank")
        raise RegistrationRefused(f"{who}: {why}; this process exits")

    def begin_launch(self, launch: int, world: int) -> int:
        """Coordinator side, before it starts the ranks of launch ``launch`` (numbers only grow): from now on a
        registration of an earlier launch is refused, the registrations of ranks ``0..world-1`` are removed (the
        processes of the earlier launch, if any still run, are told LOST at their next heartbeat and then refused),
        and the lost ranks of the earlier launch are no longer fenced (new processes take their slots; the old
        ones cannot come back, their launch is over). Returns the job's launch, which is ``launch`` unless a
        later launch was already begun."""
        k = self.keys
        return int(self._begin_launch(keys=[k.launch, k.fenced, k.live], args=[int(launch), int(world), k.rank(0)[:-1]]))

    def launch(self) -> int:
        return int(self.r.get(self.keys.launch) or 0)

    def heartbeat(self, rank: int, incarnation: int, update: Registration | None = None,
                  state: RankState | None = None) -> Beat:
        """Refresh the rank's liveness (and its registration, when ``update`` is given; ``state``: the rank's, which
        sets how long its registration outlives a silence)."""
        raw = b"" if update is None else encode(update.model_copy(update={"incarnation": 0}), self.cfg.max_message_bytes)
        k = self.keys
        ttl = self._ttl(update.state if update is not None else state)
        return Beat(int(self._heartbeat(keys=[k.rank(rank), k.live, k.fenced], args=[rank, incarnation, ttl, raw])))

    def _ttl(self, state: RankState | None) -> int:
        return self.start_ttl_ms if state is RankState.STARTING else self.ttl_ms

    def heartbeat_many(self, beats: Mapping[int, int]) -> dict[int, Beat]:
        """Heartbeat several ranks (rank -> incarnation) in one round trip: the same script as :meth:`heartbeat`
        once per rank in one pipeline (for a process that serves many ranks, e.g. a node agent or a simulator)."""
        if not beats:
            return {}
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        ranks = [int(r) for r in beats]
        for rank in ranks:
            self._heartbeat(keys=[k.rank(rank), k.live, k.fenced], args=[rank, int(beats[rank]), self.ttl_ms, b""],
                            client=pipe)
        return {rank: Beat(int(v)) for rank, v in zip(ranks, pipe.execute())}

    def deregister(self, rank: int, incarnation: int) -> bool:
        """Leave the job (only the current incarnation can remove itself)."""
        k = self.keys
        return bool(self._deregister(keys=[k.rank(rank), k.live], args=[rank, incarnation]))

    def fence(self, rank: int) -> int:
        """Coordinator side: declare ``rank`` lost. Its registration goes, its incarnation moves on, and until
        :meth:`begin_launch` of the next launch its heartbeats answer SUPERSEDED (the process stops acting as the rank), it cannot
        register again, and the work queue refuses its claims and results. Returns the new incarnation number:
        acks stamped with an older one come from the fenced process."""
        k = self.keys
        return int(self._fence(keys=[k.fenced, k.incarnation(rank), k.rank(rank), k.live], args=[rank]))

    def fenced(self) -> set[int]:
        return {int(x) for x in self.r.smembers(self.keys.fenced)}

    def forget(self, rank: int) -> None:
        """Coordinator side: stop reporting a dead rank."""
        self.r.zrem(self.keys.live, rank)

    def liveness(self) -> Liveness:
        """One script (one round trip, atomic, retried as a whole after a connection error)."""
        if self._refused_count is None:
            self._refused_count = self._refusals()
        rank_prefix = self.keys.rank(0)[: -len("0")]
        now_s, alive, dead = self._liveness(keys=[self.keys.live], args=[self.cfg.dead_after_s, rank_prefix])
        now = float(now_s)
        live: dict[int, Registration] = {}
        for entry in alive:
            rank, inc, raw = int(entry[0]), entry[1], entry[2] if len(entry) > 2 else None
            if raw is None or inc is None:
                continue  # zset entry without a registration: seen at the next check as LOST/dead
            try:
                live[rank] = decode(Registration, raw, self.cfg.max_message_bytes).model_copy(update={"incarnation": int(inc)})
            except WireError as e:
                log.warning("job %s rank %d: unreadable registration skipped: %s", self.job_id, rank, e.reason)
        dead_ages = self._past_start_grace({int(dead[i]): now - float(dead[i + 1]) for i in range(0, len(dead), 2)})
        if dead_ages:
            dead_ages = self._silent_since_restart(dead_ages)
        return Liveness(now, live, dead_ages)

    def _silent_since_restart(self, dead: dict[int, float]) -> dict[int, float]:
        """Keep the ranks that stayed silent for ``dead_after_s`` while the server was up, reachable and accepting
        writes (see the module docstring); the others are neither live nor dead yet."""
        writable_for = self._writable_for()  # blocks while Redis refuses writes (up to redis.write_wait_s)
        try:
            uptime = float(self.r.info("server")["uptime_in_seconds"])
        except (redis.ResponseError, KeyError, TypeError, ValueError):
            uptime = float("inf")  # INFO not allowed (an external server with ACLs): no allowance for restarts
        since = min(uptime, writable_for) - BACKOFF_CAP_S
        return {r: age for r, age in dead.items() if min(age, since) > self.cfg.dead_after_s}

    def _refusals(self) -> int | None:
        """How many writes Redis refused so far; None if unknown. ``INFO errorstats`` counts OOM, MISCONF and
        READONLY; before Redis 7 a refusal inside a script (e.g. a heartbeat) is an ERR there, so from 6.2 those are
        counted as the scripts' failed calls (``INFO commandstats``, less NOSCRIPT) instead of every ERR: redis-py's
        ``CLIENT SETINFO`` on connect fails with ERR before Redis 7.2, and counting it would take every new
        connection for a refused write and push the detection of a dead rank back by the heartbeat deadline."""
        try:
            stats = self.r.info("errorstats")
            if self._server_major is None:
                self._server_major = int(str(self.r.info("server")["redis_version"]).split(".")[0])
            calls = self.r.info("commandstats") if self._server_major < 7 else {}
        except (redis.ResponseError, KeyError, TypeError, ValueError):
            return None

        def count(section: dict, key: str, field: str) -> int:
            v = section.get(key)
            return int(v.get(field, 0)) if isinstance(v, dict) else 0

        refused = sum(count(stats, f"errorstat_{k}", "count") for k in ("OOM", "MISCONF", "READONLY"))
        if self._server_major < 7:
            failed = count(calls, "cmdstat_eval", "failed_calls") + count(calls, "cmdstat_evalsha", "failed_calls")
            refused += max(0, failed - count(stats, "errorstat_NOSCRIPT", "count"))
        return refused

    def check_writable(self) -> None:
        """One probe write: returns once Redis accepts writes; raises :class:`~.server.RedisRefusesWrites` naming
        the cause when it refused them for ``redis.write_wait_s`` (a Redis problem, not a rank's)."""
        self.r.set(self.keys.ns + ":writable", 1, px=60_000)

    def _writable_for(self) -> float:
        """Seconds since Redis last refused a write, as far as this registry saw (inf: not since it started
        looking). Heartbeats refused by Redis are not a rank's silence: a probe write waits while writes are
        refused (and raises :class:`~.server.RedisRefusesWrites` past ``redis.write_wait_s``), and refusals
        counted by the server since the last look (``INFO errorstats``) restart the clock."""
        self.check_writable()
        n = self._refusals()
        now = time.monotonic()
        if n is not None and self._refused_count is not None and n != self._refused_count:
            self._refused_at = now
        if n is not None:
            self._refused_count = n
        return float("inf") if self._refused_at is None else now - self._refused_at

    def report_slow(self, rank: int, seconds: float) -> None:
        """Rank side: a heartbeat took ``seconds`` to get through (kept if the longest since the coordinator's
        last look): the ranks' view of a Redis stall, beside the coordinator's own."""
        self._report_slow(keys=[self.keys.slow], args=[int(rank), float(seconds)])

    def reported_slow(self) -> dict[int, float]:
        """Coordinator side: the ranks' slowest heartbeat round trips since the last call (then forgotten)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(self.keys.slow)
        pipe.delete(self.keys.slow)
        got = pipe.execute()[0] or {}
        return {int(r): float(v) for r, v in got.items()}

    def live(self) -> dict[int, Registration]:
        return self.liveness().live

    def dead(self) -> dict[int, float]:
        """``liveness().dead`` without reading and decoding every live rank's registration (one small script, then
        the same allowance for a Redis restart), so cheap to poll at thousands of ranks."""
        if self._refused_count is None:  # the first look: how many refusals there were before (not this run's)
            self._refused_count = self._refusals()
        now_s, dead = self._dead(keys=[self.keys.live], args=[self.cfg.dead_after_s])
        now = float(now_s)
        ages = {int(dead[i]): now - float(dead[i + 1]) for i in range(0, len(dead), 2)}
        ages = self._past_start_grace(ages)
        return self._silent_since_restart(ages) if ages else ages

    def _past_start_grace(self, dead: dict[int, float]) -> dict[int, float]:
        """Leave out the ranks still starting (registration state ``starting``) whose silence is shorter than
        ``start_grace_s``: a rank's start-up (imports, model load, communicators) can hold its interpreter long
        enough to starve the heartbeat thread on a loaded machine; that is not a lost rank. Reads the registrations
        of the silent ranks only (none in a healthy run)."""
        young = [r for r, age in dead.items() if age <= self.cfg.start_grace_s]
        if not young:
            return dead
        pipe = self.r.pipeline(transaction=False)
        for r in young:
            pipe.hget(self.keys.rank(r), "m")
        out = dict(dead)
        for r, raw in zip(young, pipe.execute()):
            if raw is None:
                continue
            try:
                reg = decode(Registration, raw, self.cfg.max_message_bytes)
            except WireError:
                continue
            if reg.state is RankState.STARTING:
                del out[r]
        return out


class Heartbeater:
    """Rank side: registers, then heartbeats every ``heartbeat_s`` on a daemon thread.

    A ``LOST`` answer re-registers (new incarnation, ``rank`` event ``rejoined``); ``SUPERSEDED`` stops the thread
    and sets :attr:`superseded` (the process should exit). Connection errors are logged and retried next period.
    """

    def __init__(self, registry: Registry, reg: Registration, events: EventLog | None = None,
                 on_reregister: Callable[[Registration], None] | None = None):
        self.registry = registry
        self.registration = reg
        self.events = events
        self.on_reregister = on_reregister
        self.superseded = False
        self.refused: str | None = None  # why this process may not act as the rank (set with ``superseded``)
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: Registration | None = None

    def start(self) -> Registration:
        self.registration = self.registry.register(self.registration)
        self._emit("registered")
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.registration.rank}", daemon=True)
        self._thread.start()
        return self.registration

    def update(self, **fields) -> None:
        """Change role/state; written with the next heartbeat."""
        with self._lock:
            self.registration = self.registration.model_copy(update=fields)
            self._pending = self.registration

    def beat_now(self) -> None:
        """Write the pending fields at once, in the caller's thread, instead of with the next beat. A rank calls it
        as it leaves ``starting``: a rank still registered as starting is forgiven its silence for ``start_grace_s``,
        so a rank killed within a heartbeat period of becoming ready (a fast job reaches its first checkpoint in less)
        went unnoticed past the heartbeat deadline, and its peers' errors in the collective it broke were taken as
        their own failure, not as its loss (the restart path). A failed write stays pending for the next beat."""
        try:
            self.beat_once()
        except redis.RedisError as e:
            self.errors += 1
            log.warning("rank %d: heartbeat failed (%s); retrying next period", self.registration.rank, e)

    def stop(self, deregister: bool = True) -> None:
        """Stop beating; ``deregister=False`` simulates a crash (the coordinator will see the rank die)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.registry.cfg.socket_timeout_s + 1)
        if deregister and not self.superseded:
            try:
                self.registry.deregister(self.registration.rank, self.registration.incarnation)
                self._emit("left")
            except redis.RedisError as e:
                log.warning("rank %d: deregister failed: %s", self.registration.rank, e)

    def beat_once(self) -> Beat:
        with self._lock:
            reg, pending, self._pending = self.registration, self._pending, None
        try:
            beat = self.registry.heartbeat(reg.rank, reg.incarnation, pending, reg.state)
        except redis.RedisError:
            if pending is not None:
                with self._lock:  # not written: keep it for the next beat (unless a newer update replaced it)
                    self._pending = self._pending or pending
            raise
        if beat is Beat.LOST:
            # registration gone (TTL expired while the rank or Redis was away): register the latest fields again
            try:
                new = self.registry.register(self.registration)
            except FencedRankError as e:  # declared lost, or a newer launch / a live process holds the rank now
                self._give_up(reg, str(e))
                return Beat.SUPERSEDED
            with self._lock:  # an update() meanwhile keeps its fields; it is written with the next beat
                self.registration = self.registration.model_copy(update={"incarnation": new.incarnation})
            self._emit("rejoined")
            if self.on_reregister:
                self.on_reregister(self.registration)
        elif beat is Beat.SUPERSEDED:
            self._give_up(reg, f"job {self.registry.job_id}: rank {reg.rank} incarnation {reg.incarnation} superseded "
                          "(declared lost by the coordinator, or a newer launch's process took the rank); this process "
                          "stops acting as the rank")
        return beat

    def _give_up(self, reg: Registration, reason: str) -> None:
        self.superseded = True
        self.refused = reason
        self._stop.set()
        log.error("%s", reason)
        if self.events:
            self.events.emit("control", what="superseded", reason=reason, rank=reg.rank, incarnation=reg.incarnation)

    def _loop(self) -> None:
        period = self.registry.cfg.heartbeat_s
        slowest = 0.0  # the longest round trip of a beat not reported yet (a Redis stall as this rank saw it)
        while not self._stop.wait(period):
            t0 = time.monotonic()
            try:
                self.beat_once()
                slowest = max(slowest, time.monotonic() - t0)
                if slowest > period:  # reported once Redis answers again: the coordinator names it with the stall
                    self.registry.report_slow(self.registration.rank, round(slowest, 3))
                    slowest = 0.0
            except redis.RedisError as e:
                slowest = max(slowest, time.monotonic() - t0)
                self.errors += 1
                log.warning("rank %d: heartbeat failed (%s); retrying next period", self.registration.rank, e)

    def _emit(self, state: str) -> None:
        if self.events:
            r = self.registration
            self.events.emit("rank", rank=r.rank, state=state, host=r.host, incarnation=r.incarnation)
