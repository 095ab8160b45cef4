"""Rank registry: who is in the job, where, in which role, and who stopped answering.

Protocol (keys in ``keys.py``):

- ``register(reg)`` runs one Lua script: ``INCR dr:<job>:inc:<r>`` (the new incarnation), ``HSET dr:<job>:rank:<r>
  inc <n> m <json>`` with a PEXPIRE TTL, and ``ZADD dr:<job>:live <server TIME> <r>``. A rank that registers again
  (restarted process, or its registration was lost) gets a higher incarnation, and the older process is fenced
  out: its heartbeats answer :attr:`Beat.SUPERSEDED`.
- ``heartbeat(rank, incarnation)`` (Lua): if the stored incarnation matches, refresh the TTL and the zset score
  (server TIME, so host clocks never matter) and answer ``OK``; if the registration is gone (TTL expired while the
  rank or Redis was away) answer ``LOST`` (the rank re-registers); if a newer incarnation exists, ``SUPERSEDED``.
  ``heartbeat_many({rank: incarnation})`` runs the same script for several ranks in one pipeline (a process that
  serves many ranks, e.g. ``tools/bench_control_load.py``).
- Dead-rank detection needs no keyspace notifications: the coordinator asks :meth:`Registry.liveness`, one script
  that reads server TIME and splits the zset at ``now - heartbeat_s * dead_after_heartbeats`` (:meth:`Registry.dead`
  runs only that script; ``liveness`` also reads every live rank's registration). A dead rank stays
  in the zset (reported dead) until it heartbeats again, deregisters, or the coordinator calls :meth:`forget`.

Every write here is idempotent under redis-py's retry-on-connection-error (a retried register only skips an
incarnation number; a retried heartbeat refreshes twice).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

import redis

from dynaresize.control.config import RedisConfig
from dynaresize.control.keys import Keys
from dynaresize.control.wire import Registration, WireError, decode, encode
from dynaresize.events import EventLog

log = logging.getLogger("dynaresize.control.registry")

_REGISTER = """
local inc = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], 'inc', inc, 'm', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
return inc
"""

_HEARTBEAT = """
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
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cut, 'WITHSCORES')
return {tostring(now), alive, dead}
"""


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
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._deregister = client.register_script(_DEREGISTER)
        self._liveness = client.register_script(_LIVENESS)

    def register(self, reg: Registration) -> Registration:
        """Store ``reg`` and return it with its new incarnation."""
        if reg.job_id != self.job_id:
            raise ValueError(f"registration of job {reg.job_id!r} sent to the registry of job {self.job_id!r}")
        raw = encode(reg.model_copy(update={"incarnation": 0}), self.cfg.max_message_bytes)
        k = self.keys
        inc = int(self._register(keys=[k.incarnation(reg.rank), k.rank(reg.rank), k.live], args=[reg.rank, raw, self.ttl_ms]))
        return reg.model_copy(update={"incarnation": inc})

    def heartbeat(self, rank: int, incarnation: int, update: Registration | None = None) -> Beat:
        """Refresh the rank's liveness (and its registration, when ``update`` is given)."""
        raw = b"" if update is None else encode(update.model_copy(update={"incarnation": 0}), self.cfg.max_message_bytes)
        k = self.keys
        return Beat(int(self._heartbeat(keys=[k.rank(rank), k.live], args=[rank, incarnation, self.ttl_ms, raw])))

    def heartbeat_many(self, beats: Mapping[int, int]) -> dict[int, Beat]:
        """Heartbeat several ranks (rank -> incarnation) in one round trip: the same script as :meth:`heartbeat`
        once per rank in one pipeline (for a process that serves many ranks, e.g. a node agent or a simulator)."""
        if not beats:
            return {}
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        ranks = [int(r) for r in beats]
        for rank in ranks:
            self._heartbeat(keys=[k.rank(rank), k.live], args=[rank, int(beats[rank]), self.ttl_ms, b""], client=pipe)
        return {rank: Beat(int(v)) for rank, v in zip(ranks, pipe.execute())}

    def deregister(self, rank: int, incarnation: int) -> bool:
        """Leave the job (only the current incarnation can remove itself)."""
        k = self.keys
        return bool(self._deregister(keys=[k.rank(rank), k.live], args=[rank, incarnation]))

    def forget(self, rank: int) -> None:
        """Coordinator side: stop reporting a dead rank."""
        self.r.zrem(self.keys.live, rank)

    def liveness(self) -> Liveness:
        now_s, alive, dead = self._liveness(keys=[self.keys.live], args=[self.cfg.dead_after_s])
        now = float(now_s)
        pipe = self.r.pipeline(transaction=False)
        ranks = [int(x) for x in alive]
        for rank in ranks:
            pipe.hmget(self.keys.rank(rank), "inc", "m")
        live: dict[int, Registration] = {}
        for rank, (inc, raw) in zip(ranks, pipe.execute() if ranks else []):
            if raw is None:
                continue  # zset entry without a registration: seen at the next check as LOST/dead
            try:
                live[rank] = decode(Registration, raw, self.cfg.max_message_bytes).model_copy(update={"incarnation": int(inc)})
            except WireError as e:
                log.warning("job %s rank %d: unreadable registration skipped: %s", self.job_id, rank, e.reason)
        dead_ages = {int(dead[i]): now - float(dead[i + 1]) for i in range(0, len(dead), 2)}
        return Liveness(now, live, dead_ages)

    def live(self) -> dict[int, Registration]:
        return self.liveness().live

    def dead(self) -> dict[int, float]:
        """Dead ranks -> age (s) of their last heartbeat: the liveness script alone, without reading and decoding
        every live rank's registration (what :meth:`liveness` adds), so cheap to poll at thousands of ranks."""
        now_s, _alive, dead = self._liveness(keys=[self.keys.live], args=[self.cfg.dead_after_s])
        now = float(now_s)
        return {int(dead[i]): now - float(dead[i + 1]) for i in range(0, len(dead), 2)}


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
        beat = self.registry.heartbeat(reg.rank, reg.incarnation, pending)
        if beat is Beat.LOST:
            self.registration = self.registry.register(self.registration)
            self._emit("rejoined")
            if self.on_reregister:
                self.on_reregister(self.registration)
        elif beat is Beat.SUPERSEDED:
            self.superseded = True
            self._stop.set()
            log.error("rank %d incarnation %d superseded by a newer process", reg.rank, reg.incarnation)
            if self.events:
                self.events.emit("control", what="superseded", reason="a newer incarnation registered",
                                 rank=reg.rank, incarnation=reg.incarnation)
        return beat

    def _loop(self) -> None:
        period = self.registry.cfg.heartbeat_s
        while not self._stop.wait(period):
            try:
                self.beat_once()
            except redis.RedisError as e:
                self.errors += 1
                log.warning("rank %d: heartbeat failed (%s); retrying next period", self.registration.rank, e)

    def _emit(self, state: str) -> None:
        if self.events:
            r = self.registration
            self.events.emit("rank", rank=r.rank, state=state, host=r.host, incarnation=r.incarnation)
