"""Several runs side by side (static vs dynamic, naive vs optimised switching), with ratios to a baseline.

A ratio is ``value / baseline value``: > 1 means more of that metric than the baseline (good for throughput and
utilisation, bad for step time, bubble and switch overhead). Undefined ratios (missing value, zero baseline) are
None.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from dynaresize.analysis.metrics import Summary
from dynaresize.analysis.report import fmt, table

# (label, getter)
METRICS = [
    ("world_size", lambda s: s.run["world_size"]),
    ("steps_completed", lambda s: s.totals["steps_completed"]),
    ("span_s", lambda s: s.totals["span_s"]),
    ("samples_per_s", lambda s: s.totals["samples_per_s"]),
    ("tokens_per_s", lambda s: s.totals["tokens_per_s"]),
    ("step_time_mean_s", lambda s: s.totals["step_time_mean_s"]),
    ("step_time_median_s", lambda s: s.totals["step_time_median_s"]),
    ("bubble_fraction", lambda s: s.totals["bubble_fraction"]),
    ("utilisation_rollout", lambda s: s.roles["rollout"]["utilisation"]),
    ("utilisation_train", lambda s: s.roles["train"]["utilisation"]),
    ("switches", lambda s: s.totals["switches"]),
    ("switch_critical_s", lambda s: s.totals["switch_critical_s"]),
    ("switch_hidden_s", lambda s: s.totals["switch_hidden_s"]),
    ("bad_lines", lambda s: s.read["bad_lines"]),
]


def compare(summaries: list[Summary], baseline: int = 0) -> dict:
    base = summaries[baseline]
    names = [s.run["name"] for s in summaries]
    rows = []
    for label, get in METRICS:
        vals = [get(s) for s in summaries]
        b = get(base)
        ratios = [(v / b) if isinstance(v, (int, float)) and isinstance(b, (int, float)) and b else None for v in vals]
        rows.append({"metric": label, "values": vals, "ratios": [round(r, 4) if r is not None else None for r in ratios]})
    return {"runs": names, "paths": [s.run["path"] for s in summaries], "baseline": names[baseline], "rows": rows}


def render_compare(c: dict) -> str:
    names = c["runs"]
    base = c["baseline"]
    headers = ["metric"] + names + [f"{n} / {base}" for n in names if n != base]
    bi = names.index(base)
    rows = []
    for r in c["rows"]:
        rows.append([r["metric"]] + [fmt(v, 3) for v in r["values"]]
                    + [fmt(x, 3) + "x" if x is not None else "-" for i, x in enumerate(r["ratios"]) if i != bi])
    return f"comparison (ratios against {base}):\n" + table(headers, rows)


def write_compare(c: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    pj, pc = out_dir / "compare.json", out_dir / "compare.csv"
    pj.write_text(json.dumps(c, indent=1) + "\n")
    with open(pc, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric"] + c["runs"] + [f"ratio_{n}" for n in c["runs"]])
        for r in c["rows"]:
            w.writerow([r["metric"]] + ["" if v is None else v for v in r["values"]] + ["" if v is None else v for v in r["ratios"]])
    return [pj, pc]
