"""Analysis metrics on tiny hand-computed logs, damaged logs, and run comparison."""

from __future__ import annotations

import json

import pytest

from dynaresize.analysis.atoms import build_atoms
from dynaresize.analysis.compare import compare
from dynaresize.analysis.metrics import analyze
from dynaresize.analysis.reader import load_run
from dynaresize.events import EventLog

pytestmark = pytest.mark.unit


def tiny_run(path, switch: bool = True, run_end: bool = True):
    """4 ranks. Steps 0-1 on a 2:2 split; then a switch moves rank 1 to rollout; step 2 on 1:3.

    step 0: rollout 2-3 [0,6], train 0-1 [0,4]    step 1: rollout 2-3 [6,10], train 0-1 [6,10]
    switch: drain rank 1 [10,11], comm_select 0-3 [11,11.5] (critical), optimizer_stage_in rank 0 [11.5,13]
            (background, overlaps the next training stage), topology 1:3 at 11.5
    step 2: rollout 1-3 [11.5,15.5], train 0 [11.5,15.5]
    """
    log = EventLog(path / "events.jsonl", t0=0.0)
    e = log.emit_at
    e(0.0, "run_start", run_id="tiny", source="sim", world_size=4, wall_time=0.0)
    e(0.0, "topology", step=0, train_ranks="0-1", rollout_ranks="2-3")
    e(0.0, "step_start", step=0)
    e(4.0, "stage", step=0, stage="train", ranks="0-1", start=0.0, end=4.0, tokens=100)
    e(6.0, "stage", step=0, stage="rollout", ranks="2-3", start=0.0, end=6.0, tokens=100)
    e(6.0, "step_end", step=0, samples=8, tokens_generated=100)
    e(6.0, "step_start", step=1)
    e(10.0, "stage", step=1, stage="rollout", ranks="2-3", start=6.0, end=10.0, tokens=120)
    e(10.0, "stage", step=1, stage="train", ranks="0-1", start=6.0, end=10.0, tokens=100)
    e(10.0, "step_end", step=1, samples=8, tokens_generated=120)
    if switch:
        e(10.0, "switch_start", switch_id="s1", step=1, from_train=2, from_rollout=2, to_train=1, to_rollout=3)
        e(11.0, "switch_op", switch_id="s1", op="drain", ranks="1", start=10.0, end=11.0, critical=True)
        e(11.5, "switch_op", switch_id="s1", op="comm_select", ranks="0-3", start=11.0, end=11.5, critical=True)
        e(11.5, "switch_end", switch_id="s1", critical_path_s=1.5, hidden_s=1.5)
        e(11.5, "topology", step=2, train_ranks="0", rollout_ranks="1-3")
        e(11.5, "step_start", step=2)
        e(13.0, "switch_op", switch_id="s1", op="optimizer_stage_in", ranks="0", start=11.5, end=13.0, critical=False)
        e(15.5, "stage", step=2, stage="rollout", ranks="1-3", start=11.5, end=15.5, tokens=150)
        e(15.5, "stage", step=2, stage="train", ranks="0", start=11.5, end=15.5, tokens=120)
        e(15.5, "step_end", step=2, samples=8, tokens_generated=150)
    if run_end:
        e(16.0, "run_end", status="completed", steps=3 if switch else 2)
    log.close()
    return path


def test_two_static_steps_exact_idle_and_bubble(tmp_path):
    s = analyze(load_run(tiny_run(tmp_path, switch=False)))
    t = s.totals
    # span [0,10] x 4 GPUs = 40 GPU-s; busy: trainers 2 x 8, rollout 2 x 10 -> idle 4
    assert t["span_s"] == 10.0 and t["total_gpu_s"] == 40.0
    assert t["busy_gpu_s"] == 36.0 and t["idle_gpu_s"] == 4.0 and t["bubble_fraction"] == 0.1
    assert s.roles["train"] == {"gpu_s": 20.0, "busy_gpu_s": 16.0, "idle_gpu_s": 4.0, "utilisation": 0.8}
    assert s.roles["rollout"]["utilisation"] == 1.0
    assert t["samples_per_s"] == 1.6 and t["tokens_per_s"] == 22.0
    r0, r1 = s.steps
    assert (r0.rollout_s, r0.train_s, r0.idle_train_gpu_s, r0.idle_rollout_gpu_s) == (6.0, 4.0, 4.0, 0.0)
    assert r0.bubble == pytest.approx(4 / 24, abs=1e-6) and r1.bubble == 0.0
    assert (r0.train_ranks, r0.rollout_ranks) == (2, 2)


