"""Commands and acks: durable, ordered, fenced, applied at most once.

Coordinator side, :class:`CommandBus`:

- On creation it takes a new **epoch**: ``INCR dr:<job>:epoch``. A later coordinator incarnation does the same, which
  fences the older one out twice over: its :meth:`CommandBus.send` fails with :class:`FencedError` (the send script
  checks the epoch key before writing), and ranks reject any of its commands still in flight (stale epoch).
- :meth:`CommandBus.send` runs one Lua script: check the epoch, take the next **job-wide stream id** (server TIME in
  ms, strictly above the last one, kept in ``dr:<job>:cmdid``), then write the command under that id: for
  ``redis.broadcast_min_ranks`` (default 2) or more targets ONE ``XADD dr:<job>:bcast MAXLEN ~ N <id> m <json> r
  <rank-set>`` (the job-wide **broadcast stream**: one write whatever the number of ranks), else ``XADD
  dr:<job>:cmd:<r>`` for each target; then ``PUBLISH dr:<job>:wake <rank-set>``. One round trip and one short
  request for any number of ranks.
- :meth:`CommandBus.await_acks` reads ``dr:<job>:ack:<command_id>`` with ``XREAD BLOCK`` (each block shorter than
  the socket timeout) until every wanted rank answered or the timeout passed, and returns the acks by rank and the
  ranks that did not answer. Acks of an older epoch are ignored: a coordinator that took over resends the pending
  commands of its predecessor under the same ids and its own epoch (:meth:`CommandBus.send` with ``command_id``); a rank that
  already applied one answers the stored result re-stamped with the new epoch, one that had not yet read the old
  copy rejects it (stale epoch) and applies the new one. Either way each command is applied once.

Rank side, :class:`CommandReceiver`:

- Reads its own stream from its own **cursor** (``dr:<job>:cursor:<r>``: the id of the last entry it finished) and
  the broadcast stream from its broadcast cursor (``dr:<job>:bcursor:<r>``) in one XREAD, and merges the two by id
  (the ids are job-wide increasing, so the merge is the send order; a read that filled its COUNT bounds what is
  taken). Broadcast entries whose rank set does not name the rank are skipped. So a rank that was disconnected,
  or restarted, gets every command it missed, in order.
- Pub/sub is only the wake-up (a message published while the rank reconnects is lost, the stream entry is not):
  a rank waits on ``dr:<job>:wake`` for at most ``block_ms`` and then reads the stream anyway; if its pub/sub
  connection is broken it falls back to ``XREAD BLOCK block_ms``.
- For each entry: decode (bad message -> logged ``control`` event, skipped, error ack when its id is readable);
  reject another job's command, a stale epoch (below the job's epoch key or the highest epoch this rank saw) and
  an epoch ahead of the job's epoch key (no coordinator holds it: garbage, which would otherwise fence out the
  real coordinator on this rank), each with an error ack and a ``control`` event;
  claim the command (``HSETNX dr:<job>:applied:<r> <id> started:<token>``, the token naming this receiver, so that a
  claim retried after a lost reply recognises itself): an id already there is **not** applied again,
  its stored ack is re-sent (``replayed=true``); then run the handler and commit, in one MULTI, the stored ack,
  the cursor and ``XADD dr:<job>:ack:<id>``. A crash between claim and commit leaves ``started``: after a restart
  that command answers an error ("interrupted") instead of running twice (at most once).
- A commit that fails (connection error, timeout, ``-OOM``, ``-MISCONF``, ``-READONLY``, a Redis restart: any of
  them, any number of times) leaves the applied command's ack in memory (``_uncommitted``) until a commit
  succeeds; the entry is read again from the unmoved cursor and only committed, never handed to the handler
  again (the claim would not stop it: a claim of this receiver recognises itself). Proved by the property test
  ``tests/contract/test_at_most_once_faults.py`` (a fault-injecting proxy in front of redis-server).

Streaming commands (:meth:`CommandReceiver.run_stream`, a :class:`StreamHandler`): a command may be *accepted*
(``begin`` returns :data:`PENDING`) and finish later, while the rank reads and begins the commands after it (a
rollout rank's next generate joins the running decode: continuous batching). Such a command is claimed like any
other before it begins; its ack (stored result, ack stream) is written when it finishes, in whatever order the
commands finish; the cursor moves only over a prefix of entries whose acks are written, so after a crash every
command not yet answered is read again and answers "interrupted" (at most once, as above), one answered is replayed.
Before a command begins, ``settle`` ends (or aborts) the pending work it must not overlap, and those commands are
answered first. Entries read past a pending one are handed out once (a read position ahead of the cursor; an id
pending here is never begun again). A command of a newer epoch aborts the pending ones (``abort``): a fenced
coordinator's work.

Retries: redis-py retries a command after a connection error, so a write may be applied twice. Here that is
harmless: a duplicate command entry is skipped by its id, a duplicate ack is de-duplicated by rank, and
SET/HSET/INCR of the epoch are idempotent or only skip a number.

Trimming: each command stream keeps about ``stream_maxlen`` entries; a rank more than that far behind loses the
oldest commands (the coordinator sees no ack from it).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Protocol, runtime_checkable

import redis

from dynaresize.contract.protocol import CommandKind
from dynaresize.control.config import RedisConfig
from dynaresize.contract.keys import Keys
from dynaresize.control.wire import Ack, Command, WireError, decode, encode, new_command_id
from dynaresize.events import EventLog, count_ranks, format_ranks

log = logging.getLogger("dynaresize.control.commands")

Handler = Callable[[Command], "dict[str, Any] | None"]
PENDING: Any = type("Pending", (), {"__repr__": lambda self: "PENDING"})()  # StreamHandler.begin: accepted, ack later


@runtime_checkable
class StreamHandler(Protocol):
    """A handler whose commands may finish after later ones began (:meth:`CommandReceiver.run_stream`)."""

    def settle(self, cmd: Command) -> None: ...  # finish (or abort) the pending work that must end before cmd

    def begin(self, cmd: Command) -> "dict[str, Any] | None": ...  # the result, or PENDING (raises: an error ack)

    def advance(self) -> None: ...  # one step of the pending work

    def take_done(self) -> list[tuple[str, "dict[str, Any] | None", "str | None"]]: ...  # (id, result, error) ended

    def busy(self) -> bool: ...  # commands pending

    def wants_more(self) -> bool: ...  # would begin the next command now (free capacity)

    def abort(self, reason: str) -> None: ...  # fail every pending command (they go to take_done)


@dataclass
class _Held:
    """An entry handled while a streamed command before it is pending: the cursor waits for its ack."""

    at: tuple[bytes, bool]
    command_id: str | None
    raw_ack: bytes | None
    store: bool
    epoch: int = 0
    written: bool = False


STARTED = b"started"  # prefix of a claim: "started:<receiver token>"

_SEND = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur ~= tonumber(ARGV[1]) then return -cur end
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lms, lseq = 0, 0
local last = redis.call('GET', KEYS[2])
if last then
  local a, b = string.match(last, '^(%d+)-(%d+)$')
  if a then lms, lseq = tonumber(a), tonumber(b) end
end
local id
if ms > lms then id = string.format('%d-0', ms) else id = string.format('%d-%d', lms, lseq + 1) end
local n = 0
if ARGV[7] == '1' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], id, 'm', ARGV[3], 'r', ARGV[5])
  n = 1
else
  for part in string.gmatch(ARGV[5], '[^,]+') do
    local a, b = string.match(part, '^(%d+)-(%d+)$')
    if not a then a = part; b = part end
    for r = tonumber(a), tonumber(b) do
      local ok = redis.pcall('XADD', ARGV[6] .. r, 'MAXLEN', '~', ARGV[2], id, 'm', ARGV[3])
      if type(ok) == 'table' and ok.err then  -- a stream written by someone else with a later id
        redis.call('XADD', ARGV[6] .. r, 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[3])
      end
      n = n + 1
    end
  end
end
redis.call('SET', KEYS[2], id)
redis.call('PUBLISH', ARGV[4], ARGV[5])
return n
"""

