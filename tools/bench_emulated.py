"""The emulated runtime against the simulator (issue 17 part 3): same profile, same observed response lengths.

For each row (static splits and dynamic resizing, barrier and continuous schedule) it runs the real job with
the emulated accelerator (``dynaresize run CONFIG``, ``cluster.device: emulated``), then the sample-level simulator
on the same profile and that run's own samples: the trace of its ``batches.jsonl`` (every sample's prompt and
response length x ``emulation.tokens_per_token``), with work admitted the way the runtime admits it (one command's
batch at a time, streamed chunks of ``stream_min_groups``): :func:`dynaresize.analysis.whatif.emulated_sim_config`.
It compares samples per wall second: the runtime's over its span (``dynaresize analyze``'s ``span_s``), the
simulator's per modelled second / ``time_scale``. Static rows: the initial split and the simulator's best static
barrier split. Prints the table, then one JSON line: ``runtime_vs_sim`` (the row furthest from 1), ``worst_row``,
``dynamic_vs_best_static_runtime`` and ``dynamic_vs_best_static_sim`` (dynamic continuous over the best static
barrier row) and ``runtime_vs_sim_no_latency`` (the same with nothing fitted from the run's log: no control-plane
latency per command, the profile's optimizer step; :func:`dynaresize.analysis.whatif.fitted_fixed_costs`).

    .venv/bin/python tools/bench_emulated.py --steps 10                        # configs/emulated-8gpu.yaml, ~7 min
    .venv/bin/python tools/bench_emulated.py --config configs/emulated-16gpu.yaml --steps 10 --time-scale 0.2

Figures and what they mean: docs/emulation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(out: Path, config: str, overrides: list[str]) -> Path:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", "dynaresize.cli", "run", config, f"run.output_dir={out}", "run.progress=false",
            *overrides, "--quiet"]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}): {' '.join(overrides)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    return run_dir


def observed(run_dir: Path) -> dict:
    """What the runtime measured: samples per wall second over the run's span (as ``dynaresize analyze`` and the
    what-if measure it: the earliest step start or busy interval to the latest step end), switches, emulation."""
    from dynaresize.analysis.metrics import analyze
    from dynaresize.analysis.reader import load_run

    summary = json.loads((run_dir / "summary.json").read_text())
    span = analyze(load_run(run_dir)).totals["span_s"]
    samples = sum(len(json.loads(l)["keys"]) for l in (run_dir / "batches.jsonl").read_text().splitlines() if l.strip())
    return {"samples_per_s": samples / span, "span_s": span, "switches": len(summary["switches"]),
            "critical_s": summary["switch_critical_path_s"], "faithful": summary["emulation"]["faithful"],
            "overrun_s": summary["emulation"]["overrun_s"]}


def simulate(run_dir: Path, n_train: int, continuous: bool, streaming: bool, resize: bool, latency: bool = True) -> dict:
    """The sample-level simulator on the run's own profile and its own samples (the trace of its batches.jsonl, each
    length x tokens_per_token: :func:`dynaresize.analysis.whatif.emulated_sim_config`, which also admits work the
    way the runtime does); samples per wall second of the emulation (modelled seconds x time_scale)."""
    from dynaresize.analysis.whatif import emulated_sim_config
    from dynaresize.policy import Topology
    from dynaresize.schedule import Mechanisms
    from dynaresize.sim.compare import run_samples, setup

    # latency=False: the same prediction from the profile alone, without what the run's log says its control plane
    # cost (the fitted latency per command and the optimizer step after it: whatif.fitted_fixed_costs)
    c, scale = emulated_sim_config(run_dir, fitted=latency)
    st = setup(c)
    res = run_samples(st, Topology(n_train, c.cluster.gpus - n_train), Mechanisms(continuous, streaming, resize))
    return {"samples_per_s": res.samples / (res.total_s * scale), "switches": res.switches, "critical_s": res.critical_s * scale}


def best_static_sim(run_dir: Path, gpus: int) -> int:
    """The simulator's best static barrier split (trainers) for the run's own samples."""
    return max(range(1, gpus), key=lambda n: simulate(run_dir, n, False, False, False)["samples_per_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/emulated-8gpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--time-scale", type=float, default=0.1, help=(
        "emulation.time_scale of every run (default 0.1, not the configs' 0.02: the control plane's real latency, "
        "tens of ms a command on a loaded 2-core machine, does not shrink with the time scale; docs/emulation.md)"))
    ap.add_argument("-o", "--override", action="append", default=[], help="extra dotted override for every run")
    ap.add_argument("--keep", type=Path, default=None, help="keep every row's run directory under this folder")
    args = ap.parse_args()
    from dynaresize.config.loader import load_config

    base = [f"run.steps={args.steps}", f"emulation.time_scale={args.time_scale}", *args.override]
    cfg = load_config(ROOT / args.config, base)
    sched = {"barrier": ["pipeline.schedule=barrier"], "continuous": ["pipeline.schedule=continuous"]}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-emulated-") as tmp:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        def row(name: str, n_train: int, schedule: str, resize: bool) -> dict:
            over = [*base, *sched[schedule], f"cluster.initial_train={n_train}", f"policy.enabled={str(resize).lower()}"]
            rd = one_run(Path(tmp) / f"{len(rows)}", args.config, over)
            c = load_config(rd / "config.yaml")
            obs = observed(rd)
            cont = schedule == "continuous"
            sim = simulate(rd, n_train, cont, cont and c.pipeline.streaming_training, resize)
            bare = simulate(rd, n_train, cont, cont and c.pipeline.streaming_training, resize, latency=False)
            r = {"row": name, "schedule": schedule, "runtime": round(obs["samples_per_s"], 4),
                 "sim": round(sim["samples_per_s"], 4), "ratio": round(obs["samples_per_s"] / sim["samples_per_s"], 4),
                 "ratio_no_latency": round(obs["samples_per_s"] / bare["samples_per_s"], 4),
                 "switches": obs["switches"], "sim_switches": sim["switches"], "critical_s": obs["critical_s"],
                 "sim_critical_s": round(sim["critical_s"], 4), "faithful": obs["faithful"], "overrun_s": obs["overrun_s"],
                 "_rd": rd}
            rows.append(r)
            return r

        init = cfg.cluster.initial_train
        first = row(f"static {init}:{cfg.cluster.gpus - init}", init, "barrier", False)
        best = best_static_sim(first["_rd"], cfg.cluster.gpus)
        if best != init:
            row(f"static {best}:{cfg.cluster.gpus - best}", best, "barrier", False)
        for n in sorted({init, best}):
            row(f"static {n}:{cfg.cluster.gpus - n}", n, "continuous", False)
        row("dynamic", init, "barrier", True)
        dyn = row("dynamic", init, "continuous", True)
    head = ["row", "schedule", "runtime", "sim", "ratio", "ratio_no_latency", "switches", "sim_switches", "critical_s", "sim_critical_s",
            "faithful", "overrun_s"]
    print("samples/s of wall time (sim: per modelled second / time_scale); critical_s: switches' critical path")
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        print("  ".join(f"{r[h]:>14.3f}" if isinstance(r[h], float) else f"{str(r[h]):>14}" for h in head))
    barrier = [r for r in rows if r["schedule"] == "barrier" and r["row"] != "dynamic"]
    best_rt = max(barrier, key=lambda r: r["runtime"])
    best_sim = max(barrier, key=lambda r: r["sim"])
    print(json.dumps({
        "runtime_vs_sim": max(rows, key=lambda r: abs(r["ratio"] - 1.0))["ratio"],  # the row furthest from 1
        # the same with the profile alone (no fitted control-plane latency nor optimizer step: fitted_fixed_costs)
        "runtime_vs_sim_no_latency": max(rows, key=lambda r: abs(r["ratio_no_latency"] - 1.0))["ratio_no_latency"],
        "worst_row": (lambda w: f"{w['row']} {w['schedule']}")(max(rows, key=lambda r: abs(r["ratio"] - 1.0))),
        "dynamic_vs_best_static_runtime": round(dyn["runtime"] / best_rt["runtime"], 4),
        "dynamic_vs_best_static_sim": round(dyn["sim"] / best_sim["sim"], 4),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