def test_switch_roles_overlap_and_op_costs(tmp_path):
    s = analyze(load_run(tiny_run(tmp_path)))
    t = s.totals
    # span [0,15.5] x 4 = 62; busy per rank 12.5 (stage-in overlaps train: counted once), 13.5, 14.5, 14.5
    assert t["total_gpu_s"] == 62.0 and t["busy_gpu_s"] == 55.0 and t["idle_gpu_s"] == 7.0
    assert t["bubble_fraction"] == pytest.approx(7 / 62, abs=1e-6)
    # rank 1 is a trainer until 11.5, then rollout
    assert s.roles["train"]["gpu_s"] == 27.0 and s.roles["train"]["busy_gpu_s"] == 22.0
    assert s.roles["rollout"]["gpu_s"] == 35.0 and s.roles["rollout"]["busy_gpu_s"] == 33.0
    step2 = s.steps[2]
    assert (step2.train_ranks, step2.rollout_ranks) == (1, 3)
    assert (step2.idle_train_gpu_s, step2.idle_rollout_gpu_s) == (1.0, 2.0)
    assert s.steps[1].switches == "s1"
    assert t["switches"] == 1 and t["switch_critical_s"] == 1.5 and t["switch_hidden_s"] == 1.5
    assert t["switch_hidden_fraction"] == 0.5
    ops = {o.op: o for o in s.ops}
    assert ops["drain"].gpu_s == 1.0 and ops["comm_select"].gpu_s == 2.0
    assert ops["optimizer_stage_in"].hidden_s == 1.5 and ops["optimizer_stage_in"].critical_s == 0.0
    sw = s.switches[0]
    assert (sw.from_split, sw.to_split, sw.wall_s, sw.n_ops) == ("2:2", "1:3", 3.0, 3)


def test_switch_costs_fall_back_to_ops_without_switch_end(tmp_path):
    tiny_run(tmp_path)
    lines = [ln for ln in (tmp_path / "events.jsonl").read_text().splitlines() if '"switch_end"' not in ln]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    s = analyze(load_run(tmp_path))
    assert s.switches[0].critical_s == 1.5 and s.switches[0].hidden_s == 1.5 and not s.switches[0].complete


def test_atoms_partition_without_expanding():
    atoms, member = build_atoms(["0-1", "2-3", "0", "1-3", "0-3"], 6)
    assert [a.blocks for a in atoms] == [((0, 0),), ((1, 1),), ((2, 3),), ((4, 5),)]
    assert [a.size for a in atoms] == [1, 1, 2, 2]
    assert member.shape == (4, 5) and member[2].tolist() == [False, True, False, True, True]
    assert not member[3].any()  # ranks 4-5 are in no set
    atoms, _ = build_atoms(["0-1,6-7", "2-5"], 8)  # non-contiguous identical blocks merge
    assert [a.blocks for a in atoms] == [((0, 1), (6, 7)), ((2, 5),)]


def test_damaged_log_is_counted_never_fatal_and_numbers_unchanged(tmp_path):
    clean = analyze(load_run(tiny_run(tmp_path / "clean")))
    d = tiny_run(tmp_path / "damaged", run_end=False)
    lines = (d / "events.jsonl").read_text().splitlines()
    obj = json.loads(lines[3])
    obj["future_key"] = {"nested": [1, 2]}  # unknown extra keys are fine
    lines[3] = json.dumps(obj)
    lines.insert(5, "\x00\x00garbage")
    lines.insert(7, '{"v": 1, "type": "stage", "t": 3, "step": 0, "stage": "train", "ranks": "3-1", "start": 0, "end": 1}')
    lines.insert(8, '{"v": 1, "type": "stage", "t": 3, "step": 0, "stage": "train", "ranks": "0", "start": 5, "end": 1}')
    lines.insert(9, '{"v": 1, "type": "teleport", "t": 3}')
    text = "\n".join(lines) + '\n{"v": 1, "type": "stage", "t": 16, "step": 3, "sta'  # killed mid-write
    (d / "events.jsonl").write_text(text)
    s = analyze(load_run(d))
    assert s.read["bad_lines"] == 3 and s.read["skipped_events"] == 2
    assert any("3-1" in r for r in s.read["skipped_reasons"])
    assert s.run["status"] is None and any("no run_end" in n for n in s.notes)
    for k in ("busy_gpu_s", "idle_gpu_s", "bubble_fraction", "samples_per_s", "switch_critical_s"):
        assert s.totals[k] == clean.totals[k], k


