"""Every config under ``configs/`` runs to completion somewhere in the suite (issue 48: the README's
``configs/emulated-16gpu.yaml`` stopped at step 4 of 20 and nothing ran it).

Each config not run by another test runs here as written, shortened by overrides (fewer steps, this session's
model cache and output directory, a shorter warm-start where the config's is long); ``test_every_config_is_run``
keeps the list whole: a new config fails it until it is run here or named with the test that runs it. The
``cuda`` configs cannot run on this machine: ``config check`` validates them (tests/unit/test_config.py loads every
config under configs/, those included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_job import SEED, batches, run_dir_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

# config -> its own shortening (on top of COMMON); steps chosen to reach what the full run reaches first: the 16-GPU
# rehearsal failed at step 4 (its batch's last chunk: 1 group of 8 samples on 12 trainers). A warm-start of 0 steps
# where the config's own would build a model for this test alone
RUN_HERE: dict[str, list[str]] = {
    "base.yaml": ["run.steps=2", "model.tiny.warmstart_steps=0"],
    "quickstart-static.yaml": ["run.steps=2"],
    "emulated-16gpu.yaml": ["run.steps=6"],
    # issue 45's drifting profile, shortened: that it runs (tests/unit/test_emulation.py checks its drift); no model
    # built for this test alone
    "emulated-8gpu-drift.yaml": ["run.steps=2", "model.tiny.warmstart_steps=0"],
    "byo-example.yaml": ["run.steps=2", "model.tiny.warmstart_steps=0", "task.dataset.val_every=2"],
    "quickstart-vllm.yaml": ["run.steps=2", "run.checkpoint_every=0", "policy.forced_splits={}"],
}
RUN_ELSEWHERE = {
    "quickstart.yaml": "tests/integration/test_job.py (and most integration tests: its BASE overrides)",
    "slurm-local.yaml": "tests/slurm/test_job_slurm.py (submitted through Slurm)",
    "emulated-8gpu.yaml": "tests/integration/test_memory_emulated.py (the 8B rehearsal: 6 steps, train.zero_stage=1)",
}
CUDA_ONLY = {"gpu-8x1.yaml", "gpu-32x4.yaml"}  # config check: tests/unit/test_config.py::test_shipped_configs_validate
COMMON = [f"run.seed={SEED}", "run.progress=false", "redis.heartbeat_s=0.5", "redis.dead_after_heartbeats=8"]


def test_every_config_is_run():
    shipped = {p.name for p in CONFIGS.glob("*.yaml")}
    assert shipped == set(RUN_HERE) | set(RUN_ELSEWHERE) | CUDA_ONLY, "a config under configs/ that no test runs"


def _byo_data(tmp_path: Path) -> list[str]:
    out = tmp_path / "byo-data"
    subprocess.run([sys.executable, "tools/make_byo_example.py", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    return [f"task.dataset.train_files=[{out / 'train.parquet'}]", f"task.dataset.val_files=[{out / 'val.parquet'}]"]


@pytest.mark.parametrize("name", sorted(RUN_HERE))
def test_config_runs_to_completion(tmp_path, model_cache, name):
    if name == "quickstart-vllm.yaml":
        pytest.importorskip("vllm", reason="vLLM's CPU build is published for Linux x86_64 only")
    extra = _byo_data(tmp_path) if name == "byo-example.yaml" else []
    over = [*COMMON, *RUN_HERE[name], *extra, f"run.output_dir={tmp_path / 'runs'}", f"model.cache_dir={model_cache}"]
    p = subprocess.run([sys.executable, "-m", "dynaresize.cli", "run", str(CONFIGS / name), *over, "--quiet"], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    steps = int(next(o for o in RUN_HERE[name] if o.startswith("run.steps=")).split("=")[1])
    assert [b["step"] for b in batches(run_dir_of(tmp_path / "runs"))] == list(range(steps))
