"""``dynaresize calibrate RUN_DIR -o costs.yaml``: fit the simulator's cost model to a (real) run's event log.

The fitted file lets ``dynaresize simulate --costs costs.yaml`` replay that cluster at another scale. What is
fitted and how: :mod:`dynaresize.analysis.fit`. The fit quality (points, R^2, RMSE, op sample counts) is printed
and written as comments at the top of the YAML file, so the file itself holds only keys the simulator accepts.

    dynaresize calibrate runs/quickstart-20261130-101500 -o costs.yaml
    dynaresize calibrate runs/real --json           # the full fit as JSON on stdout

Format: ``switching: {costs}`` and ``sim: {train, rollout, workload, schedule, step_gap_s, command_latency_s}``, config sections that
``dynaresize simulate --costs`` merges whole; :func:`to_costs_section` is the one place that maps the fit onto it.
A replay of the logged run also needs its step count and split schedule on the command line; the comments at
the top of the file give them (``sim.steps=N policy.enabled=false 'policy.forced_splits={k: trainers}'``).
"""

from __future__ import annotations

import argparse
import json
import math
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
    """The fit as simulator config sections (only fitted values; the rest keeps the simulator's defaults).

    Written as ``switching: {...}`` and ``sim: {...}``, the shape of an experiment config, so the file is both a
    ``dynaresize simulate --costs`` file and a config overlay.

    - ``switching.costs``: :class:`dynaresize.policy.config.SwitchCostConfig` (what the policy and the simulator
      price a switch with): measured per-op medians as ``override_s``; the median weight_sync stage as the
      ``weight_sync`` override when no weight_sync op was logged.
    - ``train``: the simulator's ``sim.train`` (tokens_per_gpu_s, step_overhead_s; the fit assumes perfect
      data-parallel scaling over the rank counts seen, so scaling_per_doubling = 1, attention term 0).
    - ``rollout``: ``model: empirical`` with the fitted overhead and tokens/s per rank (the simulator's decode
      physics is for GPUs; a stage-time fit does not determine its parameters, so it is not used).
    - ``workload``: the log's mean response length of every step (``response_tokens_by_step``), B x G, the
      length cap, and what a trained token counts; the length *shape* is not in the log (the default is kept).
    - ``command_latency_s``: the control plane's fitted latency per command, a training chunk's (every log;
      :func:`dynaresize.analysis.fit.fit_command_latency`).
    - ``schedule`` and the mechanisms the run's coordinator ran (:func:`dynaresize.analysis.fit.fit_schedule`): a run
      on the scheduler core is ``barrier`` with ``pipeline.continuous_rollout`` and ``pipeline.streaming_training``
      as it ran them (``pipeline.schedule: barrier_free`` or ``barrier``; the sample-level model turns them on); a
      run of the retired lockstep loop is barrier_lockstep with ``step_gap_s``, the coordinator's measured per-step
      gap less the two commands a step the model prices with ``command_latency_s``.
    ``rollout``, ``workload`` and ``schedule`` are written for real (non-simulated) logs only.
    """
    costs: dict = {}
    override = {k: round(v, 6) for k, v in fit["override_s"].items()}
    if "weight_sync" not in override and fit["weight_sync_s"] is not None:
        override["weight_sync"] = round(fit["weight_sync_s"], 6)
    if override:
        costs["override_s"] = override
    train: dict = {}
    f = fit["train"]
    if f["tokens_per_s_per_gpu"] is not None:
        train["tokens_per_gpu_s"] = round(f["tokens_per_s_per_gpu"], 6)
    if f["overhead_s"] is not None:
        train["step_overhead_s"] = round(max(f["overhead_s"], 0.0), 6)
    if train:
        train.update(scaling_per_doubling=1.0, attention_per_context_token=0.0)
    out: dict = {"switching": {"costs": costs}} if costs else {}
    sim: dict = {}
    if train:
        sim["train"] = train
    lat = (fit.get("command_latency") or {}).get("command_latency_s")
    if lat is not None:
        sim["command_latency_s"] = round(lat, 6)
    if fit["source"].get("kind") == "sim":
        # a simulated log's rollout and workload come from the physics and workload in its own config: a line
        # fitted to them would replace an exact model by an approximation, so only costs and train are written
        return {**out, "sim": sim}
    r = fit["rollout"]
    if r["tokens_per_s_per_gpu"] is not None:
        sim["rollout"] = {"model": "empirical", "empirical_overhead_s": round(max(r["overhead_s"], 0.0), 6),
                          "empirical_tokens_per_gpu_s": round(r["tokens_per_s_per_gpu"], 6)}
    w = fit.get("workload") or {}
    if w.get("steps"):
        by = [round(x, 3) for x in w["response_tokens_by_step"]]
        wl = {"prompts_per_step": w["prompts_per_step"], "responses_per_prompt": w["responses_per_prompt"]}
        if w["max_response_tokens"] is not None:
            wl["max_response_tokens"] = max(w["max_response_tokens"], int(math.ceil(max(by))))
        wl.update(response_tokens_start=by[0], response_tokens_end=by[-1], response_tokens_by_step=by,
                  trained_tokens=w["trained_tokens"])
        sim["workload"] = wl
    sc = fit.get("schedule") or {}
    if sc.get("schedule") == "barrier_lockstep":
        sim["schedule"] = "barrier_lockstep"
        if sc.get("step_gap_s") is not None:  # the model prices two commands a step on the critical path itself
            sim["step_gap_s"] = round(max(0.0, sc["step_gap_s"] - 2 * (lat or 0.0)), 6)
    elif sc.get("schedule"):
        sim["schedule"] = sc["schedule"]
        if sc.get("mechanisms"):
            sim["pipeline"] = dict(sc["mechanisms"])
    return {**out, "sim": sim}


