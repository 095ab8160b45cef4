"""Sustained load on the control plane: N simulated ranks in P processes for minutes; missed deadlines counted.

    python tools/bench_control_load.py --ranks 1024 --procs 4 --duration 300      # fault-matrix row 10
    python tools/bench_control_load.py --ranks 64 --procs 2 --duration 5 --json   # smoke (tests/contract)
    python tools/bench_control_load.py --ranks 1024 --procs 4 --duration 60 --compare

Everything is real except the ranks' work: a private ``redis-server`` (:class:`RedisServer`, AOF everysec as in a
run), the coordinator's :class:`CommandBus` and :class:`Registry` in this process, and ``--procs`` spawned rank
processes that serve their ranks with the real protocol classes but without one thread per rank:

- registration: :meth:`Registry.register` per rank (real incarnations);
- heartbeats: one thread per process beats all its ranks every ``heartbeat_s`` in one pipeline
  (:meth:`Registry.heartbeat_many`, the registry's own script per rank; a LOST answer re-registers, as the
  :class:`Heartbeater` does);
- commands: one real :class:`CommandReceiver` per rank (``wake=False``); ``--threads`` receiver loops per process
  share one pub/sub subscription each to the job's wake-up channel and, when a wake-up names some of their ranks,
  call ``process(timeout=0)`` on those receivers (cursor read, claim, handler, one MULTI commit with the ack);
  every ``block_ms`` without a wake-up they read every rank's stream anyway (the receiver's own fallback). The
  at-most-once claim and the ack path are the real ones.

For ``--duration`` seconds the coordinator sends a command every ``--interval`` s (PING to every live rank; every
``--subset-every``-th one to a random subset, alternately a contiguous range and a scattered sample), waits for
the acks, and a watcher thread calls :meth:`Registry.dead` (the liveness script) every ``--liveness-s`` s. At mid-run ``--crash``
ranks are told to crash (a SHUTDOWN command with ``{"crash": true}``: the rank acks, then stops heartbeating and
serving, like ``Heartbeater.stop(deregister=False)``) so that the watcher must see them die.

Measured (table: count, p50, p95, p99, max):

- ``send_ms``: ``CommandBus.send`` (one Lua script: XADD to every target stream + PUBLISH);
- ``send_one_ms``: probe, right after each send: the same command bytes sent by the same script to ONE stream of
  another job nobody reads (what a send would cost if a command were one entry of a job-wide stream);
- ``delivery_ms``: per rank, command created -> that rank's handler runs (the "fan-out" as a rank sees it);
- ``fanout_all_ms``: per command, command created -> the last target's handler runs;
- ``acks_ms``: per command, command created -> ``await_acks`` holds every target's ack;
- ``hb_age_s``: per liveness sample, the oldest heartbeat of a healthy rank (server time, from the ``live`` zset);
- ``hb_gap_s``: per process, seconds between two completed heartbeat pipelines (rank side);
- ``liveness_ms``: one :meth:`Registry.dead` call of the coordinator (what it polls while waiting for acks).

Missed deadlines and integrity (all must be 0; ``--strict`` exits 1 otherwise):

- ``false_deaths``: a rank that liveness reported dead while its process was healthy and it was not told to
  crash (``hb_age_over``: samples where a healthy rank's heartbeat was older than ``dead_after_s``);
- ``deadline_missed``: commands whose acks were not all in ``--deadline`` s after the send;
- ``lost_acks``: acks still missing ``--lost-after`` s after the send; ``error_acks``: acks with ok=false;
- ``duplicate_acks``: ack stream entries beyond one per target (XLEN of every ``ack:<id>`` at the end);
- ``apply_mismatches``: ranks whose handler ran a different number of times than commands were sent to them;
  ``duplicate_applies``: a handler that ran twice for one (rank, command id);
- ``crash_undetected``: crashed ranks liveness never reported dead (``crash_detect_s``: crash ack -> reported).

Always exits 1 when an integrity check fails (lost/duplicate/mismatch/undetected crash/a rank process died).
Prints a table then one JSON line; ``--json`` prints only the JSON. ``--compare`` also runs
``tools/bench_control_plane.py`` (the same number of rank threads in ONE process, one receiver thread per rank)
and prints its figures next to these with the ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = "load"
log = logging.getLogger("bench_control_load")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(math.ceil(q / 100 * len(xs))) - 1))]


def summary(xs: list[float]) -> dict[str, float | int]:
    return {"n": len(xs), "p50": pct(xs, 50), "p95": pct(xs, 95), "p99": pct(xs, 99), "max": max(xs) if xs else float("nan")}


# --- rank side: one OS process serving many simulated ranks ----------------------------------------------------
class RankProcess:
    """The ranks of one process: registrations, one heartbeat thread, ``threads`` receiver loops."""

    def __init__(self, endpoint_file: str, cfg_json: str, index: int, ranks: list[int], threads: int):
        from dynaresize.control.config import RedisConfig
        from dynaresize.contract.keys import Keys
        from dynaresize.control.registry import Registry
        from dynaresize.control.server import connect

        self.cfg = RedisConfig.model_validate_json(cfg_json)
        self.endpoint_file = endpoint_file
        self.index = index
        self.ranks = ranks
        self.keys = Keys(JOB)
        self.client = connect(endpoint_file, role=f"sim{index}", cfg=self.cfg)
        self.registry = Registry(self.client, JOB, self.cfg)
        self.lock = threading.Lock()
        self.inc: dict[int, int] = {}
        self.beating: set[int] = set()  # ranks whose heartbeat is sent (registered, not crashed/shut down)
        self.applied: dict[int, int] = {r: 0 for r in ranks}
        self.seen: set[tuple[int, str]] = set()
        self.stats = {"proc": index, "ranks": len(ranks), "duplicate_applies": 0, "via_wake": 0, "via_periodic": 0,
                      "periodic_reads": 0, "wakeups": 0, "beats": 0, "beat_errors": 0, "beats_lost": 0, "beats_superseded": 0,
                      "receiver_errors": 0, "pubsub_errors": 0, "rejected": 0, "crashed": [], "hb_gap_s": [],
                      "hb_rtt_ms": []}
        self.stop_beats = threading.Event()
        n = max(1, min(threads, len(ranks)))
        self.shards = [ranks[i::n] for i in range(n)]

    # registration and heartbeats -------------------------------------------------------------------------------
    def register_all(self) -> None:
        from dynaresize.control.wire import RankState, Registration

        host, pid = socket.gethostname(), os.getpid()
        for r in self.ranks:
            reg = self.registry.register(Registration(job_id=JOB, rank=r, host=host, device="cpu",
                                                      staging_dir="/tmp/dr-load", pid=pid, state=RankState.IDLE))
            with self.lock:
                self.inc[r] = reg.incarnation
                self.beating.add(r)

    def beat_loop(self) -> None:
        """The Heartbeater's loop (wait a period, beat), for all ranks of this process in one pipeline."""
        import redis

        from dynaresize.control.registry import Beat, Registry
        from dynaresize.control.server import connect
        from dynaresize.control.wire import RankState, Registration

        reg = Registry(connect(self.endpoint_file, role=f"sim{self.index}-hb", cfg=self.cfg), JOB, self.cfg)
        last = time.monotonic()
        while not self.stop_beats.wait(self.cfg.heartbeat_s):
            with self.lock:
                beats = {r: self.inc[r] for r in self.beating}
            t0 = time.monotonic()
            try:
                res = reg.heartbeat_many(beats)
            except redis.RedisError as e:
                self.stats["beat_errors"] += 1
                log.warning("process %d: heartbeat failed (%s); retrying next period", self.index, e)
                continue
            t1 = time.monotonic()
            self.stats["beats"] += 1
            self.stats["hb_rtt_ms"].append((t1 - t0) * 1000)
            self.stats["hb_gap_s"].append(t1 - last)
            last = t1
            for r, beat in res.items():
                if beat is Beat.LOST:  # as Heartbeater.beat_once: the registration expired -> register again
                    self.stats["beats_lost"] += 1
                    new = reg.register(Registration(job_id=JOB, rank=r, host=socket.gethostname(), device="cpu",
                                                    staging_dir="/tmp/dr-load", pid=os.getpid(), state=RankState.IDLE))
                    with self.lock:
                        self.inc[r] = new.incarnation
                elif beat is Beat.SUPERSEDED:
                    self.stats["beats_superseded"] += 1
                    with self.lock:
                        self.beating.discard(r)

    # commands --------------------------------------------------------------------------------------------------
    def serve(self, shard: list[int], done: threading.Event) -> None:
        """One receiver loop over ``shard``: process the ranks a wake-up names, and every rank not read for
        ``block_ms`` (each real receiver reads its stream at least that often, wake-up or not)."""
        import redis

        from dynaresize.control.commands import CommandReceiver
        from dynaresize.control.server import connect
        from dynaresize.events import parse_ranks

        client = connect(self.endpoint_file, role=f"sim{self.index}-recv", cfg=self.cfg)
        receivers = {r: CommandReceiver(client, JOB, r, self.cfg, incarnation=lambda r=r: self.inc[r], wake=False)
                     for r in shard}
        handlers = {r: self._handler(r) for r in shard}
        active = set(shard)
        counts = dict.fromkeys(("via_wake", "via_periodic", "wakeups", "periodic_reads", "receiver_errors",
                                "pubsub_errors", "rejected"), 0)
        pubsub = None
        period = self.cfg.block_ms / 1000
        last_read = dict.fromkeys(shard, time.monotonic())
        while active:
            if pubsub is None:
                try:
                    pubsub = client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.keys.wake)
                except redis.RedisError as e:
                    counts["pubsub_errors"] += 1
                    log.warning("process %d: wake-up subscription failed (%s)", self.index, e)
                    pubsub = None
            todo: set[int] = set()
            try:
                wait = max(0.0, min(last_read[r] for r in active) + period - time.monotonic())
                if pubsub is None:
                    time.sleep(wait)
                    msg = None
                else:
                    msg = pubsub.get_message(timeout=wait)
                while msg is not None:
                    data = msg.get("data")
                    if isinstance(data, bytes):
                        try:
                            todo.update(active.intersection(parse_ranks(data.decode())))
                        except ValueError:
                            todo.update(active)  # unreadable wake-up: read every stream
                    msg = pubsub.get_message(timeout=0)
            except (redis.RedisError, OSError, ValueError) as e:
                counts["pubsub_errors"] += 1
                log.warning("process %d: wake-up channel broken (%s); resubscribing", self.index, e)
                pubsub = None
            if todo:
                counts["wakeups"] += 1
            now = time.monotonic()
            due = {r for r in active if now - last_read[r] >= period} - todo
            counts["periodic_reads"] += len(due)
            for r in sorted(todo | due):
                last_read[r] = time.monotonic()
                try:
                    counts["via_wake" if r in todo else "via_periodic"] += receivers[r].process(handlers[r], timeout=0)
                except redis.RedisError as e:
                    counts["receiver_errors"] += 1
                    log.warning("rank %d: control plane unreachable (%s); retrying", r, e)
                    continue
                if r in self.finished:
                    active.discard(r)
        for recv in receivers.values():
            counts["rejected"] += recv.rejected
            recv.close()
        with self.lock:
            for k, v in counts.items():
                self.stats[k] += v
        if pubsub is not None:
            pubsub.close()
        client.close()
        done.set()

    def _handler(self, rank: int):
        from dynaresize.contract.protocol import CommandKind

        def handle(cmd):
            now = time.time()
            key = (rank, cmd.command_id)
            with self.lock:
                if key in self.seen:
                    self.stats["duplicate_applies"] += 1
                self.seen.add(key)
            self.applied[rank] += 1
            if cmd.kind is CommandKind.SHUTDOWN:
                crash = bool(cmd.payload.get("crash"))
                with self.lock:
                    self.beating.discard(rank)  # crash: just stop beating (no deregister); shutdown: leave below
                self.finished.add(rank)
                if crash:
                    self.stats["crashed"].append(rank)
                else:
                    self.leaving.append(rank)
            return {"delivery_ms": (now - cmd.issued_at) * 1000}

        return handle

    def run(self, ready, go, out) -> None:
        self.finished: set[int] = set()
        self.leaving: list[int] = []
        ready.set()
        go.wait()
        cpu0 = time.process_time()
        hb = threading.Thread(target=self.beat_loop, name="heartbeat", daemon=True)
        hb.start()  # before registering: the first ranks must not expire while the last ones register
        self.register_all()
        dones = []
        for shard in self.shards:
            done = threading.Event()
            threading.Thread(target=self.serve, args=(shard, done), name="receiver", daemon=True).start()
            dones.append(done)
        for done in dones:
            done.wait()
        self.stop_beats.set()
        hb.join(self.cfg.socket_timeout_s + 1)
        for r in self.leaving:  # shut down cleanly: leave the job (only the current incarnation can)
            self.registry.deregister(r, self.inc[r])
        self.client.close()
        out.put(json.dumps(self.stats | {"applied": self.applied, "cpu_s": time.process_time() - cpu0}))