_CLAIM = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return false end
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v == ARGV[2] then return false end
return v
"""


# Take the job's next epoch, atomically with the owner record that says who took it and how. ARGV[1]: the epoch
# the caller holds now ('' : none; a restart passes its own, so that a fenced coordinator never takes a new one),
# ARGV[2]: '1' when the job must have no epoch yet (a fresh start: a takeover goes through --resume only).
_TAKE_EPOCH = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[1] ~= '' and cur ~= tonumber(ARGV[1]) then return {-1, cur} end
if ARGV[2] == '1' and cur ~= 0 then return {-2, cur} end
local e = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], 'epoch', e, 'm', ARGV[3])
return {e, cur}
"""


class FencedError(RuntimeError):
    """This coordinator's epoch is no longer the job's epoch: a newer coordinator took over (the message says who
    and how, from the job's owner record)."""


class EpochTaken(RuntimeError):
    """A fresh start found the job's epoch already taken: a run directory is taken over only by ``--resume``."""


def owner_record(how: str, run_dir: str | None = None, **extra: Any) -> dict[str, Any]:
    """Who takes an epoch: this process (pid, host), the run directory, and ``how`` (``start``: a fresh run,
    ``resume``: ``dynaresize run --resume``, ``restart``: an automatic restart of the ranks)."""
    import os
    import socket

    return {"pid": os.getpid(), "host": socket.gethostname(), "run_dir": run_dir, "how": how, **extra}


def why_fenced(client: redis.Redis, keys: Keys, epoch: int, run_dir: str | None = None) -> str:
    """Why coordinator ``epoch`` is fenced, in words, from the owner record of the epoch that replaced it."""
    try:
        raw = client.hgetall(keys.owner)
    except redis.RedisError as e:
        return f"(who took over could not be read: {e})"
    try:
        owner = json.loads(raw[b"m"]) if raw.get(b"m") else {}
        cur = int(raw.get(b"epoch") or 0)
    except (ValueError, TypeError):
        owner, cur = {}, 0
    if not owner:
        return "(no owner record: an older version took it, or Redis lost its data)"
    return who_took_over(owner, cur, keys.job_id, run_dir)


