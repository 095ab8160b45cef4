"""Fault-matrix row 10 (load), small: tools/bench_control_load.py with 64 ranks in 2 processes for 4 s (a command every 0.5 s).

The full figure is the benchmark command itself (``--ranks 1024 --procs 4 --duration 180``, see docs/workers.md);
this test asserts behaviour only, never timings: no healthy rank is reported dead, every command is acked by every
target exactly once (no ack lost, none duplicated, every handler ran once per command sent to its rank), and the
rank told to crash mid-run is reported dead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def test_load_smoke_no_false_death_no_lost_or_duplicate_ack(redis_binary):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_control_load.py"), "--ranks", "64", "--procs", "2",
           "--duration", "4", "--interval", "0.5", "--subset-every", "2", "--crash", "1", "--dead-after", "3", "--json"]
    env = dict(os.environ, PATH=f"{Path(redis_binary).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON from {' '.join(cmd)} (rc {out.returncode}): {out.stderr[-2000:]}"
    res = json.loads(lines[-1])
    assert out.returncode == 0, f"integrity check failed: {json.dumps(res)[:3000]}\n{out.stderr[-2000:]}"

    assert res["commands"] >= 4 and res["subset_commands"] >= 1
    assert res["process_failures"] == [] and res["watcher_errors"] == []
    # no healthy rank reported dead, and the watcher did sample liveness
    assert res["metrics"]["hb_age_s"]["n"] > 0 and res["false_deaths"] == 0 and res["false_death_ranks"] == []
    # every target acked every command exactly once, checked against the ack streams themselves
    assert res["lost_acks"] == 0 and res["error_acks"] == 0
    assert res["duplicate_acks"] == 0 and res["ack_entries"] == res["acks_expected"] > 64
    assert res["duplicate_applies"] == 0 and res["apply_mismatches"] == 0
    # the crashed rank was seen dead (liveness is not blind under load)
    assert len(res["crashed"]) == 1 and res["crash_undetected"] == 0
    assert list(res["crash_detect_s"]) == [str(res["crashed"][0])]
    side = res["rank_side"]
    assert side["via_wake"] > 0, "no command was read on a wake-up"
    assert side["beats"] > 0 and side["beat_errors"] == 0 and side["beats_lost"] == 0 and side["beats_superseded"] == 0
    assert res["integrity_ok"] is True
