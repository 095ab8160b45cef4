"""Run one simulation or the full comparison: static splits, DynaResize (optimised / naive), greedy, oracle, and,
at sample level, the barrier-free mechanisms added one at a time, against the work-conserving bound.

The oracle is not a run: for every step the best candidate split with free, instant switches, perfectly pipelined
*with the step barrier* (sum over steps of min over splits of max(rollout + sync, train), plus the first stage to
fill the pipe). Runs without the barrier can beat it; the bound (:mod:`dynaresize.sim.bound`) is what no schedule
can beat.

Rows of ``compare`` (all measured side by side in one call):

- ``static T:R``: each static split with the barrier, step-level (verl's one-step-off); the best is the baseline;
- ``dynaresize``, ``dynaresize naive``, ``greedy``: today's resizing with the barrier, step-level;
- sample-level (``samples=True``; per-GPU continuous batching driven by the scheduler core):
  ``best static (samples)``, the baseline split again at sample level (how far the two models agree);
  ``best static +cont+stream``, the baseline split with continuous rollout and streaming training, no resizing;
  ``dyn barrier (samples)``, ``dyn +continuous``, ``dyn +cont+stream``, ``dyn +cont+stream+helpers``: resizing
  with each mechanism added in turn (helpers: idle rollout ranks compute gradients of the batch in training); the
  last one is "all mechanisms";
- ``oracle (barrier)``, ``tight bound`` and ``bound`` (the work-conserving one; ``%bound`` is against it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from dynaresize.config.schema import Config
from dynaresize.policy import ResizePolicy, SwitchCostModel, Topology, from_cluster, greedy_config
from dynaresize.policy.config import OptimizationsConfig
from dynaresize.schedule import Mechanisms
from dynaresize.sim.bound import bound_total, tight_bound
from dynaresize.sim.engine import Pipeline, RunResult, StaticController
from dynaresize.sim.mechanisms import SimMechanisms, helpers_on, play_hooks
from dynaresize.sim.samples import TAIL_SHARE_BARRIER_FREE, SamplePipeline, SampleRunResult, SampleSettings
from dynaresize.sim.stages import StageTable


@dataclass
class Setup:
    cfg: Config
    table: StageTable
    candidates: tuple[Topology, ...]
    initial: Topology
    costs: SwitchCostModel
    naive_costs: SwitchCostModel


def setup(cfg: Config) -> Setup:
    sim, cl, sw = cfg.sim, cfg.cluster, cfg.switching
    from dynaresize.config.memory import feasible_trainer_counts

    # the splits that fit in GPU memory (cluster.gpu_memory_gb; all when unset: the simulated GPUs are not this host's)
    cands = from_cluster(cl, feasible_trainer_counts(cfg, read_device=lambda: None))
    table = StageTable(sim, cfg.run.seed, sim.steps, cl.gpus)
    return Setup(
        cfg, table, cands, Topology(cl.initial_train, cl.gpus - cl.initial_train),
        SwitchCostModel(sw.costs, sw.optimizations), SwitchCostModel(sw.costs, OptimizationsConfig.naive()),
    )


def _pipe(s: Setup, name: str, ctl, costs: SwitchCostModel, initial: Topology, log: bool, forced: dict | None = None) -> Pipeline:
    sim, overlap = s.cfg.sim, s.cfg.switching.costs.deferred_overlap_fraction
    return Pipeline(name, s.table, initial, ctl, costs, s.cfg.pipeline.staleness_bound, log, overlap,
                    lockstep=sim.schedule == "barrier_lockstep", step_gap_s=sim.step_gap_s, forced=forced)


def run_dynamic(s: Setup, log: bool, naive: bool = False, greedy: bool = False, name: str = "dynaresize",
                forced: dict[int, int] | None = None) -> RunResult:
    pcfg = greedy_config(s.cfg.policy) if greedy else s.cfg.policy
    costs = s.naive_costs if naive else s.costs
    ctl = ResizePolicy(pcfg, costs, s.candidates)
    return _pipe(s, name, ctl, costs, s.initial, log, forced).run()


def run_static(s: Setup, topo: Topology, log: bool = False, forced: dict[int, int] | None = None) -> RunResult:
    """A static split; with ``forced`` ({step: trainers}, ``policy.forced_splits``) only those scripted switches."""
    name = f"static {topo}" + (" + forced splits" if forced else "")
    return _pipe(s, name, StaticController(), s.costs, topo, log, forced).run()


def link_settings(s: Setup, fanout: int | None = None) -> tuple[int, float] | None:
    """The charged links of a run (:mod:`dynaresize.sim.links`): ``fanout`` (0 the star, f the relay) or, by
    default, the configured ones (None when ``sim.pipeline.link_model`` is free)."""
    p = s.cfg.sim.pipeline
    if fanout is None:
        if p.link_model == "free":
            return None
        fanout = 0 if p.link_model == "star" else p.relay_fanout
    return fanout, s.costs.weight_bytes() / (p.link_gbps * 1e9)


def run_samples(s: Setup, topo: Topology, mech: Mechanisms, log: bool = False, name: str | None = None,
                record_versions: bool = False, tail_share: float = TAIL_SHARE_BARRIER_FREE,
                fanout: int | None = None) -> SampleRunResult:
    """One sample-level run from ``topo`` with ``mech``; resizing (``mech.resize``) uses the configured policy
    (``tail_share``: see :data:`~dynaresize.sim.samples.TAIL_SHARE_BARRIER_FREE`; ``fanout``: charged links with the
    star (0) or a relay of that fan-out, default: as configured)."""
    p = s.cfg.sim.pipeline
    hooks = play_hooks(mech)  # the policy's pipeline predictor plays the simulator-only mechanisms it runs
    policy = ResizePolicy(s.cfg.policy, s.costs, s.candidates, pipeline_hooks=hooks) if mech.resize else None
    name = name or f"{'dyn' if mech.resize else 'static ' + str(topo)} {mech.label} (samples)"
    settings = SampleSettings(s.cfg.pipeline.staleness_bound, log, s.cfg.switching.costs.deferred_overlap_fraction,
                              p.claim_groups, p.stream_chunks, record_versions, p.helper_rate, p.helper_cost_s,
                              tail_share=tail_share, train_queue=p.train_queue,
                              claim_ahead=p.claim_ahead, kv_move_gbps=p.kv_move_gbps,
                              consolidation_min_gain=p.consolidation_min_gain, links=link_settings(s, fanout))
    return SamplePipeline(name, s.table, topo, mech, s.costs, policy, settings).run()


def best_static_samples(s: Setup, mech: Mechanisms) -> tuple[Topology, float]:
    """The best static split at sample level with ``mech`` (resizing off) and its total: a local search over the
    splits from the step-level best (the sample level's best split is often one or two GPUs away from it)."""
    mech = replace(mech, resize=False)
    s.table.sweep([c.n_rollout for c in s.candidates])
    cands = sorted(s.candidates, key=lambda c: c.n_train)
    i = min(range(len(cands)), key=lambda j: run_static(s, cands[j]).total_s)
    total: dict[int, float] = {}

    def at(j: int) -> float:
        if j not in total:
            total[j] = run_samples(s, cands[j], mech).total_s
        return total[j]

    while True:
        j = min((j for j in (i - 1, i + 1) if 0 <= j < len(cands)), key=at)
        if at(j) >= at(i):
            return cands[i], at(i)
        i = j


def oracle_total(s: Setup) -> float:
    t, sync = s.table, s.costs.weight_sync_s()
    by_r = sorted(s.candidates, key=lambda c: c.n_rollout)

    lock, gap = s.cfg.sim.schedule == "barrier_lockstep", s.cfg.sim.step_gap_s  # the sync and gap gate both pools

    def period(k: int, c: Topology) -> tuple[float, float, float]:
        sk = sync if k >= 1 else 0.0
        r = t.rollout_s(k, c.n_rollout) + (0.0 if lock else sk)
        tr = t.train_s(k, c.n_train)
        return max(r, tr) + (sk + gap if lock else 0.0), r, tr

    total = 0.0
    for k in range(t.steps):
        lo, hi = 0, len(by_r) - 1  # first index where rollout <= train (rollout falls, train rises with n_rollout)
        while lo < hi:
            mid = (lo + hi) // 2
            _, r, tr = period(k, by_r[mid])
            if r <= tr:
                hi = mid
            else:
                lo = mid + 1
        best = min((period(k, by_r[i]) for i in (lo - 1, lo) if 0 <= i < len(by_r)), key=lambda x: x[0])
        total += best[0]
        if k == 0:
            total += min(best[1], best[2])
    return total


def tight_bound_of(s: Setup, helper_share: float = 1.0):
    """The tight bound (:func:`dynaresize.sim.bound.tight_bound`) for ``s``: the least weight sync of the compared
    cost models (the naive one may price it differently); ``helper_share=0``: of the schedules without gradient
    helpers (between 0 and 1: whose helpers take at most that share of every batch's training)."""
    sync = min(s.costs.weight_sync_s(), s.naive_costs.weight_sync_s())
    return tight_bound(s.table, s.cfg.sim, s.cfg.cluster.gpus, s.cfg.pipeline.staleness_bound, sync, helper_share)


def static_choices(s: Setup) -> list[Topology]:
    cands, m = list(s.candidates), s.cfg.sim.compare_static_max
    if len(cands) <= m:
        return cands
    picks = {cands[round(i * (len(cands) - 1) / (m - 1))] for i in range(m)} | {s.initial}
    return sorted(picks)


SAMPLE_ROWS = (  # (row name, summary key, mechanisms); resizing rows start from the configured split
    ("dyn barrier (samples)", "barrier", Mechanisms(False, False, True)),
    ("dyn +continuous", "continuous_rollout", Mechanisms(True, False, True)),
    ("dyn +cont+stream", "streaming_training", Mechanisms(True, True, True)),
    ("dyn +cont+stream+helpers", "gradient_helpers", SimMechanisms(True, True, True, True)),
    ("dyn +cont+stream+helpers+consol", "tail_consolidation", SimMechanisms(True, True, True, True, True)),
)
ALL_MECHANISMS = SAMPLE_ROWS[-1][1]  # the summary key of the run with every mechanism
RUNTIME_MECHANISMS = SAMPLE_ROWS[2][1]  # the run with the runtime's mechanisms (barrier-free: continuous + streaming)
# the runtime's mechanisms with charged links (dynaresize.sim.links): the star and the relay of sim.pipeline.relay_fanout;
# the rows above keep the configured link model (sim.pipeline.link_model)
LINK_ROWS = (("dyn +c+s, star links", "star"), ("dyn +c+s, relay links", "relay"))


def link_summary(r: SampleRunResult, free: SampleRunResult) -> dict:
    """What a run with charged links paid for its weight delivery: per delivery the seconds from the fetch to the
    arrival (mean, max), per version from its first fetch to its last arrival (mean), rank 0's link busy share, the
    most copies one rank sent of one version, and its throughput against the same run with free links."""
    L = r.links
    spreads = [b - a for a, b in L.spreads.values()]
    return dict(total_s=r.total_s, throughput=r.throughput, vs_free_links=r.throughput / free.throughput - 1,
                delivery_mean_s=sum(L.delays) / max(1, len(L.delays)), delivery_max_s=max(L.delays, default=0.0),
                version_spread_mean_s=sum(spreads) / max(1, len(spreads)),
                rank0_link_busy=L.origin_busy_s / r.total_s, most_copies_sent_by_one_rank=L.most_sends,
                transfers=L.transfers)


def with_predictor(s: Setup, predictor: str) -> Setup:
    """The same world with ``policy.predictor`` set (the workload, table and costs shared)."""
    return replace(s, cfg=s.cfg.model_copy(update={"policy": s.cfg.policy.model_copy(update={"predictor": predictor})}))


def compare(s: Setup, samples: bool = True, predictors: tuple[str, ...] = ()) -> dict:
    """Every row of the comparison; ``predictors``: ``policy.predictor`` values besides the configured one whose
    all-mechanisms sample-level run is added (row and ``summary['all_mechanisms_by_predictor']``)."""
    t0 = time.perf_counter()
    choices = static_choices(s)
    s.table.sweep([c.n_rollout for c in choices])
    statics = [run_static(s, c) for c in choices]
    best = min(statics, key=lambda r: r.total_s)
    dyn = run_dynamic(s, False)
    naive = run_dynamic(s, False, naive=True, name="dynaresize naive")
    greedy = run_dynamic(s, False, greedy=True, name="greedy")
    orc = oracle_total(s)
    bound = bound_total(s.table, s.cfg.sim, s.cfg.cluster.gpus, s.cfg.pipeline.staleness_bound)
    tight = tight_bound_of(s)
    best_topo = Topology(int(best.name.split()[-1].split(":")[0]), s.cfg.cluster.gpus - int(best.name.split()[-1].split(":")[0]))
    extra: list[RunResult] = []
    mech_runs: dict[str, RunResult] = {}
    if samples:
        extra.append(run_samples(s, best_topo, Mechanisms(False, False, False), name="best static (samples)"))
        extra.append(run_samples(s, best_topo, Mechanisms(True, True, False), name="best static +cont+stream"))
        for row, key, mech in SAMPLE_ROWS:
            mech_runs[key] = run_samples(s, s.initial, mech, name=row)
        extra.extend(mech_runs.values())
        relay_f = s.cfg.sim.pipeline.relay_fanout
        link_runs = {key: run_samples(s, s.initial, SAMPLE_ROWS[2][2], name=row, fanout=0 if key == "star" else relay_f)
                     for row, key in LINK_ROWS}
        extra.extend(link_runs.values())
        by_pred = {s.cfg.policy.predictor: mech_runs[ALL_MECHANISMS]}
        for p in predictors:
            if p not in by_pred:
                by_pred[p] = run_samples(with_predictor(s, p), s.initial, SAMPLE_ROWS[-1][2], name=f"dyn all, predictor {p}")
                extra.append(by_pred[p])
    n_samples = best.samples
    rows = []
    for r in statics + [dyn, naive, greedy] + extra:
        rows.append(dict(
            name=r.name, total_s=r.total_s, throughput=r.throughput, gain=best.total_s / r.total_s - 1,
            of_oracle=orc / r.total_s, of_bound=bound.total_s / r.total_s, switches=r.switches,
            overhead_s=r.overhead_s, critical_s=r.critical_s, hidden=r.hidden_fraction,
        ))
    rows.append(dict(name="oracle (barrier)", total_s=orc, throughput=n_samples / orc, gain=best.total_s / orc - 1,
                     of_oracle=1.0, of_bound=bound.total_s / orc, switches=None, overhead_s=0.0, critical_s=0.0, hidden=None))
    rows.append(dict(name="tight bound", total_s=tight.total_s, throughput=n_samples / tight.total_s,
                     gain=best.total_s / tight.total_s - 1, of_oracle=orc / tight.total_s, of_bound=bound.total_s / tight.total_s,
                     switches=None, overhead_s=0.0, critical_s=0.0, hidden=None))
    rows.append(dict(name="bound", total_s=bound.total_s, throughput=n_samples / bound.total_s,
                     gain=best.total_s / bound.total_s - 1, of_oracle=orc / bound.total_s, of_bound=1.0, switches=None,
                     overhead_s=0.0, critical_s=0.0, hidden=None))
    summary = dict(
        best_static_split=best.name.split()[-1], best_static_throughput=best.throughput,
        dynaresize_throughput=dyn.throughput, oracle_throughput=n_samples / orc,
        gain_vs_best_static=best.total_s / dyn.total_s - 1, time_change_vs_best_static=dyn.total_s / best.total_s - 1,
        fraction_of_oracle=orc / dyn.total_s, overhead_hidden_fraction=dyn.hidden_fraction, switches=dyn.switches,
        naive_gain_vs_best_static=best.total_s / naive.total_s - 1, naive_overhead_hidden_fraction=naive.hidden_fraction,
        greedy_gain_vs_best_static=best.total_s / greedy.total_s - 1, greedy_switches=greedy.switches,
        initial_split=str(s.initial), gpus=s.cfg.cluster.gpus, steps=s.table.steps,
        fraction_of_bound=bound.total_s / dyn.total_s, oracle_fraction_of_bound=bound.total_s / orc,
        bound_work_s=bound.work_s, bound_chain_s=bound.chain_s,
        tight_bound_s=tight.total_s, tight_bound_binding=tight.binding, fraction_of_tight_bound=tight.total_s / dyn.total_s,
    )
    if samples:
        allm = mech_runs[ALL_MECHANISMS]
        sb, sc = extra[0], extra[1]
        # the schedules without gradient helpers (the runtime's mechanisms) against the bound of such schedules
        free = tight_bound_of(s, helper_share=0.0)
        runtime = mech_runs[RUNTIME_MECHANISMS]
        summary.update(
            samples_vs_step_best_static=sb.total_s / best.total_s,  # > 1: the sample-level model is slower
            best_static_continuous_gain=best.total_s / sc.total_s - 1,
            all_mechanisms_gain_vs_best_static=best.total_s / allm.total_s - 1,
            # against the same split at sample level with the barrier: the two models' difference taken out
            all_mechanisms_gain_vs_best_static_samples=sb.total_s / allm.total_s - 1,
            all_mechanisms_fraction_of_bound=bound.total_s / allm.total_s,
            all_mechanisms_fraction_of_tight_bound=tight.total_s / allm.total_s,
            all_mechanisms_switches=allm.switches,
            tight_bound_without_helpers_s=free.total_s,
            runtime_mechanisms_fraction_of_helper_free_tight_bound=free.total_s / runtime.total_s,
            # the most any schedule without gradient helpers (the runtime's, any split and switching) can reach of
            # either bound: it takes at least free.total_s
            helper_free_ceiling_of_tight_bound=tight.total_s / free.total_s,
            helper_free_ceiling_of_bound=bound.total_s / free.total_s,
            mechanisms={key: dict(gain_vs_best_static=best.total_s / r.total_s - 1, fraction_of_bound=bound.total_s / r.total_s,
                                  fraction_of_tight_bound=tight.total_s / r.total_s, switches=r.switches, wall_s=r.wall_s,
                                  helps=r.helps)
                        | ({} if helpers_on(mech) else {"fraction_of_helper_free_tight_bound": free.total_s / r.total_s})
                        for (_, key, mech), r in zip(SAMPLE_ROWS, mech_runs.values())},
        )
        free_run = mech_runs[RUNTIME_MECHANISMS]  # (charged too when the configuration says so)
        summary["weight_delivery"] = dict(
            link_gbps=s.cfg.sim.pipeline.link_gbps, weight_gb=s.costs.weight_bytes() / 1e9, relay_fanout=relay_f,
            configured_link_model=s.cfg.sim.pipeline.link_model, configured_throughput=free_run.throughput,
            **{key: link_summary(r, free_run) for key, r in link_runs.items()})
        summary["all_mechanisms_by_predictor"] = {
            p: dict(gain_vs_best_static=best.total_s / r.total_s - 1, fraction_of_bound=bound.total_s / r.total_s,
                    fraction_of_tight_bound=tight.total_s / r.total_s, switches=r.switches, wall_s=r.wall_s)
            for p, r in by_pred.items()}
        prev = best.total_s
        for key, r in mech_runs.items():  # the share each mechanism adds, in the order they are turned on
            summary["mechanisms"][key]["adds"] = prev / r.total_s - 1
            prev = r.total_s
    summary["compare_wall_s"] = time.perf_counter() - t0
    return dict(rows=rows, summary=summary, dynaresize=dyn)


def format_table(rows: list[dict]) -> str:
    head = (f"{'run':<26} {'time_s':>11} {'samples/s':>10} {'vs_best':>8} {'%oracle':>8} {'%bound':>7} {'switches':>8} "
            f"{'overhead_s':>10} {'hidden':>7}")
    out = [head, "-" * len(head)]
    for r in rows:
        sw = "-" if r["switches"] is None else str(r["switches"])
        hid = "-" if r["hidden"] is None or not r["switches"] else f"{100 * r['hidden']:.0f}%"
        ob = f"{100 * r['of_bound']:>6.1f}%" if r.get("of_bound") is not None else f"{'-':>7}"
        out.append(f"{r['name']:<26} {r['total_s']:>11.0f} {r['throughput']:>10.3f} {100 * r['gain']:>+7.1f}% "
                   f"{100 * r['of_oracle']:>7.1f}% {ob} {sw:>8} {r['overhead_s']:>10.1f} {hid:>7}")
    return "\n".join(out)


def format_links(wd: dict) -> str:
    """The weight-delivery table of ``summary['weight_delivery']``: the star against the relay."""
    head = (f"{'weights (charged links)':<26} {'samples/s':>10} {'vs_free':>8} {'deliver_s':>9} {'max_s':>8} "
            f"{'spread_s':>8} {'rank0_link':>10} {'max_copies':>10}")
    out = [f"weight delivery: {wd['weight_gb']:.1f} GB per version, {wd['link_gbps']:g} GB/s per rank's link "
           f"(ASSUMPTION), relay fan-out {wd['relay_fanout']}", head, "-" * len(head)]
    for key in ("star", "relay"):
        r = wd[key]
        out.append(f"{key:<26} {r['throughput']:>10.3f} {100 * r['vs_free_links']:>+7.1f}% {r['delivery_mean_s']:>9.2f} "
                   f"{r['delivery_max_s']:>8.2f} {r['version_spread_mean_s']:>8.2f} {100 * r['rank0_link_busy']:>9.1f}% "
                   f"{r['most_copies_sent_by_one_rank']:>10}")
    return "\n".join(out)