def who_took_over(owner: dict[str, Any], epoch: int | None, job_id: str, run_dir: str | None = None) -> str:
    """An owner record (:func:`owner_record`) of the coordinator that replaced this one, in words; ``epoch``: the
    one it took (None when unknown: the record came from the run's Redis directory, the server being down)."""
    import os
    import socket

    who = f"pid {owner.get('pid')} on {owner.get('host')}"
    took = "" if epoch is None else f" epoch {epoch}"
    same_process = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
    theirs = owner.get("run_dir")
    if run_dir is not None and theirs is not None and os.path.realpath(theirs) != os.path.realpath(run_dir):
        return (f"a job-name collision: the run in {theirs} ({who}) uses the same job id {job_id} on this Redis "
                f"and took{took or ' its epoch'}; give each run its own job id (a run directory made by this version has one)")
    if same_process:
        return f"this coordinator's own restart took{took or ' the epoch'} (a stale handle of an earlier epoch)"
    if owner.get("how") == "resume":
        return f"another coordinator took this run over with `dynaresize run --resume` ({who}{',' + took if took else ''})"
    if owner.get("how") == "restart":
        return f"coordinator {who} restarted the ranks{' with' + took if took else ''} (its automatic restart after lost ranks)"
    return f"coordinator {who} started{' with' + took if took else ''}"


class AckResult(NamedTuple):
    acks: dict[int, Ack]  # rank -> its ack
    missing: list[int]  # wanted ranks that did not answer in time, sorted


def _emit(events: EventLog | None, what: str, reason: str, **data: Any) -> None:
    if events is not None:
        try:
            events.emit("control", what=what, reason=reason, **{k: v for k, v in data.items() if v is not None})
        except Exception as e:  # noqa: BLE001 - logging must never take a rank down
            log.warning("cannot write control event: %s", e)


