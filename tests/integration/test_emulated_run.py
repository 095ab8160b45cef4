"""The emulated accelerator end to end (``cluster.device: emulated``): real Redis, 4 worker processes on the CPU,
DeepSpeed, GRPO, each piece of work lasting its modelled GPU time.

- RL semantics: an emulated run that switches both ways (barrier-free schedule, and barrier) trains on the same
  samples, from the same versions, with the same rewards and losses as the static barrier run on the CPU with the
  same seed (``test_continuous_schedule``'s static run and check);
- timing: the logged stage and switch-op intervals last at least their modelled time (lower bounds computed from
  the timing model and the logged token counts), and the summary has the ``emulation`` block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.emulation.model import TimingModel
from tests.integration.test_continuous_schedule import CONTINUOUS, STEPS, same_samples, static_run  # noqa: F401
from tests.integration.test_job import SEED, batches, run, run_dir_of

pytestmark = pytest.mark.integration

EMULATED = ["cluster.device=emulated", "emulation.time_scale=0.004", f"run.steps={STEPS}", f"run.seed={SEED}",
            "task.dataset.val_every=0"]


def events(run_dir: Path, etype: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["type"] == etype]


def check_paced(rd: Path) -> None:
    """Every logged interval lasts at least what the timing model gives it, and the summary says how faithful."""
    cfg = load_config(rd / "config.yaml")
    m = TimingModel(cfg)
    r, k, s = cfg.sim.rollout, cfg.emulation.tokens_per_token, cfg.emulation.time_scale
    n_train = {b["step"]: b["n_train"] for b in batches(rd)}
    eps = 1e-4  # the run clock's rounding
    seen = set()
    streamed = cfg.rollout.max_running != 0  # the worker streams the generates (continuous batching)
    slots = min(cfg.rollout.max_running or cfg.rollout.pull_batch, r.max_seqs_per_gpu)
    per_rank: dict[str, list[float]] = {}  # streamed: [seconds, tokens] of a rank's rollout intervals
    for e in events(rd, "stage"):
        dur = e["end"] - e["start"]
        if e["stage"] == "rollout" and e.get("samples") and streamed:
            # continuous batching: a command's interval starts where the rank's previous one ended, so its decode
            # spreads over both; per rank, the intervals hold every iteration (>= tokens / slots of them) and every
            # generated token is one row of one iteration
            acc = per_rank.setdefault(e["ranks"], [0.0, 0.0])
            acc[0], acc[1] = acc[0] + dur, acc[1] + e["tokens"]
            seen.add("rollout")
        elif e["stage"] == "rollout" and e.get("samples"):
            # iterations >= the mean response length; every generated token is one row of one iteration
            its = e["tokens"] / e["samples"]
            assert dur >= s * k * (r.iteration_fixed_s * its + r.compute_per_seq_s * e["tokens"]) - eps, e
            seen.add("rollout")
        elif e["stage"] == "train" and e.get("optimizer_step"):
            assert dur >= m.optimizer_step_s() - eps, e
            seen.add("optimizer_step")
        elif e["stage"] == "train" and e.get("tokens"):  # a chunk (the barrier's: the whole batch): at least its responses
            t = cfg.sim.train
            n = n_train[e["step"]]
            eff = t.scaling_per_doubling ** math.log2(n) if n > 1 else 1.0
            assert dur >= s * k * e["tokens"] / (t.tokens_per_gpu_s * n * eff) - eps, e
            seen.add("train")
        elif e["stage"] == "weight_sync" and cfg.pipeline.schedule == "barrier":  # the blocking broadcast
            assert dur >= m.weight_sync_s() - eps, e
            seen.add("weight_sync")
    for rank, (dur, tokens) in per_rank.items():
        assert dur >= s * k * (r.iteration_fixed_s * tokens / slots + r.compute_per_seq_s * tokens) - eps, (rank, dur)
    assert {"rollout", "train"} <= seen, seen
    # each involved rank's switch ops add up to what the plan gives it
    switches = {e["switch_id"]: e for e in events(rd, "switch_start")}
    per: dict[tuple[str, str], float] = {}
    for e in events(rd, "switch_op"):
        if e["switch_id"] in switches and e["op"] != "optimizer_stage_in":
            per[(e["switch_id"], e["ranks"])] = per.get((e["switch_id"], e["ranks"]), 0.0) + e["end"] - e["start"]
    assert per, "no switch op logged"
    for (sid, rank), got in per.items():
        sw = switches[sid]
        want = sum(m.switch_ops_s(sw["from_train"], sw["to_train"], cfg.cluster.gpus, int(rank)).values())
        assert got >= want - 1e-3, (sid, rank, got, want)
    summary = json.loads((rd / "summary.json").read_text())
    emu = summary["emulation"]
    assert isinstance(emu["faithful"], bool) and emu["ranks"] == cfg.cluster.gpus
    assert {"prefill", "decode"} <= set(emu["by_kind"]) and any(k.startswith("switch.") for k in emu["by_kind"])
    assert emu["faithful"] == (emu["overruns"] == 0)


@pytest.mark.parametrize("schedule", ["continuous", "barrier"])
def test_emulated_run_keeps_rl_semantics_and_lasts_the_modelled_time(tmp_path, model_cache, static_run, schedule):  # noqa: F811
    extra = [*CONTINUOUS, "policy.forced_splits={2: 1, 4: 3}"] if schedule == "continuous" else [
        "policy.forced_splits={2: 1, 4: 3}", "pipeline.schedule=barrier", "task.dataset.val_every=0"]
    out = run(tmp_path, model_cache, *EMULATED, *extra)
    rd = run_dir_of(tmp_path)
    got = batches(rd)
    same_samples(got, batches(static_run))
    n_train = [b["n_train"] for b in got]
    assert 1 in n_train and 3 in n_train, n_train  # switched both ways
    check_paced(rd)
    summary = json.loads((rd / "summary.json").read_text())
    assert "emulation" in summary
    if not summary["emulation"]["faithful"]:
        assert "emulation NOT faithful" in out
