"""The sample-level engine's golden fixture (tests/fixtures/sim_golden.json) and the worlds it was recorded on.

``python -m tests.support.sim_golden --write`` runs every world through the engine on the path and records, per
run, what :func:`fingerprint` keeps; ``tests/unit/test_sim_fast.py`` runs the same worlds and asserts every recorded
value is identical. The fixture was recorded with the engine and core as they were at commit a6367d7, before the fast
engine (issue 28, item 3). Regenerate it only for an intended change of the simulator's results (say so in the commit),
never to make the check pass.

The worlds: 150 random small worlds, each drawn from its own ``random.Random(index)`` (so a world does not depend on
the others or on the code under test), each run twice (the configured split with its mechanisms; the mirrored split
with resizing off); and five scenarios of ``configs/sim`` at 6-24 steps with four mechanism sets. They reach the engine
only through its public entries (``load_config``, ``setup``, ``run_samples``).

Trainer-gen was removed (issue 25): the worlds still draw its cost and its mechanism flag, unused, so that every other
value of every world is the one recorded before; the runs that had it on run without it, and the scenarios' runs at a
rollout-bound split (where it went) were dropped."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any, Iterator

from dynaresize.config.loader import load_config
from dynaresize.policy import Topology
from dynaresize.sim.mechanisms import SimMechanisms
from dynaresize.sim.compare import run_samples, setup

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "sim_golden.json"
RANDOM_WORLDS = 150

EAGER = ["policy.min_dwell_steps=1", "policy.cooldown_steps=0", "policy.imbalance_threshold=0.02",
         "policy.min_relative_gain=0.0"]
SCENARIOS = {  # name: (steps, overrides)
    "paper_8gpu": (24, EAGER),
    "stationary_8gpu": (20, []),
    "scale_64gpu": (8, []),
    "dapo_64gpu": (6, []),
    "taskmix_64gpu": (6, []),
}
SCENARIO_MECHS = (SimMechanisms(False, False, True), SimMechanisms(True, True, True),
                  SimMechanisms(True, True, True, True), SimMechanisms(True, False, False, True))


def _uniform(rng: random.Random, lo: float, hi: float) -> float:
    """A float in [lo, hi], the bounds themselves one time in ten each (4 decimals: the override stays plain)."""
    u = rng.random()
    return lo if u < 0.1 else hi if u < 0.2 else round(rng.uniform(lo, hi), 4)


def random_world(index: int) -> dict[str, Any]:
    """Random world ``index``: 2-12 GPUs, 1-12 prompts of 1-6 responses, lengths, caps, KV slots, staleness 0-2, claims,
    chunks, helpers, command latency, weight sync, the prompt lengths' shape, an eager policy or not."""
    rng = random.Random(index)
    i, f, pick = rng.randint, (lambda lo, hi: _uniform(rng, lo, hi)), rng.choice
    return dict(
        gpus=i(2, 12), prompts=i(1, 12), group=i(1, 6), steps=i(2, 10), mean=f(20, 800), sigma=f(0, 1.5),
        cap=i(50, 3000), cap_share=pick([0.0, 0.2]), slots=i(1, 48), staleness=i(0, 2), scaling=f(0.6, 1.0),
        overhead=f(0, 2), helper_rate=f(0.3, 1.0), helper_cost=f(0, 1), retired_gen_cost=f(0, 2),  # (trainer-gen's)
        latency=pick([0.0, 0.0, 0.01, 0.2]), sync=f(0, 1), train_frac=f(0, 1), claim=i(1, 4), chunks=i(1, 8),
        mech=[rng.random() < 0.5 for _ in range(5)][:4], prompt_sigma=pick([0.0, 0.5]), eager=rng.random() < 0.5,
        seed=i(0, 3),
    )


