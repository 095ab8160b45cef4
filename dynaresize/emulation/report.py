"""The run's ``emulation`` summary: every rank's pacing record (the last ``emulation.pacing`` metric event it wrote,
cumulative over its process) merged into one block of ``summary.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaresize.emulation.engine import OVERRUNS_METRIC
from dynaresize.emulation.pacer import merge
from dynaresize.events import EventType, read_events


def emulation_summary(run_dir: str | Path) -> dict[str, Any]:
    """``faithful`` (no span overran its model), overruns and their seconds, by kind; a rank restarted mid-run
    (fault recovery) counts from its restart on."""
    last: dict[int, dict[str, Any]] = {}
    for ev in read_events(Path(run_dir) / "events.jsonl", types={EventType.METRIC}):
        if ev.data.get("name") == OVERRUNS_METRIC:
            last[int(ev.data["rank"])] = ev.data["by_kind"]
    return merge([last[r] for r in sorted(last)])


def describe(block: dict[str, Any]) -> str:
    """One line for ``dynaresize run``: whether the emulation kept to its model, and where it did not."""
    if block["faithful"]:
        return f"emulation: faithful (every paced span within its modelled time, {block['ranks']} ranks)"
    worst = sorted(block["by_kind"].items(), key=lambda kv: -kv[1]["overrun_s"])
    parts = ", ".join(f"{k} {v['overruns']}/{v['spans']}" for k, v in worst if v["overruns"])
    return (f"emulation NOT faithful: {block['overruns']} spans ran past their modelled time by {block['overrun_s']:.2f} s "
            f"in all ({parts}); summary.json 'emulation' has the details")
