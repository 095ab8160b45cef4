"""``dynaresize demo`` end to end: real redis-server, simulated ranks, a dead rank noticed, a valid event log."""

from __future__ import annotations

import json

import pytest

from dynaresize.cli import main as cli_main
from dynaresize.events import ReadStats, read_events

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


def test_demo_runs_and_logs(tmp_path, redis_binary, capsys):
    rc = cli_main(["demo", "configs/quickstart.yaml", f"run.output_dir={tmp_path}", "redis.heartbeat_s=0.1",
                   f"redis.server_binary={redis_binary}", "--ranks", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "missing ranks" in out and "seen dead after" in out
    (run_dir,) = list(tmp_path.iterdir())
    assert (run_dir / "config.yaml").exists()
    endpoint = json.loads((run_dir / "redis" / "redis.json").read_text())
    assert endpoint["port"] > 0
    stats = ReadStats()
    events = list(read_events(run_dir, stats))
    assert stats.bad == 0
    types = [e.type.value for e in events]
    assert types[0] == "run_start" and types[-1] == "run_end" and events[-1]["status"] == "completed"
    states = [(e["rank"], e["state"]) for e in events if e.type.value == "rank"]
    dead = [r for r, s in states if s == "dead"]
    assert len(dead) == 1 and (dead[0], "registered") in states and (dead[0], "left") not in states
    commands = [e for e in events if e.type.value == "control" and e["what"].startswith("command:")]
    assert any(e["missing"] == str(dead[0]) for e in commands), "the broadcast after the kill reports the dead rank"
