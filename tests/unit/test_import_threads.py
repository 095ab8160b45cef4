"""The Slurm entry blocks SIGTERM before it starts any thread (slurm/preempt.py): a thread started earlier keeps
SIGTERM unblocked and a preemption's process-directed signal can land on it instead of the watcher. So importing the
entry and loading a config must start no thread: no torch, no numpy (its BLAS pool) at import time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_slurm_entry_and_a_config_starts_no_thread():
    code = ("import os, sys\n"
            "import dynaresize.slurm.entry, dynaresize.config.loader as L\n"
            f"L.load_config({str(ROOT / 'configs/quickstart.yaml')!r})\n"
            "print(len(os.listdir('/proc/self/task')), 'torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "False", "False"], out.stdout
