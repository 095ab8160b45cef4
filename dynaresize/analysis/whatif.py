"""``dynaresize analyze RUN --whatif``: the run's own work replayed through the simulator, every schedule side by side.

Which split should the run have used, and what did resizing (and each barrier-free mechanism) buy? The run's
measured work goes through :func:`dynaresize.sim.compare.compare` (both pipeline models) and the rows are printed
against the time the run took. How the work and the costs are taken, by the kind of run:

- **simulated** (``source: sim`` in the event log): its own ``config.yaml`` again; the same seed draws the same
  batches, so the replay is the run's own model;
- **emulated** (``cluster.device: emulated``, :func:`emulated_sim_config`): the config's own GPU profile
  (``sim.rollout``, ``sim.train``, ``switching.costs``), the workload the trace of its ``batches.jsonl`` with
  ``trace_token_scale = emulation.tokens_per_token``; modelled seconds x ``emulation.time_scale`` = wall seconds;
- **real CPU** (any other runtime log): the calibrated fit (:func:`dynaresize.analysis.calibrate.to_costs_section`:
  train rate and step overhead, switch-op medians, empirical rollout rate and overhead, the schedule the run ran:
  barrier with its mechanisms on the scheduler core, barrier_lockstep with the coordinator's gap for a run of the
  retired lockstep loop) and the trace of its ``batches.jsonl`` (when it holds per-sample lengths; else the log's
  per-step mean lengths, with an assumed shape). The sample-level rows need decode physics, which a stage-time fit
  does not give: :func:`cpu_decode_physics` maps the fitted rate onto it (fitted: one rank's tokens/s; assumed: a
  CPU iteration costs per sequence in the batch, no fixed part, no KV or prefill term, no slot cap), and the
  fitted per-stage rollout overhead has no place there, so those rows leave it out (the output says so).

The row ``own schedule (replay)``: the run's own split schedule through the step-level model (below); ``own split
(replay)``, for a run without switches, its own split and schedule (barrier or continuous) through the sample-level
model, which follows the runtime's commands (one command's groups per rank at a time, each
``sim.command_latency_s`` late).

The measured time is the run's span as ``dynaresize analyze`` measures it (``totals.span_s``: the earliest step
start or busy interval to the latest step end). The row ``own schedule (replay)`` is the run's own split schedule
(its switches as ``policy.forced_splits``, step level, barrier) through the same model: how far the replay is from
the measured time, before any what-if is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from dynaresize import atomic
from dynaresize.analysis.calibrate import schedule_label, to_costs_section
from dynaresize.analysis.fit import fit_command_latency, fit_costs, ran_lockstep
from dynaresize.analysis.metrics import analyze
from dynaresize.analysis.reader import RunData, load_run
from dynaresize.config.loader import ConfigError, load_config
from dynaresize.config.schema import Config
from dynaresize.sim.trace import TraceError, load_trace, trace_file

MIN_GAIN = 0.01  # below a 1% gain from the best static split to all mechanisms, no share of it is given
MEASURED_HOW = "span_s of dynaresize analyze: earliest step start or busy interval to the latest step end"

# the sample-level chain, in the order the mechanisms are turned on: (summary key, compare row, label)
CHAIN = (
    ("resizing", "dyn barrier (samples)", "resizing (barrier)"),
    ("continuous_rollout", "dyn +continuous", "+ continuous rollout"),
    ("streaming_training", "dyn +cont+stream", "+ streaming training"),
    ("gradient_helpers", "dyn +cont+stream+helpers", "+ gradient helpers"),
)
SAMPLE_ROW_NAMES = {"best static (samples)"} | {c for _, c, _ in CHAIN}


@dataclass
class Replay:
    """What the simulator replays for one run: the config, the factor to the run's clock, and what was assumed."""

    kind: str  # simulated | emulated | cpu
    cfg: Config
    time_scale: float = 1.0  # run seconds per simulated second
    samples_cfg: Config | None = None  # the sample-level rows' config when it differs (the CPU decode mapping)
    fit: dict | None = None  # dynaresize calibrate's fit of the run, when the replay was built from it
    notes: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # what is assumed rather than measured, or not modelled


def _run_dir(path: str | Path) -> Path:
    p = Path(path)
    return p.parent if p.name == "events.jsonl" else p


