"""``dynaresize analyze RUN --whatif`` (dynaresize/analysis/whatif.py) on a simulated run, on a real CPU run's
directory (tests/fixtures/real_cpu_trace_run: ``dynaresize run configs/quickstart.yaml run.steps=30``, 4 CPU ranks,
one switch 3:1 -> 2:2, with per-sample lengths in batches.jsonl) and on an emulated run's directory (a hand-written
``cluster.device: emulated`` config next to that run's logs: the mapping, not the emulation, is under test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dynaresize.analysis.whatif import CHAIN, emulated_sim_config, whatif
from dynaresize.cli import main as dynaresize
from dynaresize.config.loader import ConfigError, load_config, write_resolved
from dynaresize.sim.compare import run_static, setup
from dynaresize.sim.workload import make_batch

REPO = Path(__file__).parents[2]
TRACE_RUN = REPO / "tests" / "fixtures" / "real_cpu_trace_run"
OLD_RUN = REPO / "tests" / "fixtures" / "real_cpu_run"  # no batches.jsonl
ROW_NAMES = {"measured (the run)", "own schedule (replay)", "barrier + resizing", "oracle (barrier)", "bound"} | {
    label for _, _, label in CHAIN}


def _check_rows(w: dict) -> dict:
    rows = {r["name"]: r for r in w["rows"]}
    assert ROW_NAMES <= set(rows)
    times = [r["time_s"] for r in w["rows"] if r["name"] != "measured (the run)"]
    assert w["bound_s"] == min(times) and w["bound_s"] > 0  # no schedule beats the bound
    assert set(w["mechanisms"]) == {k for k, _, _ in CHAIN}
    return rows


def test_whatif_of_a_simulated_run_replays_it_exactly(tmp_path, capsys):
    out = tmp_path / "sim"
    assert dynaresize(["simulate", str(REPO / "configs/sim/paper_8gpu.yaml"), "sim.steps=30", "--out", str(out)]) == 0
    w = whatif(out)
    assert w["kind"] == "simulated" and w["time_scale"] == 1.0 and w["steps"] == 30
    rows = _check_rows(w)
    # the same config and seed: its own schedule replayed is the run, to float rounding of the log
    assert w["replay_vs_measured"] == pytest.approx(1.0, abs=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert w["measured_s"] == pytest.approx(summary["total_s"], rel=1e-6)
    assert rows["barrier + resizing"]["time_s"] == pytest.approx(summary["total_s"], rel=1e-6)  # the run was that
    m = w["mechanisms"]  # each mechanism's "adds" chains the sample-level rows, in order
    prev = next(r for r in w["rows"] if r["model"] == "samples")["time_s"]
    for key, _, label in CHAIN:
        assert m[key]["time_s"] == rows[label]["time_s"]
        assert m[key]["adds"] == pytest.approx(prev / m[key]["time_s"] - 1)
        prev = m[key]["time_s"]
    capsys.readouterr()
    assert dynaresize(["analyze", str(out), "--whatif"]) == 0
    text = capsys.readouterr().out
    assert "own schedule (replay)" in text and "+ gradient helpers" in text and "span_s of dynaresize analyze" in text
    assert json.loads(text.strip().splitlines()[-1])["replay_s"] == pytest.approx(w["replay_s"])
    assert (out / "analysis" / "whatif.json").is_file()


def test_whatif_of_a_real_cpu_run_uses_its_fit_and_its_trace(capsys, tmp_path):
    w = whatif(TRACE_RUN)
    assert w["kind"] == "cpu" and w["steps"] == 30 and w["own_schedule"] == {"3": 2}
    _check_rows(w)
    assert any("the trace of" in n for n in w["notes"]) and any("calibrate's fit" in n for n in w["notes"])
    assert any("GPU-like decode physics" in x and "assumed" in x for x in w["left_out"])
    # the calibrated replay of its own schedule comes close to the measured loop (measured: 0.989)
    assert w["replay_vs_measured"] == pytest.approx(1.0, abs=0.10)
    samples = [r for r in w["rows"] if r["model"] == "samples"]
    assert len(samples) == 1 + len(CHAIN) and all(r["vs_measured"] == pytest.approx(1.0, abs=0.25) for r in samples)
    # a log without per-sample lengths still replays, on the per-step means, and says so
    old = whatif(OLD_RUN)
    assert old["kind"] == "cpu" and any("no trace" in n and "length shape assumed" in n for n in old["notes"])
    assert dynaresize(["analyze", str(TRACE_RUN), "--whatif", "--json", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["kind"] == "cpu"


def _emulated_run(tmp_path: Path, *more: str) -> Path:
    """A run directory as an emulated run leaves it: its config (cluster.device: emulated) and its logs."""
    rd = tmp_path / "emu"
    rd.mkdir(parents=True)
    cfg = load_config(TRACE_RUN / "config.yaml", ["cluster.device=emulated", "emulation.time_scale=0.01",
                                                  "emulation.tokens_per_token=150", "run.name=emu", *more])
    write_resolved(cfg, rd)
    if not any(m.startswith("pipeline.schedule=") for m in more):  # the trace run's own: the retired lockstep loop,
        own = yaml.safe_load((rd / "config.yaml").read_text())  # as a run directory of its time says it
        own["pipeline"]["schedule"] = "lockstep"
        (rd / "config.yaml").write_text(yaml.safe_dump(own, sort_keys=False))
    for f in ("events.jsonl", "batches.jsonl"):
        shutil.copy(TRACE_RUN / f, rd / f)
    return rd


def test_emulated_run_maps_to_its_profile_its_trace_and_its_time_scale(tmp_path):
    rd = _emulated_run(tmp_path)
    cfg, scale = emulated_sim_config(rd)
    own = yaml.safe_load((rd / "config.yaml").read_text())
    assert scale == 0.01 and cfg.sim.steps == 30
    assert cfg.sim.workload.trace == str(rd / "batches.jsonl") and cfg.sim.workload.trace_token_scale == 150
    # the run's own GPU profile, untouched, but for how the runtime admits work: one command's batch at a time
    assert cfg.sim.rollout.model_dump() == {**own["sim"]["rollout"], "max_seqs_per_gpu": own["rollout"]["pull_batch"]}
    assert cfg.sim.pipeline.claim_groups == own["rollout"]["pull_batch"] // own["rollout"]["group_size"]
    assert cfg.sim.pipeline.stream_chunks == own["rollout"]["prompts_per_step"] // own["pipeline"]["stream_min_groups"]
    assert cfg.sim.train.model_dump() == own["sim"]["train"]
    assert cfg.switching.costs.model_dump() == own["switching"]["costs"]
    assert cfg.sim.schedule == "barrier_lockstep" and cfg.sim.step_gap_s == 0.0  # the retired runtime loop, no modelled gap
    first = json.loads((rd / "batches.jsonl").read_text().splitlines()[0])
    b = make_batch(cfg.sim.workload, 0, 0, 30)
    assert b.tokens_generated == sum(max(1, round(150 * n)) for n in first["response_tokens"])
    w = whatif(rd)
    assert w["kind"] == "emulated" and w["time_scale"] == 0.01
    s = setup(cfg)  # every row is the simulator's modelled seconds x time_scale
    forced = {int(k): v for k, v in w["own_schedule"].items()}
    assert w["replay_s"] == pytest.approx(run_static(s, s.initial, forced=forced).total_s * 0.01, rel=1e-9)
    _check_rows(w)
    assert not w["left_out"]
    # a static run (policy off): its resizing rows turn its policy settings on, so they say what resizing buys
    off = whatif(_emulated_run(tmp_path / "static", "policy.enabled=false"))
    assert any("turned on" in n for n in off["notes"]) and not any("turned on" in n for n in w["notes"])
    assert off["resizing_s"] == pytest.approx(w["resizing_s"], rel=1e-12)
    # a run with dynamic sampling logged its kept groups only: the what-if says what that leaves out
    ds = whatif(_emulated_run(tmp_path / "ds", "algorithm.dynamic_sampling.enabled=true"))
    assert any("dropped groups is not replayed" in x for x in ds["left_out"])


def test_emulated_mapping_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cluster.device is 'cpu', not an emulated run"):
        emulated_sim_config(TRACE_RUN)
    rd = _emulated_run(tmp_path)
    (rd / "batches.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"sim\.workload\.trace.*cannot read the trace"):
        emulated_sim_config(rd)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(TRACE_RUN / "events.jsonl", bare / "events.jsonl")
    assert dynaresize(["analyze", str(bare), "--whatif"]) == 2  # no config.yaml: one message, exit 2


def test_a_continuous_emulated_run_maps_to_continuous_batching_over_its_ranks_slots(tmp_path):
    """The streamed runtime admits a sequence as one leaves, over min(rollout.max_running, max_seqs_per_gpu) slots:
    the simulator's GPU gets as many slots and claims one group at a time; max_running=0 is one command at a time."""
    more = ["pipeline.schedule=continuous", "task.dataset.val_every=0", "sim.rollout.max_seqs_per_gpu=48",
            "rollout.max_running=40", "pipeline.groups_per_command=2"]
    cfg, _ = emulated_sim_config(_emulated_run(tmp_path / "a", *more))
    assert (cfg.sim.rollout.max_seqs_per_gpu, cfg.sim.pipeline.claim_groups) == (40, 1)
    cfg, _ = emulated_sim_config(_emulated_run(tmp_path / "b", *more[:-2], "rollout.max_running=0", more[-1]))
    g = cfg.rollout.group_size
    assert (cfg.sim.rollout.max_seqs_per_gpu, cfg.sim.pipeline.claim_groups) == (2 * g, 2)
    cfg, _ = emulated_sim_config(_emulated_run(tmp_path / "c", *more[:-2], "rollout.pull_batch=24"))  # null: pull_batch
    assert (cfg.sim.rollout.max_seqs_per_gpu, cfg.sim.pipeline.claim_groups) == (24, 1)