def schedule_label(sc: dict) -> str:
    """The fitted schedule in words: ``barrier_lockstep``, ``barrier`` or ``barrier + continuous rollout + ...``."""
    on = [name.replace("_", " ") for name, v in (sc.get("mechanisms") or {}).items() if v]
    return " + ".join([sc.get("schedule") or "barrier", *on])


def _comments(fit: dict) -> str:
    s = fit["source"]
    lines = [f"written by dynaresize calibrate from {s['path']}",
             f"run {s['run']}: {s['world_size']} GPUs, {s['steps']} steps, {s['switches']} switches, {s['bad_lines']} bad lines"]
    for stage in ("rollout", "train"):
        f = fit[stage]
        lines.append(f"{stage}: {f['n']} points, overhead_s={f['overhead_s']}, tokens_per_s_per_gpu={f['tokens_per_s_per_gpu']}, "
                     f"r2={f['r2']}, rmse_s={f['rmse_s']}")
    w, sc = fit.get("workload") or {}, fit.get("schedule") or {}
    if w.get("steps"):
        lines.append(f"workload from the log: {w['steps']} steps of mean response length {min(w['response_tokens_by_step']):.1f}.."
                     f"{max(w['response_tokens_by_step']):.1f} tokens, {w['prompts_per_step']}x{w['responses_per_prompt']} samples, "
                     f"trained tokens = {w['trained_tokens']}; length shape (response_sigma) assumed, not in the log")
    if sc.get("schedule") == "barrier_lockstep":
        lines.append(f"schedule: barrier_lockstep (the retired lockstep loop), step_gap_s from {sc['n']} steps")
    elif s.get("kind") == "runtime" and sc.get("schedule"):
        lines.append(f"schedule: {schedule_label(sc)} (the run's coordinator)")
    cl = fit.get("command_latency") or {}
    if cl.get("n"):
        kinds = ", ".join(f"{k} {v['median_s']:.4g} s (n={v['n']})" for k, v in (cl.get("by_kind") or {}).items())
        lines.append(f"command latency: {cl['command_latency_s']:.4g} s, the training chunks' median (every command: "
                     f"quartiles {cl['p25_s']:.4g}..{cl['p75_s']:.4g} s over {cl['n']}; by kind: {kinds}), from each "
                     "command's trigger to its last rank's start (fit_command_latency)")
        st = cl.get("optimizer_step") or {}
        if st.get("overhead_s") is not None:
            lines.append(f"optimizer step: {st['span_s']:.4g} s from its last trainer's start (median of {st['n']}); "
                         f"{st['overhead_s']:.4g} s after the charged latency (what an emulated run's what-if gives "
                         "sim.train.step_overhead_s, x 1 / time_scale)")
    lines.append(f"replay: dynaresize simulate CONFIG --costs THIS_FILE sim.steps={s['steps']} policy.enabled=false "
                 f"'policy.forced_splits={fit.get('forced_splits') or {}}'")
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