def _config(run_dir: Path) -> Config:
    f = run_dir / "config.yaml"
    if not f.is_file():
        raise ConfigError(f"{f}: no config.yaml in the run directory (the what-if replays the run's own config)")
    return load_config(f)


def with_values(cfg: Config, values: dict[str, object], origin: str) -> Config:
    """``cfg`` with dotted keys set (``{"sim.steps": 30}``), validated again; a ConfigError names the key."""
    data = cfg.model_dump()
    for dotted, v in values.items():
        node, parts = data, dotted.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = v
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        from dynaresize.sim.cli import error_key

        raise ConfigError("; ".join(f"{error_key(er)}: {er['msg'].removeprefix('Value error, ')} ({origin})"
                                    for er in e.errors())) from None


def _trace_steps(run_dir: Path) -> int:
    return len(load_trace(run_dir).steps)


def emulated_sim_config(run: str | Path, fitted: bool = True) -> tuple[Config, float]:
    """The simulator config that models an emulated run, and the wall seconds per modelled second.

    The run's own config (its GPU profile: ``sim.rollout``, ``sim.train``, ``switching.costs``; its cluster,
    policy and staleness), the workload the trace of its ``batches.jsonl`` with every length times
    ``emulation.tokens_per_token``, ``sim.steps`` the trace's steps, and the schedule the runtime's (barrier; the
    simulator's barrier_lockstep for a run of the retired lockstep loop, :func:`ran_lockstep`, with no coordinator
    gap: the modelled profile has none), and what the run's own log says its control plane cost
    (:func:`fitted_fixed_costs`: real wall time, whatever the emulation's clock; ``fitted=False``: the profile
    alone). Multiply the simulator's seconds by the returned ``emulation.time_scale`` to compare with the run's wall
    time.
    """
    run_dir = _run_dir(run)
    cfg = _config(run_dir)
    if cfg.cluster.device != "emulated":
        raise ConfigError(f"{run_dir / 'config.yaml'}: cluster.device is {cfg.cluster.device!r}, not an emulated run")
    tf = trace_file(run_dir)
    try:
        steps = _trace_steps(run_dir)
    except TraceError as e:
        raise ConfigError(f"sim.workload.trace: {e}") from None
    values: dict[str, object] = {
        "sim.workload.trace": str(tf), "sim.workload.trace_token_scale": cfg.emulation.tokens_per_token,
        "sim.workload.response_tokens_by_step": [], "sim.workload.tasks": [], "sim.workload.task_weights": {},
        "sim.workload.cap_share": 0.0, "sim.workload.cap_share_end": None, "sim.workload.dynamic_sampling.enabled": False,
        "sim.steps": steps,
    }
    lockstep = ran_lockstep(run_dir)
    if lockstep:
        values.update({"sim.schedule": "barrier_lockstep", "sim.step_gap_s": 0.0})
    values.update(runtime_admission(cfg, lockstep))
    if fitted:
        values.update(fitted_fixed_costs(fit_command_latency(load_run(run_dir)), cfg.emulation.time_scale))
    return with_values(cfg, values, f"emulated run {run_dir}"), cfg.emulation.time_scale


def fitted_fixed_costs(lat: dict, time_scale: float) -> dict[str, object]:
    """What an emulated run's control plane cost, as the simulator's settings in modelled seconds (wall seconds /
    ``time_scale``: they do not shrink with the emulation's clock), from
    :func:`dynaresize.analysis.fit.fit_command_latency` of its log: ``sim.command_latency_s`` (a training chunk's
    latency, charged to every command) and, when its optimizer steps were logged, ``sim.train.step_overhead_s`` (a
    step's measured time from its last trainer's start, and its own latency less the one charged). The second
    replaces the profile's step time: the measured one already holds it (the emulated step lasts at least its
    modelled time), and whatever the CPU's real step added."""
    out: dict[str, object] = {"sim.command_latency_s": (lat["command_latency_s"] or 0.0) / time_scale}
    step = lat["optimizer_step"]["overhead_s"]
    if step is not None:
        out["sim.train.step_overhead_s"] = step / time_scale
    return out


