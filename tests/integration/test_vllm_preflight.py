"""rollout.engine=vllm that cannot work is one message before any rank starts (the coordinator's preflight,
dynaresize.engines.rollout_vllm.preflight): a vllm that cannot be imported, an engine that cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynaresize.engines.rollout_vllm import explain
from tests.integration.test_job import BASE, SEED

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def needs_vllm() -> None:
    """On Linux x86_64 (CI's platform) `make setup` installs vLLM's CPU build: never skipped there."""
    import platform

    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.importorskip("vllm", reason="vLLM's CPU build is published for Linux x86_64 only")


def launch(tmp: Path, cache: str, *overrides: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, str(ROOT)])
    argv = [sys.executable, "-m", "dynaresize.cli", "run", "configs/quickstart.yaml", *BASE, f"run.seed={SEED}",
            f"run.output_dir={tmp / 'runs'}", f"model.cache_dir={cache}", "rollout.engine=vllm", *overrides, "--quiet"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def no_rank_started(tmp: Path) -> None:
    runs = list((tmp / "runs").iterdir())
    assert len(runs) == 1
    logs = runs[0] / "logs"
    assert not logs.exists() or not list(logs.glob("rank*.log")), "ranks were launched"


def test_a_vllm_that_cannot_be_imported_is_one_message_before_any_rank(tmp_path, model_cache):
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('vllm shim: broken on purpose')\n")
    p = launch(tmp_path, model_cache, pythonpath=str(shim.parent))
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "vllm cannot be imported" in out and "broken on purpose" in out, out[-3000:]
    assert "rollout.engine: torch" in out and "make setup" in out
    assert "Traceback" not in out, out[-3000:]
    no_rank_started(tmp_path)


def test_an_engine_that_cannot_be_built_names_the_setting(tmp_path, model_cache):
    needs_vllm()
    # 64 TiB of KV cache: more host memory than any machine here has
    p = launch(tmp_path, model_cache, "rollout.vllm.cpu_kv_cache_mb=67108864")
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "vLLM could not build an engine on cpu" in out, out[-3000:]
    assert "rollout.vllm.cpu_kv_cache_mb (now 67108864)" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    no_rank_started(tmp_path)


@pytest.mark.parametrize("error, setting", [
    ("ValueError: Model architectures ['FooForCausalLM'] are not supported for now.", "another model.path"),
    ("ValueError: User-specified max_model_len (4096) is greater than the derived max_model_len", "rollout.vllm.max_model_len"),
    ("RuntimeError: something else", "rollout.vllm.*"),
])
def test_each_build_failure_names_its_setting(error, setting):
    cfg = SimpleNamespace(cpu_kv_cache_mb=256, gpu_memory_utilization=0.45, max_model_len=None)
    msg = explain("build", error, "/models/m", cfg, "cpu")
    assert msg.startswith("vLLM could not build an engine on cpu for model directory '/models/m': " + error)
    assert setting in msg


def test_the_forked_rank_parent_imports_vllm_once_and_stays_single_threaded(tmp_path):
    """The zygote (dynaresize.job.zygote) makes vLLM's imports before it forks when the run's engine is vllm, and
    forks only with one native thread: vLLM's imports must start none (with the ranks' OMP_NUM_THREADS=1)."""
    needs_vllm()
    from dynaresize.config.loader import load_config, write_resolved
    from dynaresize.job.launcher import worker_env

    write_resolved(load_config("configs/quickstart.yaml", ["rollout.engine=vllm"]), tmp_path)
    code = ("import os, sys\n"
            "from dynaresize.job.zygote import preload\n"
            f"preload('dynaresize.worker.main', {str(tmp_path)!r})\n"
            "print(len(os.listdir('/proc/self/task')), 'vllm.v1.engine.llm_engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=worker_env("cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "True"], out.stdout[-2000:]
