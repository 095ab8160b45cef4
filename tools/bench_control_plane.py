"""Benchmark of the control plane: N simulated ranks register, then receive broadcast commands and ack them.

    python tools/bench_control_plane.py --ranks 1024 [--procs 4] [--rounds 30] [--compare]

A private real redis-server is started (AOF on, as in a run). Ranks are threads spread over ``--procs`` processes,
each with its own client and wake-up subscription, using the real :class:`Registry` and :class:`CommandReceiver`.
The coordinator (this process) uses the real :class:`CommandBus`.

Measured:

- ``register_s``: from "go" until the registry lists all N ranks live;
- ``fanout_ms``: one ``CommandBus.send`` to all N ranks: the command is durable (one entry in the job's broadcast
  stream; with ``--compare`` also the per-rank fan-out, one entry in every rank's stream) and the wake-up is
  published (one Lua script, one round trip), while the N ranks wake up and compete for the CPUs;
- ``fanout_idle_ms``: the same send to N ranks of another job once the rank processes have exited (the fan-out's
  own cost: the server's work and one round trip, without N ranks waking up and competing for the CPUs);
- ``delivery_ms``: from the send until a rank's handler runs (per rank; includes Python thread wake-up);
- ``acks_ms``: from the send until ``await_acks`` holds all N acks.

Prints a table, then one JSON object as the last line (``per_rank_*`` keys for the per-rank mode). Target (not a
test): p99 fan-out (broadcast) to 1024 ranks <= 10 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

JOB = "bench"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def worker(endpoint_file: str, cfg_json: str, ranks: list[int], go, ready) -> None:
    """One process: ``ranks`` as threads (register, heartbeat, apply commands until SHUTDOWN)."""
    from dynaresize.control.commands import CommandReceiver
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import connect
    from dynaresize.contract.protocol import CommandKind
    from dynaresize.control.wire import RankState, Registration

    cfg = RedisConfig.model_validate_json(cfg_json)
    host = socket.gethostname()
    clients = {r: connect(endpoint_file, role=f"rank{r}", cfg=cfg) for r in ranks}
    for c in clients.values():
        c.ping()
    ready.set()
    go.wait()
    regs: dict[int, Registration] = {}
    stop = threading.Event()

    def register(r: int) -> None:
        regs[r] = Registry(clients[r], JOB, cfg).register(
            Registration(job_id=JOB, rank=r, host=host, device="cpu", staging_dir="/tmp", pid=os.getpid(),
                         state=RankState.IDLE))

    threads = [threading.Thread(target=register, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def beat() -> None:  # one heartbeat thread per process, the real heartbeat call for each rank
        reg = Registry(connect(endpoint_file, role="hb", cfg=cfg), JOB, cfg)
        while not stop.wait(cfg.heartbeat_s):
            for r in ranks:
                reg.heartbeat(r, regs[r].incarnation)

    def serve(r: int) -> None:
        recv = CommandReceiver(clients[r], JOB, r, cfg, incarnation=regs[r].incarnation)

        def handle(cmd):
            if cmd.kind is CommandKind.SHUTDOWN:
                stop.set()
            return {"delivery_ms": (time.time() - cmd.issued_at) * 1000}

        recv.run(handle, stop.is_set, idle_s=0.5)
        recv.close()

    hb = threading.Thread(target=beat, daemon=True)
    hb.start()
    servers = [threading.Thread(target=serve, args=(r,), daemon=True) for r in ranks]
    for t in servers:
        t.start()
    for t in servers:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=4, help="processes the rank threads are spread over")
    ap.add_argument("--rounds", type=int, default=30, help="broadcast commands timed")
    ap.add_argument("--gap", type=float, default=0.05, help="seconds between broadcasts")
    ap.add_argument("--compare", action="store_true",
                    help="also time the per-rank fan-out (one stream entry per target, redis.broadcast_min_ranks=0), "
                    "alternating with the broadcast stream round by round")
    ap.add_argument("--appendfsync", choices=["always", "everysec", "no"], default=None,
                    help="AOF fsync policy of the server (default: the config default, always)")
    args = ap.parse_args()

    from dynaresize.control.commands import CommandBus
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import RedisServer, connect
    from dynaresize.contract.protocol import CommandKind

    cfg = RedisConfig(heartbeat_s=1.0, dead_after_heartbeats=3, block_ms=500, socket_timeout_s=10)
    if args.appendfsync:
        cfg = cfg.model_copy(update={"appendfsync": args.appendfsync})
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp, RedisServer(cfg, tmp) as srv:
        go, procs, readies = ctx.Event(), [], []
        for p in range(args.procs):
            ready = ctx.Event()
            part = list(range(p, args.ranks, args.procs))
            proc = ctx.Process(target=worker, args=(str(srv.endpoint_file), cfg.model_dump_json(), part, go, ready), daemon=True)
            proc.start()
            procs.append(proc)
            readies.append(ready)
        for ready in readies:
            ready.wait(120)
        coord = connect(srv.endpoint_file, role="coordinator", cfg=cfg)
        registry = Registry(coord, JOB, cfg)
        bus = CommandBus(coord, JOB, cfg)
        t0 = time.perf_counter()
        go.set()
        while len(registry.live()) < args.ranks:
            if time.perf_counter() - t0 > 120:
                print("ranks did not register within 120 s", file=sys.stderr)
                return 1
            time.sleep(0.005)
        register_s = time.perf_counter() - t0
        time.sleep(1.0)  # let every receiver subscribe and settle

        everyone = list(range(args.ranks))
        load_start = os.getloadavg()[0]
        modes = {"per_rank": 0, "broadcast": cfg.broadcast_min_ranks} if args.compare else {"broadcast": cfg.broadcast_min_ranks}
        buses = {m: CommandBus(coord, JOB, cfg.model_copy(update={"broadcast_min_ranks": n}), epoch=bus.epoch)
                 for m, n in modes.items()}
        got = {m: {"fanout": [], "acks": [], "delivery": [], "idle": [], "missing": 0} for m in modes}
        for i in range(args.rounds + 2):
            for m, b in buses.items():  # the modes alternate round by round: both see the same machine load
                t = time.perf_counter()
                cmd = b.send(CommandKind.PING, everyone, {"i": i})
                sent = time.perf_counter()
                res = b.await_acks(cmd.command_id, everyone, timeout=30)
                done = time.perf_counter()
                if i >= 2:  # warm-up
                    g = got[m]
                    g["fanout"].append((sent - t) * 1000)
                    g["acks"].append((done - t) * 1000)
                    g["missing"] += len(res.missing)
                    g["delivery"] += [a.result["delivery_ms"] for a in res.acks.values() if a.result]
                time.sleep(args.gap)
        bus.request(CommandKind.SHUTDOWN, everyone, timeout=30)
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
        # the same send to N ranks of another job, once the ranks have exited: the fan-out's own cost
        time.sleep(2.0)
        quiet_epoch = int(coord.incr(f"dr:{JOB}-quiet:epoch"))
        quiet = {m: CommandBus(coord, JOB + "-quiet", cfg.model_copy(update={"broadcast_min_ranks": n}), epoch=quiet_epoch)
                 for m, n in modes.items()}
        for i in range(args.rounds + 2):
            for m, b in quiet.items():
                t = time.perf_counter()
                b.send(CommandKind.PING, everyone, {"i": i})
                if i >= 2:
                    got[m]["idle"].append((time.perf_counter() - t) * 1000)
                time.sleep(args.gap)
        coord.close()

    out = {"ranks": args.ranks, "procs": args.procs, "rounds": args.rounds, "cores": os.cpu_count(),
           "load1_start": round(load_start, 1), "load1_end": round(os.getloadavg()[0], 1), "appendfsync": cfg.appendfsync, "register_s": round(register_s, 3)}
    for m, g in got.items():
        pre = "" if m == "broadcast" else "per_rank_"
        for name, xs in (("fanout", g["fanout"]), ("fanout_idle", g["idle"]), ("delivery", g["delivery"]), ("acks", g["acks"])):
            out[f"{pre}{name}_p50_ms"] = round(pct(xs, 50), 3)
            out[f"{pre}{name}_p99_ms"] = round(pct(xs, 99), 3)
        out[f"{pre}missing_acks"] = g["missing"]
    print(f"control plane: {args.ranks} ranks in {args.procs} processes, {args.rounds} commands per mode, "
          f"{os.cpu_count()} cores (load {out['load1_start']} at the start, {out['load1_end']} at the end), "
          f"appendfsync {cfg.appendfsync}")
    print(f"{'metric':<48} {'mode':<10} {'p50':>10} {'p99':>10} {'mean':>10}")
    for name, key in (("fan-out: send() to all ranks (ms)", "fanout"),
                      ("fan-out, ranks gone (the send's own cost) (ms)", "idle"),
                      ("delivery: send -> rank handler runs (ms)", "delivery"),
                      ("acks: send -> all acks collected (ms)", "acks")):
        for m, g in got.items():
            xs = g[key]
            print(f"{name:<48} {m:<10} {pct(xs, 50):>10.2f} {pct(xs, 99):>10.2f} "
                  f"{statistics.fmean(xs) if xs else float('nan'):>10.2f}")
    print(f"{'register: all ranks live (s)':<48} {'':<10} {register_s:>10.3f}")
    for m, g in got.items():
        print(f"{'missing acks (all rounds)':<48} {m:<10} {g['missing']:>10d}")
    target = "met" if out["fanout_p99_ms"] <= 10 else "NOT met"
    print(f"target p99 fan-out (broadcast) <= 10 ms: {target}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
