"""What ``redis.appendfsync always`` costs against ``everysec``: one write, and one command round trip.

    python tools/bench_redis_fsync.py [--writes 2000] [--commands 200] [--repeats 3]

For each policy a private real redis-server is started in a temporary directory (AOF on, as in a run; put
``TMPDIR`` on the disk a run directory would use: the cost is the fsync of that disk). Measured, policies
interleaved ``--repeats`` times so that load on a shared machine hits both alike:

- ``write_ms``: one INCR (a write that goes to the append-only file), client to reply;
- ``command_ms``: one ``CommandBus.request`` to one rank (a real ``CommandReceiver`` on a thread with its own
  client): send script, wake-up, claim, handler, MULTI commit of ack and cursor, ack read; three fsyncs with
  ``always``.

Prints a table, then one JSON object as the last line (medians over the repeats of each percentile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

POLICIES = ("always", "everysec")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def measure(policy: str, writes: int, commands: int) -> dict[str, float]:
    from dynaresize.control.commands import CommandBus, CommandReceiver
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.server import RedisServer, connect
    from dynaresize.contract.protocol import CommandKind

    cfg = RedisConfig(appendfsync=policy, block_ms=100, socket_timeout_s=5)
    with tempfile.TemporaryDirectory(prefix="bench-fsync-") as tmp, RedisServer(cfg, tmp) as srv:
        c = connect(srv.endpoint_file, "bench", cfg)
        for _ in range(50):
            c.incr("warm")
        w = []
        for _ in range(writes):
            t = time.perf_counter()
            c.incr("n")
            w.append((time.perf_counter() - t) * 1000)

        stop = threading.Event()
        recv = CommandReceiver(connect(srv.endpoint_file, "rank0", cfg), "bench", 0, cfg, incarnation=1)
        th = threading.Thread(target=recv.run, args=(lambda cmd: {}, stop.is_set, 0.1), daemon=True)
        th.start()
        bus = CommandBus(c, "bench", cfg)
        rt = []
        for i in range(commands + 10):
            t = time.perf_counter()
            _, res = bus.request(CommandKind.PING, [0], {"i": i}, timeout=10)
            if res.missing:
                raise RuntimeError(f"no ack for command {i}")
            if i >= 10:
                rt.append((time.perf_counter() - t) * 1000)
        stop.set()
        th.join(5)
        recv.close()
        c.close()
    return {"write_p50_ms": pct(w, 50), "write_p99_ms": pct(w, 99),
            "command_p50_ms": pct(rt, 50), "command_p99_ms": pct(rt, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--commands", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for _ in range(args.repeats):
        for p in POLICIES:
            runs[p].append(measure(p, args.writes, args.commands))
    out: dict[str, object] = {"cores": os.cpu_count(), "repeats": args.repeats, "tmpdir": tempfile.gettempdir()}
    print(f"appendfsync cost, {args.writes} writes and {args.commands} command round trips per run, "
          f"median of {args.repeats} interleaved runs, TMPDIR={tempfile.gettempdir()}")
    print(f"{'metric':<28} " + " ".join(f"{p:>10}" for p in POLICIES))
    for metric in ("write_p50_ms", "write_p99_ms", "command_p50_ms", "command_p99_ms"):
        vals = {p: statistics.median(r[metric] for r in runs[p]) for p in POLICIES}
        out[metric] = {p: round(v, 3) for p, v in vals.items()}
        print(f"{metric:<28} " + " ".join(f"{vals[p]:>10.3f}" for p in POLICIES))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
