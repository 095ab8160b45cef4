"""A small synthetic run writer with KNOWN costs, for the analysis tests and benchmark.

Why: the analysis tools must be tested before (and independently of) the simulator and the real runtime. This
writes the same schema they do (rank sets, stage busy intervals, switch_start/switch_op/switch_end, topology)
from a deliberately simple, exactly known model, so calibration can be checked against the truth:

- rollout stage time = rollout_overhead_s + tokens / (n_rollout x rollout_tokens_per_s_per_gpu)
- train stage time   = train_overhead_s + tokens / (n_train x train_tokens_per_s_per_gpu)
- a step: rollout (rollout ranks) and train (train ranks) start together (one-step-off pipeline), then a
  weight_sync on all ranks; the step ends when the sync ends.
- a switch (between two steps, at the given steps): critical ops in sequence (drain, offload, comm_select,
  onload) on the moving ranks, then a non-critical optimizer_stage_in overlapping the next training stage.

It is not the simulator: no policy, no noise model beyond a seeded token-count jitter and drift.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize.events import EventLog, make_event, format_ranks

DEFAULT_OPS: dict[str, float] = {"drain": 0.5, "offload": 1.0, "comm_select": 0.2, "onload": 2.0}


@dataclass(frozen=True)
class SynthCosts:
    rollout_overhead_s: float = 2.0
    rollout_tokens_per_s_per_gpu: float = 400.0
    train_overhead_s: float = 1.0
    train_tokens_per_s_per_gpu: float = 600.0
    weight_sync_s: float = 0.5
    ops_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_OPS))
    stage_in_s: float = 1.5  # the hidden optimizer_stage_in


@dataclass(frozen=True)
class SynthRun:
    world: int = 8
    steps: int = 12
    train: int = 6  # initial trainers: ranks 0..train-1; rollout ranks are the rest
    samples_per_step: int = 64
    tokens_per_step: int = 20000
    drift: float = 0.03  # relative growth of tokens per step
    jitter: float = 0.1
    switches: tuple[tuple[int, int], ...] = ((4, 4),)  # (after step, new train count)
    seed: int = 0
    mode: str = "optimized"
    noise: float = 0.0  # relative sd of a seeded multiplicative noise on stage and op durations


def write_synthetic_run(run_dir: str | Path, run: SynthRun = SynthRun(), costs: SynthCosts = SynthCosts(),
                        chunk: int = 2000) -> Path:
    """Write ``run_dir/events.jsonl`` and return the run directory."""
    run_dir = Path(run_dir)
    rng = random.Random(run.seed)
    log = EventLog(run_dir / "events.jsonl", t0=0.0)
    buf = []

    def emit(t, etype, **data):
        buf.append(make_event(etype, t, **data))
        if len(buf) >= chunk:
            log.write_many(buf)
            buf.clear()

    n_tr = run.train
    nrng = random.Random(run.seed + 1)

    def nz() -> float:
        return max(0.05, 1.0 + nrng.gauss(0.0, run.noise)) if run.noise else 1.0
    world = run.world
    allr = format_ranks(range(world))

    def sets(n):
        return format_ranks(range(n)), format_ranks(range(n, world))

    tr, ro = sets(n_tr)
    emit(0.0, "run_start", run_id=run_dir.name, source="sim", world_size=world, wall_time=0.0, train_ranks=tr, rollout_ranks=ro)
    emit(0.0, "topology", step=0, train_ranks=tr, rollout_ranks=ro)
    switch_at = dict(run.switches)
    t = 1.0
    stage_in_end = None
    for k in range(run.steps):
        tokens = int(run.tokens_per_step * (1 + run.drift) ** k * (1 + rng.uniform(-run.jitter, run.jitter)))
        n_ro = world - n_tr
        emit(t, "step_start", step=k)
        r_end = t + nz() * (costs.rollout_overhead_s + tokens / (n_ro * costs.rollout_tokens_per_s_per_gpu))
        t_end = t + nz() * (costs.train_overhead_s + tokens / (n_tr * costs.train_tokens_per_s_per_gpu))
        emit(r_end, "stage", step=k, stage="rollout", ranks=ro, start=t, end=r_end, tokens=tokens, samples=run.samples_per_step)
        emit(t_end, "stage", step=k, stage="train", ranks=tr, start=t, end=t_end, tokens=tokens, samples=run.samples_per_step)
        if stage_in_end is not None:
            stage_in_end = None
        ws0 = max(r_end, t_end)
        ws1 = ws0 + costs.weight_sync_s * nz()
        emit(ws1, "stage", step=k, stage="weight_sync", ranks=allr, start=ws0, end=ws1)
        emit(ws1, "step_end", step=k, samples=run.samples_per_step, tokens_generated=tokens, tokens_trained=tokens)
        t = ws1
        if k in switch_at and switch_at[k] != n_tr:
            new_tr = switch_at[k]
            sid = f"sw{k}"
            emit(t, "decision", step=k, action="resize", reason="synthetic", target_train=new_tr, target_rollout=world - new_tr)
            emit(t, "switch_start", switch_id=sid, step=k, from_train=n_tr, from_rollout=world - n_tr,
                 to_train=new_tr, to_rollout=world - new_tr, mode=run.mode)
            moving = format_ranks(range(min(n_tr, new_tr), max(n_tr, new_tr)))
            t0 = t
            for op, d in costs.ops_s.items():
                d *= nz()
                ranks = allr if op == "comm_select" else moving
                emit(t + d, "switch_op", switch_id=sid, op=op, ranks=ranks, start=t, end=t + d, critical=True)
                t += d
            n_tr = new_tr
            tr, ro = sets(n_tr)
            si0, si1 = t, t + costs.stage_in_s
            emit(si1, "switch_op", switch_id=sid, op="optimizer_stage_in", ranks=tr, start=si0, end=si1, critical=False)
            emit(t, "switch_end", switch_id=sid, critical_path_s=t - t0, hidden_s=costs.stage_in_s)
            emit(t, "topology", step=k + 1, train_ranks=tr, rollout_ranks=ro)
        else:
            emit(t, "decision", step=k, action="hold", reason="synthetic")
    emit(t, "run_end", status="completed", steps=run.steps)
    if buf:
        log.write_many(buf)
    log.close()
    return run_dir