def runtime_admission(cfg: Config, lockstep: bool = False) -> dict[str, object]:
    """How the runtime hands out and trains work, as the sample-level simulator's settings. In the continuous
    schedule (``rollout.max_running`` not 0) a rank batches continuously over its KV slots (``max_running``, null:
    ``pull_batch``, capped by ``sim.rollout.max_seqs_per_gpu``: dynaresize.emulation.engine), a sequence entering as
    one leaves: a simulated GPU with as many slots that claims one group at a time (its finest grain). Otherwise the
    torch engine decodes one command's batch at a time (``pipeline.groups_per_command`` groups; ``rollout.pull_batch``
    samples in a run of the retired lockstep loop, ``lockstep``), so a simulated GPU holds at most that many
    sequences and claims that many groups once it has drained.
    A streamed training chunk starts with ``pipeline.stream_min_groups`` complete groups; the trainers hold
    ``pipeline.train_queue`` training commands at once (1 in the retired lockstep loop), and a rollout rank holds one
    group queued beyond its KV slots' worth, so its refills never wait the control plane: the simulator's ``claim_ahead``."""
    p, r = cfg.pipeline, cfg.rollout
    per_cmd = r.pull_batch if lockstep else p.groups_per_command * r.group_size
    if not lockstep and r.max_running != 0:
        slots, claim = min(r.kv_slots, cfg.sim.rollout.max_seqs_per_gpu), 1
    else:
        slots, claim = max(1, per_cmd), max(1, per_cmd // r.group_size)
    return {"sim.rollout.max_seqs_per_gpu": slots, "sim.pipeline.claim_groups": claim,
            "sim.pipeline.stream_chunks": max(1, r.prompts_per_step // p.stream_min_groups),
            "sim.pipeline.train_queue": 1 if lockstep else p.train_queue,
            "sim.pipeline.claim_ahead": not lockstep,  # a rank holds a group queued (job.handout.QUEUED_GROUPS)
            "sim.workload.prompts_per_step": r.prompts_per_step, "sim.workload.responses_per_prompt": r.group_size}


def cpu_decode_physics(cfg: Config, tokens_per_s: float, overhead_s: float) -> Config:
    """The fitted CPU rollout (overhead per stage + tokens / rate per rank) as the sample-level decode physics.

    Fitted: ``compute_per_seq_s = 1 / tokens_per_s`` (one rank's generated tokens per second: a CPU is
    compute-bound, an iteration costs in proportion to the sequences it decodes) and ``iteration_fixed_s`` = the
    fitted per-stage overhead / the mean over steps of the longest response (ASSUMPTION: the part that does not
    shrink with more ranks is a fixed cost per decode iteration, paid until a rank's longest response ends; the
    tiny model's forward pass is dominated by per-call overhead). Assumed: no KV-read or prefill cost (both are in
    the fitted rate) and no slot cap (``max_seqs_per_gpu`` = a whole step's samples).
    """
    from dynaresize.sim.workload import make_batch

    w, steps = cfg.sim.workload, cfg.sim.steps
    batches = [make_batch(w, cfg.run.seed, k, steps) for k in range(steps)]
    longest = sum(float(b.lengths.max()) for b in batches) / steps
    return with_values(cfg, {
        "sim.rollout.model": "physics", "sim.rollout.iteration_fixed_s": max(overhead_s, 1e-9) / longest,
        "sim.rollout.compute_per_seq_s": 1.0 / tokens_per_s, "sim.rollout.kv_bytes_per_token": 0.0,
        "sim.rollout.prefill_tokens_per_s": 1e15,
        "sim.rollout.max_seqs_per_gpu": max(len(b.lengths) for b in batches),
    }, "CPU decode mapping")


def _cpu_replay(run_dir: Path, rd: RunData) -> Replay:
    from dynaresize.sim.cli import merge_sections

    from dynaresize.analysis.fit import fit_busy, unfitted

    fit = fit_costs(rd)
    busy_note = []
    for stage in ("rollout", "train"):  # a stage whose wall spans cannot be fitted: its busy seconds (fit_busy)
        if fit[stage]["tokens_per_s_per_gpu"] is None:
            busy = fit_busy(rd, stage)
            if busy["tokens_per_s_per_gpu"] is None:
                raise ConfigError(
                    f"{run_dir}: the run's {stage} throughput cannot be fitted: its stage spans: {unfitted(fit[stage])}; "
                    f"its busy seconds (step_end {stage}_s): {unfitted(busy)}. Nothing to replay: a run whose "
                    f"{stage} tokens per rank vary more (more steps, longer responses: rollout.max_tokens, or a resize) "
                    f"lets it be fitted")
            busy_note.append(f"{stage} from its busy seconds per step (its wall spans: {unfitted(fit[stage])})")
            fit[stage] = busy
    sections = to_costs_section(fit)
    cfg = merge_sections(_config(run_dir), f"calibrated fit of {run_dir}", sections)
    notes = [f"costs: dynaresize calibrate's fit of this run (train {fit['train']['tokens_per_s_per_gpu']:.0f} tokens/s "
             f"per rank + {max(fit['train']['overhead_s'], 0):.3f} s/step; rollout {fit['rollout']['tokens_per_s_per_gpu']:.0f} "
             f"tokens/s per rank + {max(fit['rollout']['overhead_s'], 0):.3f} s/stage; switch ops: logged medians; "
             f"{schedule_label(fit['schedule'])}"
             + (f"; {'; '.join(busy_note)}" if busy_note else "") + ")"]
    steps = len(rd.steps)
    values: dict[str, object] = {}
    try:
        n_trace = _trace_steps(run_dir)
    except TraceError as e:
        n_trace = 0
        notes.append(f"workload: per-step mean response lengths from the event log, length shape assumed (no trace: {e})")
    if n_trace:
        steps = min(steps, n_trace)
        values.update({"sim.workload.trace": str(trace_file(run_dir)), "sim.workload.trace_token_scale": 1.0,
                       "sim.workload.response_tokens_by_step": []})
        notes.append(f"workload: the trace of {trace_file(run_dir)} (every sample's logged length)")
    values["sim.steps"] = steps
    cfg = with_values(cfg, values, f"CPU run {run_dir}")
    r = fit["rollout"]
    overhead = max(r["overhead_s"], 0.0)
    sc = cpu_decode_physics(cfg, r["tokens_per_s_per_gpu"], overhead)
    rep = Replay("cpu", cfg, samples_cfg=sc, notes=notes, fit=fit)
    rep.left_out.append(
        f"GPU-like decode physics: the sample-level rows map the fitted CPU rollout onto it (cpu_decode_physics: "
        f"compute_per_seq_s = 1 / {r['tokens_per_s_per_gpu']:.0f} tokens/s fitted; iteration_fixed_s = "
        f"{sc.sim.rollout.iteration_fixed_s:.4g} s = the fitted {overhead:.3f} s stage overhead spread over the mean "
        "longest response, assumed; no KV, prefill or slot cap, assumed); step-level rows, oracle and bound use the "
        "fitted empirical rollout as it is")
    return rep


def replay_of(run: str | Path, rd: RunData | None = None) -> Replay:
    """How the simulator replays ``run`` (see the module docstring)."""
    run_dir = _run_dir(run)
    rd = rd or load_run(run)
    cfg = _config(run_dir)
    if rd.source == "sim":
        return Replay("simulated", cfg, notes=["replay: the run's own config and seed (the same batches)"])
    if cfg.cluster.device == "emulated":
        c, scale = emulated_sim_config(run_dir)
        return Replay("emulated", c, time_scale=scale, notes=[
            f"profile: the run's own sim.rollout, sim.train and switching.costs; workload: the trace of {trace_file(run_dir)} "
            f"x {c.sim.workload.trace_token_scale:g} tokens per token; modelled s x {scale:g} = wall s; control-plane "
            f"latency {c.sim.command_latency_s * scale:.4g} wall s a command and optimizer step "
            f"{c.sim.train.step_overhead_s * scale:.4g} wall s after it, fitted from the log's spans (fit_command_latency)"])
    return _cpu_replay(run_dir, rd)


def _filtered_note(rep: Replay) -> Replay:
    """A runtime run with dynamic sampling logged only its kept groups: the dropped groups' rollout is missing."""
    if rep.kind != "simulated" and rep.cfg.algorithm.dynamic_sampling.enabled:
        rep.left_out.append("dynamic sampling: batches.jsonl holds the trained (kept) groups only, so the rollout of "
                            "the dropped groups is not replayed (every rollout row is short of that work)")
    return rep


def _policy_on(rep: Replay) -> Replay:
    """The resizing rows answer "what would resizing have bought": a run with ``policy.enabled: false`` (a static
    run) is replayed with its policy settings turned on."""
    if rep.cfg.policy.enabled:
        return rep
    on = {"policy.enabled": True}
    rep.cfg = with_values(rep.cfg, on, "what-if")
    if rep.samples_cfg is not None:
        rep.samples_cfg = with_values(rep.samples_cfg, on, "what-if")
    rep.notes.append("resizing rows: the run's policy settings, turned on (the run itself had policy.enabled: false)")
    return rep


def _forced(rd: RunData, rep: Replay) -> dict[int, int]:
    cfg, notes = rep.cfg, rep.notes
    fit_splits = (rep.fit or fit_costs(rd))["forced_splits"]
    ok = {k: n for k, n in fit_splits.items() if 1 <= k < cfg.sim.steps and 1 <= n <= cfg.cluster.gpus - 1}
    if len(ok) < len(fit_splits):
        notes.append(f"own schedule: {len(fit_splits) - len(ok)} logged switch(es) outside the replayed steps left out")
    return ok


def whatif(run: str | Path) -> dict:
    """Replay ``run`` and return the what-if: measured time, one row per schedule, the mechanisms' shares."""
    from dynaresize.sim.compare import compare, run_samples, run_static, setup

    rd = load_run(run)
    rep = _policy_on(_filtered_note(replay_of(run, rd)))
    measured = analyze(rd).totals["span_s"]
    s = setup(rep.cfg)
    k = rep.time_scale
    forced = _forced(rd, rep)
    own = run_static(s, s.initial, forced=forced)
    cmp = compare(s, samples=rep.samples_cfg is None)
    by = {r["name"]: r for r in cmp["rows"]}
    sm = cmp["summary"]
    samples_split = sm["best_static_split"]
    if rep.samples_cfg is not None:  # the sample-level rows from their own physics (and their own best split)
        sc = compare(setup(rep.samples_cfg), samples=True)
        samples_split = sc["summary"]["best_static_split"]
        by.update({r["name"]: r for r in sc["rows"] if r["name"] in SAMPLE_ROW_NAMES})
    best_name = f"static {sm['best_static_split']}"
    rows = [dict(name="measured (the run)", model="event log", time_s=measured)]

    def row(name: str, key: str, model: str) -> dict:
        return dict(name=name, model=model, time_s=by[key]["total_s"] * k, switches=by[key]["switches"])

    rows.append(dict(name="own schedule (replay)", model="step", time_s=own.total_s * k, switches=own.switches))
    own_samples = None
    if not forced:  # a static run: its own split and schedule at sample level too (the model that follows commands)
        from dynaresize.schedule import Mechanisms

        sc = rep.samples_cfg or rep.cfg
        cont = sc.pipeline.schedule == "barrier_free"
        ss = setup(sc) if rep.samples_cfg is not None else s
        own_samples = run_samples(ss, ss.initial, Mechanisms(cont, cont and sc.pipeline.streaming_training, False))
        rows.append(dict(name="own split (replay)", model="samples", time_s=own_samples.total_s * k, switches=0))
    rows.append(row(f"best static {sm['best_static_split']} (barrier)", best_name, "step"))
    rows.append(row("barrier + resizing", "dynaresize", "step"))
    rows.append(row(f"best static {samples_split} (barrier)", "best static (samples)", "samples"))
    for key, cname, label in CHAIN:
        rows.append(row(label, cname, "samples"))
    rows.append(row("oracle (barrier)", "oracle (barrier)", "step"))
    rows.append(row("tight bound", "tight bound", "step"))
    rows.append(row("bound", "bound", "step"))
    best_s = by[best_name]["total_s"] * k
    best_samples_s = by["best static (samples)"]["total_s"] * k
    for r in rows:  # sample-level rows against the best split at sample level: the two models' difference taken out
        base = best_samples_s if r["model"] == "samples" else best_s
        r["vs_measured"] = r["time_s"] / measured if measured > 0 else None
        r["vs_best_static"] = base / r["time_s"] - 1 if r["time_s"] > 0 else None
    # the share each mechanism adds, at sample level (one model): time before / time after - 1, in the order turned
    # on, and its share of the whole gain from the best static split to all mechanisms (log-time shares)
    chain_t = [by["best static (samples)"]["total_s"]] + [by[c]["total_s"] for _, c, _ in CHAIN]
    whole = math.log(chain_t[0] / chain_t[-1]) if chain_t[-1] > 0 else 0.0
    mech = {}
    for i, (key, _, _) in enumerate(CHAIN):
        step = math.log(chain_t[i] / chain_t[i + 1])
        mech[key] = dict(time_s=chain_t[i + 1] * k, adds=chain_t[i] / chain_t[i + 1] - 1,
                         share=step / whole if whole >= MIN_GAIN else None)
    return dict(
        run=rd.name, kind=rep.kind, path=str(_run_dir(run)), measured_s=measured, measured_how=MEASURED_HOW,
        time_scale=k, steps=rep.cfg.sim.steps, gpus=rep.cfg.cluster.gpus, initial_split=str(s.initial),
        own_schedule={str(a): b for a, b in sorted(forced.items())},
        replay_s=own.total_s * k, replay_vs_measured=own.total_s * k / measured if measured > 0 else None,
        replay_samples_s=own_samples.total_s * k if own_samples else None,
        replay_samples_vs_measured=own_samples.total_s * k / measured if own_samples and measured > 0 else None,
        best_static_split=sm["best_static_split"], best_static_s=best_s, resizing_s=by["dynaresize"]["total_s"] * k,
        oracle_s=by["oracle (barrier)"]["total_s"] * k, bound_s=by["bound"]["total_s"] * k,
        tight_bound_s=by["tight bound"]["total_s"] * k,
        mechanisms=mech, rows=rows, notes=rep.notes, left_out=rep.left_out,
    )


def render(w: dict) -> str:
    unit = "wall s" if w["kind"] != "simulated" else "simulated s"
    out = [f"what-if {w['run']} ({w['kind']} run, {w['gpus']} GPUs, {w['steps']} steps, start {w['initial_split']} "
           f"train:rollout; times in {unit}" + (f", modelled s x {w['time_scale']:g}" if w["time_scale"] != 1 else "") + ")",
           f"measured: {w['measured_s']:.3f} s ({w['measured_how']})"]
    out.append("vs_run: time / measured time; vs_best: throughput against the best static split of the same model")
    head = f"{'schedule':<32} {'model':>9} {'time_s':>11} {'vs_run':>7} {'vs_best':>8} {'switches':>8}"
    out += [head, "-" * len(head)]
    for r in w["rows"]:
        sw = "-" if r.get("switches") is None else str(r["switches"])
        vm = f"{r['vs_measured']:.3f}" if r["vs_measured"] is not None else "-"
        vb = f"{100 * r['vs_best_static']:+.1f}%" if r["vs_best_static"] is not None else "-"
        out.append(f"{r['name']:<32} {r['model']:>9} {r['time_s']:>11.3f} {vm:>7} {vb:>8} {sw:>8}")
    out.append("mechanisms (sample level, turned on in this order): " + "; ".join(
        f"{key} {100 * m['adds']:+.1f}%" + (f" ({100 * m['share']:.0f}% of the gain)" if m["share"] is not None else "")
        for key, m in w["mechanisms"].items()) + ("" if any(m["share"] is not None for m in w["mechanisms"].values())
                                                  else " (all together under a 1% gain: no shares)"))
    out.append(f"own schedule replayed: {w['own_schedule'] or 'no switch'} -> {w['replay_s']:.3f} s, "
               f"{w['replay_vs_measured']:.3f} x the measured time")
    if w.get("replay_samples_s") is not None:
        out.append(f"own split and schedule replayed at sample level: {w['replay_samples_s']:.3f} s, "
                   f"{w['replay_samples_vs_measured']:.3f} x the measured time")
    out += [f"note: {n}" for n in w["notes"]] + [f"assumed or left out: {x}" for x in w["left_out"]]
    return "\n".join(out)


def to_json(w: dict) -> str:
    return json.dumps(w, separators=(",", ":"))


def write(w: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return atomic.write_json(out_dir / "whatif.json", w, indent=1)