def test_truncated_mid_step_and_empty_logs(tmp_path):
    d = tiny_run(tmp_path / "cut")
    lines = (d / "events.jsonl").read_text().splitlines()
    cut = [i for i, ln in enumerate(lines) if '"step_start"' in ln and '"step":2' in ln][0]
    (d / "events.jsonl").write_text("\n".join(lines[: cut + 2]) + "\n" + lines[cut + 2][:20])
    s = analyze(load_run(d))
    assert s.totals["steps_completed"] == 2 and s.steps[-1].end is None and s.read["bad_lines"] == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "events.jsonl").write_text("")
    e = analyze(load_run(tmp_path / "empty"))
    assert e.totals["span_s"] == 0.0 and e.totals["bubble_fraction"] == 0.0 and e.steps == []
    with pytest.raises(FileNotFoundError, match="no event log"):
        load_run(tmp_path / "nowhere")


def test_roles_inferred_without_topology(tmp_path):
    tiny_run(tmp_path, switch=False)
    p = tmp_path / "events.jsonl"
    p.write_text("\n".join(ln for ln in p.read_text().splitlines() if '"topology"' not in ln) + "\n")
    s = analyze(load_run(tmp_path))
    assert s.run["roles_inferred"] and s.roles["train"]["gpu_s"] == 20.0 and s.roles["rollout"]["gpu_s"] == 20.0


def test_compare_ratios_against_baseline(tmp_path):
    a = analyze(load_run(tiny_run(tmp_path / "a", switch=False)))
    b = analyze(load_run(tiny_run(tmp_path / "b")))
    c = compare([a, b])
    rows = {r["metric"]: r for r in c["rows"]}
    assert rows["samples_per_s"]["values"] == [1.6, pytest.approx(24 / 15.5, abs=1e-6)]
    assert rows["samples_per_s"]["ratios"] == [1.0, pytest.approx((24 / 15.5) / 1.6, abs=1e-4)]
    assert rows["switches"]["ratios"] == [None, None]  # zero baseline: undefined, not infinite
    c2 = compare([a, b], baseline=1)
    assert {r["metric"]: r for r in c2["rows"]}["span_s"]["ratios"] == [pytest.approx(10 / 15.5, abs=1e-4), 1.0]


def test_a_core_runs_steps_without_step_start_have_a_step_time_a_reward_and_validation(tmp_path):
    """The scheduler core logs no ``step_start`` (its steps overlap): a step's time is its window, optimizer step to
    optimizer step (before: ``-`` for every step on the default schedule); the reward is the step's mean reward; the
    validation passes' figures are in the totals (before: not shown)."""
    from dynaresize.analysis.report import render

    log = EventLog(tmp_path / "events.jsonl", t0=0.0)
    e = log.emit_at
    e(0.0, "run_start", run_id="core", source="runtime", world_size=4, wall_time=0.0)
    e(0.0, "topology", step=0, train_ranks="0-1", rollout_ranks="2-3")
    e(3.0, "stage", step=0, stage="rollout", ranks="2-3", start=0.5, end=3.0, tokens=100)
    e(5.0, "stage", step=0, stage="train", ranks="0-1", start=3.0, end=5.0, tokens=100)
    e(5.0, "step_end", step=0, samples=8, tokens_generated=100, reward_mean=0.25)
    e(6.0, "stage", step=1, stage="rollout", ranks="2-3", start=3.0, end=6.0, tokens=120)
    e(8.5, "stage", step=1, stage="train", ranks="0-1", start=5.0, end=8.5, tokens=120)
    e(8.5, "step_end", step=1, samples=8, tokens_generated=120, reward_mean=0.5)
    for v, (r, p) in {0: (0.078, 0.25), 2: (0.152, 0.44)}.items():  # validation passes (Validation.record)
        e(8.6, "metric", name="val_reward_mean", value=r, step=v, k=4)
        e(8.6, "metric", name="val_pass_at_k", value=p, step=v, k=4)
    e(9.0, "run_end", status="completed", steps=2)
    log.close()
    s = analyze(load_run(tmp_path))
    assert [(r.duration_s, r.reward) for r in s.steps] == [(4.5, 0.25), (3.5, 0.5)]  # from the span's start, then 5 -> 8.5
    assert s.totals["step_time_mean_s"] == 4.0
    text = render(s)
    header = next(l for l in text.splitlines() if l.startswith("step  step_s"))
    assert " reward " in header and "step time mean / median s" in text and "4.00 / 4.00" in text
    assert s.totals["validation"] == {0: {"reward_mean": 0.078, "pass_at_k": 0.25, "k": 4},
                                      2: {"reward_mean": 0.152, "pass_at_k": 0.44, "k": 4}}
    assert "validation mean reward / pass@4 (version 0 -> 2, 2 passes)" in text and "0.078 -> 0.152 / 0.250 -> 0.440" in text