def rank_process(endpoint_file: str, cfg_json: str, index: int, ranks: list[int], threads: int, ready, go, out) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s sim{index} %(levelname)s %(message)s")
    RankProcess(endpoint_file, cfg_json, index, ranks, threads).run(ready, go, out)


# --- coordinator side -------------------------------------------------------------------------------------------
class Watcher(threading.Thread):
    """Polls Registry.liveness like the coordinator; counts false deaths and heartbeat ages of healthy ranks."""

    def __init__(self, endpoint_file: str, cfg, period: float, procs, owner: dict[int, int]):
        super().__init__(name="watcher", daemon=True)
        from dynaresize.control.registry import Registry
        from dynaresize.control.server import connect

        self.client = connect(endpoint_file, role="watcher", cfg=cfg)
        self.registry = Registry(self.client, JOB, cfg)
        self.cfg = cfg
        self.period = period
        self.procs = procs
        self.owner = owner
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.crashed: dict[int, float] = {}  # rank -> monotonic time its crash was acked
        self.detected: dict[int, float] = {}  # rank -> seconds from crash ack to reported dead
        self.false_deaths: dict[int, int] = {}  # rank -> samples it was wrongly reported dead
        self.ages: list[float] = []
        self.ages_over = 0
        self.liveness_ms: list[float] = []
        self.dead_procs: set[int] = set()
        self.errors: list[str] = []

    def crash(self, rank: int, at: float) -> None:
        with self.lock:
            self.crashed[rank] = at

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - recorded and reported, the run goes on
                self.errors.append(f"{type(e).__name__}: {e}")

    def sample(self) -> None:
        t0 = time.perf_counter()
        dead = self.registry.dead()  # what the coordinator polls while it waits for acks
        self.liveness_ms.append((time.perf_counter() - t0) * 1000)
        now = time.monotonic()
        with self.lock:
            crashed = dict(self.crashed)
        for p, proc in enumerate(self.procs):
            if not proc.is_alive():
                self.dead_procs.add(p)
        for r in dead:
            if r in crashed:
                self.detected.setdefault(r, now - crashed[r])
            elif self.owner.get(r) not in self.dead_procs:
                self.false_deaths[r] = self.false_deaths.get(r, 0) + 1
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(self.registry.keys.live, 0, -1, withscores=True)
        (sec, usec), entries = pipe.execute()
        server_now = sec + usec / 1e6
        ages = [server_now - score for member, score in entries if int(member) not in crashed]
        if ages:
            oldest = max(ages)
            self.ages.append(oldest)
            if oldest > self.cfg.dead_after_s:
                self.ages_over += 1


