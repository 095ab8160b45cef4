"""``dynaresize calibrate RUN_DIR -o costs.yaml``: fit the simulator's cost model to a (real) run's event log.

The fitted file lets ``dynaresize simulate --costs costs.yaml`` replay that cluster at another scale. What is
fitted and how: :mod:`dynaresize.analysis.fit`. The fit quality (points, R^2, RMSE, op sample counts) is printed
and written as comments at the top of the YAML file, so the file itself holds only keys the simulator accepts.

    dynaresize calibrate runs/quickstart-20261130-101500 -o costs.yaml
    dynaresize calibrate runs/real --json           # the full fit as JSON on stdout

PROVISIONAL FORMAT: the simulator's ``costs:`` section (dynaresize/sim/config.py) is being written in parallel;
:func:`to_costs_section` is the one place that maps the fit onto it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from dynaresize.analysis.fit import fit_costs
from dynaresize.analysis.reader import load_run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_DIR", help="run directory (or events.jsonl)")
    p.add_argument("-o", "--output", type=Path, default=None, help="costs YAML to write (default RUN_DIR/analysis/costs.yaml)")
    p.add_argument("--json", action="store_true", help="print the full fit as JSON")


def to_costs_section(fit: dict) -> dict:
    """The fit as the simulator's ``costs:`` section (only fitted values; unknown ones are left out)."""
    out: dict = {}
    for stage in ("rollout", "train"):
        f = fit[stage]
        if f["overhead_s"] is not None:
            out[f"{stage}_overhead_s"] = round(max(f["overhead_s"], 0.0), 6)
        if f["tokens_per_s_per_gpu"] is not None:
            out[f"{stage}_tokens_per_s_per_gpu"] = round(f["tokens_per_s_per_gpu"], 6)
    if fit["weight_sync_s"] is not None:
        out["weight_sync_s"] = round(fit["weight_sync_s"], 6)
    if fit["override_s"]:
        out["override_s"] = {k: round(v, 6) for k, v in fit["override_s"].items()}
    return {"costs": out}


def _comments(fit: dict) -> str:
    s = fit["source"]
    lines = [f"written by dynaresize calibrate from {s['path']}",
             f"run {s['run']}: {s['world_size']} GPUs, {s['steps']} steps, {s['switches']} switches, {s['bad_lines']} bad lines"]
    for stage in ("rollout", "train"):
        f = fit[stage]
        lines.append(f"{stage}: {f['n']} points, r2={f['r2']}, rmse_s={f['rmse_s']}")
    for op, o in fit["ops"].items():
        lines.append(f"{op}: n={o['n']} median={o['median_s']:.4g}s min={o['min_s']:.4g}s max={o['max_s']:.4g}s "
                     f"critical_share={o['critical_share']:.2f}")
    return "".join(f"# {x}\n" for x in lines)


def write_costs(fit: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_comments(fit) + yaml.safe_dump(to_costs_section(fit), sort_keys=False))
    return path


def main(args: argparse.Namespace) -> int:
    run = Path(args.run)
    if not (run.is_file() or (run / "events.jsonl").is_file()):
        print(f"dynaresize calibrate: no event log at {run} (expected {run}/events.jsonl)", file=sys.stderr)
        return 2
    fit = fit_costs(load_run(run))
    out = args.output or ((run if run.is_dir() else run.parent) / "analysis" / "costs.yaml")
    write_costs(fit, out)
    if args.json:
        print(json.dumps(fit, indent=1))
    else:
        print(_comments(fit) + yaml.safe_dump(to_costs_section(fit), sort_keys=False), end="")
    if fit["rollout"]["tokens_per_s_per_gpu"] is None or fit["train"]["tokens_per_s_per_gpu"] is None:
        print("dynaresize calibrate: warning: a stage throughput could not be fitted (no token counts, fewer than 3 "
              "steps, or one rank count and one token count only); only its mean time was kept", file=sys.stderr)
    print(f"wrote {out}")
    return 0
