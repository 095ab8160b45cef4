"""The switch cost model: a role switch as a list of fine-grained ops, each with a cost and a critical-path flag.

Which ops a switch needs, and which of them stall the pipeline, depends on the optimisations that are on:

==================  ===========================================  ==============================================
optimisation        off (naive)                                  on (DynaResize)
==================  ===========================================  ==============================================
process_reuse       process_restart + engine_build (critical)    offload / onload of the live engine
comm_reuse          comm_init over the whole world: every rank   comm_select of a pre-built group (ms)
                    stops (stop-the-world switch)
bounded_staging     optimizer state through the shared FS        device -> host buffer critical, NVMe write
                                                                 in the background
deferred_optimizer  optimizer stage-in and re-shard critical     overlapped with the first forward/backward
==================  ===========================================  ==============================================

Costs are functions of model size, GPU counts and bandwidths (``SwitchCostConfig``; ``override_s`` replaces any
formula by a measured duration). Pure: the same inputs give the same plan.
"""

from __future__ import annotations

from functools import lru_cache

from dynaresize.events import SwitchOp
from dynaresize.policy.config import OptimizationsConfig, SwitchCostConfig
from dynaresize.policy.types import OpGroup, PlannedOp, Topology

GB = 1e9


class SwitchCostModel:
    def __init__(self, costs: SwitchCostConfig, opts: OptimizationsConfig):
        self.c = costs
        self.o = opts
        self.plan = lru_cache(maxsize=4096)(self._plan)  # pure, so memoised

    @property
    def stop_the_world(self) -> bool:
        """Without communicator reuse a new world group is built, which every rank must join."""
        return not self.o.comm_reuse

    def weight_bytes(self) -> float:
        return self.c.model_params_b * 1e9 * self.c.weight_bytes_per_param

    def optimizer_bytes(self) -> float:
        return self.c.model_params_b * 1e9 * self.c.optimizer_bytes_per_param

    def weight_sync_s(self) -> float:
        return self._cost(SwitchOp.WEIGHT_SYNC, self.weight_bytes() / (self.c.nccl_gbps * GB))

    def _cost(self, op: SwitchOp, formula: float) -> float:
        return float(self.c.override_s.get(op.value, formula))

    def _op(self, op: SwitchOp, group: OpGroup, formula: float, critical: bool, nbytes: float = 0) -> PlannedOp:
        return PlannedOp(op, group, self._cost(op, formula), critical, int(nbytes))

    def _plan(self, src: Topology, dst: Topology) -> tuple[PlannedOp, ...]:
        """Ops to go from ``src`` to ``dst`` (same total). Empty when nothing moves."""
        if src.total != dst.total:
            raise ValueError(f"cannot switch {src} -> {dst}: GPU totals differ")
        if src == dst:
            return ()
        c, o = self.c, self.o
        to_rollout = dst.n_rollout > src.n_rollout
        w, opt = self.weight_bytes(), self.optimizer_bytes()
        shard_out = opt / src.n_train  # one old trainer's ZeRO shard
        shard_in = opt / dst.n_train  # one new trainer's ZeRO shard
        pcie, nvme, fs = c.pcie_gbps * GB, c.nvme_gbps * GB, c.shared_fs_gbps * GB
        M = OpGroup.ALL if self.stop_the_world else OpGroup.MOVING
        T = OpGroup.ALL if self.stop_the_world else OpGroup.TRAINERS
        ops: list[PlannedOp] = []
        if not to_rollout:
            ops.append(self._op(SwitchOp.DRAIN, M, c.drain_s, True))
        # optimizer state of leaving trainers (to_rollout) or of the old partitioning (to_train) goes out
        if o.bounded_staging:
            ops.append(self._op(SwitchOp.OPTIMIZER_STAGE_OUT, T if not to_rollout else M, shard_out / pcie, True, shard_out))
        else:
            ops.append(self._op(SwitchOp.OPTIMIZER_STAGE_OUT, T if not to_rollout else M, shard_out / fs, True, shard_out))
        if o.process_reuse:
            ops.append(self._op(SwitchOp.OFFLOAD, M, w / pcie, True, w))
        else:
            ops.append(self._op(SwitchOp.PROCESS_RESTART, M, c.process_restart_s, True))
        if o.comm_reuse:
            ops.append(self._op(SwitchOp.COMM_SELECT, M, c.comm_select_s, True))
        else:
            ops.append(self._op(SwitchOp.COMM_INIT, OpGroup.ALL, c.comm_init_base_s + c.comm_init_per_gpu_s * src.total, True))
        if o.process_reuse:
            onload = (w / pcie + c.wake_fixed_s) if to_rollout else (w / pcie + c.train_engine_rebuild_s)
            ops.append(self._op(SwitchOp.ONLOAD, M, onload, True, w))
            ops.append(self._op(SwitchOp.ENGINE_BUILD, T, c.train_engine_rebuild_s, True))
        else:
            build = max(c.rollout_engine_build_s, c.train_engine_build_s)
            ops.append(self._op(SwitchOp.ENGINE_BUILD, OpGroup.ALL, build, True))
            ops.append(self._op(SwitchOp.WEIGHT_LOAD, OpGroup.ALL, w / fs, True, w))
        ops.append(self._op(SwitchOp.WEIGHT_SYNC, M, w / (c.nccl_gbps * GB), True, w))
        # optimizer state into the new partitioning
        deferred = o.deferred_optimizer
        stage_bw = nvme if o.bounded_staging else fs
        ops.append(self._op(SwitchOp.OPTIMIZER_STAGE_IN, T, shard_in / stage_bw, not deferred, shard_in))
        ops.append(self._op(SwitchOp.OPTIMIZER_RESHARD, T, shard_in / (c.nccl_gbps * GB), not deferred, shard_in))
        if o.bounded_staging and to_rollout:
            ops.append(self._op(SwitchOp.OPTIMIZER_STAGE_OUT, M, shard_out / nvme, False, shard_out))  # NVMe write behind
        ops.append(self._op(SwitchOp.WARMUP, M if o.process_reuse else OpGroup.ALL, c.warmup_s if o.process_reuse else c.warmup_naive_s, True))
        return tuple(ops)

    def critical_cost_s(self, src: Topology, dst: Topology) -> float:
        """Estimated critical-path cost: stop-the-world ops add up; moving ranks and trainers run side by side."""
        plan = self.plan(src, dst)
        crit = {g: 0.0 for g in OpGroup}
        for p in plan:
            if p.critical:
                crit[p.group] += p.cost_s
        return crit[OpGroup.ALL] + max(crit[OpGroup.MOVING], crit[OpGroup.TRAINERS])

    def total_cost_s(self, src: Topology, dst: Topology) -> float:
        """Sum of every op's cost: the overhead if nothing were overlapped."""
        return sum(p.cost_s for p in self.plan(src, dst))
