"""``dynaresize simulate CONFIG [key=value ...] [--compare] [--json] [--costs FILE] [--out RUN_DIR]``.

Without ``--compare``: one simulated DynaResize run (or the static initial split with ``policy.enabled=false``)
written as a run directory (``config.yaml``, ``events.jsonl``, ``summary.json``) that ``dynaresize analyze`` reads.
With ``--compare``: every static split, DynaResize optimised and naive, greedy and the oracle bound as a table;
``--json`` adds one JSON object as the last line. ``--costs FILE.yaml`` merges a calibration file: either the keys
of ``switching.costs`` at top level, or ``switching`` and ``sim`` sections (what ``dynaresize calibrate`` writes:
``switching.costs``; ``sim.train``, ``rollout``, ``workload``, ``schedule``, ``step_gap_s``); dotted overrides on
the command line are applied after it, so they win. ``policy.forced_splits`` ({step: trainers}) scripts switches as in a real run
(with ``policy.enabled=false``: only those).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from dynaresize.config.loader import ConfigError, load_config, parse_override, read_yaml_mapping, write_resolved
from dynaresize.events import EventLog, EventType, make_event
from dynaresize.config.schema import moved_key
from dynaresize.policy.config import SwitchCostConfig, SwitchingConfig
from dynaresize.sim.config import SimConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="experiment YAML (e.g. configs/sim/paper_8gpu.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sim.steps=500 cluster.gpus=64")
    p.add_argument("--compare", action="store_true", help="run static splits, DynaResize, naive, greedy, the oracle, the "
                   "sample-level mechanisms and the bound")
    p.add_argument("--no-samples", action="store_true", help="--compare: leave out the sample-level rows (faster at scale)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--costs", metavar="FILE", help="YAML of switch costs merged into switching.costs (from dynaresize calibrate)")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default: <run.output_dir>/<run.name>-<timestamp>)")


def _deep(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        dst[k] = _deep(dict(dst.get(k) or {}), v) if isinstance(v, dict) and isinstance(dst.get(k), dict) else v
    return dst


def merge_costs(cfg, path: str):
    """Return ``cfg`` with the calibration file at ``path`` merged in (ConfigError naming file and key).

    A file whose top level holds ``switching`` and/or ``sim`` (what ``dynaresize calibrate`` writes) is merged into
    those sections (``switching.costs``; ``sim.train``, ``rollout``, ``workload``, ``schedule``, ...); any other
    mapping is the keys of ``switching.costs``."""
    data = read_yaml_mapping(path, "cost file",
                             "switching.costs keys (e.g. pcie_gbps: 25, override_s: {drain: 0.4}) or of the "
                             "'switching' and 'sim' sections")
    if "switching" in data or "sim" in data:
        return merge_sections(cfg, path, data)
    try:
        costs = SwitchCostConfig.model_validate(_deep(cfg.switching.costs.model_dump(), data))
    except ValidationError as e:
        msgs = "; ".join(f"switching.costs.{error_key(er)}: {er['msg'].removeprefix('Value error, ')}" for er in e.errors())
        raise ConfigError(f"{path}: {msgs}; allowed keys: {', '.join(SwitchCostConfig.model_fields)}") from None
    return cfg.model_copy(update={"switching": cfg.switching.model_copy(update={"costs": costs})})


def error_key(er: dict) -> str:
    """Dotted key of one validation error; a cross-field rule (RuleError) adds the key it blames."""
    from dynaresize.config.base import RuleError

    loc = tuple(er["loc"])
    rule = (er.get("ctx") or {}).get("error")
    if isinstance(rule, RuleError):
        loc += rule.key
    return ".".join(str(x) for x in loc)


def merge_sections(cfg, path: str, data: dict):
    other = sorted(k for k in data if k not in ("switching", "sim"))
    if other:
        raise ConfigError(f"{path}: unknown top-level key {other[0]!r} (a calibration file holds only 'switching' and 'sim')")
    moved = moved_key(data)
    if moved is not None:
        raise ConfigError(f"{path}: {moved}")
    update = {}
    for name, model in (("switching", SwitchingConfig), ("sim", SimConfig)):
        if name not in data:
            continue
        if not isinstance(data[name], dict):
            raise ConfigError(f"{path}: {name}: expected a mapping of {name} sections (e.g. {'costs' if name == 'switching' else 'train'})")
        try:
            update[name] = model.model_validate(_deep(getattr(cfg, name).model_dump(), data[name]))
        except ValidationError as e:
            msgs = "; ".join(f"{name}.{error_key(er)}: {er['msg'].removeprefix('Value error, ')}" for er in e.errors())
            raise ConfigError(f"{path}: {msgs}") from None
    return cfg.model_copy(update=update)


def apply_overrides(cfg, overrides: list[str]):
    """Dotted overrides applied to a loaded config (after a --costs file, so the command line wins)."""
    if not overrides:
        return cfg
    from dynaresize.config.schema import Config

    data = cfg.model_dump()
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[parts[-1]] = _deep(dict(node[parts[-1]]), value) if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) else value
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError("; ".join(f"{'.'.join(str(x) for x in er['loc'])}: {er['msg']} (after --costs and overrides)"
                                    for er in e.errors())) from None


def _forced(cfg) -> dict[int, int]:
    forced = dict(cfg.policy.forced_splits)
    for step, n in forced.items():
        if not 1 <= n <= cfg.cluster.gpus - 1 or not 1 <= step < cfg.sim.steps:
            raise ConfigError(f"policy.forced_splits: {step}: {n} needs 1 <= step < sim.steps ({cfg.sim.steps}) and "
                              f"1 <= trainers <= cluster.gpus - 1 ({cfg.cluster.gpus - 1})")
    return forced


def main(args: argparse.Namespace) -> int:
    from dynaresize.sim.mechanisms import SimMechanisms
    from dynaresize.sim.compare import compare, format_links, format_table, run_dynamic, run_samples, run_static, setup

    cfg = load_config(args.config, args.overrides)
    if args.costs:
        cfg = apply_overrides(merge_costs(load_config(args.config), args.costs), args.overrides)
    s = setup(cfg)
    if args.compare:
        out = compare(s, samples=not args.no_samples)
        print(f"{cfg.run.name}: {cfg.cluster.gpus} GPUs, {cfg.sim.steps} steps, start {s.initial} (train:rollout)")
        print(format_table(out["rows"]))
        sm = out["summary"]
        if "weight_delivery" in sm:
            print(format_links(sm["weight_delivery"]))
        print(f"best static split {sm['best_static_split']}; DynaResize {100 * sm['gain_vs_best_static']:+.1f}% throughput, "
              f"{100 * sm['fraction_of_oracle']:.1f}% of oracle, {sm['switches']} switches, "
              f"{100 * sm['overhead_hidden_fraction']:.0f}% of switch overhead hidden")
        if args.json:
            print(json.dumps(sm))
        return 0
    run_dir = Path(args.out) if args.out else Path(cfg.run.output_dir) / f"{cfg.run.name}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, run_dir)
    log = cfg.sim.write_events
    t0 = time.perf_counter()
    forced = _forced(cfg)
    pm = cfg.sim.pipeline
    if pm.model == "samples":
        if forced:
            raise ConfigError("policy.forced_splits: scripted resizes are a step-level feature (sim.pipeline.model=step)")
        res = run_samples(s, s.initial, SimMechanisms(pm.continuous_rollout, pm.streaming_training, cfg.policy.enabled,
                                                      pm.gradient_helpers, pm.tail_consolidation), log)
    else:
        res = run_dynamic(s, log, forced=forced) if cfg.policy.enabled else run_static(s, s.initial, log, forced=forced)
    wall = time.perf_counter() - t0
    if log:
        head = make_event(EventType.RUN_START, 0.0, run_id=f"{cfg.run.name}-seed{cfg.run.seed}", source="sim", world_size=cfg.cluster.gpus,
                          wall_time=0.0, train_ranks=f"0-{s.initial.n_train - 1}" if s.initial.n_train > 1 else "0",
                          rollout_ranks=f"{s.initial.n_train}-{cfg.cluster.gpus - 1}" if s.initial.n_rollout > 1 else str(s.initial.n_train))
        tail = make_event(EventType.RUN_END, round(res.total_s, 6), status="completed", steps=res.steps)  # rounded like every event
        path = run_dir / "events.jsonl"
        path.unlink(missing_ok=True)
        with EventLog(path, t0=0.0) as ev:
            ev.write_many([head, *res.events, tail])
    summary = dict(run=res.name, total_s=res.total_s, throughput=res.throughput, samples=res.samples, steps=res.steps,
                   switches=res.switches, overhead_s=res.overhead_s, critical_s=res.critical_s,
                   overhead_hidden_fraction=res.hidden_fraction, wall_s=wall, events=len(res.events or []))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{res.name}: {res.steps} steps in {res.total_s:.0f} simulated s, {res.throughput:.3f} samples/s, "
          f"{res.switches} switches ({100 * res.hidden_fraction:.0f}% of overhead hidden); simulated in {wall:.2f} s -> {run_dir}")
    if args.json:
        print(json.dumps(summary))
    return 0