class CommandBus:
    """Coordinator side: send commands to ranks, await their acks."""

    def __init__(self, client: redis.Redis, job_id: str, cfg: RedisConfig, events: EventLog | None = None,
                 epoch: int | None = None, owner: dict[str, Any] | None = None, after: int | None = None,
                 fresh: bool = False):
        """Takes the job's next epoch (unless ``epoch`` is given: a second handle of one coordinator's epoch),
        recording ``owner`` (:func:`owner_record`). ``after``: the epoch the caller holds; if it is not the job's
        any more, :class:`FencedError` and no epoch is taken (a fenced coordinator never takes a new one).
        ``fresh``: the job must have no epoch yet, else :class:`EpochTaken` (a takeover is a ``--resume``)."""
        self.r = client
        self.job_id = job_id
        self.keys = Keys(job_id)
        self.cfg = cfg
        self.events = events
        self.run_dir = (owner or {}).get("run_dir")
        self._send = client.register_script(_SEND)
        if epoch is not None:
            self.epoch = int(epoch)
            return
        got, cur = (int(x) for x in client.register_script(_TAKE_EPOCH)(
            keys=[self.keys.epoch, self.keys.owner],
            args=["" if after is None else int(after), "1" if fresh else "0", json.dumps(owner or owner_record("start"))]))
        if got == -1:
            self.epoch = int(after)
            _emit(events, "fenced", f"epoch {after} superseded by {cur}: no new epoch taken", epoch=after)
            raise FencedError(f"job {job_id}: coordinator epoch {after} was fenced out by epoch {cur}: "
                              f"{why_fenced(client, self.keys, int(after), self.run_dir)}")
        if got == -2:
            raise EpochTaken(f"job {job_id}: this Redis already holds epoch {cur} of this job (taken by: "
                             f"{why_fenced(client, self.keys, 0, self.run_dir)}); nothing was started: a run is "
                             "taken over only with `dynaresize run --resume RUN_DIR`")
        self.epoch = got

    def current_epoch(self) -> int:
        return int(self.r.get(self.keys.epoch) or 0)

    def command(self, kind: CommandKind | str, ranks: Iterable[int], payload: dict[str, Any] | None = None,
                command_id: str | None = None, reply_to: str | None = None) -> Command:
        return Command(job_id=self.job_id, epoch=self.epoch, command_id=command_id or new_command_id(),
                       kind=CommandKind(kind), ranks=format_ranks(ranks), payload=payload or {}, reply_to=reply_to)

    def send(self, kind: CommandKind | str, ranks: Iterable[int], payload: dict[str, Any] | None = None,
             command_id: str | None = None, reply_to: str | None = None) -> Command:
        """Append a new command to every target's stream and wake them; returns it (keep it to resend). ``reply_to``:
        the command whose ack caused this one (a target that acked it and waited idle times the round trip)."""
        cmd = self.command(kind, ranks, payload, command_id, reply_to)
        self.resend(cmd)
        return cmd

    def resend(self, cmd: Command, ranks: Iterable[int] | None = None) -> None:
        """Send ``cmd`` again (same id): ranks that already applied it answer their stored ack."""
        targets = cmd.ranks if ranks is None else format_ranks(ranks)
        if not targets:
            return
        raw = encode(cmd, self.cfg.max_message_bytes)
        # The stream keys are built inside the script from the rank set (one short argument instead of N keys):
        # fine for the standalone Redis this project uses; Redis Cluster is not supported.
        broadcast = 0 < self.cfg.broadcast_min_ranks <= count_ranks(targets)
        args = [cmd.epoch, self.cfg.stream_maxlen, raw, self.keys.wake, targets, self.keys.cmd_prefix, int(broadcast)]
        n = int(self._send(keys=[self.keys.epoch, self.keys.cmd_last_id, self.keys.broadcast], args=args))
        if n <= 0:
            _emit(self.events, "fenced", f"epoch {cmd.epoch} superseded by {-n}", command_id=cmd.command_id, epoch=cmd.epoch)
            if n == 0:
                raise FencedError(f"job {self.job_id}: the job's epoch key {self.keys.epoch} is gone (Redis lost its data?); "
                                  f"coordinator epoch {cmd.epoch} cannot send")
            raise FencedError(f"job {self.job_id}: coordinator epoch {cmd.epoch} was fenced out by epoch {-n}: "
                              f"{why_fenced(self.r, self.keys, cmd.epoch, self.run_dir)}")

    def check_epoch(self) -> None:
        """Raise :class:`FencedError` if a newer coordinator took over (call before writing files of the run)."""
        cur = self.current_epoch()
        if cur != self.epoch:
            _emit(self.events, "fenced", f"epoch {self.epoch} superseded by {cur}", epoch=self.epoch)
            raise FencedError(f"job {self.job_id}: coordinator epoch {self.epoch} was fenced out by epoch {cur}: "
                              f"{why_fenced(self.r, self.keys, self.epoch, self.run_dir)}")

    def await_acks(self, command_id: str, ranks: Iterable[int], timeout: float) -> AckResult:
        """Collect acks of ``command_id`` from ``ranks`` until all answered or ``timeout`` seconds passed."""
        want = set(int(r) for r in ranks)
        acks: dict[int, Ack] = {}
        cursor = {command_id: b"0-0"}
        deadline = time.monotonic() + timeout
        while len(acks) < len(want):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                break
            for ack in self.read_acks(cursor, min(self.cfg.block_ms, remaining_ms) / 1000):
                if ack.rank in want and ack.rank not in acks:
                    acks[ack.rank] = ack
        return AckResult(acks, sorted(want - acks.keys()))

    def read_acks(self, cursors: dict[str, bytes], timeout: float) -> list[Ack]:
        """The acks of several commands that arrived after ``cursors`` (command id -> the last ack stream entry
        read, ``b"0-0"`` at first; advanced in place), waiting up to ``timeout`` seconds for the first one: one
        XREAD over every ack stream, so an event-driven coordinator hears whichever rank answers first."""
        if not cursors:
            return []
        streams = {self.keys.ack(cid): last for cid, last in cursors.items()}
        by_key = {self.keys.ack(cid): cid for cid in cursors}
        resp = self.r.xread(streams, count=4096, block=max(1, int(timeout * 1000)))
        out: list[Ack] = []
        for stream, entries in resp or []:
            key = stream.decode() if isinstance(stream, bytes) else str(stream)
            command_id = by_key[key]
            for entry_id, fields in entries:
                cursors[command_id] = entry_id
                try:
                    ack = decode(Ack, fields.get(b"m"), self.cfg.max_message_bytes)
                except WireError as e:
                    log.warning("job %s: bad ack on %s skipped: %s", self.job_id, key, e.reason)
                    _emit(self.events, "bad_ack", e.reason, command_id=command_id)
                    continue
                if ack.job_id != self.job_id or ack.command_id != command_id:
                    continue
                if ack.epoch < self.epoch:
                    # an ack of an earlier coordinator's copy of this command (same id, resent after a
                    # coordinator restart): a stale-epoch rejection or an ack the new epoch will get replayed
                    continue
                out.append(ack)
        return out

    def request(self, kind: CommandKind | str, ranks: Iterable[int], payload: dict[str, Any] | None = None,
                timeout: float = 30.0) -> tuple[Command, AckResult]:
        """send + await_acks."""
        ranks = list(ranks)
        cmd = self.send(kind, ranks, payload)
        return cmd, self.await_acks(cmd.command_id, ranks, timeout)


def _rank_in(rank_set: str, rank: int) -> bool:
    """Membership in a rank-set string without expanding it; a malformed one counts as 'maybe' (True)."""
    try:
        for part in rank_set.split(","):
            a, sep, b = part.partition("-")
            if (int(a) <= rank <= int(b)) if sep else int(a) == rank:
                return True
        return False
    except ValueError:
        return True