def random_world_runs(w: dict[str, Any]) -> tuple[str, list[str], list[tuple[str, Topology | None, SimMechanisms]]]:
    """The config, its overrides and the two runs of a random world (name, split or ``None`` for the configured one,
    mechanisms)."""
    init = max(1, min(w["gpus"] - 1, round(w["train_frac"] * w["gpus"])))
    mean = min(w["mean"], w["cap"])
    eager = [*EAGER, "policy.consecutive_signals=1"] if w["eager"] else []
    over = [
        f"cluster.gpus={w['gpus']}", f"cluster.initial_train={init}", f"sim.steps={w['steps']}",
        f"run.seed={w['seed']}",
        f"sim.workload.prompts_per_step={w['prompts']}", f"sim.workload.responses_per_prompt={w['group']}",
        f"sim.workload.response_tokens_start={mean}", f"sim.workload.response_tokens_end={mean}",
        f"sim.workload.response_sigma={w['sigma']}", f"sim.workload.max_response_tokens={w['cap']}",
        f"sim.workload.cap_share={w['cap_share']}", f"sim.workload.prompt_tokens_sigma={w['prompt_sigma']}",
        f"sim.rollout.max_seqs_per_gpu={w['slots']}", f"pipeline.staleness_bound={w['staleness']}",
        f"sim.train.scaling_per_doubling={w['scaling']}", f"sim.train.step_overhead_s={w['overhead']}",
        f"sim.pipeline.helper_rate={w['helper_rate']}", f"sim.pipeline.helper_cost_s={w['helper_cost']}",
        f"sim.pipeline.claim_groups={w['claim']}",
        f"sim.pipeline.stream_chunks={w['chunks']}", f"sim.command_latency_s={w['latency']}",
        f"switching.costs.override_s={{weight_sync: {w['sync']}}}", "sim.write_events=false", *eager]
    mirrored = SimMechanisms(*w["mech"][:2], False, *w["mech"][3:])
    return "paper_8gpu", over, [("configured", None, SimMechanisms(*w["mech"])),
                                ("mirrored", Topology(w["gpus"] - init, init), mirrored)]


def worlds() -> Iterator[tuple[str, str, list[str], list[tuple[str, Topology | None, SimMechanisms]]]]:
    """Every world: (its name, config name, overrides, its runs); ``None`` as a run's split means the configured one."""
    for k in range(RANDOM_WORLDS):
        yield (f"random-{k:03d}", *random_world_runs(random_world(k)))
    for name, (steps, over) in SCENARIOS.items():
        yield name, name, ["sim.write_events=false", f"sim.steps={steps}", *over], [
            (f"mech{j}", None, m) for j, m in enumerate(SCENARIO_MECHS)]


def _sha(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(r) -> dict[str, Any]:
    """What a sample-level run reports (its wall time aside), compact: floats as their repr (exact), the split per
    step, and sha256 digests of the whole event log (every event's type, time and data, in order) and of the
    sample-to-version map."""
    return dict(
        total_s=repr(r.total_s), samples=r.samples, steps=r.steps, split=" ".join(r.topologies), switches=r.switches,
        overhead_s=repr(r.overhead_s), critical_s=repr(r.critical_s), busy_rollout_gpu_s=repr(r.busy_rollout_gpu_s),
        busy_train_gpu_s=repr(r.busy_train_gpu_s), helps=r.helps,
        n_events=len(r.events or []), events=_sha([(e.type.value, e.t, e.data) for e in (r.events or [])]),
        n_versions=len(r.versions), versions=_sha(sorted((b, g, v) for (b, g), v in r.versions.items())),
    )


def run_world(config: str, over: list[str], runs: list[tuple[str, Topology | None, SimMechanisms]]) -> dict[str, dict]:
    """The world's runs (on one setup, in order), each as {"world": the world's digest, **its fingerprint}."""
    s = setup(load_config(ROOT / f"configs/sim/{config}.yaml", over))
    out = {}
    for run, topo, mech in runs:
        topo = topo or s.initial
        digest = _sha([config, over, [topo.n_train, topo.n_rollout], mech.label, mech.resize])[:16]
        out[run] = dict(world=digest, **fingerprint(run_samples(s, topo, mech, log=True, record_versions=True)))
    return out


def write(path: Path = FIXTURE) -> int:
    """Record every world's runs with the engine on the path; one run a line, so a diff shows which runs changed."""
    lines = []
    for name, config, over, runs in worlds():
        for run, fp in run_world(config, over, runs).items():
            lines.append(f"{json.dumps(name + '/' + run)}: {json.dumps(fp, separators=(',', ':'))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"record the fixture ({FIXTURE.relative_to(ROOT)})")
    ap.add_argument("--out", type=Path, default=FIXTURE, help="where to write it")
    args = ap.parse_args(argv)
    if not args.write:
        ap.print_help()
        return 2
    n = write(args.out)
    print(f"{n} runs -> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
