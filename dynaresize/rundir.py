"""Run directories: ``<parent>/<run.name>-<YYYYmmdd-HHMMSS>/``, created atomically (a name collision gets ``.2``,
``.3``, ...), so two runs started in the same second never share one. Used by ``run``, ``demo`` and ``submit``."""

from __future__ import annotations

import time
from pathlib import Path


def create_run_dir(parent: str | Path, name: str, now: float | None = None) -> Path:
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    base = parent / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    run_dir, n = base, 1
    while True:
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            n += 1
            run_dir = base.with_name(f"{base.name}.{n}")
