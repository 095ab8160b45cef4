"""Timeline picture of a run (PNG, matplotlib Agg): what every GPU did, in which role, and how the split moved.

Top panel: one lane per group of ranks with identical activity (an atom; one lane per GPU when every GPU differs),
labelled with its ranks and count. The lane background is the role (pale orange = rollout role, pale blue = train
role, grey = unassigned); bars on it are busy intervals coloured by state (rollout, train, weight sync, each switch
operation). Background where no bar is drawn is idle time. Switch operations get a minimum drawn width so a
0.2 s operation in an hour-long run stays visible (their true durations are in the tables). Thin lines mark
step ends. When there are more groups than ``max_lanes``, neighbouring groups are folded into one lane that
shows its largest member and says so in its label.

Bottom panel: rollout and training stage time per step, and the number of train / rollout GPUs over time.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
import numpy as np  # noqa: E402

from dynaresize.analysis.metrics import Summary  # noqa: E402
from dynaresize.analysis.views import ROLE_IDLE, ROLE_ROLLOUT, ROLE_TRAIN, Views, fold_atoms  # noqa: E402

ROLE_BG = {ROLE_ROLLOUT: "#fde3c8", ROLE_TRAIN: "#d6e4f2", ROLE_IDLE: "#e6e6e6"}
STAGE_COLOURS = {"rollout": "#f28e2b", "train": "#4e79a7", "weight_sync": "#59a14f", "checkpoint": "#9c755f",
                 "switch": "#e15759"}
OP_PALETTE = ["#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff9896", "#c5b0d5",
              "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]


def _colour(kind: str, op_colours: dict[str, str]) -> str:
    if kind in STAGE_COLOURS:
        return STAGE_COLOURS[kind]
    if kind not in op_colours:
        op_colours[kind] = OP_PALETTE[len(op_colours) % len(OP_PALETTE)]
    return op_colours[kind]


def _lanes(v: Views, max_lanes: int) -> list[tuple[int, str]]:
    """(atom index drawn, label) per lane, top lane first."""
    return fold_atoms(v.atoms, max_lanes)


def draw_timeline(v: Views, summary: Summary, path: Path, max_lanes: int = 40, dpi: int = 110) -> Path:
    rd = v.rd
    lanes = _lanes(v, max_lanes)
    nl = len(lanes)
    n_legend = (len(np.unique(v.kind)) if len(v.kind) else 0) + 3
    top_h = max(2.2, 0.3 * nl + 0.9, 0.17 * n_legend + 0.4)  # tall enough for its legend
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(15, top_h + 2.8), sharex=True,
                                  gridspec_kw={"height_ratios": [top_h, 2.4], "hspace": 0.08})
    t0, t1 = v.span_start, v.span_end
    span = max(t1 - t0, 1e-9)
    min_w = span * 0.002
    op_colours: dict[str, str] = {}
    kinds_seen: set[str] = set()
    for li, (ai, _) in enumerate(lanes):
        y = nl - 1 - li
        av = v.views[ai]
        for role in (ROLE_ROLLOUT, ROLE_TRAIN, ROLE_IDLE):
            segs = [(a, b - a) for a, b, r in av.roles if r == role and b > a]
            if segs:
                ax.broken_barh(segs, (y, 0.96), facecolors=ROLE_BG[role], edgecolor="none", zorder=1)
        if not len(v.rs):
            continue
        m = v.member[ai][v.rs]
        for k in np.unique(v.kind[m]):
            kind = rd.kinds[int(k)]
            sel = m & (v.kind == k)
            s, e = v.starts[sel], v.ends[sel]
            is_op = kind.startswith("op:")
            w = np.maximum(e - s, min_w) if is_op else e - s
            if is_op:  # critical ops full height, background ops a thin strip at the bottom
                crit = v.critical[sel]
                for c, (yy, hh) in ((True, (y + 0.12, 0.76)), (False, (y + 0.04, 0.22))):
                    cc = crit == c
                    if cc.any():
                        ax.broken_barh(list(zip(s[cc], w[cc])), (yy, hh), facecolors=_colour(kind[3:], op_colours),
                                       edgecolor="none", zorder=3 if c else 4)
            else:
                hh = (y + 0.28, 0.52) if kind == "weight_sync" else (y + 0.12, 0.76)
                ax.broken_barh(list(zip(s, w)), hh, facecolors=_colour(kind, op_colours), edgecolor="none", zorder=2)
            kinds_seen.add(kind[3:] if is_op else kind)
    ends = sorted(s.end for s in rd.steps.values() if s.end == s.end)
    stride = max(1, math.ceil(len(ends) / 150))
    for i, te in enumerate(ends):
        if i % stride == 0:
            ax.axvline(te, color="#333333", lw=0.4, alpha=0.5, zorder=5)
    ax.set_yticks([nl - 1 - i + 0.48 for i in range(nl)])
    ax.set_yticklabels([lab for _, lab in lanes], fontsize=8 if nl <= 24 else 6.5)
    ax.set_ylim(-0.1, nl + 0.05)
    ax.set_xlim(t0 - span * 0.005, t1 + span * 0.005)
    sw = summary.totals
    ax.set_title(f"{rd.name}: {rd.world_size} GPUs, {sw['steps_completed']} steps, bubble {100 * sw['bubble_fraction']:.1f}%, "
                 f"{sw['switches']} switch(es), {sw['samples_per_s']:.3g} samples/s"
                 + ("" if rd.complete else "  [no run_end: partial log]"), fontsize=10)
    ax.set_ylabel("ranks (x count)" + (f", step lines every {stride}" if stride > 1 else ""), fontsize=8)
    handles = [Patch(color=ROLE_BG[ROLE_ROLLOUT], label="rollout role, idle"),
               Patch(color=ROLE_BG[ROLE_TRAIN], label="train role, idle")]
    if any(r == ROLE_IDLE for av in v.views for _, _, r in av.roles):
        handles.append(Patch(color=ROLE_BG[ROLE_IDLE], label="unassigned"))
    for k in ["rollout", "train", "weight_sync", "checkpoint", "switch"] + sorted(op_colours):
        if k in kinds_seen:
            handles.append(Patch(color=_colour(k, op_colours), label=k.replace("_", " ")))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7.5, frameon=False)

    # bottom panel: stage times and the split
    steps = [r for r in summary.steps if r.end is not None]
    x = [r.end for r in steps]
    ro = [r.rollout_s if r.rollout_s is not None else np.nan for r in steps]
    tr = [r.train_s if r.train_s is not None else np.nan for r in steps]
    mk = "o" if len(steps) <= 60 else None
    ax2.plot(x, ro, color=STAGE_COLOURS["rollout"], marker=mk, ms=3, lw=1.2, label="rollout time / step")
    ax2.plot(x, tr, color=STAGE_COLOURS["train"], marker=mk, ms=3, lw=1.2, label="train time / step")
    ax2.set_ylabel("stage time (s)", fontsize=8)
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("run time (s)", fontsize=9)
    axr = ax2.twinx()
    if v.split_changes:
        ts = [c[0] for c in v.split_changes] + [t1]
        ntr = [c[1] for c in v.split_changes] + [v.split_changes[-1][1]]
        nro = [c[2] for c in v.split_changes] + [v.split_changes[-1][2]]
        axr.step(ts, ntr, where="post", color=STAGE_COLOURS["train"], ls="--", lw=1, alpha=0.8, label="train GPUs")
        axr.step(ts, nro, where="post", color=STAGE_COLOURS["rollout"], ls="--", lw=1, alpha=0.8, label="rollout GPUs")
        axr.set_ylim(0, rd.world_size * 1.08)
    axr.set_ylabel("GPUs per role (dashed)", fontsize=8)
    for r in summary.switches:
        swrec = rd.switches.get(r.switch_id)
        if swrec and swrec.ops:
            ax2.axvline(min(o.start for o in swrec.ops), color=STAGE_COLOURS["switch"], lw=0.8, ls=":", alpha=0.7)
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = axr.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="upper left", bbox_to_anchor=(1.04, 1.0), fontsize=7.5, frameon=False)
    for a in (ax, ax2, axr):
        a.tick_params(labelsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path
