"""Benchmark of ``dynaresize analyze`` on a large simulated log (target: 4096 GPUs x 1000 steps within 30 s).

Writes a synthetic log with the simulator's shape (rank-set stage events, switch_start/switch_op/switch_end,
topology; see dynaresize/analysis/synth.py) unless ``--log`` names an existing run (e.g. one written by
``dynaresize simulate``), then runs ``dynaresize analyze`` on it in a child process, once without plot and trace
and once with everything, and reports wall time and the child's peak RSS. Prints a table, then ONE JSON line.

    .venv/bin/python tools/bench_analyze.py                      # 4096 GPUs x 1000 steps, 40 switches
    .venv/bin/python tools/bench_analyze.py --gpus 512 --steps 200
    .venv/bin/python tools/bench_analyze.py --sim configs/sim/scale_4096gpu.yaml   # log from the simulator
    .venv/bin/python tools/bench_analyze.py --log runs/sim-20261130-101500
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dynaresize.analysis.synth import SynthRun, write_synthetic_run


def _child(cmd: list[str]) -> tuple[float, float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        sys.stderr.write(p.stderr)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB; max over all children so far
    return wall, max(rss, before) / 1024, p.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--switches", type=int, default=40)
    ap.add_argument("--log", type=Path, default=None, help="analyse this run instead of generating one")
    ap.add_argument("--sim", metavar="CONFIG", default=None,
                    help="generate the log with `dynaresize simulate CONFIG sim.steps=STEPS` (e.g. configs/sim/scale_4096gpu.yaml)")
    ap.add_argument("--target-s", type=float, default=30.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_analyze_") as tmp:
        if a.sim is not None:
            t = time.perf_counter()
            run = Path(tmp) / "sim"
            subprocess.run([sys.executable, "-m", "dynaresize.cli", "simulate", a.sim, f"sim.steps={a.steps}", "--out", str(run)],
                           check=True, stdout=subprocess.DEVNULL)
            gen_s = time.perf_counter() - t
        elif a.log is None:
            rng = random.Random(1)
            every = max(1, a.steps // (a.switches + 1))
            sw = tuple((k, rng.randint(int(0.3 * a.gpus), int(0.7 * a.gpus))) for k in range(every, a.steps, every))[: a.switches]
            t = time.perf_counter()
            run = write_synthetic_run(Path(tmp) / "bench", SynthRun(world=a.gpus, steps=a.steps, train=a.gpus // 2,
                                                                   tokens_per_step=40 * a.gpus * 200, drift=0.0005,
                                                                   switches=sw))
            gen_s = time.perf_counter() - t
        else:
            run, gen_s = a.log, 0.0
        log = run / "events.jsonl" if run.is_dir() else run
        size_mb = log.stat().st_size / 1e6
        lines = sum(1 for _ in open(log, "rb"))
        base = [sys.executable, "-m", "dynaresize.cli", "analyze", str(run), "-q"]
        w1, r1, rc1 = _child(base + ["--out", f"{tmp}/a1", "--no-plot", "--no-trace"])
        w2, r2, rc2 = _child(base + ["--out", f"{tmp}/a2"])
        trace_mb = (Path(tmp) / "a2" / "trace.json").stat().st_size / 1e6 if rc2 == 0 else None
    src = f"simulate {a.sim}" if a.sim else (str(a.log) if a.log else f"synthetic {a.gpus} GPUs")
    rows = [("log", f"{src} x {a.steps} steps, {lines} lines, {size_mb:.1f} MB (generated in {gen_s:.1f} s)"),
            ("analyze --no-plot --no-trace", f"{w1:.2f} s, peak RSS {r1:.0f} MiB, rc={rc1}"),
            ("analyze (PNG + trace)", f"{w2:.2f} s, peak RSS <= {r2:.0f} MiB, trace {trace_mb} MB, rc={rc2}"),
            ("target", f"{a.target_s:.0f} s: {'PASS' if rc1 == 0 and w1 <= a.target_s else 'FAIL'}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    print(json.dumps({"bench": "analyze", "source": src, "gpus": a.gpus, "steps": a.steps, "lines": lines, "log_mb": round(size_mb, 2),
                      "analyze_s": round(w1, 3), "analyze_rss_mib": round(r1), "analyze_full_s": round(w2, 3),
                      "analyze_full_rss_mib_max": round(r2), "trace_mb": trace_mb, "target_s": a.target_s,
                      "ok": rc1 == 0 and rc2 == 0 and w1 <= a.target_s}))
    return 0 if rc1 == 0 and rc2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