class CommandReceiver:
    """Rank side: apply this rank's commands in order, each at most once, and ack them.

    ``incarnation`` is an int or a callable returning the rank's current incarnation (it changes on re-register).
    Call :meth:`process` in the rank's loop, or :meth:`run` on a thread.
    """

    def __init__(self, client: redis.Redis, job_id: str, rank: int, cfg: RedisConfig,
                 incarnation: int | Callable[[], int] = 0, events: EventLog | None = None, wake: bool = True):
        self.r = client
        self.job_id = job_id
        self.rank = int(rank)
        self.keys = Keys(job_id)
        self.cfg = cfg
        self.events = events
        self._incarnation = incarnation
        self._claim = client.register_script(_CLAIM)
        self._token = f"{STARTED.decode()}:{uuid.uuid4().hex}"  # our claims; a retried claim recognises its own
        self._uncommitted: dict[str, bytes] = {}  # applied here, ack not yet committed (Redis was unreachable)
        self.max_epoch = 0
        self.job_epoch = 0  # the job's epoch key, read with the entries being handled
        self.rejected = 0
        self.applied = 0
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.cursor(self.rank))
        pipe.get(self.keys.broadcast_cursor(self.rank))
        own, bcast = pipe.execute()
        self.cursor: bytes = own or b"0-0"  # own stream: the last entry this rank finished with
        self.bcursor: bytes = bcast or b"0-0"  # the job's broadcast stream: likewise (entries for others skipped)
        self._held: list[_Held] = []  # entries after a pending streamed command, in stream order (run_stream)
        self._ahead: dict[bool, bytes] = {}  # read positions past the cursors while entries are held
        # the round trip (Ack.reply_s): the newest ack written (command id, monotonic time), and per command read
        # while this rank waited idle since that ack and answering it, when that ack was written
        self._last_ack: tuple[str, float] | None = None
        self._reply_from: dict[str, float] = {}
        self._pubsub = None
        if wake:
            self._subscribe()

    @property
    def incarnation(self) -> int:
        return int(self._incarnation() if callable(self._incarnation) else self._incarnation)

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except Exception:  # noqa: BLE001
                pass
            self._pubsub = None

    # -- waiting and reading -----------------------------------------------------------------------------------
    def _subscribe(self) -> None:
        try:
            ps = self.r.pubsub(ignore_subscribe_messages=True)
            ps.subscribe(self.keys.wake)
            self._pubsub = ps
        except redis.RedisError as e:
            log.warning("rank %d: wake-up subscription failed (%s); polling the stream instead", self.rank, e)
            self._pubsub = None

    def _read(self, block_ms: int | None = None) -> tuple[list, int]:
        """Entries after the cursors, merged in order, and the job's epoch (one round trip; XREAD BLOCK only as the
        fallback). An entry is ``(entry_id, fields, broadcast)``; :meth:`process` skips broadcast entries for others."""
        streams = {self.keys.cmd(self.rank): self._from(False), self.keys.broadcast: self._from(True)}
        if block_ms:
            resp = self.r.xread(streams, count=READ_COUNT, block=block_ms)
            epoch = int(self.r.get(self.keys.epoch) or 0) if resp else 0
        else:
            pipe = self.r.pipeline(transaction=False)
            pipe.xread(streams, count=READ_COUNT)
            pipe.get(self.keys.epoch)
            resp, ep = pipe.execute()
            epoch = int(ep or 0)
        return self._merge(resp or []), epoch

    def _from(self, broadcast: bool) -> bytes:
        """Where a read of a stream starts: its cursor, or past it over the entries held behind a pending one."""
        cur = self.bcursor if broadcast else self.cursor
        ahead = self._ahead.get(broadcast)
        return ahead if ahead is not None and _id_key(ahead) > _id_key(cur) else cur

    def _merge(self, resp: list) -> list:
        """One list in id order (every send takes a job-wide increasing id, so the two streams interleave
        exactly as sent). A stream that filled its COUNT may hold more entries below the other's: only entries up
        to the smaller of the full streams' last ids are taken now, the rest at the next read."""
        bname = self.keys.broadcast.encode()
        merged, limit = [], None
        for stream, entries in resp:
            name = stream if isinstance(stream, bytes) else str(stream).encode()
            is_b = name == bname
            if len(entries) >= READ_COUNT:
                last = _id_key(entries[-1][0])
                limit = last if limit is None else min(limit, last)
            merged += [(entry_id, fields, is_b) for entry_id, fields in entries]
        merged.sort(key=lambda e: _id_key(e[0]))
        if limit is not None:
            merged = [e for e in merged if _id_key(e[0]) <= limit]
        return merged

    def _wait(self, seconds: float) -> list | None:
        """Wait up to ``seconds`` for a wake-up naming this rank; returns entries when the fallback read them."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._pubsub is None:
                self._subscribe()
            if self._pubsub is None:
                entries, epoch = self._read(block_ms=max(1, int(min(remaining, self.cfg.block_ms / 1000) * 1000)))
                if entries:
                    self.max_epoch = max(self.max_epoch, epoch)
                    return entries
                continue
            try:
                msg = self._pubsub.get_message(timeout=min(remaining, self.cfg.block_ms / 1000))
            except (redis.RedisError, OSError, ValueError) as e:
                log.warning("rank %d: wake-up channel broken (%s); falling back to XREAD BLOCK", self.rank, e)
                self.close()
                continue
            if msg is None:
                return None  # a bounded wait ended: read the stream anyway (a wake-up may have been lost)
            data = msg.get("data")
            if isinstance(data, bytes) and _rank_in(data.decode(errors="replace"), self.rank):
                return None

    def process(self, handler: Handler, timeout: float = 0.0) -> int:
        """Apply the pending commands (waiting up to ``timeout`` s for the first). Returns entries handled.

        Never raises on message content; Redis connection errors propagate (redis-py already retried).
        """
        idle = self._last_ack if not self._held and not (isinstance(handler, StreamHandler) and handler.busy()) else None
        entries, epoch = self._read()
        deadline = time.monotonic() + timeout
        while not entries and time.monotonic() < deadline:
            got = self._wait(deadline - time.monotonic())
            if got is not None:
                entries, epoch = got, self.max_epoch
            else:
                entries, epoch = self._read()
        self.max_epoch = max(self.max_epoch, epoch)
        self.job_epoch = epoch
        if isinstance(handler, StreamHandler):
            self._fence_pending(handler)
        handled = 0
        for entry_id, fields, broadcast in entries:
            if broadcast and not _rank_in(_text(fields.get(b"r")), self.rank):
                if self._held:
                    self._ahead[True] = entry_id
                else:
                    self.bcursor = entry_id  # another rank's: skipped (not persisted: skipping again is harmless)
                continue
            self._handle(entry_id, fields.get(b"m"), handler, broadcast, idle)
            handled += 1
        return handled

    def run(self, handler: Handler, stop: Callable[[], bool], idle_s: float = 1.0) -> None:
        """Loop :meth:`process` until ``stop()``; connection errors are logged and retried."""
        while not stop():
            try:
                self.process(handler, timeout=idle_s)
            except redis.RedisError as e:
                log.warning("rank %d: control plane unreachable (%s); retrying", self.rank, e)
                time.sleep(min(1.0, idle_s))

    def run_stream(self, handler: StreamHandler, stop: Callable[[], bool], idle_s: float = 1.0,
                   poll_s: float = 0.005, check_s: float = 0.05) -> None:
        """Loop until ``stop()``: while commands are pending, one ``advance`` at a time, reading new entries every
        ``poll_s`` when the handler wants more work and at least every ``check_s`` (a shutdown, a newer epoch);
        otherwise :meth:`process` as :meth:`run` does. Connection errors are logged and retried."""
        last = 0.0
        try:
            while not stop():
                try:
                    if handler.busy():
                        now = time.monotonic()
                        if now - last >= (poll_s if handler.wants_more() else check_s):
                            last = now
                            self.process(handler, timeout=0.0)
                        if handler.busy():
                            handler.advance()
                    else:
                        self.process(handler, timeout=idle_s)
                    self._collect(handler)
                except redis.RedisError as e:
                    log.warning("rank %d: control plane unreachable (%s); retrying", self.rank, e)
                    time.sleep(0.05 if handler.busy() else min(1.0, idle_s))
        finally:
            for _ in range(3):  # what finished (a shutdown's ack) is written before the rank leaves
                try:
                    self._collect(handler)
                    break
                except redis.RedisError as e:
                    log.warning("rank %d: acks not written yet (%s); retrying", self.rank, e)
                    time.sleep(0.2)

    def _fence_pending(self, handler: StreamHandler) -> None:
        """Pending commands of an epoch below the job's are a fenced coordinator's: aborted (their acks stored)."""
        fenced = [h.epoch for h in self._held if h.raw_ack is None and h.epoch < self.max_epoch]
        if fenced and handler.busy():
            handler.abort(f"fenced: epoch {self.max_epoch} took over from {max(fenced)}")
            self._collect(handler)

    def _collect(self, handler: StreamHandler) -> None:
        """The acks of streamed commands that ended, then every written ack's prefix committed."""
        by_id = {h.command_id: h for h in self._held if h.raw_ack is None}
        for cid, result, error in handler.take_done():
            h = by_id.get(cid)
            if h is None:
                continue
            ack = Ack(job_id=self.job_id, epoch=h.epoch, command_id=cid, rank=self.rank, incarnation=self.incarnation,
                      ok=error is None, result=result if error is None else None, error=error[:2000] if error else None,
                      reply_s=self._reply_s(cid))
            h.raw_ack = encode(ack, self.cfg.max_message_bytes)
        self._settle()

    def _settle(self) -> None:
        """Write every ready ack of the held entries, then move the cursors over the prefix whose acks are written."""
        for h in self._held:
            if h.raw_ack is not None and not h.written:
                pipe = self.r.pipeline(transaction=True)
                self._ack_writes(pipe, h.command_id, h.raw_ack, h.store)
                pipe.execute()
                h.written = True
                self._acked(h.command_id)
        n = 0
        while n < len(self._held) and self._held[n].written:
            n += 1
        if not n:
            return
        last = {h.at[1]: h.at[0] for h in self._held[:n]}
        pipe = self.r.pipeline(transaction=True)
        for broadcast, entry_id in last.items():
            pipe.set(self.keys.broadcast_cursor(self.rank) if broadcast else self.keys.cursor(self.rank), entry_id)
        pipe.execute()
        for broadcast, entry_id in last.items():
            if broadcast:
                self.bcursor = entry_id
            else:
                self.cursor = entry_id
        del self._held[:n]
        if not self._held:
            self._ahead.clear()

    def _finish(self, at: tuple[bytes, bool], command_id: str | None, raw_ack: bytes | None, store: bool) -> None:
        """Commit an entry's ack and cursor now, or, behind a pending streamed command, hold it (ack written now,
        cursor later)."""
        if not self._held:
            self._commit(at, command_id, raw_ack, store=store)
            return
        self._held.append(_Held(at, command_id, raw_ack, store, written=raw_ack is None))
        self._ahead[at[1]] = at[0]
        self._settle()

    # -- one entry ---------------------------------------------------------------------------------------------
    def _handle(self, entry_id: bytes, raw: bytes | None, handler: Handler, broadcast: bool = False,
                idle: tuple[str, float] | None = None) -> None:
        """One entry of this rank's own stream or (``broadcast``) of the job's broadcast stream. ``idle``: the newest
        ack written (command id, when) if the rank waited idle after it for this read (None: it was busy)."""
        at = (entry_id, broadcast)  # where the entry is: its commit moves that stream's cursor
        try:
            cmd = decode(Command, raw, self.cfg.max_message_bytes)
        except WireError as e:
            self._reject(at, e.reason, _loose_id(raw, self.cfg.max_message_bytes), None)
            return
        if cmd.job_id != self.job_id:
            self._reject(at, f"command of job {cmd.job_id!r} on job {self.job_id!r}'s stream", cmd.command_id, cmd.epoch)
            return
        if any(h.command_id == cmd.command_id for h in self._held):  # read again past a pending entry: begun once
            self._ahead[broadcast] = entry_id
            return
        if cmd.epoch > self.job_epoch:
            self._reject(at, f"epoch {cmd.epoch} is ahead of the job's epoch {self.job_epoch} (no coordinator holds it)",
                         cmd.command_id, cmd.epoch)
            return
        if cmd.epoch < self.max_epoch:
            self._reject(at, f"stale epoch {cmd.epoch} < {self.max_epoch} (fenced coordinator)",
                         cmd.command_id, cmd.epoch)
            return
        stream = isinstance(handler, StreamHandler)
        self.max_epoch = cmd.epoch
        if cmd.command_id in self._uncommitted:  # applied before a commit failed: commit, never re-apply
            raw_ack = self._uncommitted[cmd.command_id]
            try:  # under the epoch of this copy: a coordinator that took over meanwhile resent it with the same id
                raw_ack = encode(decode(Ack, raw_ack, self.cfg.max_message_bytes).model_copy(update={"epoch": cmd.epoch}),
                                 self.cfg.max_message_bytes)
            except WireError as e:
                log.warning("rank %d: uncommitted ack of %s unreadable (%s); committed as it is", self.rank, cmd.command_id, e.reason)
            # kept until the commit succeeded: a commit failing again (connection, -OOM, READONLY, MISCONF) must find
            # it here next time, not the claim, which is our own "started" and would hand the command back
            self._finish(at, cmd.command_id, raw_ack, store=True)
            self._uncommitted.pop(cmd.command_id, None)
            return
        if stream and handler.busy():  # what must end before this command ends now, and is answered first
            try:
                handler.settle(cmd)
            except Exception as e:  # noqa: BLE001 - the pending commands fail, never the rank
                log.warning("rank %d: settling before %s failed: %s", self.rank, cmd.command_id, e)
                handler.abort(f"{e.__class__.__name__}: {e}")
            self._collect(handler)
        prev = self._claim(keys=[self.keys.applied(self.rank)], args=[cmd.command_id, self._token])
        if prev is not None:
            self._replay(at, cmd, prev)
            return
        if idle is not None and cmd.reply_to is not None and cmd.reply_to == idle[0]:
            self._reply_from[cmd.command_id] = idle[1]  # it answers the ack this rank waited idle after
        try:
            result = handler.begin(cmd) if stream else handler(cmd)
            if result is PENDING:
                self.applied += 1
                self._held.append(_Held(at, cmd.command_id, None, True, epoch=cmd.epoch))
                self._ahead[broadcast] = entry_id
                self._collect(handler)
                return
            if result is not None and not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, expected a dict or None")
            ack = self._ack(cmd, ok=True, result=result)
            raw_ack = encode(ack, self.cfg.max_message_bytes)
        except Exception as e:  # noqa: BLE001 - a failing handler is an error ack, never a dead rank
            log.warning("rank %d: command %s (%s) failed: %s", self.rank, cmd.command_id, cmd.kind.value, e)
            ack = self._ack(cmd, ok=False, error=f"{e.__class__.__name__}: {e}"[:2000])
            raw_ack = encode(ack, self.cfg.max_message_bytes)
        self.applied += 1
        self._uncommitted[cmd.command_id] = raw_ack
        if stream:  # what the command finished before it (a drained stream) is answered first
            self._collect(handler)
        self._finish(at, cmd.command_id, raw_ack, store=True)
        self._uncommitted.pop(cmd.command_id, None)

    def _ack(self, cmd: Command, ok: bool, result: dict | None = None, error: str | None = None, replayed: bool = False) -> Ack:
        return Ack(job_id=self.job_id, epoch=cmd.epoch, command_id=cmd.command_id, rank=self.rank,
                   incarnation=self.incarnation, ok=ok, result=result, error=error, replayed=replayed,
                   reply_s=None if replayed else self._reply_s(cmd.command_id))

    def _reply_s(self, command_id: str) -> float | None:
        """Seconds from the ack the command answers to this one's (made now), if it was timed."""
        t0 = self._reply_from.pop(command_id, None)
        return None if t0 is None else max(0.0, time.monotonic() - t0)

    def _replay(self, at: tuple[bytes, bool], cmd: Command, prev: bytes) -> None:
        if prev.startswith(STARTED):
            reason = "interrupted: an earlier attempt started but did not finish; not re-applied (at most once)"
            ack = self._ack(cmd, ok=False, error=reason)
            _emit(self.events, "interrupted", reason, rank=self.rank, command_id=cmd.command_id, epoch=cmd.epoch)
        else:
            try:
                # under the epoch of the copy being answered: a command resent by a newer coordinator (same id)
                # gets the stored result of the first application, never a second application
                ack = decode(Ack, prev, self.cfg.max_message_bytes).model_copy(update={"replayed": True, "epoch": cmd.epoch})
            except WireError as e:
                ack = self._ack(cmd, ok=False, error=f"already applied; stored ack unreadable: {e.reason}")
        log.info("rank %d: command %s already applied; re-sent its ack", self.rank, cmd.command_id)
        self._finish(at, cmd.command_id, encode(ack, self.cfg.max_message_bytes), store=False)

    def _reject(self, at: tuple[bytes, bool], reason: str, command_id: str | None, epoch: int | None) -> None:
        entry_id = at[0]
        self.rejected += 1
        log.warning("job %s rank %d: rejected stream entry %s: %s", self.job_id, self.rank, entry_id.decode(), reason)
        _emit(self.events, "rejected", reason, rank=self.rank, command_id=command_id, epoch=epoch)
        raw_ack = None
        if command_id:
            ack = Ack(job_id=self.job_id, epoch=max(1, epoch or 1), command_id=command_id, rank=self.rank,
                      incarnation=self.incarnation, ok=False, error=f"rejected: {reason}"[:2000])
            raw_ack = encode(ack, self.cfg.max_message_bytes)
        self._finish(at, command_id, raw_ack, store=False)

    def _ack_writes(self, pipe, command_id: str, raw_ack: bytes, store: bool) -> None:
        """An ack's writes, in the caller's MULTI: the stored result (``store``: the at-most-once record) and the ack
        stream entry."""
        if store:
            pipe.hset(self.keys.applied(self.rank), command_id, raw_ack)
        akey = self.keys.ack(command_id)
        pipe.xadd(akey, {"m": raw_ack})
        pipe.expire(akey, self.cfg.ack_ttl_s)

    def _acked(self, command_id: str | None) -> None:
        """An ack was written: the newest one and its time (a rank idle since then times the command that answers it)."""
        if command_id:
            self._last_ack = (command_id, time.monotonic())

    def _commit(self, at: tuple[bytes, bool], command_id: str | None, raw_ack: bytes | None, store: bool) -> None:
        """One MULTI: stored ack (at-most-once record), cursor, ack stream. Every part is safe to retry."""
        entry_id, broadcast = at
        pipe = self.r.pipeline(transaction=True)
        pipe.set(self.keys.broadcast_cursor(self.rank) if broadcast else self.keys.cursor(self.rank), entry_id)
        acked = raw_ack is not None and bool(command_id)
        if acked:
            self._ack_writes(pipe, command_id, raw_ack, store)
        pipe.execute()
        if acked:
            self._acked(command_id)
        if broadcast:
            self.bcursor = entry_id
        else:
            self.cursor = entry_id


READ_COUNT = 256  # entries read per stream and round trip


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as a comparable pair (``b"1700000000000-3"`` -> (1700000000000, 3))."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(raw: bytes | None) -> str:
    """A broadcast entry's rank set; a missing one reads as 'every rank' (the entry is then decoded and rejected)."""
    return "0-" + str(1 << 62) if raw is None else raw.decode(errors="replace")


def _loose_id(raw: bytes | None, max_bytes: int) -> str | None:
    """The command_id of a rejected message, when it can be read safely (so the coordinator gets an error ack)."""
    if raw is None or len(raw) > max_bytes:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: deeply nested garbage
        return None
    cid = obj.get("command_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and 0 < len(cid) <= 64 and cid.isprintable() and ":" not in cid else None
