"""``dynaresize analyze RUN_DIR [RUN_DIR ...]``: post-hoc analysis of run directories (real or simulated).

For each run: a per-step table and totals in the terminal, and into ``RUN_DIR/analysis/`` (or ``--out``):
``summary.json``, ``steps.csv``, ``switches.csv``, ``ops.csv``, ``timeline.png`` (unless ``--no-plot``) and
``trace.json`` (a Chrome/Perfetto trace, unless ``--no-trace``). With several runs, also a side-by-side comparison
with ratios against the first run (or ``--baseline``), written as ``compare.json``/``compare.csv`` into ``--out``
(default: the baseline's analysis directory). With ``--out`` and several runs, each run gets ``--out/<name>/``.

Examples::

    dynaresize analyze runs/quickstart-20261130-101500
    dynaresize analyze runs/static runs/dynamic --out cmp/ --no-plot
    dynaresize analyze runs/naive runs/optimized --baseline runs/naive
    dynaresize analyze runs/quickstart-20261130-101500 --whatif    # what the other schedules would have taken

With ``--whatif`` (:mod:`dynaresize.analysis.whatif`), each run's own work is replayed through the simulator and
the table of schedules is printed, then one JSON line (``--json``: the JSON line only), and written as
``whatif.json`` into the analysis directory; the other files are not written.

Metric definitions: docs/analysis.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynaresize.analysis.compare import compare, render_compare, write_compare
from dynaresize.analysis.metrics import Summary, analyze
from dynaresize.analysis.reader import load_run
from dynaresize.analysis.report import render, write_files
from dynaresize.analysis.views import build_views


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or events.jsonl files)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/analysis)")
    p.add_argument("--no-plot", action="store_true", help="skip the timeline PNG")
    p.add_argument("--no-trace", action="store_true", help="skip the Perfetto trace")
    p.add_argument("--baseline", default=None, help="run to compare against (a RUN_DIR given, its name, or index)")
    p.add_argument("--max-lanes", type=int, default=40, help="timeline lanes before neighbouring groups are folded")
    p.add_argument("--max-rank-tracks", type=int, default=64,
                   help="trace: one track per rank up to this many ranks, else one per group of identical ranks")
    p.add_argument("--max-steps-shown", type=int, default=20, help="terminal: steps shown (all are in steps.csv)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the comparison and file paths")
    p.add_argument("--whatif", action="store_true", help="replay each run's own work through the simulator: the best "
                   "static split, resizing, each barrier-free mechanism, the oracle and the bound against the measured "
                   "time (then one JSON line; docs/analysis.md)")
    p.add_argument("--json", action="store_true", help="--whatif: print only the JSON line")


def analyze_one(run: str | Path, out_dir: Path, plot: bool = True, trace: bool = True, max_lanes: int = 40,
                max_rank_tracks: int = 64) -> tuple[Summary, list[Path]]:
    """Analyse one run and write its files; returns the summary and the paths written."""
    rd = load_run(run)
    v = build_views(rd)
    s = analyze(rd, v)
    paths = write_files(s, out_dir)
    if trace:
        from dynaresize.analysis.trace import write_trace

        p = out_dir / "trace.json"
        write_trace(v, p, max_rank_tracks=max_rank_tracks)
        paths.append(p)
    if plot:
        from dynaresize.analysis.timeline import draw_timeline

        paths.append(draw_timeline(v, s, out_dir / "timeline.png", max_lanes=max_lanes))
    return s, paths


def _out_dir(run: Path, out: Path | None, name: str, several: bool) -> Path:
    if out is None:
        base = run if run.is_dir() else run.parent
        return base / "analysis"
    return out / name if several else out


def _baseline_index(args, runs: list[Path], names: list[str]) -> int:
    if args.baseline is None:
        return 0
    b = args.baseline
    for i, (r, n) in enumerate(zip(runs, names)):
        if b == n or Path(b).resolve() == r.resolve():
            return i
    if b.isdigit() and int(b) < len(runs):
        return int(b)
    raise SystemExit(f"dynaresize analyze: --baseline {b!r} is none of the runs given ({', '.join(names)})")


def main(args: argparse.Namespace) -> int:
    runs = [Path(r) for r in args.runs]
    missing = [r for r in runs if not (r.is_file() or (r / "events.jsonl").is_file())]
    if missing:
        for r in missing:
            print(f"dynaresize analyze: no event log at {r} (expected {r}/events.jsonl)", file=sys.stderr)
        return 2
    if args.whatif:
        return _whatif(runs, args)
    several = len(runs) > 1
    names: list[str] = []
    summaries: list[Summary] = []
    for r in runs:
        name = (r if r.is_dir() else r.parent).name or "run"
        while name in names:
            name += "_"
        names.append(name)
        out = _out_dir(r, args.out, name, several)
        s, paths = analyze_one(r, out, plot=not args.no_plot, trace=not args.no_trace, max_lanes=args.max_lanes,
                               max_rank_tracks=args.max_rank_tracks)
        s.run["name"] = name
        summaries.append(s)
        if not args.quiet:
            print(render(s, max_steps=args.max_steps_shown))
        print(f"wrote: {', '.join(str(p) for p in paths)}")
        if not args.quiet:
            print()
    if several:
        bi = _baseline_index(args, runs, names)
        c = compare(summaries, bi)
        print(render_compare(c))
        out = args.out if args.out is not None else _out_dir(runs[bi], None, names[bi], False)
        print(f"wrote: {', '.join(str(p) for p in write_compare(c, out))}")
    return 0


def _whatif(runs: list[Path], args: argparse.Namespace) -> int:
    from dynaresize.analysis.whatif import render, to_json, whatif, write
    from dynaresize.config.loader import ConfigError

    several = len(runs) > 1
    for r in runs:
        try:
            w = whatif(r)
        except ConfigError as e:
            print(f"dynaresize analyze --whatif: {e}", file=sys.stderr)
            return 2
        path = write(w, _out_dir(r, args.out, (r if r.is_dir() else r.parent).name or "run", several))
        if not args.json:
            print(render(w))
            print(f"wrote: {path}")
        print(to_json(w))
    return 0
