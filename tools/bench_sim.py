"""Simulator benchmark: every scenario in configs/sim compared side by side, and the simulators' wall time at 4096 GPUs.

    .venv/bin/python tools/bench_sim.py                 # every scenario, every row (tens of minutes on 2 busy cores)
    .venv/bin/python tools/bench_sim.py --scenarios paper_8gpu stationary_8gpu --steps-cap 0

Per scenario, one table (rows measured in one run: each static split with the barrier, today's DynaResize, naive,
greedy, the sample-level rows with each barrier-free mechanism added in turn, the barrier oracle and the bound), then
a summary table, then ONE JSON object as the last line. Targets (issue 28): DynaResize with every mechanism >= 90%
of the tight bound (``all_mechanisms_fraction_of_tight_bound``) and >= 85% of the work-conserving one
(``all_mechanisms_fraction_of_bound``) in every scenario; ahead of the best static split with the barrier in every drifting scenario, never
more than 1% behind it in a stationary one; the sample-level model at 4096 GPUs x 1000 steps under 60 s and at 512
GPUs x 500 steps under 10 s (the step-level one at 4096 x 1000 under 10 s), each run timed whole (not projected).
Beside them (not a target of the issue): the runtime's mechanisms (continuous rollout + streaming training, no
gradient helpers) against the tight bound of the schedules without helpers
(``runtime_mechanisms_fraction_of_helper_free_tight_bound``, column ``%t_rt``): the full tight bound lets a batch
train on helpers at the simulator's assumed ``helper_rate`` with no data-parallel loss, most of its distance at 64 GPUs.
Scenarios on the empirical CPU model (cpu_quickstart) get no sample-level rows: that model has no decode physics to
follow per GPU. The sample-level model costs about a millisecond of Python per GRPO
group on a busy machine, so scenarios longer than ``--steps-cap`` steps run (every row alike) with that many steps,
said in their heading. The timing runs (every mechanism, no event log) report wall and CPU seconds and the machine's
load average beside them (the machine is shared: wall time moves with the load). ``--timing-only`` skips the scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynaresize.config.loader import ConfigError, load_config  # noqa: E402
from dynaresize.sim.mechanisms import SimMechanisms  # noqa: E402
from dynaresize.sim.compare import SAMPLE_ROWS, compare, format_table, run_dynamic, run_samples, setup  # noqa: E402

EVERY = SAMPLE_ROWS[-1][2]  # every mechanism (the summary's "all mechanisms" run)
BEFORE_CONSOLIDATION = SimMechanisms(True, True, True, True)  # every mechanism but tail consolidation (the timings before it)

STATIONARY = {"stationary_8gpu", "cpu_quickstart"}


def scenarios() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs/sim").glob("*.yaml") if p.stem != "base")


def timed(name: str, samples: bool, steps: int, mech: SimMechanisms = EVERY) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and the 1-minute load average at its end of one whole run of scenario ``name`` with
    ``steps`` steps (sample level: with ``mech``, every mechanism by default; no event log)."""
    cfg = load_config(ROOT / f"configs/sim/{name}.yaml", [f"sim.steps={steps}", "sim.write_events=false"])
    s = setup(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    if samples:
        run_samples(s, s.initial, mech)
    else:
        run_dynamic(s, False)
    return time.perf_counter() - t0, time.process_time() - c0, os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="*", help="scenario names (default: every file in configs/sim except base)")
    ap.add_argument("--steps-cap", type=int, default=200, help="run longer scenarios with this many steps (0: as configured)")
    ap.add_argument("--timing-only", action="store_true", help="only the timing runs (no scenario)")
    ap.add_argument("--no-timing", action="store_true", help="skip the whole timed 512- and 4096-GPU runs")
    ap.add_argument("--predictors", nargs="*", default=["capacity", "pipeline"], choices=["capacity", "pipeline"],
                    help="policy.predictor values whose all-mechanisms run is compared side by side (the configured one's "
                         "is the table's main row)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every scenario (e.g. policy.rollout_model=decode)")
    args = ap.parse_args(argv)
    try:  # a bad --set is named before any scenario runs
        load_config(ROOT / "configs/sim/paper_8gpu.yaml", ["sim.write_events=false", *args.set])
    except ConfigError as e:
        ap.error(str(e))
    names = [] if args.timing_only else (args.scenarios or scenarios())
    out: dict = {"scenarios": {}}
    lines = []
    for name in names:
        cfg = load_config(ROOT / f"configs/sim/{name}.yaml", ["sim.write_events=false", *args.set])
        capped = bool(args.steps_cap) and cfg.sim.steps > args.steps_cap
        if capped:
            cfg = load_config(ROOT / f"configs/sim/{name}.yaml", ["sim.write_events=false", f"sim.steps={args.steps_cap}", *args.set])
        samples = cfg.sim.rollout.model == "physics"
        r = compare(setup(cfg), samples=samples, predictors=tuple(args.predictors))
        sm = r["summary"]
        print(f"== {name}: {cfg.cluster.gpus} GPUs, {cfg.sim.steps} steps, start {sm['initial_split']}"
              + (" (steps capped by --steps-cap)" if capped else ""))
        print(format_table(r["rows"]))
        print()
        out["scenarios"][name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sm.items()}
        allg = sm.get("all_mechanisms_gain_vs_best_static")
        allb = sm.get("all_mechanisms_fraction_of_bound")
        allt = sm.get("all_mechanisms_fraction_of_tight_bound")
        rtf = sm.get("runtime_mechanisms_fraction_of_helper_free_tight_bound")
        if allg is None:
            target = "n/a (no sample level)"
        else:  # issue 28: >= 90% of the tight bound, >= 85% of the work-conserving one
            ahead = allg >= -0.01 if name in STATIONARY else allg > 0
            target = "met" if ahead and allt >= 0.9 and allb >= 0.85 else "MISSED"
            cap_t, cap_b = sm["helper_free_ceiling_of_tight_bound"], sm["helper_free_ceiling_of_bound"]
            if cap_t < 0.9 or cap_b < 0.85:  # out of reach of every schedule without gradient helpers (a proof)
                target += f" (without helpers at most {100 * cap_t:.1f}% / {100 * cap_b:.1f}%)"
        out["scenarios"][name]["target"] = target
        out["scenarios"][name]["steps_capped"] = capped
        fmt = lambda x: "-" if x is None else f"{100 * x:+.1f}%"  # noqa: E731
        adds = sm.get("mechanisms", {})
        lines.append(f"{name:<18} {sm['best_static_split']:>10} {fmt(sm['gain_vs_best_static']):>9} "
                     f"{100 * sm['fraction_of_bound']:>7.1f}% {fmt(allg):>9} "
                     f"{'-' if allb is None else f'{100 * allb:.1f}%':>8} "
                     f"{'-' if allt is None else f'{100 * allt:.1f}%':>7} "
                     f"{'-' if rtf is None else f'{100 * rtf:.1f}%':>6} "
                     + " ".join(f"{fmt(adds[k]['adds']) if k in adds else '-':>9}" for k in ("barrier", "continuous_rollout", "streaming_training", "gradient_helpers", "tail_consolidation"))
                     + f" {fmt(sm.get('all_mechanisms_gain_vs_best_static_samples')):>9} {sm['compare_wall_s']:>7.1f} {target}")
    preds = [(n, sc.get("all_mechanisms_by_predictor", {})) for n, sc in out["scenarios"].items()]
    if any(bp for _, bp in preds):
        print("every mechanism, by policy.predictor (gain vs the best static barrier split; % of the work-conserving / tight bound; switches):")
        for n, bp in preds:
            print(f"{n:<18} " + " | ".join(f"{p}: {100 * v['gain_vs_best_static']:+.1f}% {100 * v['fraction_of_bound']:.1f}% "
                                           f"{100 * v['fraction_of_tight_bound']:.1f}% {v['switches']} sw" for p, v in bp.items()))
    if not args.no_timing:
        wall_step, _, _ = timed("scale_4096gpu", False, 1000)
        w512, c512, l512 = timed("scale_512gpu", True, 500)
        w4096, c4096, l4096 = timed("scale_4096gpu", True, 1000)
        w512b, c512b, _ = timed("scale_512gpu", True, 500, BEFORE_CONSOLIDATION)
        w4096b, c4096b, _ = timed("scale_4096gpu", True, 1000, BEFORE_CONSOLIDATION)
    print(f"{'scenario':<18} {'best':>10} {'dyn_step':>9} {'%bound':>8} {'dyn_all':>9} {'%bound':>8} {'%tight':>7} {'%t_rt':>6} "
          f"{'+barrier':>9} {'+contin.':>9} {'+stream':>9} {'+helpers':>9} {'+consol.':>9} {'vs_s_bst':>9} {'wall_s':>7} target")
    print("\n".join(lines))
    print("dyn_step: today's DynaResize (barrier, step level) vs the best static split; dyn_all: every mechanism (sample "
          "level); %bound: of the work-conserving bound; %tight: of the tight bound; %t_rt: the runtime's mechanisms (cont+stream) of the tight bound without helpers; 'without helpers at most': the most any schedule without gradient helpers can reach of the tight / the work-conserving bound (it takes at least the tight bound without helpers); +barrier/+contin./+stream/+helpers/+consol.: what each adds in turn; vs_s_bst: dyn_all vs the best split at sample level")
    if args.no_timing:
        print(json.dumps(out))
        return 0
    print(f"4096 GPUs x 1000 steps: step-level {wall_step:.2f} s; sample-level (all mechanisms, whole run) {w4096:.1f} s "
          f"wall, {c4096:.1f} s CPU, load {l4096:.1f} (target 60 s: {'met' if w4096 <= 60 else 'MISSED'})")
    print(f"512 GPUs x 500 steps: sample-level (all mechanisms, whole run) {w512:.1f} s wall, {c512:.1f} s CPU, load "
          f"{l512:.1f} (target 10 s: {'met' if w512 <= 10 else 'MISSED'})")
    print(f"without tail consolidation: 4096 x 1000 {w4096b:.1f} s wall, {c4096b:.1f} s CPU; 512 x 500 {w512b:.1f} s wall, "
          f"{c512b:.1f} s CPU")
    out["sim_4096x1000_wall_s"] = round(wall_step, 3)
    out["sim_4096x1000_sample_level_s"] = round(w4096, 1)
    out["sim_4096x1000_sample_level_cpu_s"] = round(c4096, 1)
    out["sim_512x500_sample_level_s"] = round(w512, 2)
    out["sim_512x500_sample_level_cpu_s"] = round(c512, 2)
    out["sim_4096x1000_sample_level_no_consolidation_s"] = round(w4096b, 1)
    out["sim_4096x1000_sample_level_no_consolidation_cpu_s"] = round(c4096b, 1)
    out["sim_512x500_sample_level_no_consolidation_s"] = round(w512b, 2)
    out["sim_512x500_sample_level_no_consolidation_cpu_s"] = round(c512b, 2)
    out["timing_load_avg_1min"] = [round(l512, 2), round(l4096, 2)]  # at the end of the 512 and the 4096 run
    out["cpu_cores"] = os.cpu_count()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
