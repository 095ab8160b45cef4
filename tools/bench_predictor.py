"""The resize policy's two predictors in the runtime, side by side: capacity against pipeline (issue 28, item 1).

Runs the real job with the emulated accelerator (``configs/emulated-8gpu.yaml`` by default: barrier-free schedule,
resizing on, starting at the config's split) once per predictor per repetition, alternating (capacity, pipeline,
pipeline, capacity, ...), so both see the same machine load. With ``policy.predictor: pipeline`` the coordinator
hands the policy each batch with its rollout ranks' measured decode model (docs/schedule.md, "What the resize
policy observes"); the runs log that fit either way (the metric ``rollout.iteration_s``), and this bench compares
it with the timing model the emulated engine paces by (per real iteration: ``time_scale x tokens_per_token x
iteration_fixed_s``; per sequence the same x (``compute_per_seq_s`` + the KV reads at the run's mean context)).

Prints a table (samples per wall second over the run's span, switches and where, the split at the end, the fit
against the model; for the pipeline runs their own split played on their logged batches over their measured step
times, with the measured command latency and with none) then ONE JSON line: ``pipeline_vs_capacity`` (median
samples/s ratio), the medians of each, ``fit_vs_model_iteration_s`` and ``fit_vs_model_seq_iteration_s`` (the
fit's median over steps, over the model's), ``played_vs_measured``, ``played_vs_measured_no_latency`` and
``command_latency_s`` (the logged ``control.round_trip_s``), medians over the pipeline runs.

    .venv/bin/python tools/bench_predictor.py --steps 20 --reps 2          # ~6 min at time scale 0.02
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.bench_emulated import observed, one_run  # noqa: E402


def decode_fit_vs_model(run_dir: Path) -> tuple[float, float]:
    """The logged fit's median over steps, over the timing model's, for (iteration_s, seq_iteration_s)."""
    from dynaresize.config.loader import load_config
    from dynaresize.emulation.model import TimingModel

    cfg = load_config(run_dir / "config.yaml")
    m = TimingModel(cfg)
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    fits = [e for e in events if e.get("name") == "rollout.iteration_s"]
    if not fits:
        return float("nan"), float("nan")
    # the mean context of a decoded token: prompt + E[L^2] / 2E[L] (real tokens), over every sample of the run
    prompts, responses = [], []
    for line in (run_dir / "batches.jsonl").read_text().splitlines():
        b = json.loads(line)
        prompts += b["prompt_tokens"]
        responses += b["response_tokens"]
    tokens = sum(responses)
    context = (sum(p * r for p, r in zip(prompts, responses)) + sum(r * r for r in responses) / 2) / max(1, tokens)
    w = m.decode_iteration_s(1, context) - (m.decode_iteration_s(2, context) - m.decode_iteration_s(1, context))
    u = m.decode_iteration_s(2, context) - m.decode_iteration_s(1, context)
    fw = statistics.median(e["value"] for e in fits)
    fu = statistics.median(e["seq_iteration_s"] for e in fits)
    return fw / w, fu / u


def played_vs_measured(run_dir: Path) -> tuple[float, float, float]:
    """A ``predictor: pipeline`` run's own split played on its logged batches (the newest ``pipeline_trace_steps``, as
    the policy plays them) against its measured step times, over the steps whose window saw no switch: (played /
    measured, the same with the command latency at 0, the median logged ``control.round_trip_s``). NaN where the run
    logged no batches."""
    from dataclasses import replace

    from dynaresize.config.loader import load_config
    from dynaresize.policy import Topology
    from dynaresize.policy.pipeline_predictor import PipelinePredictor, extrapolate
    from dynaresize.schedule.codec import decode

    wls, topo = {}, {}
    for line in (run_dir / "schedule.jsonl").read_text().splitlines():
        ev = json.loads(line).get("event") or {}
        if ev.get("type") == "StepMeasured" and ev["observation"].get("workload"):
            o = ev["observation"]
            wls[o["step"]] = decode(o["workload"])
            topo[o["step"]] = Topology(o["topology"]["n_train"], o["topology"]["n_rollout"])
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = {e["step"]: e["t"] for e in events if e.get("type") == "step_end"}
    trips = [e["value"] for e in events if e.get("name") == "control.round_trip_s"]
    pol = load_config(run_dir / "config.yaml").policy
    n = pol.pipeline_trace_steps  # the policy's window, drift and efficiency (ResizePolicy.step)

    def play(tr):
        return tr if pol.pipeline_lead_steps is None else extrapolate(tr, pol.pipeline_lead_steps, pol.pipeline_trend_z)

    steady = [k for k in sorted(wls) if k >= n - 1 and k - 1 in ends and all(topo.get(j) == topo[k] for j in range(k - n + 1, k + 1))]
    if not steady:
        return float("nan"), float("nan"), float("nan")
    pp = PipelinePredictor(pol.train_scaling_per_doubling)
    played, zero, measured = [], [], []
    for k in steady:
        tr = tuple(wls[j] for j in range(k - n + 1, k + 1))
        played.append(pp.period_s(play(tr), topo[k]))
        zero.append(pp.period_s(play(tuple(replace(w, command_latency_s=0.0) for w in tr)), topo[k]))
        measured.append(ends[k] - ends[k - 1])
    m = statistics.mean(measured)
    return statistics.mean(played) / m, statistics.mean(zero) / m, statistics.median(trips) if trips else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/emulated-8gpu.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2, help="runs per predictor (alternating)")
    ap.add_argument("-o", "--override", action="append", default=[], help="extra dotted override for every run")
    args = ap.parse_args()
    order = [p for i in range(args.reps) for p in (("capacity", "pipeline") if i % 2 == 0 else ("pipeline", "capacity"))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-predictor-") as tmp:
        for i, pred in enumerate(order):
            rd = one_run(Path(tmp) / str(i), args.config, [f"run.steps={args.steps}", f"policy.predictor={pred}",
                                                            *args.override])
            obs = observed(rd)
            summary = json.loads((rd / "summary.json").read_text())
            fw, fu = decode_fit_vs_model(rd)
            pm, pm0, trip = played_vs_measured(rd) if pred == "pipeline" else (float("nan"),) * 3
            load = float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").exists() else float("nan")
            rows.append({"predictor": pred, "samples_per_s": round(obs["samples_per_s"], 3), "switches": obs["switches"],
                         "path": " ".join(f"{s['step']}:{s['from']}>{s['to']}" for s in summary["switches"]) or "-",
                         "fit_w": round(fw, 3), "fit_u": round(fu, 3), "load": load, "played": round(pm, 3),
                         "played_c0": round(pm0, 3), "latency_s": round(trip, 4)})
    print(f"{'predictor':>10} {'samples/s':>10} {'switches':>8} {'fit/model w':>11} {'fit/model u':>11} "
          f"{'played/measured':>15} {'(latency 0)':>11} {'latency s':>9} {'load':>5}  path")
    for r in rows:
        print(f"{r['predictor']:>10} {r['samples_per_s']:>10.3f} {r['switches']:>8} {r['fit_w']:>11.3f} {r['fit_u']:>11.3f} "
              f"{r['played']:>15.3f} {r['played_c0']:>11.3f} {r['latency_s']:>9.4f} {r['load']:>5.1f}  {r['path']}")
    piped = [r for r in rows if r["predictor"] == "pipeline" and r["played"] == r["played"]]
    med = {p: statistics.median(r["samples_per_s"] for r in rows if r["predictor"] == p) for p in ("capacity", "pipeline")}
    print(json.dumps({
        "pipeline_vs_capacity": round(med["pipeline"] / med["capacity"], 4),
        "capacity_samples_per_s": med["capacity"], "pipeline_samples_per_s": med["pipeline"],
        "fit_vs_model_iteration_s": round(statistics.median(r["fit_w"] for r in rows), 3),
        "fit_vs_model_seq_iteration_s": round(statistics.median(r["fit_u"] for r in rows), 3),
        "played_vs_measured": round(statistics.median(r["played"] for r in piped), 3) if piped else None,
        "played_vs_measured_no_latency": round(statistics.median(r["played_c0"] for r in piped), 3) if piped else None,
        "command_latency_s": round(statistics.median(r["latency_s"] for r in piped), 4) if piped else None,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
