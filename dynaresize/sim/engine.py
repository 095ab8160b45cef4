"""The discrete-event model of the one-step-off pipeline, driven by a policy, writing the project's event log.

Stages and their dependencies (staleness bound s, default 1; T_k produces policy version k+1):

- rollout R_j starts when the rollout pool finished R_{j-1} and version j-s exists (T_{j-s-1} done); it first
  receives the new weights (weight sync) when j-s >= 1;
- training T_k starts when T_{k-1} and R_k are done.

With s = 1, R_{k+1} runs while T_k trains: a static split's step time is max(rollout + sync, train).

Decision points: with staleness >= 1, R_{k+1} runs beside T_k, and the policy is consulted when the first of the
two finishes, the moment one pool falls idle, with the newest finished step: step k if T_k ended first
(rollout-bound), step k-1 if R_{k+1} did (train-bound; T_{k-1} ended before R_{k+1} began). One observation per
decision: when the bound stage changes, either nothing finished since the last decision (no decision is taken) or
two steps did (the policy is shown the newest; the EWMA misses one sample). With
staleness 0 the decision waits for T_k. A resize applies to the next rollout that has not started and to T_{k+1}.
Each group of ranks starts its ops as soon as it is both told and free, so nothing is delayed by waiting for a
decision:

- rollout -> trainers (optimised): the moving ranks start when their in-flight rollout ends (often the decision
  point itself), so their chain (drain, offload, onload, weight sync, warm-up) runs while T_k still trains; the
  staying trainers run their ops (stage-out of the old partitioning, rebuild) after T_k; T_{k+1} waits for both;
- trainers -> rollout (optimised): the moving trainers start when T_k ends and join the next rollout as soon as
  they are ready, even while the old pool still finishes the in-flight rollout (the "mixed" step: two rollouts
  and one training pass at once);
- deferred optimizer state is loaded during T_{k+1}'s forward/backward; only what does not fit delays it;
- naive switching (no communicator reuse) stops the world: every rank waits until both in-flight stages are done,
  runs the ops, and the pipeline refills. Knowing the decision earlier buys it nothing.

A switch's ``critical_path_s`` is how much later its gated stage ends than with a free, instant switch to the
same split; ``hidden_s`` = the sum of its ops' costs minus that.

``barrier_lockstep`` (``sim.schedule``; ``barrier``, the default, is the ideal pipeline above) models the retired
runtime coordinator's loop instead (an old run's ``pipeline.schedule: lockstep``): step k starts
both R_{k+1} and T_k once T_{k-1} and R_k are done, the weight sync (blocking, on both pools) and ``step_gap_s``
(batch assembly, command round trips) have passed; the policy decides at that moment and the switch's critical
ops run before the step's stages. ``forced`` (``policy.forced_splits``, {step: trainers}) switches so that T_step
and R_{step+1} run on that split, as the coordinator's scripted resizes do, bypassing the controller there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from dynaresize.events import Event, EventType, make_event
from dynaresize.policy import Decision, Observation, OpGroup, SwitchCostModel, Topology
from dynaresize.policy.types import ResizeAction
from dynaresize.sim.stages import StageTable


class Controller(Protocol):
    def decide(self, obs: Observation) -> Decision: ...


class StaticController:
    """Never resizes (the static baselines)."""

    def decide(self, obs: Observation) -> Decision:
        return Decision(ResizeAction.HOLD, obs.topology, "static split")


@dataclass
class RunResult:
    name: str
    total_s: float
    samples: int
    steps: int
    switches: int = 0
    overhead_s: float = 0.0  # sum of all switch op costs
    critical_s: float = 0.0  # pipeline delay caused by switches
    topologies: list[str] = field(default_factory=list)  # train:rollout per step (trainers' view)
    events: list[Event] | None = None
    wall_s: float = 0.0

    @property
    def throughput(self) -> float:
        return self.samples / self.total_s

    @property
    def hidden_fraction(self) -> float:
        return max(0.0, 1.0 - self.critical_s / self.overhead_s) if self.overhead_s > 0 else 0.0


def rank_range(a: int, b: int) -> str:
    """Rank-set string of ranks a..b-1 (contiguous; cheap even for thousands of ranks)."""
    return "" if b <= a else (str(a) if b - a == 1 else f"{a}-{b - 1}")


@dataclass
class _Switch:
    sid: str
    step: int
    src: Topology
    dst: Topology
    overhead: float
    delay_r: float | None = None
    delay_t: float | None = None
    t_end: float = 0.0
    head: tuple[float, float, int] | None = None  # (ready, free_ready, moving) for a mixed rollout
    bg_train: float = 0.0  # deferred trainer work to overlap with the next training step
    gate_t_free: float = 0.0


class Pipeline:
    """One simulated run. ``run()`` returns a :class:`RunResult` (with events when ``log`` is true)."""

    def __init__(self, name: str, table: StageTable, initial: Topology, controller: Controller, costs: SwitchCostModel,
                 staleness: int = 1, log: bool = False, overlap_fraction: float = 0.9, lockstep: bool = False,
                 step_gap_s: float = 0.0, forced: dict[int, int] | None = None):
        self.name, self.tab, self.ctl, self.costs = name, table, controller, costs
        self.N, self.K, self.s = initial.total, table.steps, staleness
        self.topo = initial
        self.log = log
        self.overlap = overlap_fraction
        self.sync_s = costs.weight_sync_s()
        self.lockstep, self.gap, self.forced = lockstep, step_gap_s, dict(forced or {})
        self.lat = table.sim.command_latency_s  # control-plane latency per command (sim.command_latency_s)
        self.ev: list[Event] = []
        self.r_start: list[float] = []  # first busy moment of R_j (sync or head start)
        self.r_gen: list[float] = []  # generation start of the old/whole pool
        self.r_end: list[float] = []
        self.r_n: list[int] = []
        self.r_mixed: list[bool] = []
        self.t_start: list[float] = []
        self.t_end: list[float] = []
        self.t_n: list[int] = []
        self.gate_r = 0.0
        self.gate_t = 0.0
        self.pending: _Switch | None = None
        self.result = RunResult(name, 0.0, 0, self.K)

    def emit(self, t: float, etype: EventType, **data) -> None:
        if self.log:
            self.ev.append(make_event(etype, round(t, 6), **data))

    # --- stages -----------------------------------------------------------------------------------------------
    def _dep(self, j: int) -> float:
        i = j - self.s - 1
        return self.t_end[i] if i >= 0 else 0.0

    def _rollout_start(self, j: int) -> float:
        prev = self.r_end[j - 1] if j > 0 else 0.0
        if self.lockstep and j >= 1:
            return max(max(prev, self._dep(j)) + self.gap, self.gate_r)
        return max(prev, self._dep(j), self.gate_r)

    def _run_rollout(self, j: int) -> None:
        n, nt = self.topo.n_rollout, self.topo.n_train
        start = self._rollout_start(j)
        sync = self.sync_s if j - self.s >= 1 else 0.0
        # control-plane latency: the weight-fetch command (when there is a version to fetch), then the generate one
        gen = start + sync + (self.lat if sync > 0 else 0.0) + self.lat
        D = self.tab.rollout_s(j, n)
        floor = self.tab.tail_s(j)
        sw, first, mixed = self.pending, start, False
        if sw is not None and sw.head is not None:
            ready, free_ready, moving = sw.head
            dep = self._dep(j)

            def end_for(new_join: float) -> tuple[float, float]:
                a, b = min(gen, new_join), max(gen, new_join)
                n_early = moving if new_join < gen else n - moving
                credit = min((b - a) * n_early / n, max(0.0, D - floor))
                return a, b + D - credit

            a, end = end_for(max(ready, dep))
            _, end_free = end_for(max(free_ready, dep))
            sw.delay_r, sw.head = end - end_free, None
            first, mixed = min(a, start), True
            self.emit(max(ready, dep), EventType.STAGE, step=j, stage="rollout", ranks=rank_range(nt, nt + moving),
                      start=round(max(ready, dep), 6), end=round(end, 6), version=max(0, j - self.s), mixed=True)
            old = rank_range(nt + moving, self.N)
            self._maybe_close(sw)
        else:
            end = gen + D
            old = rank_range(nt, self.N)
            if sw is not None and sw.delay_r is None:
                sw.delay_r = 0.0
                self._maybe_close(sw)
        if sync > 0:
            self.emit(start, EventType.STAGE, step=j, stage="weight_sync", ranks=old, start=round(start + self.lat, 6),
                      end=round(gen - self.lat, 6))
        b = self.tab.batches[j]
        self.emit(gen, EventType.STAGE, step=j, stage="rollout", ranks=old, start=round(gen, 6), end=round(end, 6),
                  tokens=b[1], samples=b[0], version=max(0, j - self.s))
        self.emit(first, EventType.STEP_START, step=j)
        self.r_start.append(first)
        self.r_gen.append(gen)
        self.r_end.append(end)
        self.r_n.append(n)
        self.r_mixed.append(mixed)

    def _run_train(self, k: int) -> None:
        n = self.topo.n_train
        prev = self.t_end[k - 1] if k > 0 else 0.0
        ready = max(prev, self.r_end[k])
        if self.lockstep:  # the coordinator's blocking weight sync and its own per-step time come first
            ready += self.gap + (self.sync_s if k >= 1 else 0.0)
        start = max(ready, self.gate_t)
        dur = self.tab.train_s(k, n) + 2 * self.lat  # the train command and the optimizer-step command
        spill = 0.0
        sw = self.pending
        if sw is not None and sw.delay_t is None:
            spill = max(0.0, sw.bg_train - self.overlap * dur)
            free_start = max(ready, sw.gate_t_free)
            sw.delay_t = start + spill - free_start
            self._maybe_close(sw)
        end = start + dur + spill
        self.t_start.append(start)
        self.t_end.append(end)
        self.t_n.append(n)
        b = self.tab.batches[k]
        self.emit(start, EventType.STAGE, step=k, stage="train", ranks=rank_range(0, n), start=round(start, 6),
                  end=round(end, 6), tokens=b[2], samples=b[0])
        self.emit(end, EventType.STEP_END, step=k, samples=b[0], tokens_generated=b[1], tokens_trained=b[2])

    # --- switches -----------------------------------------------------------------------------------------------
    def _maybe_close(self, sw: _Switch) -> None:
        if sw.delay_r is None or sw.delay_t is None:
            return
        crit = max(0.0, sw.delay_r, sw.delay_t)
        self.result.critical_s += crit
        self.result.overhead_s += sw.overhead
        self.emit(sw.t_end, EventType.SWITCH_END, switch_id=sw.sid, critical_path_s=round(crit, 6),
                  hidden_s=round(max(0.0, sw.overhead - crit), 6))
        self.pending = None

    def _close_pending(self) -> None:
        sw = self.pending
        if sw is not None:
            sw.head = None
            sw.delay_r = sw.delay_r if sw.delay_r is not None else 0.0
            sw.delay_t = sw.delay_t if sw.delay_t is not None else 0.0
            self._maybe_close(sw)

    def _switch(self, k: int, t_d: float, dec: Decision) -> None:
        src, dst = self.topo, dec.target
        plan = self.costs.plan(src, dst)
        crit = {g: 0.0 for g in OpGroup}
        for p in plan:
            if p.critical:
                crit[p.group] += p.cost_s
        bg_train = sum(p.cost_s for p in plan if not p.critical and p.group is OpGroup.TRAINERS)
        overhead = sum(p.cost_s for p in plan)
        sid = f"s{self.result.switches}"
        self.result.switches += 1
        to_rollout = dst.n_rollout > src.n_rollout
        moving = abs(dst.n_train - src.n_train)
        lo, hi = sorted((src.n_train, dst.n_train))
        mv = rank_range(lo, hi)
        inflight_end = max(t_d, self.r_end[-1] if self.r_end else 0.0)  # the rollout pool is free
        free_t = max(t_d, self.t_end[k])  # the trainers are free (T_k may still run at a rollout-end decision)
        sw = _Switch(sid, k, src, dst, overhead, bg_train=bg_train)
        if self.costs.stop_the_world:
            barrier = max(free_t, inflight_end)  # every rank stops: nothing overlaps in-flight work
            resume = barrier + crit[OpGroup.ALL] + max(crit[OpGroup.MOVING], crit[OpGroup.TRAINERS])
            self.gate_r = self.gate_t = resume
            sw.gate_t_free = free_t
            starts = {OpGroup.ALL: barrier, OpGroup.MOVING: barrier, OpGroup.TRAINERS: barrier}
            sw.t_end = resume
        elif to_rollout:
            ready = free_t + crit[OpGroup.MOVING]  # moving trainers start once T_k is done
            sw.head = (ready, free_t, moving)
            self.gate_t = free_t + crit[OpGroup.TRAINERS]
            sw.gate_t_free = free_t
            starts = {OpGroup.ALL: t_d, OpGroup.MOVING: free_t, OpGroup.TRAINERS: free_t}
            sw.t_end = max(ready, self.gate_t)
        else:
            free_m = inflight_end  # moving rollout ranks start once their in-flight rollout is done
            ready = free_m + crit[OpGroup.MOVING]
            self.gate_t = max(free_t + crit[OpGroup.TRAINERS], ready)
            sw.gate_t_free = max(free_m, free_t)
            starts = {OpGroup.ALL: t_d, OpGroup.MOVING: free_m, OpGroup.TRAINERS: free_t}
            sw.t_end = self.gate_t
        self.emit(t_d, EventType.SWITCH_START, switch_id=sid, step=k, from_train=src.n_train, from_rollout=src.n_rollout,
                  to_train=dst.n_train, to_rollout=dst.n_rollout, planned_critical_s=round(dec.critical_cost_s, 6),
                  mode="naive" if self.costs.stop_the_world else "optimized")
        if self.log:
            ranks = {OpGroup.ALL: rank_range(0, self.N), OpGroup.MOVING: mv,
                     OpGroup.TRAINERS: rank_range(0, min(src.n_train, dst.n_train))}
            cursor = dict(starts)
            bg_cursor = {g: starts[g] + (crit[g] if g is not OpGroup.ALL else 0.0) for g in OpGroup}
            for p in plan:
                cur = cursor if p.critical else bg_cursor
                a = cur[p.group]
                cur[p.group] = a + p.cost_s
                self.emit(a, EventType.SWITCH_OP, switch_id=sid, op=p.op, ranks=ranks[p.group], start=round(a, 6),
                          end=round(a + p.cost_s, 6), critical=p.critical, bytes=p.bytes)
            self.emit(t_d, EventType.ROLE_CHANGE, step=k, ranks=mv, from_role="train" if to_rollout else "rollout",
                      to_role="rollout" if to_rollout else "train")
            self.emit(t_d, EventType.TOPOLOGY, step=k, train_ranks=rank_range(0, dst.n_train),
                      rollout_ranks=rank_range(dst.n_train, self.N))
        self.pending = sw
        self.topo = dst

    # --- the loop ---------------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        t0 = time.perf_counter()
        topo0 = self.topo
        self.emit(0.0, EventType.TOPOLOGY, step=0, train_ranks=rank_range(0, topo0.n_train), rollout_ranks=rank_range(topo0.n_train, self.N))
        fed = -1  # newest step already shown to the policy
        for k in range(self.K):
            while len(self.r_end) <= k:
                self._run_rollout(len(self.r_end))
            self._run_train(k)
            self.result.topologies.append(f"{self.t_n[k]}:{self.r_n[k]}")
            if k == self.K - 1:
                break
            # decision point: the first of the two concurrent stages (R_{k+1}, T_k) to finish, i.e. the moment a
            # pool falls idle; with staleness 0 nothing overlaps T_k and the decision waits for it
            t_d = self.t_end[k]
            if self.s >= 1:
                while len(self.r_end) <= k + 1:
                    self._run_rollout(len(self.r_end))
                t_d = max(t_d, self.r_end[k + 1]) if self.lockstep else min(t_d, self.r_end[k + 1])
            while len(self.r_end) < self.K and len(self.r_end) - self.s - 1 <= k and self._rollout_start(len(self.r_end)) < t_d:
                self._run_rollout(len(self.r_end))
            # lockstep: the switch starts after the blocking sync and the coordinator's gap, before the next stages
            t_sw = t_d + (self.gap + (self.sync_s if k + 2 - self.s >= 1 else 0.0) if self.lockstep else 0.0)
            target = self.forced.get(k + 1)
            if target is not None:
                if target != self.topo.n_train:
                    dec = Decision(ResizeAction.RESIZE, Topology(target, self.N - target), "forced by policy.forced_splits")
                    self.emit(t_d, EventType.DECISION, step=k + 1, action=dec.action.value, reason=dec.reason,
                              target_train=target, target_rollout=self.N - target)
                    self._close_pending()
                    self._switch(k, t_sw, dec)
                continue
            j = k  # newest finished step (with s = 1, T_{k-1} ended before R_{k+1} began)
            while j > fed and self.t_end[j] > t_d:
                j -= 1
            if j <= fed:
                continue  # nothing new to learn from since the last decision
            fed = j
            obs = Observation(
                step=j, topology=self.topo, rollout_s=self.r_end[j] - self.r_gen[j], train_s=self.t_end[j] - self.t_start[j],
                rollout_tail_s=self.tab.tail_s(j), weight_sync_s=self.sync_s if j - self.s >= 1 else 0.0,
                tokens_generated=self.tab.batches[j][1], tokens_trained=self.tab.batches[j][2],
                steps_left=self.K - 1 - k,
                mixed=self.r_mixed[j] or self.t_n[j] + self.r_n[j] != self.N or self.t_n[j] != self.topo.n_train
                or self.r_n[j] != self.topo.n_rollout or self.pending is not None,
            )
            dec = self.ctl.decide(obs)
            if self.log and not isinstance(self.ctl, StaticController):
                extra = {}
                if dec.resize:
                    extra = dict(target_train=dec.target.n_train, target_rollout=dec.target.n_rollout,
                                 expected_saving_s=round(dec.expected_saving_s, 6), cost_s=round(dec.critical_cost_s, 6))
                self.emit(t_d, EventType.DECISION, step=j, action=dec.action.value, reason=dec.reason,
                          imbalance=round(dec.imbalance, 6), **extra)
            if dec.resize and dec.target != self.topo:
                self._close_pending()  # only without cooldown (greedy): close the earlier switch as it stands
                self._switch(k, t_sw, dec)
        r = self.result
        r.total_s = self.t_end[-1]
        r.samples = sum(self.tab.batches[k][0] for k in range(self.K))
        r.wall_s = time.perf_counter() - t0
        if self.log:
            self.ev.sort(key=lambda e: e.t)
            r.events = self.ev
        return r
