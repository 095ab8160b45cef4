"""Control-plane latency (sim.command_latency_s): both simulators on a world small enough to count its commands by
hand, and its fit from an event log's gaps between spans (dynaresize.analysis.fit.fit_command_latency)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynaresize.analysis.calibrate import to_costs_section
from dynaresize.analysis.fit import fit_command_latency, fit_costs
from dynaresize.analysis.reader import load_run
from dynaresize.config.loader import load_config
from dynaresize.schedule import Mechanisms
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import run_samples, run_static, setup

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

# 2 GPUs at 1:1, staleness 0, 1 prompt x 1 response of 100 tokens, 2 steps: everything runs one after the other
SERIAL = ["cluster.gpus=2", "cluster.initial_train=1", "pipeline.staleness_bound=0", "sim.steps=2",
          "sim.workload.prompts_per_step=1", "sim.workload.responses_per_prompt=1", "sim.workload.response_tokens_start=100",
          "sim.workload.response_tokens_end=100", "sim.workload.response_sigma=0", "sim.workload.prompt_tokens_sigma=0",
          "sim.write_events=false"]


def serial(c: float):
    return setup(load_config(ROOT / "configs/sim/paper_8gpu.yaml", SERIAL + [f"sim.command_latency_s={c}"]))


@pytest.mark.parametrize("c", [0.05, 0.3])
def test_a_serial_world_is_slower_by_its_seven_commands(c):
    """R_0, T_0, R_1, T_1 one after the other: Assign (generate), Train, Step; SendWeights (weight fetch, then the
    sync), Assign, Train, Step: 7 commands on the critical path, in both models."""
    s0, s1 = serial(0.0), serial(c)
    barrier = Mechanisms(False, False, False)
    assert run_samples(s1, s1.initial, barrier).total_s == pytest.approx(run_samples(s0, s0.initial, barrier).total_s + 7 * c)
    assert run_static(s1, s1.initial).total_s == pytest.approx(run_static(s0, s0.initial).total_s + 7 * c)


@pytest.mark.parametrize("c", [0.05, 0.3])
def test_a_train_queue_of_two_hides_the_steps_command_behind_its_chunk(c):
    """``sim.pipeline.train_queue=2`` (the runtime's ``pipeline.train_queue``): each optimizer step is sent with the
    batch's last chunk and waits behind it on the trainers, so 5 of the serial world's 7 commands are left on the
    critical path; with no latency the queue changes nothing."""
    barrier = Mechanisms(False, False, False)
    q2 = ["sim.pipeline.train_queue=2"]

    def total(c: float, extra: list[str]) -> float:
        s = setup(load_config(ROOT / "configs/sim/paper_8gpu.yaml", SERIAL + [f"sim.command_latency_s={c}"] + extra))
        return run_samples(s, s.initial, barrier).total_s

    assert total(0.0, q2) == pytest.approx(total(0.0, []))
    assert total(c, q2) == pytest.approx(total(0.0, []) + 5 * c)


def test_latency_never_speeds_a_run_up_and_zero_is_the_old_model():
    base = ["sim.steps=12", "sim.write_events=false"]
    runs = {}
    for c in (0.0, 0.05, 0.5):
        s = setup(load_config(ROOT / "configs/sim/paper_8gpu.yaml", base + [f"sim.command_latency_s={c}"]))
        runs[c] = [run_samples(s, s.initial, SimMechanisms(True, True, True, True)).total_s, run_static(s, s.initial).total_s]
    assert runs[0.0] < runs[0.05] < runs[0.5]


def _line(t: float, **data) -> str:
    return json.dumps({"v": 1, "t": t, **data})


def test_the_fit_recovers_a_known_latency_from_a_synthetic_log(tmp_path):
    """A lock-step log: each stage starts ``c`` after the latest end of any span (the command it waited for),
    except three that also waited for something unlogged (a decision); the first has nothing before it: the median
    of the other 59 is ``c``."""
    c = 0.037
    lines = [_line(0.0, type="run_start", run_id="synthetic", source="runtime", world_size=2, wall_time=0.0)]
    t = 0.0
    for k in range(20):
        r0 = t + c + (1.0 if k in (4, 9, 15) else 0.0)  # the rollout command (three waited for a decision too)
        r1 = r0 + 0.5 + 0.01 * k
        lines.append(_line(r1, type="stage", step=k, stage="rollout", ranks="1", start=r0, end=r1, tokens=100, samples=4))
        t0 = r1 + c  # the train command, once the batch is complete
        t1 = t0 + 0.3
        lines.append(_line(t1, type="stage", step=k, stage="train", ranks="0", start=t0, end=t1, tokens=100))
        w0 = t1 + c  # the weight sync, once the optimizer stepped
        w1 = w0 + 0.02
        lines.append(_line(w1, type="stage", step=k, stage="weight_sync", ranks="1", start=w0, end=w1))
        lines.append(_line(w1, type="step_end", step=k, samples=4))
        t = w1
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    fit = fit_command_latency(load_run(tmp_path))
    assert fit["n"] == 59 and fit["command_latency_s"] == pytest.approx(c, abs=1e-9)
    assert fit["p25_s"] == pytest.approx(c, abs=1e-9)
    costs = to_costs_section(fit_costs(load_run(tmp_path)))
    assert costs["sim"]["command_latency_s"] == pytest.approx(c, abs=1e-6)


@pytest.mark.parametrize("c", [0.02, 0.25])
def test_the_fit_recovers_the_simulators_own_latency(tmp_path, c):
    """A sample-level run with every mechanism, logged: every span starts one command after a span's end."""
    cfg = load_config(ROOT / "configs/sim/paper_8gpu.yaml", ["sim.steps=10", f"sim.command_latency_s={c}"])
    s = setup(cfg)
    r = run_samples(s, s.initial, SimMechanisms(True, True, True, True), log=True)
    lines = [_line(0.0, type="run_start", run_id="sim", source="sim", world_size=8, wall_time=0.0)]
    (tmp_path / "events.jsonl").write_text("\n".join(lines + [e.to_json() for e in r.events]) + "\n")
    assert fit_command_latency(load_run(tmp_path))["command_latency_s"] == pytest.approx(c, rel=1e-6)


def test_calibrate_writes_the_latency_and_takes_it_out_of_the_lockstep_gap():
    fit = fit_costs(load_run(ROOT / "tests/fixtures/real_cpu_run"))
    lat, gap = fit["command_latency"]["command_latency_s"], fit["schedule"]["step_gap_s"]
    assert 0.001 < lat < 0.1  # a CPU run's control plane: milliseconds to tens of ms per command
    sim = to_costs_section(fit)["sim"]
    assert sim["command_latency_s"] == pytest.approx(lat, abs=1e-6)
    assert sim["step_gap_s"] == pytest.approx(max(0.0, gap - 2 * lat), abs=1e-6)


def test_the_fit_takes_a_command_from_its_trigger_to_its_last_rank_by_kind(tmp_path):
    """A runtime-like log of 2 trainers (ranks 0, 1) and a rollout rank (2), times by hand. A training command runs
    on both trainers and counts from its trigger (its ranks' previous end, or its batch's last rollout end before it)
    to its LAST trainer's start; a background span (rank 0's send) is no trigger; a rollout span that begins where its
    rank's previous one ended was queued (no sample), and so is the generate that starts with an install; a generate
    counts from its rank's previous end or a new version (an optimizer step's end). The simulator is charged the
    training chunks' median (0.07 s); the optimizer step, 0.05 s from its last trainer's start (median of 0.06 and
    0.04) after a latency of 0.03 s, is 0.05 + 0.03 - 0.07 = 0.01 s after the charged latency."""
    from dynaresize.analysis.whatif import fitted_fixed_costs

    def stage(step, stage, rank, start, end, **kw):
        return _line(end, type="stage", step=step, stage=stage, ranks=str(rank), start=start, end=end, **kw)

    lines = [_line(0.0, type="run_start", run_id="synthetic", source="runtime", world_size=3, wall_time=0.0),
             stage(0, "rollout", 2, 0.10, 1.00, tokens=10, samples=4),  # nothing before it: no sample
             stage(0, "rollout", 2, 1.00, 1.50, tokens=10, samples=4),  # queued behind the first
             stage(0, "train", 0, 1.53, 1.83, chunk=True), stage(0, "train", 1, 1.56, 1.86, chunk=True),  # 1.56 - 1.50
             stage(0, "weight_sync", 0, 1.80, 1.89, background=True),  # not a trigger: 1.93 - 1.86, not - 1.89
             stage(0, "train", 0, 1.93, 2.13, chunk=True), stage(0, "train", 1, 1.90, 2.10, chunk=True),
             stage(0, "train", 0, 2.16, 2.22, optimizer_step=True), stage(0, "train", 1, 2.15, 2.22, optimizer_step=True),
             stage(0, "weight_sync", 2, 2.30, 2.31, install=True),  # the start of a generate: no command
             stage(1, "rollout", 2, 2.31, 2.80, tokens=10, samples=4),  # right after the install: queued
             stage(1, "train", 0, 2.84, 3.04, chunk=True), stage(1, "train", 1, 2.88, 3.08, chunk=True),  # 2.88 - 2.80
             stage(1, "rollout", 2, 2.90, 3.20, tokens=10, samples=4),  # 2.90 - 2.80 (its own previous end)
             stage(1, "train", 0, 3.10, 3.15, optimizer_step=True), stage(1, "train", 1, 3.11, 3.15, optimizer_step=True)]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    fit = fit_command_latency(load_run(tmp_path))
    kinds = {k: (v["n"], round(v["median_s"], 9)) for k, v in fit["by_kind"].items()}
    assert kinds == {"generate": (1, 0.1), "train_chunk": (3, 0.07), "optimizer_step": (2, 0.03)}
    assert fit["of"] == "train_chunk" and fit["n"] == 3 and fit["command_latency_s"] == pytest.approx(0.07)
    assert fit["median_all_s"] == pytest.approx(0.065)  # of 0.03 0.03 0.06 0.07 0.08 0.10
    st = fit["optimizer_step"]
    assert st["n"] == 2 and st["span_s"] == pytest.approx(0.05) and st["overhead_s"] == pytest.approx(0.01)
    # an emulated run's what-if: the same in modelled seconds (wall / time_scale)
    assert fitted_fixed_costs(fit, 0.02) == pytest.approx({"sim.command_latency_s": 3.5, "sim.train.step_overhead_s": 0.5})
    assert to_costs_section(fit_costs(load_run(tmp_path)))["sim"]["command_latency_s"] == pytest.approx(0.07)
