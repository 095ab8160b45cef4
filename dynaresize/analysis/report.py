"""Render a :class:`~dynaresize.analysis.metrics.Summary` as terminal text, JSON and CSV files.

Files written into the output directory: ``summary.json`` (everything), ``steps.csv`` (one row per step),
``switches.csv`` (one row per switch), ``ops.csv`` (the cost of each switch operation kind).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Sequence

from dynaresize.analysis.metrics import OpCost, StepRow, Summary, SwitchRow


def fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if abs(x) >= 1e5:
            return f"{x:.3g}"
        return f"{x:.{nd}f}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


STEP_COLS = [("step", "step"), ("duration_s", "step_s"), ("rollout_s", "rollout_s"), ("train_s", "train_s"),
             ("idle_rollout_gpu_s", "idle_ro_gpu_s"), ("idle_train_gpu_s", "idle_tr_gpu_s"), ("bubble", "bubble"),
             ("train_ranks", "T"), ("rollout_ranks", "R"), ("samples", "samples"), ("reward", "reward"), ("switches", "switch"),
             ("dlogp_mean", "dlogp_mean"), ("dlogp_max", "dlogp_max"), ("mismatch_k3", "k3")]
SMALL_COLS = {"dlogp_mean", "dlogp_max", "mismatch_k3"}  # ~1e-7 on CPU: 3 significant digits, not 2 decimals


def small(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def _cell(key: str, x: Any) -> Any:
    return small(x) if key in SMALL_COLS else x


def render(s: Summary, max_steps: int = 20) -> str:
    r, t = s.run, s.totals
    out = [f"== {r['name']}  ({r['source'] or '?'}, {r['world_size']} GPUs, status={r['status'] or 'NO run_end'}, "
           f"{t['steps_completed']} steps, span {fmt(t['span_s'])} s)  {r['path']}"]
    rd = s.read
    out.append(f"log: {rd['lines']} lines, {rd['events']} events, {rd['bad_lines']} bad lines skipped, "
               f"{rd['skipped_events']} nonsensical events skipped")
    for n in s.notes:
        out.append(f"note: {n}")
    steps = s.steps
    shown: list[StepRow | None] = list(steps)
    if len(steps) > max_steps:
        h = max_steps // 2
        shown = steps[:h] + [None] + steps[-h:]
    rows = [[_cell(k, getattr(x, k)) for k, _ in STEP_COLS] if x else ["..."] * len(STEP_COLS) for x in shown]
    out += ["", "per step (full table in steps.csv):", table([h for _, h in STEP_COLS], rows)]
    out += ["", "totals:", table(["metric", "value"], [
        ["throughput samples/s", t["samples_per_s"]], ["throughput tokens/s", t["tokens_per_s"]],
        ["step time mean / median s", f"{fmt(t['step_time_mean_s'])} / {fmt(t['step_time_median_s'])}"],
        ["bubble fraction", f"{fmt(t['bubble_fraction'], 4)} ({fmt(t['idle_gpu_s'])} idle of {fmt(t['total_gpu_s'])} GPU-s)"],
        ["switches", t["switches"]],
        ["switch overhead critical / hidden s", f"{fmt(t['switch_critical_s'])} / {fmt(t['switch_hidden_s'])}"
         + (f" ({fmt(100 * t['switch_hidden_fraction'], 1)}% hidden)" if t["switch_hidden_fraction"] is not None else "")],
        ["critical switch time / span", fmt(t["switch_critical_fraction_of_span"], 4)],
        *mismatch_rows(t.get("mismatch") or {}),
        *validation_rows(t.get("validation") or {}),
    ])]
    out += ["", "utilisation per role (busy / available GPU-s while in the role):", table(
        ["role", "gpu_s", "busy_gpu_s", "idle_gpu_s", "utilisation"],
        [[k, v["gpu_s"], v["busy_gpu_s"], v["idle_gpu_s"], v["utilisation"]] for k, v in s.roles.items() if v["gpu_s"] > 0])]
    if s.ops:
        out += ["", "switch operations (wall seconds per op; gpu_s = seconds x ranks):",
                table([f.name for f in fields(OpCost)], [list(asdict(o).values()) for o in s.ops])]
    if s.switches:
        sw = s.switches if len(s.switches) <= max_steps else s.switches[:max_steps]
        out += ["", f"switches ({len(s.switches)}):", table([f.name for f in fields(SwitchRow)], [list(asdict(o).values()) for o in sw])]
    return "\n".join(out)


def validation_rows(val: dict) -> list[list[str]]:
    """The validation passes (held-out prompts, never trained on): first and last version's mean reward and pass@k."""
    if not val:
        return []
    v0, v1 = min(val), max(val)
    k = val[v1].get("k")
    return [[f"validation mean reward / pass@{k if k is not None else 'k'} (version {v0} -> {v1}, {len(val)} passes)",
             f"{fmt(val[v0].get('reward_mean'), 3)} -> {fmt(val[v1].get('reward_mean'), 3)} / "
             f"{fmt(val[v0].get('pass_at_k'), 3)} -> {fmt(val[v1].get('pass_at_k'), 3)}"]]


def mismatch_rows(m: dict) -> list[list[str]]:
    """The totals' training-inference mismatch lines (docs/analysis.md): every trained token, then the samples of
    the trainer's own version (the same weights on both sides), then TIS; none when the run reported no figures."""
    rows = []
    for p, what in (("mismatch_", "all trained tokens"), ("mismatch_same_version_", "same-version samples")):
        if f"{p}tokens" in m:
            rows.append([f"rollout/trainer |dlogp| mean / max, k3 ({what})",
                         f"{small(m[f'{p}abs_mean'])} / {small(m[f'{p}abs_max'])}, {small(m[f'{p}k3'])} "
                         f"({m[f'{p}tokens']} tokens, {m[f'{p}steps']} step{'' if m[f'{p}steps'] == 1 else 's'})"])
    if "tis_weight_mean" in m:
        rows.append(["TIS weight mean, capped fraction", f"{small(m['tis_weight_mean'])}, {small(m['tis_capped_frac'])}"])
    return rows


def _csv(path: Path, cls, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f.name for f in fields(cls)])
        for r in rows:
            w.writerow(["" if v is None else v for v in asdict(r).values()])


def write_files(s: Summary, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.json", out_dir / "steps.csv", out_dir / "switches.csv", out_dir / "ops.csv"]
    paths[0].write_text(json.dumps(s.to_dict(), indent=1) + "\n")
    _csv(paths[1], StepRow, s.steps)
    _csv(paths[2], SwitchRow, s.switches)
    _csv(paths[3], OpCost, s.ops)
    return paths
