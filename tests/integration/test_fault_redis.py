"""Fault-matrix row 5 end to end: the run's redis-server is SIGKILLed twice in the middle of a real job (4 worker
processes, DeepSpeed on CPU, GRPO); the coordinator's watchdog restarts it from its append-only file, every client
rides the outage out, and the run completes with nothing lost: every step once, every sample of every step, a
``control`` event ``redis_restarted`` per crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynaresize.control.server import connect
from test_job import SEED  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

B, G, STEPS = 4, 4, 8
ROOT = Path(__file__).resolve().parents[2]


def redis_pid(run_dir: Path) -> int:
    """The run's redis-server, found through its endpoint file (redis.json + password): INFO says its pid."""
    c = connect(run_dir / "redis" / "redis.json", role="test")
    try:
        return int(c.info("server")["process_id"])
    finally:
        c.close()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def restarted_events(run_dir: Path) -> list[dict]:
    evs = [json.loads(l) for l in lines(run_dir / "events.jsonl") if '"redis_restarted"' in l]
    return [e for e in evs if e["type"] == "control" and e["what"] == "redis_restarted"]


def test_redis_sigkilled_mid_run_the_run_completes_and_loses_nothing(tmp_path, model_cache):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "dynaresize.cli", "run", "configs/quickstart.yaml", "run.progress=false",
            "cluster.gpus=4", "cluster.initial_train=2", f"rollout.prompts_per_step={B}", f"rollout.group_size={G}",
            "rollout.max_tokens=16", "model.tiny.warmstart_steps=20", "run.checkpoint_every=0", "redis.heartbeat_s=1.0",
            "redis.dead_after_heartbeats=5",  # 5 s: a rank starved of CPU on a loaded 2-core machine is not dead
            f"run.steps={STEPS}", f"run.seed={SEED}", f"run.output_dir={tmp_path / 'runs'}",
            f"model.cache_dir={model_cache}", "--quiet"]
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 600
        rd = None
        while time.monotonic() < deadline and p.poll() is None:
            runs = tmp_path / "runs"
            rd = rd or next((d for d in runs.iterdir() if d.is_dir()), None) if runs.exists() else None
            done = len(lines(rd / "batches.jsonl")) if rd else 0
            # crash 1 after step 2; crash 2 after step 4 once the first restart is logged (skipped if the run is faster)
            if (not killed and done >= 2) or (len(killed) == 1 and 4 <= done < STEPS - 1 and restarted_events(rd)):
                pid = redis_pid(rd)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            if len(killed) == 2:
                break
            time.sleep(0.05)
        out, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert killed, f"the run ended before Redis could be killed:\n{out[-3000:]}"
    assert p.returncode == 0, f"the run failed after Redis was killed (pids {killed}):\n{out[-4000:]}"
    assert len(set(killed)) == len(killed), "each kill hit a new redis-server process"

    got = [json.loads(l) for l in lines(rd / "batches.jsonl")]
    assert [b["step"] for b in got] == list(range(STEPS)), "every step exactly once, in order"
    for b in got:
        assert sorted(b["keys"]) == sorted(f"{b['step']}.{q}.{i}" for q in range(B) for i in range(G)), b["step"]
        assert min(b["versions"]) >= b["step"] - 1
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    restarts = restarted_events(rd)
    assert len(restarts) == len(killed), restarts
    for pid, ev in zip(killed, restarts):
        assert f"pid {pid}" in ev["reason"] and "SIGKILL" in ev["reason"], ev
