"""The memory model obeyed by the emulated accelerator (docs/memory.md), end to end on real ranks:

- a run forced into a split the emulated GPU cannot hold fails as an out-of-memory error would: one message naming
  the rank, its role and the figures, before the switch moved anything (the checkpoint before it stays, the run
  resumable);
- the paper's job rehearsed (configs/emulated-8gpu.yaml: Qwen3-8B's memory on 96 GB GPUs, the 8B timing profile),
  with ZeRO-1 so that 4:4, the split the policy moves to without a memory model, does not fit: it runs and never
  enters a split that does not fit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynaresize.config.loader import load_config
from dynaresize.config.memory import memory_report
from dynaresize.memory import GB
from tests.integration.test_emulated_run import EMULATED
from tests.integration.test_job import BASE, SEED, batches, run, run_dir_of

pytestmark = pytest.mark.integration


def test_forced_split_that_does_not_fit_fails_as_an_oom(tmp_path, model_cache):
    over = [*EMULATED, "run.steps=4", "run.checkpoint_every=1", "sim.rollout.kv_cache_gb=0.001"]
    t = memory_report(load_config("configs/quickstart.yaml", [*BASE, *over])).table
    # an emulated GPU between what 1 trainer and 2 trainers need: the initial 2:2 fits, 1:3 does not
    cap = (t.split(1).trainer.device + t.split(2).trainer.device) / 2 / GB
    assert t.split(2).rollout.device < cap * GB
    p = run(tmp_path, model_cache, *over, f"cluster.gpu_memory_gb={cap:.9f}", "policy.forced_splits={2: 1}", wait=False)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out[-3000:]
    line = next(ln for ln in out.splitlines() if "out of memory" in ln)
    assert "rank 0 as a trainer of the split 1:3 needs" in line and "GiB" in line and "adam moments" in line, line
    rd = run_dir_of(tmp_path)
    got = batches(rd)
    assert [b["n_train"] for b in got] == [2, 2], got  # steps 0 and 1 trained at 2:2, no step at 1:3
    assert any((rd / "checkpoints").glob("step-*")), out[-2000:]  # the checkpoint before the switch is kept
    assert f"--resume {rd}" in out


def test_emulated_8b_rehearsal_never_enters_a_split_that_does_not_fit(tmp_path, model_cache):
    over = ["run.steps=6", "train.zero_stage=1", "run.progress=false", f"run.seed={SEED}",
            f"run.output_dir={tmp_path}", f"model.cache_dir={model_cache}"]
    cfg = load_config("configs/emulated-8gpu.yaml", over)
    fits = set(memory_report(cfg).table.feasible())
    assert 4 not in fits and 6 in fits, fits  # ZeRO-1: 4:4 does not fit 96 GB
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "dynaresize.cli", "run", "configs/emulated-8gpu.yaml", *over, "--quiet"],
                       cwd=root, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rd = run_dir_of(tmp_path)
    splits = {b["n_train"] for b in batches(rd)}
    assert splits <= fits, (splits, fits)
    for e in map(json.loads, (rd / "events.jsonl").read_text().splitlines()):
        if e["type"] == "switch_start":
            assert e["to_train"] in fits, e
