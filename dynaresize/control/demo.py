"""``dynaresize demo [CONFIG] [overrides] [--ranks N]``: the control plane end to end on one machine.

What it does, in order (every step is an event in ``<run_dir>/events.jsonl``):

1. creates a fresh run directory, writes the resolved config, starts the run's private redis-server;
2. starts N simulated ranks (threads), each registering and heartbeating, and applying commands from its stream;
3. the coordinator takes an epoch, waits for all ranks, assigns the initial roles with ``switch_role`` (first
   ``cluster.initial_train`` ranks train, the rest roll out), pings everyone, then moves one rollout rank to training;
4. one rank is killed silently: the coordinator notices it within ``redis.dead_after_heartbeats`` periods, and the
   next broadcast reports it as missing;
5. ``shutdown`` to the survivors, a table of ranks, and the server is stopped cleanly (AOF flushed).

Nothing here needs a GPU or Slurm. Until the GRPO job exists, ``dynaresize run`` (and ``make run``) runs this demo.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path

from dynaresize.config.loader import load_config, write_resolved
from dynaresize.rundir import create_run_dir
from dynaresize.rundir import job_id as rundir_job_id
from dynaresize.events import EventLog, Role, format_ranks

log = logging.getLogger("dynaresize.control.demo")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="experiment YAML (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. redis.heartbeat_s=0.5")
    p.add_argument("--ranks", type=int, default=None, help="simulated ranks (default: cluster.gpus)")


class SimRank:
    """One simulated rank: heartbeats on one thread, applies its commands on another."""

    def __init__(self, rank: int, job_id: str, endpoint_file: Path, cfg, events: EventLog):
        from dynaresize.control.commands import CommandReceiver
        from dynaresize.control.registry import Heartbeater, Registry
        from dynaresize.control.server import connect
        from dynaresize.control.wire import RankState, Registration

        self.rank = rank
        self.role = Role.IDLE
        self.applied = 0
        self._stop = threading.Event()
        reg = Registration(job_id=job_id, rank=rank, host=socket.gethostname(), device="cpu",
                           staging_dir=f"/tmp/dynaresize-stage/{job_id}/{rank}", pid=os.getpid(),
                           state=RankState.IDLE)  # ready at once (no start-up grace)
        self.client = connect(endpoint_file, role=f"rank{rank}", cfg=cfg)
        self.hb = Heartbeater(Registry(self.client, job_id, cfg), reg, events=events)
        self.hb.start()
        self.recv = CommandReceiver(self.client, job_id, rank, cfg, incarnation=lambda: self.hb.registration.incarnation,
                                    events=events)
        self.thread = threading.Thread(target=self.recv.run, args=(self.handle, self._stop.is_set, 0.2),
                                       name=f"rank{rank}", daemon=True)
        self.thread.start()

    def handle(self, cmd) -> dict:
        from dynaresize.contract.protocol import CommandKind
        from dynaresize.control.wire import RankState

        self.applied += 1
        if cmd.kind is CommandKind.SWITCH_ROLE:
            self.role = Role(cmd.payload["to"])
            self.hb.update(role=self.role, state=RankState.IDLE)
        elif cmd.kind is CommandKind.SHUTDOWN:
            self._stop.set()
        return {"role": self.role.value, "applied": self.applied}

    def kill(self) -> None:
        """Die without a word: no deregistration, no more heartbeats or acks."""
        self._stop.set()
        self.hb.stop(deregister=False)
        self.thread.join(timeout=5)
        self.recv.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.hb.stop(deregister=True)
        self.recv.close()


def main(args: argparse.Namespace) -> int:
    from dynaresize.control.commands import CommandBus
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import RedisServer, connect
    from dynaresize.contract.protocol import CommandKind

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(getattr(args, "config", None), getattr(args, "overrides", None) or [])
    n = args.ranks or cfg.cluster.gpus
    if n < 2:
        print("dynaresize demo: --ranks must be at least 2")
        return 2
    run_dir = create_run_dir(cfg.run.output_dir, cfg.run.name)
    write_resolved(cfg, run_dir)
    job_id = rundir_job_id(run_dir)
    rcfg = cfg.redis
    events = EventLog(run_dir / "events.jsonl")
    events.emit("run_start", run_id=run_dir.name, job_id=job_id, source="runtime", world_size=n, wall_time=events.t0)
    n_train = min(cfg.cluster.initial_train, n - 1)
    status = "failed"
    ranks: dict[int, SimRank] = {}
    rows: dict[int, dict] = {}
    try:
        with RedisServer(rcfg, run_dir) as srv:
            print(f"run dir   {run_dir}\nredis     {srv.endpoint.host}:{srv.endpoint.port} (password in {srv.dir}/password)")
            coord = connect(srv.endpoint_file, role="coordinator", cfg=rcfg)
            bus = CommandBus(coord, job_id, rcfg, events=events)
            registry = Registry(coord, job_id, rcfg)
            for r in range(n):
                ranks[r] = SimRank(r, job_id, srv.endpoint_file, rcfg, events)
            _wait_for(lambda: len(registry.live()) == n, 10, "all ranks to register")
            print(f"epoch     {bus.epoch}; {n} ranks registered")

            train, rollout = list(range(n_train)), list(range(n_train, n))
            for role, group in ((Role.TRAIN, train), (Role.ROLLOUT, rollout)):
                _step(bus, events, CommandKind.SWITCH_ROLE, group, {"to": role.value}, rows)
                events.emit("role_change", step=0, ranks=format_ranks(group), from_role=Role.IDLE, to_role=role)
            events.emit("topology", step=0, train_ranks=format_ranks(train), rollout_ranks=format_ranks(rollout))
            _step(bus, events, CommandKind.PING, range(n), {}, rows)

            moved = rollout[-1] if len(rollout) > 1 else None
            if moved is not None:
                _step(bus, events, CommandKind.SWITCH_ROLE, [moved], {"to": Role.TRAIN.value}, rows)
                events.emit("role_change", step=1, ranks=str(moved), from_role=Role.ROLLOUT, to_role=Role.TRAIN)
                train, rollout = train + [moved], rollout[:-1]
                events.emit("topology", step=1, train_ranks=format_ranks(train), rollout_ranks=format_ranks(rollout))

            victim = n - 1 if moved != n - 1 else 0
            ranks[victim].kill()
            t_kill = time.monotonic()
            _wait_for(lambda: victim in registry.dead(), 10 * rcfg.dead_after_s + 5, f"rank {victim} to be seen dead")
            took = time.monotonic() - t_kill
            events.emit("rank", rank=victim, state="dead", detected_after_s=round(took, 3))
            print(f"rank {victim} killed; seen dead after {took:.2f}s (threshold {rcfg.dead_after_s:.2f}s)")
            res = _step(bus, events, CommandKind.PING, range(n), {}, rows)
            print(f"ping after the kill: missing ranks {format_ranks(res.missing) or '-'}")

            survivors = [r for r in range(n) if r != victim]
            _step(bus, events, CommandKind.SHUTDOWN, survivors, {}, rows)
            live = registry.live()
            for r in survivors:
                ranks[r].stop()
            _print_table(n, live, rows, victim)
            coord.close()
        status = "completed"
        return 0
    finally:
        for r in ranks.values():
            r._stop.set()
        events.emit("run_end", status=status, steps=0)
        events.close()
        print(f"events    {run_dir / 'events.jsonl'}")


def _step(bus, events: EventLog, kind, ranks, payload, rows):
    ranks = list(ranks)
    t0 = time.monotonic()
    cmd, res = bus.request(kind, ranks, payload, timeout=max(1.0, bus.cfg.dead_after_s))
    ms = (time.monotonic() - t0) * 1000
    events.emit("metric", name=f"control.{kind.value}.acks_ms", value=round(ms, 3))
    events.emit("control", what=f"command:{kind.value}", command_id=cmd.command_id, epoch=cmd.epoch,
                reason=f"{len(res.acks)}/{len(ranks)} acks in {ms:.1f} ms" + (f", missing {format_ranks(res.missing)}" if res.missing else ""),
                ranks=format_ranks(ranks), missing=format_ranks(res.missing))
    for r, a in res.acks.items():
        rows[r] = {"last": kind.value, "ok": a.ok, "result": a.result or {}, "ms": ms}
    print(f"{kind.value:<12} -> {format_ranks(ranks):<10} acks {len(res.acks)}/{len(ranks)} in {ms:7.1f} ms"
          + (f"  missing {format_ranks(res.missing)}" if res.missing else ""))
    return res


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(0.05)


def _print_table(n: int, live: dict, rows: dict, victim: int) -> None:
    print(f"\n{'rank':>4}  {'status':<8} {'role':<8} {'inc':>3}  {'last command':<12} {'applied':>7}")
    for r in range(n):
        row = rows.get(r, {})
        reg = live.get(r)
        status = "dead" if r == victim else ("alive" if reg else "gone")
        role = row.get("result", {}).get("role", "-")
        print(f"{r:>4}  {status:<8} {role:<8} {reg.incarnation if reg else '-':>3}  {row.get('last', '-'):<12} "
              f"{row.get('result', {}).get('applied', '-'):>7}")
    print()
