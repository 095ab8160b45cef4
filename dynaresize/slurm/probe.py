"""The built-in probe: a tiny stand-in for the main job that exercises the Slurm plumbing for real.

``slurm.entry=probe`` makes the het job run this instead of the GRPO job:

- the coordinator (component 0) starts the run's real redis-server (``dynaresize.control.server``), publishes the
  rendezvous, waits until every rank of component 1 has registered in Redis with its Slurm identity and writes
  them to ``<run_dir>/probe/ranks-r<restart>.json``;
- then it counts ``slurm.probe_steps`` steps (``slurm.probe_step_s`` each), persisting the counter in
  ``<run_dir>/probe/state.json`` after every step, and polls the preemption hook between steps, exactly where the
  main job will: USR2 -> checkpoint callback -> ``scontrol requeue <leader>``; the requeued job resumes the counter;
- when done it writes ``<run_dir>/probe/done.json``; ranks see it, deregister and exit 0.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from dynaresize import atomic
from dynaresize.slurm import rendezvous
from dynaresize.slurm.preempt import PreemptAction

log = logging.getLogger("dynaresize.slurm.probe")
PROBE_DIR = "probe"


def _write_json(p: Path, obj) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(p, obj, indent=1)


def _read_json(p: Path, default):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return default


def run_coordinator(ctx) -> int:
    cfg, run_dir, ident = ctx.cfg, Path(ctx.run_dir), ctx.identity
    pdir = run_dir / PROBE_DIR
    restart = ident.restart_count if ident else 0
    job = ident.job_id if ident else "local"
    _write_json(pdir / f"coordinator-r{restart}.json", {"identity": ident.to_json() if ident else None, "pid": os.getpid()})
    server = None
    try:
        from dynaresize.control.registry import Registry
        from dynaresize.control.server import RedisServer

        server = RedisServer(cfg.redis, run_dir)
        ep = server.start()
        rendezvous.publish(run_dir, job, restart, server.endpoint_file)
        registry = Registry(server.client("coordinator"), job, cfg.redis)
        deadline = time.monotonic() + 120
        live: dict = {}
        while time.monotonic() < deadline:
            live = registry.live()
            if len(live) >= cfg.cluster.gpus:
                break
            time.sleep(0.2)
        ranks = [r.model_dump(mode="json") for _, r in sorted(live.items())]
        _write_json(pdir / f"ranks-r{restart}.json", {"redis": f"{ep.host}:{ep.port}", "ranks": ranks})
        if len(live) < cfg.cluster.gpus:
            log.error("only %d of %d ranks registered", len(live), cfg.cluster.gpus)
            return 3
        state_path = pdir / "state.json"
        state = _read_json(state_path, {"step": 0, "starts": []})
        state["starts"].append({"restart": restart, "step": state["step"], "t": time.time()})
        _write_json(state_path, state)
        pre = ctx.preemption
        pre.on_checkpoint(lambda reason: _write_json(state_path, {**state, "checkpoint_reason": reason}))
        stopped = None
        while state["step"] < cfg.slurm.probe_steps:
            time.sleep(cfg.slurm.probe_step_s)
            state["step"] += 1
            _write_json(state_path, state)
            action = pre.poll()
            if action is PreemptAction.REQUEUED:
                print(f"probe: requeued at step {state['step']}", flush=True)
                return 0
            if action is PreemptAction.STOP:
                stopped = pre.handled.reason if pre.handled else "stop"
                print(f"probe: stopping at step {state['step']} ({stopped})", flush=True)
                break
        _write_json(pdir / "done.json", {"step": state["step"], "restart": restart, "t": time.time(), "stopped": stopped})
        # give ranks a moment to see done.json and deregister before the server goes away
        end = time.monotonic() + 30
        while time.monotonic() < end and registry.live():
            time.sleep(0.2)
        print(f"probe: done at step {state['step']} (restart {restart})", flush=True)
        return 0
    finally:
        if server is not None:
            server.stop()


def run_worker(ctx) -> int:
    from dynaresize.control.registry import Heartbeater, Registry
    from dynaresize.control.server import connect
    from dynaresize.control.wire import RankState, Registration

    cfg, run_dir, ident = ctx.cfg, Path(ctx.run_dir), ctx.identity
    if ident is None:
        raise RuntimeError("probe worker: not inside a Slurm job step")
    rv = rendezvous.wait(run_dir, ident.job_id, ident.restart_count)
    client = connect(rv.endpoint_file, role=f"rank{ident.procid}", cfg=cfg.redis)
    reg = Registration(
        job_id=ident.job_id, rank=ident.procid, host=ident.node or os.uname().nodename,
        device=f"cuda:{ident.cuda_device}" if cfg.cluster.device == "cuda" else "cpu",
        staging_dir=os.environ.get("SLURM_TMPDIR", "/tmp"), pid=os.getpid(), slurm_job_id=ident.job_id,
        het_group=ident.het_group, node=ident.node, local_id=ident.localid, gpu=ident.gpu,
        state=RankState.IDLE,  # ready at once (no start-up grace)
    )
    hb = Heartbeater(Registry(client, ident.job_id, cfg.redis), reg)
    hb.start()
    done = run_dir / PROBE_DIR / "done.json"
    try:
        while not done.exists():
            time.sleep(0.2)
    finally:
        hb.stop(deregister=True)
    return 0
