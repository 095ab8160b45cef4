"""The event-log schema: writers validate, readers stream and survive damage, rank sets round-trip."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
from hypothesis import given, strategies as st

from dynaresize.events import (
    EventError, EventLog, EventType, ReadStats, SCHEMA_VERSION, count_ranks, format_ranks, make_event, parse_ranks,
    read_events,
)

pytestmark = pytest.mark.unit


def test_writer_rejects_an_event_missing_a_required_key(tmp_path):
    with pytest.raises(EventError, match="step_end: key 'samples'"):
        make_event(EventType.STEP_END, 1.0, step=3)
    with pytest.raises(EventError, match="'op' = 'teleport'"):
        make_event("switch_op", 0.0, switch_id="s", op="teleport", ranks="0", start=0, end=1, critical=True)


def test_round_trip_and_damage_is_counted_not_fatal(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", t0=100.0)
    log.emit_at(0.0, EventType.RUN_START, run_id="r", source="sim", world_size=8, wall_time=100.0)
    log.emit_at(1.5, EventType.STAGE, step=0, stage="rollout", ranks="2-7", start=0.5, end=1.5, tokens=10)
    log.close()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"v": 1, "type": "stage", "t": 2.0, "step": 1}\n')  # missing keys
        f.write('{"v": 99, "type": "stage", "t": 2.0}\n')  # from the future
        f.write("garbage\n")
        f.write('{"v": 1, "type": "step_end", "t": 3.0, "step": 1, "sam')  # killed mid-write
    stats = ReadStats()
    evs = list(read_events(tmp_path, stats))
    assert [e.type for e in evs] == [EventType.RUN_START, EventType.STAGE]
    assert evs[1]["ranks"] == "2-7" and evs[1]["tokens"] == 10 and evs[1].t == 1.5
    assert stats.bad == 4 and stats.events == 2 and stats.lines == 6
    assert any("newer than this reader" in r for r in stats.reasons)


def test_reopened_log_keeps_the_time_axis_of_the_run(tmp_path):
    log = EventLog(tmp_path / "e.jsonl", t0=1000.0)
    log.emit_at(0.0, "run_start", run_id="r", source="runtime", world_size=2, wall_time=1000.0)
    log.close()
    assert EventLog(tmp_path / "e.jsonl").t0 == 1000.0


def _writer(path, n, tag):
    log = EventLog(path, t0=0.0)
    for i in range(n):
        log.emit_at(float(i), "metric", name=tag * 200, value=float(i))
    log.close()


def test_concurrent_writers_never_interleave_inside_a_line(tmp_path):
    path = tmp_path / "events.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, 300, c)) for c in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    lines = path.read_text().splitlines()
    assert len(lines) == 600
    assert all(json.loads(l)["v"] == SCHEMA_VERSION for l in lines)


@given(st.sets(st.integers(0, 5000), max_size=200))
def test_rank_sets_round_trip(ranks):
    text = format_ranks(ranks)
    assert parse_ranks(text) == sorted(ranks)
    assert count_ranks(text) == len(ranks)


@pytest.mark.parametrize("bad", ["1-", "a", "3-1", "1,,2"])
def test_malformed_rank_sets_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_ranks(bad)
