"""What `dynaresize analyze` writes: JSON/CSV tables, a timeline PNG, a Perfetto trace, and a comparison."""

from __future__ import annotations

import csv
import json

import pytest

from dynaresize.analysis.reader import load_run
from dynaresize.analysis.synth import SynthRun, write_synthetic_run
from dynaresize.analysis.timeline import _lanes
from dynaresize.analysis.trace import BG_OFFSET, write_trace
from dynaresize.analysis.views import build_views
from dynaresize.cli import main as dynaresize

pytestmark = pytest.mark.unit


def _slices(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == cat]


def test_trace_one_track_per_rank_with_nested_switch_ops(tmp_path):
    run = write_synthetic_run(tmp_path / "r", SynthRun(world=8, steps=6, switches=((2, 4),)))
    info = write_trace(build_views(load_run(run)), tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name" and e["pid"] == 1}
    assert {t: n for t, n in names.items() if t < BG_OFFSET} == {r: f"rank {r}" for r in range(8)}
    assert not info["grouped"]
    stages = _slices(trace, "stage")
    # per step: rollout on 2 (then 4) ranks, train on 6 (then 4), weight_sync on all 8 -> 16 slices per step
    assert len(stages) == 6 * 16
    assert len(_slices(trace, "step")) == 6
    parents = _slices(trace, "switch")
    ops = _slices(trace, "switch_op")
    assert ops and parents
    for o in ops:  # every op lies inside a switch slice on its own track
        assert any(p["tid"] == o["tid"] and p["ts"] <= o["ts"] and o["ts"] + o["dur"] <= p["ts"] + p["dur"] + 1e-3
                   for p in parents), o
    bg = [o for o in ops if not o["args"]["critical"]]
    assert bg and all(o["tid"] >= BG_OFFSET for o in bg)  # background ops on their own tracks
    assert names[BG_OFFSET] == "rank 0 background"


def test_trace_groups_ranks_for_large_runs(tmp_path):
    run = write_synthetic_run(tmp_path / "r", SynthRun(world=512, train=256, steps=4, switches=((1, 300),)))
    v = build_views(load_run(run))
    info = write_trace(v, tmp_path / "trace.json", max_rank_tracks=64)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name" and e["pid"] == 1]
    assert info["grouped"] and len(v.atoms) == 3
    assert "ranks 0-255 (x256)" in names and "ranks 256-299 (x44)" in names and "ranks 300-511 (x212)" in names
    info = write_trace(v, tmp_path / "t2.json", max_rank_tracks=2)  # more groups than tracks allowed: fold
    assert info["tracks"] <= 2 + 2  # two main tracks (+ their background tracks)
    names = [e["args"]["name"] for e in json.loads((tmp_path / "t2.json").read_text())["traceEvents"]
             if e.get("name") == "thread_name" and e["pid"] == 1 and e["tid"] < BG_OFFSET]
    assert names == ["ranks 0-299 (x300, 2 groups; shows 0-255)", "ranks 300-511 (x212)"]


def test_timeline_lanes_collapse_and_fold(tmp_path):
    run = write_synthetic_run(tmp_path / "r", SynthRun(world=512, train=256, steps=3, switches=((0, 300), (1, 200))))
    v = build_views(load_run(run))
    lanes = _lanes(v, max_lanes=40)
    assert [lab for _, lab in lanes] == ["0-199 (x200)", "200-255 (x56)", "256-299 (x44)", "300-511 (x212)"]
    folded = _lanes(v, max_lanes=3)
    assert len(folded) == 3 and "2 groups" in folded[0][1]


def test_cli_writes_tables_png_trace_and_comparison(tmp_path, capsys):
    static = write_synthetic_run(tmp_path / "static", SynthRun(steps=8, switches=()))
    dyn = write_synthetic_run(tmp_path / "dynamic", SynthRun(steps=8, switches=((2, 4),)))
    assert dynaresize(["analyze", str(static), str(dyn), "--baseline", "static"]) == 0
    out = capsys.readouterr().out
    assert "per step" in out and "bubble fraction" in out and "dynamic / static" in out
    a = dyn / "analysis"
    png = (a / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    summary = json.loads((a / "summary.json").read_text())
    assert summary["totals"]["switches"] == 1 and len(summary["steps"]) == 8
    rows = list(csv.DictReader(open(a / "steps.csv")))
    assert len(rows) == 8 and rows[3]["train_ranks"] == "4"
    assert list(csv.DictReader(open(a / "switches.csv")))[0]["to_split"] == "4:4"
    json.loads((a / "trace.json").read_text())
    cmp_ = json.loads((static / "analysis" / "compare.json").read_text())
    sps = {r["metric"]: r for r in cmp_["rows"]}["samples_per_s"]
    assert sps["ratios"][0] == 1.0 and sps["ratios"][1] == pytest.approx(sps["values"][1] / sps["values"][0], rel=1e-3)
    assert sps["ratios"][1] > 1.2  # the rebalanced run is faster


def test_cli_damaged_and_missing_logs(tmp_path, capsys):
    run = write_synthetic_run(tmp_path / "r", SynthRun(steps=5, switches=((1, 4),)))
    with open(run / "events.jsonl", "rb+") as f:
        f.seek(-40, 2)
        f.truncate()  # killed in the middle of the last line (run_end lost)
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\n\xff\xfe not json\n")
    assert dynaresize(["analyze", str(run), "--no-plot", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "2 bad lines skipped" in out and "NO run_end" in out
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["read"]["bad_lines"] == 2
    assert not (tmp_path / "o" / "timeline.png").exists()
    assert dynaresize(["analyze", str(tmp_path / "nope")]) == 2
    assert "no event log" in capsys.readouterr().err
    assert dynaresize(["calibrate", str(run), "-o", str(tmp_path / "c.yaml")]) == 0
    assert "override_s" in (tmp_path / "c.yaml").read_text()
