"""DeepSpeed's communication wrapper on CPU, as every worker rank creates it at start-up (``warm_backend``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_warm_backend_compiles_no_extension_on_cpu(tmp_path):
    # Without the guard DeepSpeed JIT-compiles its shared-memory inference op into TORCH_EXTENSIONS_DIR here (about
    # 50 s on 2 cores, with a lock every rank waits on); training never uses it.
    ext = tmp_path / "torch_extensions"
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from dynaresize.engines.trainer_deepspeed import warm_backend
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
        warm_backend()
        import deepspeed.comm.comm as dscomm
        assert dscomm.is_initialized()
        print("shm_op", dscomm.cdb.shm_comm_op)
        dist.destroy_process_group()
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "shm_op None" in p.stdout
    assert not ext.exists() or not any(ext.rglob("*.so")), sorted(ext.rglob("*"))
