"""Chrome trace (Trace Event Format JSON) of a run: open it in https://ui.perfetto.dev or chrome://tracing.

Layout:
- process "ranks" (pid 1): one thread track per rank (tid = rank) holding its stages as complete events ("X"),
  and per switch a "switch <id>" slice with the switch's critical operations nested inside it. Background
  (non-critical) operations go on a second track per rank, "rank N background", also under a switch slice, so
  that they can overlap the rank's training stage without breaking the nesting of the main track.
- For large runs (more ranks than ``max_rank_tracks``) one track per atom (ranks with identical activity,
  e.g. "ranks 0-2047 (x2048)") instead, at most ``max_rank_tracks`` of them (neighbouring atoms folded, the
  label names the one shown), so a 4096-GPU trace stays loadable (tens of MB at most).
- process "run" (pid 0): a "steps" track with one slice per step, and a counter of the train/rollout split.

Written streaming, one event per line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dynaresize.analysis.views import Views, fold_atoms

US = 1e6
BG_OFFSET = 1_000_000  # tid offset of the background tracks


def write_trace(v: Views, path: Path, max_rank_tracks: int = 64) -> dict:
    """Write the trace; returns {"tracks": n, "events": n, "grouped": bool}."""
    rd = v.rd
    per_rank = rd.world_size <= max_rank_tracks
    # tracks: (tid, name, atom index)
    tracks: list[tuple[int, str, int]] = []
    if per_rank:
        for ai, atom in enumerate(v.atoms):
            tracks += [(r, f"rank {r}", ai) for r in atom.ranks()]
    else:
        tracks = [(v.atoms[ai].first, f"ranks {label}", ai) for ai, label in fold_atoms(v.atoms, max_rank_tracks)]
    tracks.sort()
    n = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps({"run": rd.name, "world_size": rd.world_size,
                                                                         "grouped_tracks": not per_rank}) + ',"traceEvents":[\n')
        first = True

        def out(ev: dict) -> None:
            nonlocal first, n
            f.write(("" if first else ",\n") + json.dumps(ev, separators=(",", ":")))
            first = False
            n += 1

        out({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "run"}})
        out({"ph": "M", "name": "process_sort_index", "pid": 0, "args": {"sort_index": 0}})
        out({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "ranks" if per_rank else "rank groups"}})
        out({"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": 1}})
        out({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "steps"}})
        for tid, name, _ in tracks:
            out({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}})
            out({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for s in sorted(rd.steps.values(), key=lambda s: s.step):
            if s.start == s.start and s.end == s.end:
                out({"ph": "X", "name": f"step {s.step}", "cat": "step", "pid": 0, "tid": 0, "ts": s.start * US,
                     "dur": (s.end - s.start) * US, "args": {"samples": s.samples}})
        for t, ntr, nro, nid in v.split_changes:
            out({"ph": "C", "name": "split", "pid": 0, "ts": t * US, "args": {"train": ntr, "rollout": nro, "unassigned": nid}})
        # stages
        op_kinds = np.array([k.startswith("op:") for k in rd.kinds], dtype=bool)
        stage_mask = ~op_kinds[v.kind] if len(v.kind) else np.zeros(0, bool)
        step = np.frombuffer(rd.iv_step, dtype=np.int32) if rd.n_intervals else np.zeros(0, np.int32)
        by_atom: dict[int, list[int]] = {}
        for tid, _, ai in tracks:
            by_atom.setdefault(ai, []).append(tid)
        for ai, tids in by_atom.items():
            idx = np.flatnonzero(stage_mask & v.member[ai][v.rs]) if len(v.rs) else []
            for i in idx:
                ev = {"ph": "X", "name": rd.kinds[v.kind[i]], "cat": "stage", "pid": 1, "ts": float(v.starts[i]) * US,
                      "dur": float(v.ends[i] - v.starts[i]) * US, "args": {"step": int(step[i]), "ranks": rd.ranksets[v.rs[i]]}}
                for tid in tids:
                    out({**ev, "tid": tid})
        # switches: a parent slice per (switch, track, background?) holding its ops
        bg_named: set[int] = set()
        for sw in rd.switches.values():
            groups: dict[tuple[int, bool], list] = {}
            for o in sw.ops:
                for ai in np.flatnonzero(v.member[:, o.ranks]):
                    groups.setdefault((int(ai), not o.critical), []).append(o)
            for (ai, bg), ops in groups.items():
                s0 = min(o.start for o in ops)
                s1 = max(o.end for o in ops)
                for tid in by_atom.get(ai, []):
                    t2 = tid + BG_OFFSET if bg else tid
                    if bg and t2 not in bg_named:
                        bg_named.add(t2)
                        base = next(name for t_, name, _ in tracks if t_ == tid)
                        out({"ph": "M", "name": "thread_name", "pid": 1, "tid": t2, "args": {"name": base + " background"}})
                        out({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": t2, "args": {"sort_index": tid}})
                    out({"ph": "X", "name": f"switch {sw.switch_id}", "cat": "switch", "pid": 1, "tid": t2, "ts": s0 * US,
                         "dur": (s1 - s0) * US, "args": {"step": sw.step, "mode": sw.mode, "from": sw.from_split,
                                                         "to": sw.to_split, "critical_path_s": sw.critical_path_s}})
                    for o in ops:
                        out({"ph": "X", "name": o.op, "cat": "switch_op", "pid": 1, "tid": t2, "ts": o.start * US,
                             "dur": (o.end - o.start) * US, "args": {"critical": o.critical, "bytes": o.nbytes,
                                                                     "ranks": rd.ranksets[o.ranks]}})
        f.write("\n]}\n")
    return {"tracks": len(tracks) + len(bg_named), "events": n, "grouped": not per_rank}