def _script_names() -> dict[str, str]:
    """SHA1 -> name of the control plane's Lua scripts, to name EVALSHA entries of the slow log."""
    import hashlib

    from dynaresize.control import commands, registry

    scripts = {"send": commands._SEND, "claim": commands._CLAIM, "register": registry._REGISTER,
               "heartbeat": registry._HEARTBEAT, "deregister": registry._DEREGISTER, "liveness": registry._LIVENESS,
               "dead": registry._DEAD}
    return {hashlib.sha1(src.encode()).hexdigest(): name for name, src in scripts.items()}


def _slow_name(entry: dict, scripts: dict[str, str]) -> str:
    """A SLOWLOG entry's command: 'script:<name>' for the control plane's scripts, else the command word."""
    cmd = entry.get("command", b"")
    words = (cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)).split() or ["?"]
    if words[0].upper() == "EVALSHA" and len(words) > 1:
        return "script:" + scripts.get(words[1].lower(), words[1][:12])
    return words[0].upper()


def redis_cpu(client) -> float:
    """CPU seconds (user + system) the redis-server process has used so far."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run_threaded_bench(ranks: int, rounds: int, timeout: float) -> dict | None:
    """tools/bench_control_plane.py with all rank threads in one process; its JSON line, or None on failure."""
    cmd = [sys.executable, str(ROOT / "tools" / "bench_control_plane.py"), "--ranks", str(ranks), "--procs", "1",
           "--rounds", str(rounds)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"--compare: {' '.join(cmd)} did not finish within {timeout:.0f} s", file=sys.stderr)
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"--compare: {' '.join(cmd)} failed (rc {out.returncode}): {out.stderr[-500:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def run(args: argparse.Namespace) -> dict:
    from dynaresize.control.commands import CommandBus
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import RedisServer, connect
    from dynaresize.contract.protocol import CommandKind
    from dynaresize.events import format_ranks

    extra = {} if args.dead_after is None else {"dead_after_heartbeats": args.dead_after}
    cfg = RedisConfig(heartbeat_s=args.heartbeat_s, block_ms=args.block_ms, **extra)
    rng = random.Random(args.seed)
    ctx = mp.get_context("spawn")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp, RedisServer(cfg, tmp) as srv:
        go, out = ctx.Event(), ctx.Queue()
        procs, readies, owner = [], [], {}
        for p in range(args.procs):
            part = list(range(p, args.ranks, args.procs))
            owner.update({r: p for r in part})
            ready = ctx.Event()
            proc = ctx.Process(target=rank_process, name=f"sim{p}", daemon=True,
                               args=(str(srv.endpoint_file), cfg.model_dump_json(), p, part, args.threads, ready, go, out))
            proc.start()
            procs.append(proc)
            readies.append(ready)
        for p, ready in enumerate(readies):
            if not ready.wait(120):
                raise RuntimeError(f"rank process {p} did not start within 120 s")
        coord = connect(srv.endpoint_file, role="coordinator", cfg=cfg)
        registry = Registry(coord, JOB, cfg)
        bus = CommandBus(coord, JOB, cfg)
        t0 = time.monotonic()
        go.set()
        while len(registry.live()) < args.ranks:
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"only {len(registry.live())} of {args.ranks} ranks registered within 120 s")
            time.sleep(0.05)
        register_s = time.monotonic() - t0
        time.sleep(cfg.block_ms / 1000)  # receiver loops subscribed (a missed wake-up is covered by the periodic read)

        watcher = Watcher(str(srv.endpoint_file), cfg, args.liveness_s, procs, owner)
        watcher.start()
        alive = list(range(args.ranks))
        sent: dict[str, list[int]] = {}  # command id -> targets
        per_rank_sent = {r: 0 for r in alive}
        send_ms, send_one_ms, delivery, fanout_all, acks_ms = [], [], [], [], []
        probe_bus = CommandBus(coord, JOB + "-probe", cfg) if args.probe else None
        missed = lost = errors = subsets = 0
        crash_at = args.duration / 2 if args.crash else None

        def command(kind, targets, payload, measure: bool = True) -> tuple[int, int, float]:
            """send + await (deadline, then until lost_after); returns (missed, lost, seconds to all acks)."""
            nonlocal errors
            c0 = time.perf_counter()
            cmd = bus.send(kind, targets, payload)
            if measure:
                send_ms.append((time.perf_counter() - c0) * 1000)
                if probe_bus is not None:  # the same bytes as ONE stream entry (a job-wide stream), same moment
                    p0 = time.perf_counter()
                    probe_bus.resend(cmd.model_copy(update={"job_id": probe_bus.job_id, "epoch": probe_bus.epoch}), [0])
                    send_one_ms.append((time.perf_counter() - p0) * 1000)
            sent[cmd.command_id] = list(targets)
            for r in targets:
                per_rank_sent[r] += 1
            res = bus.await_acks(cmd.command_id, targets, timeout=args.deadline)
            acks = dict(res.acks)
            m = 1 if res.missing else 0
            if res.missing:
                late = bus.await_acks(cmd.command_id, res.missing, timeout=max(0.0, args.lost_after - args.deadline))
                acks.update(late.acks)
            took = time.perf_counter() - c0
            errors += sum(1 for a in acks.values() if not a.ok)
            ds = [a.result["delivery_ms"] for a in acks.values() if a.ok and a.result and "delivery_ms" in a.result]
            if measure:
                delivery.extend(ds)
            if measure and ds and len(acks) == len(targets):
                fanout_all.append(max(ds))
                acks_ms.append(took * 1000)
            return m, len(targets) - len(acks), took

        start = time.monotonic()
        cpu_redis0, cpu_coord0 = redis_cpu(coord), time.process_time()
        tick = start - args.interval  # the first command goes at once
        i = 0
        while True:
            now = time.monotonic()
            tick = max(tick + args.interval, now)  # a command that took longer than the interval delays the next
            if tick - start > args.duration:
                break
            time.sleep(tick - now)
            if crash_at is not None and time.monotonic() - start >= crash_at:
                victims = rng.sample(alive, min(args.crash, len(alive) - 1))
                m, lo, _ = command(CommandKind.SHUTDOWN, victims, {"crash": True}, measure=False)
                missed, lost = missed + m, lost + lo
                acked = time.monotonic()
                for r in victims:
                    watcher.crash(r, acked)
                alive = [r for r in alive if r not in victims]
                crash_at = None
                continue
            targets = alive
            if args.subset_every and i % args.subset_every == args.subset_every - 1:
                subsets += 1
                k = rng.randint(1, max(1, len(alive) // 2))
                if subsets % 2:
                    s = rng.randrange(0, len(alive) - k + 1)
                    targets = alive[s:s + k]
                else:
                    targets = sorted(rng.sample(alive, k))
            m, lo, _ = command(CommandKind.PING, targets, {"i": i})
            missed, lost = missed + m, lost + lo
            i += 1
        elapsed = time.monotonic() - start
        cpu_redis, cpu_coord = redis_cpu(coord) - cpu_redis0, time.process_time() - cpu_coord0
        # crashed ranks must be seen dead: wait up to dead_after + 2 liveness periods + slack
        limit = time.monotonic() + cfg.dead_after_s + 2 * args.liveness_s + 5
        while len(watcher.detected) < len(watcher.crashed) and time.monotonic() < limit:
            time.sleep(args.liveness_s / 2)
        watcher.stop.set()
        watcher.join(cfg.socket_timeout_s + 5)

        m, lo, _ = command(CommandKind.SHUTDOWN, alive, {}, measure=False)
        missed, lost = missed + m, lost + lo
        stats = []
        for _ in procs:
            try:
                stats.append(json.loads(out.get(timeout=60)))
            except queue.Empty:
                break
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
        # audit: one ack entry per target in every ack stream; every rank applied exactly what was sent to it
        pipe = coord.pipeline(transaction=False)
        ids = list(sent)
        for cid in ids:
            pipe.xlen(bus.keys.ack(cid))
        ack_entries = [int(n) for n in pipe.execute()]
        dup_acks = sum(max(0, n - len(sent[cid])) for cid, n in zip(ids, ack_entries))
        info = coord.info("memory")
        aof = coord.info("persistence")
        slow = sorted(coord.slowlog_get(128), key=lambda e: -int(e["duration"]))  # commands over 10 ms, server-side
        coord.close()
        watcher.client.close()
    load1 = os.getloadavg()

    scripts = _script_names()
    slow_by: dict[str, int] = {}
    for e in slow:
        slow_by[_slow_name(e, scripts)] = slow_by.get(_slow_name(e, scripts), 0) + 1
    applied: dict[int, int] = {}
    for s in stats:
        applied.update({int(r): n for r, n in s["applied"].items()})
    mismatches = sorted(r for r in per_rank_sent if applied.get(r) != per_rank_sent[r])
    gaps = [g for s in stats for g in s["hb_gap_s"]]
    hb_rtt = [x for s in stats for x in s["hb_rtt_ms"]]
    crashed = sorted(watcher.crashed)
    undetected = [r for r in crashed if r not in watcher.detected]
    proc_failures = [p for p, proc in enumerate(procs) if proc.exitcode not in (0, None)] + \
                    ([f"{args.procs - len(stats)} process(es) reported no stats"] if len(stats) < args.procs else [])
    res = {
        "ranks": args.ranks, "procs": args.procs, "threads_per_proc": args.threads, "duration_s": round(elapsed, 1),
        "interval_s": args.interval, "heartbeat_s": cfg.heartbeat_s, "dead_after_s": cfg.dead_after_s,
        "deadline_s": args.deadline, "cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in load1], "register_s": round(register_s, 3),
        "commands": len(sent), "subset_commands": subsets,
        "metrics": {
            "send_ms": summary(send_ms), "send_one_ms": summary(send_one_ms), "delivery_ms": summary(delivery), "fanout_all_ms": summary(fanout_all),
            "acks_ms": summary(acks_ms), "hb_age_s": summary(watcher.ages), "hb_gap_s": summary(gaps),
            "hb_rtt_ms": summary(hb_rtt), "liveness_ms": summary(watcher.liveness_ms),
        },
        "false_deaths": sum(watcher.false_deaths.values()), "false_death_ranks": sorted(watcher.false_deaths),
        "hb_age_over": watcher.ages_over, "deadline_missed": missed, "lost_acks": lost, "error_acks": errors,
        "duplicate_acks": dup_acks, "ack_entries": sum(ack_entries), "acks_expected": sum(map(len, sent.values())), "duplicate_applies": sum(s["duplicate_applies"] for s in stats),
        "apply_mismatches": len(mismatches), "apply_mismatch_ranks": mismatches[:20],
        "crashed": crashed, "crash_detect_s": {str(r): round(t, 3) for r, t in sorted(watcher.detected.items())},
        "crash_undetected": len(undetected), "process_failures": proc_failures, "watcher_errors": watcher.errors[:5],
        "rank_side": {k: sum(s[k] for s in stats) for k in ("via_wake", "via_periodic", "wakeups", "periodic_reads", "beats",
                                                            "beat_errors", "beats_lost", "beats_superseded",
                                                            "receiver_errors", "pubsub_errors", "rejected")},
        "redis": {"used_memory_mb": round(info["used_memory"] / 2**20, 1),
                  "aof_rewrites": aof.get("aof_rewrites", 0), "aof_delayed_fsync": aof.get("aof_delayed_fsync", 0),
                  "slow_commands": len(slow), "slow_by_command": slow_by,
                  "slowest": [[_slow_name(e, scripts), round(int(e["duration"]) / 1000, 1)] for e in slow[:3]]},
        # CPU cores used during the load phase (rank processes: from registration to exit)
        "cores_used": {"redis": cpu_redis / elapsed, "coordinator": cpu_coord / elapsed,
                       "rank_processes": sum(s["cpu_s"] for s in stats) / elapsed},
    }
    res["integrity_ok"] = not (lost or dup_acks or res["duplicate_applies"] or mismatches or undetected
                               or proc_failures or errors)
    res["deadlines_ok"] = not (res["false_deaths"] or res["hb_age_over"] or missed)
    return res


def fmt(v: float, unit: str) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v:.3f}" if unit == "s" else f"{v:.1f}"


def print_table(res: dict, cmp: dict | None) -> None:
    print(f"control plane under load: {res['ranks']} ranks in {res['procs']} processes x {res['threads_per_proc']} "
          f"receiver thread(s), {res['duration_s']} s, {res['commands']} commands ({res['subset_commands']} to subsets), "
          f"{res['cores']} cores, load average {res['loadavg_start'][0]} -> {res['loadavg_end'][0]}")
    names = {"send_ms": "send(): XADD to every target + PUBLISH (ms)",
             "send_one_ms": "probe: the same command as ONE entry (ms)",
             "delivery_ms": "delivery: created -> rank handler (ms)",
             "fanout_all_ms": "fan-out: created -> last target's handler (ms)",
             "acks_ms": "acks: created -> all acks collected (ms)", "hb_age_s": "heartbeat age, oldest healthy rank (s)",
             "hb_gap_s": "heartbeat period seen by a process (s)", "hb_rtt_ms": "heartbeat pipeline round trip (ms)",
             "liveness_ms": "coordinator: Registry.dead() call (ms)"}
    print(f"{'metric':<50} {'n':>7} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}")
    for key, name in names.items():
        m, unit = res["metrics"][key], key.rsplit("_", 1)[1]
        print(f"{name:<50} {m['n']:>7} " + " ".join(f"{fmt(m[q], unit):>9}" for q in ("p50", "p95", "p99", "max")))
    print(f"{'register: all ranks live (s)':<50} {res['register_s']:>7.2f}")
    print("missed deadlines (want 0):")
    for key, name in (("false_deaths", "false deaths (healthy rank reported dead)"),
                      ("hb_age_over", f"heartbeat older than dead_after ({res['dead_after_s']} s)"),
                      ("deadline_missed", f"commands not fully acked within {res['deadline_s']} s")):
        print(f"  {name:<48} {res[key]:>7}")
    print("integrity (want 0):")
    for key in ("lost_acks", "duplicate_acks", "duplicate_applies", "apply_mismatches", "error_acks", "crash_undetected"):
        print(f"  {key:<48} {res[key]:>7}")
    if res["crashed"]:
        print(f"crashed ranks {res['crashed']} reported dead after (s): {res['crash_detect_s']}")
    rd = res["redis"]
    print(f"redis-server: {rd['used_memory_mb']} MiB, {rd['aof_rewrites']} AOF rewrite(s), {rd['aof_delayed_fsync']} "
          f"delayed fsync(s); over 10 ms server-side: {rd['slow_by_command'] or 'none'}, slowest {rd['slowest']}")
    cu = res["cores_used"]
    print(f"CPU cores used: redis-server {cu['redis']:.2f}, coordinator {cu['coordinator']:.2f}, "
          f"rank processes {cu['rank_processes']:.2f} (of {res['cores']})")
    rs = res["rank_side"]
    print(f"rank side: {rs['via_wake']} entries read on a wake-up, {rs['via_periodic']} by a periodic read "
          f"({rs['periodic_reads']} periodic reads); "
          f"{rs['beats']} heartbeat pipelines, {rs['beat_errors']} failed, {rs['beats_lost']} lost registrations")
    if cmp:
        print(f"vs tools/bench_control_plane.py ({cmp['ranks']} rank threads in 1 process, one receiver thread each):")
        print(f"  {'metric':<40} {'threaded':>10} {'this':>10} {'ratio':>8}")
        for name, theirs, ours in (("send p50 (ms)", cmp["fanout_p50_ms"], res["metrics"]["send_ms"]["p50"]),
                                   ("send p99 (ms)", cmp["fanout_p99_ms"], res["metrics"]["send_ms"]["p99"]),
                                   ("delivery p50 (ms)", cmp["delivery_p50_ms"], res["metrics"]["delivery_ms"]["p50"]),
                                   ("delivery p99 (ms)", cmp["delivery_p99_ms"], res["metrics"]["delivery_ms"]["p99"]),
                                   ("acks p50 (ms)", cmp["acks_p50_ms"], res["metrics"]["acks_ms"]["p50"]),
                                   ("acks p99 (ms)", cmp["acks_p99_ms"], res["metrics"]["acks_ms"]["p99"])):
            ratio = theirs / ours if ours and not math.isnan(ours) else float("nan")
            print(f"  {name:<40} {theirs:>10.1f} {ours:>10.1f} {ratio:>7.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024, help="simulated ranks")
    ap.add_argument("--procs", type=int, default=4, help="OS processes the ranks are spread over (round robin)")
    ap.add_argument("--threads", type=int, default=8,
                    help="receiver loops (threads) per process: they overlap the round trips of their ranks")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between commands")
    ap.add_argument("--subset-every", type=int, default=4, help="every k-th command goes to a random subset (0: never)")
    ap.add_argument("--deadline", type=float, default=2.0, help="seconds within which every ack of a command must be in")
    ap.add_argument("--lost-after", type=float, default=30.0, help="seconds after which a missing ack counts as lost")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="redis.heartbeat_s")
    ap.add_argument("--dead-after", type=int, default=None,
                    help="redis.dead_after_heartbeats (default: the config's default)")
    ap.add_argument("--block-ms", type=int, default=500, help="redis.block_ms (also the receivers' periodic read)")
    ap.add_argument("--liveness-s", type=float, default=0.5, help="seconds between the coordinator's liveness checks")
    ap.add_argument("--crash", type=int, default=1, help="ranks told to crash at mid-run (they must be seen dead)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the probe send after each command (one XADD of the same bytes to another job's stream)")
    ap.add_argument("--compare", action="store_true", help="also run tools/bench_control_plane.py --procs 1")
    ap.add_argument("--compare-rounds", type=int, default=20, help="broadcasts of the --compare run")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--strict", action="store_true", help="exit 1 on a missed deadline too")
    args = ap.parse_args(argv)
    for name in ("ranks", "procs", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.procs > args.ranks:
        ap.error(f"--procs {args.procs} > --ranks {args.ranks}")
    if args.crash >= args.ranks:
        ap.error(f"--crash {args.crash} must leave at least one rank (--ranks {args.ranks})")
    if args.deadline > args.lost_after:
        ap.error("--deadline must not exceed --lost-after")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    res = run(args)
    cmp = run_threaded_bench(args.ranks, args.compare_rounds, timeout=900) if args.compare else None
    if cmp:
        res["threaded_bench"] = cmp
    if not args.json:
        print_table(res, cmp)
    print(json.dumps(_finite(res)))
    if not res["integrity_ok"]:
        return 1
    return 1 if args.strict and not res["deadlines_ok"] else 0


def _finite(o):
    """NaN (a metric with no samples) -> null, so that the JSON line is strict JSON."""
    if isinstance(o, float):
        return None if math.isnan(o) else round(o, 3)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