def _rewrite(src: Path, dst: Path, stage_fn, step_fn=None) -> Path:
    """A copy of a run directory whose event log went through ``stage_fn`` (stage event -> events) and ``step_fn``."""
    shutil.copytree(src, dst)
    out = []
    for line in (src / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("type") == "stage":
            out += stage_fn(e)
        elif e.get("type") == "step_end" and step_fn is not None:
            out.append(step_fn(e))
        else:
            out.append(e)
    (dst / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in out))
    return dst


def test_a_barrier_free_runs_stage_counts_each_rank_once_and_an_unfittable_span_falls_back_to_busy_seconds(tmp_path):
    """The barrier-free runtime logs one interval per command, several per rank and step (before: each counted as a
    rank, so tokens per rank came out several times too small), and its stage spans hold waits: a train span that
    does not grow with the tokens (the main job's own run: "the run's stage throughputs cannot be fitted ... nothing
    to replay") is fitted from the steps' busy seconds instead; with neither fittable, the message says why."""
    from dynaresize.analysis.fit import fit_costs
    from dynaresize.analysis.reader import load_run

    def commands(e):  # each interval as three commands of the same rank(s)
        d = (e["end"] - e["start"]) / 3
        return [{**e, "start": e["start"] + i * d, "end": e["start"] + (i + 1) * d,
                 **({"tokens": e["tokens"] // 3} if "tokens" in e else {})} for i in range(3)]

    split = _rewrite(TRACE_RUN, tmp_path / "split", commands)
    want, got = load_run(TRACE_RUN), load_run(split)
    assert {k: s.ranks for k, s in got.stage_spans.items()} == {k: s.ranks for k, s in want.stage_spans.items()}
    assert fit_costs(got)["rollout"]["tokens_per_s_per_gpu"] == pytest.approx(
        fit_costs(want)["rollout"]["tokens_per_s_per_gpu"], rel=0.05)

    def flat_train(e):  # train spans that shrink as tokens grow (waits, not work)
        if e["stage"] == "train":
            e = {**e, "end": e["start"] + 1.0 - e["tokens"] / 1e4}
        return [e]

    flat = _rewrite(TRACE_RUN, tmp_path / "flat", flat_train)
    assert fit_costs(load_run(flat))["train"]["tokens_per_s_per_gpu"] is None
    w = whatif(flat)
    _check_rows(w)
    assert any("train from its busy seconds per step (its wall spans: its time does not grow with its tokens per rank"
               in n for n in w["notes"]), w["notes"]

    both = _rewrite(TRACE_RUN, tmp_path / "both", flat_train, lambda e: {**e, "train_s": 1.0 - e["tokens_trained"] / 1e4})
    with pytest.raises(ConfigError, match=r"the run's train throughput cannot be fitted: its stage spans: its time does "
                                          r"not grow with its tokens per rank over \d+ steps .*its busy seconds \(step_end "
                                          r"train_s\): its time does not grow .* lets it be fitted"):
        whatif(both)
