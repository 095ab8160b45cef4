"""The emulation's timing model: pure (no clock, no sleep), the modelled WALL seconds (already x ``time_scale``) of
every piece of work a worker rank does, from the same physics as ``dynaresize simulate``.

One real token stands for ``tokens_per_token`` (``k``) modelled tokens, prompts and responses alike. With
``s = time_scale`` and the simulator's sections ``sim.rollout`` (r), ``sim.train`` (t) and the switch cost model:

- decode iteration of a rank holding ``a`` sequences at mean context ``c`` real tokens: one real iteration is ``k``
  modelled iterations at context ``c k``:
  ``s k (r.iteration_fixed_s + a (r.compute_per_seq_s + c k r.kv_bytes_per_token / (r.hbm_gbps 1e9)))``
  (:class:`dynaresize.sim.stages.StepPhysics`; with ``c`` = the live rows' mean prompt + tokens so far + 0.5, as
  the torch engine passes it, a batch sums exactly to the simulator's time at its token-weighted context
  ``prompt + E[L^2] / 2E[L]``);
- prefill of ``P`` real prompt tokens (once per distinct prompt: the G responses of a group share it, prefix
  caching, as the simulator counts it): ``s P k / r.prefill_tokens_per_s``;
- training of a chunk of samples on one of ``n`` trainers: ``s W (1 + t.attention_per_context_token C) /
  (t.tokens_per_gpu_s n eff(n))`` with ``W`` the chunk's modelled trained tokens (prompt + response, or the response
  only: ``sim.workload.trained_tokens``), ``C`` its token-weighted context ``E[S^2] / 2E[S]`` (``train_context``)
  and ``eff(n) = t.scaling_per_doubling ** log2 n``: each rank trains its own share, all in step;
- optimizer step: ``s t.step_overhead_s``; a weight transfer: ``s SwitchCostModel.weight_sync_s()``;
- a switch op: ``s x`` the cost ``SwitchCostModel.plan`` gives it for this rank's group (moving or staying trainer),
  critical ops only; the deferred optimizer state adds, at the first optimizer step, what the training before it
  did not hide (as the sample-level simulator charges it).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from dynaresize.events import SwitchOp
from dynaresize.policy import OpGroup, SwitchCostModel, Topology
from dynaresize.policy.predictor import efficiency

# Which op of the worker's switch (dynaresize/worker/core.py ``_cmd_switch_role``) carries the planned ops that the
# CPU worker has no separate step for: a rank paces, over its switch, exactly its group's critical planned cost.
WORKER_SWITCH_OPS = (SwitchOp.OFFLOAD, SwitchOp.COMM_SELECT, SwitchOp.WEIGHT_SYNC, SwitchOp.ENGINE_BUILD,
                     SwitchOp.OPTIMIZER_RESHARD)
_CARRIER = {
    SwitchOp.DRAIN: SwitchOp.OFFLOAD, SwitchOp.OPTIMIZER_STAGE_OUT: SwitchOp.OFFLOAD, SwitchOp.OFFLOAD: SwitchOp.OFFLOAD,
    SwitchOp.PROCESS_RESTART: SwitchOp.OFFLOAD, SwitchOp.COMM_SELECT: SwitchOp.COMM_SELECT,
    SwitchOp.COMM_INIT: SwitchOp.COMM_SELECT, SwitchOp.WEIGHT_SYNC: SwitchOp.WEIGHT_SYNC,
    SwitchOp.OPTIMIZER_RESHARD: SwitchOp.OPTIMIZER_RESHARD,
}  # every other op (onload, engine_build, weight_load, warmup, a critical stage-in) goes with engine_build


class ScaledSwitchCostModel(SwitchCostModel):
    """The switch cost model with every op's cost (formula or ``override_s``) x ``scale``: the emulated run's wall
    time, so the coordinator's policy prices a switch in the same seconds it measures its steps in."""

    def __init__(self, costs, opts, scale: float):
        if scale <= 0:
            raise ValueError(f"cost scale must be > 0, got {scale}")
        self.scale = scale
        super().__init__(costs, opts)

    def _cost(self, op: SwitchOp, formula: float) -> float:
        return self.scale * super()._cost(op, formula)


def switch_cost_model(cfg) -> SwitchCostModel:
    """The cost model the runtime's policy uses: in emulated wall seconds when ``cluster.device`` is emulated."""
    sw = cfg.switching
    if cfg.cluster.device == "emulated":
        return ScaledSwitchCostModel(sw.costs, sw.optimizations, cfg.emulation.time_scale)
    return SwitchCostModel(sw.costs, sw.optimizations)


class TimingModel:
    """Modelled wall seconds of a rank's work under one config (its ``sim``, ``switching`` and ``emulation``)."""

    def __init__(self, cfg):
        self.r, self.t, self.e = cfg.sim.rollout, cfg.sim.train, cfg.emulation
        self.trained = cfg.sim.workload.trained_tokens
        self.max_seqs = self.r.max_seqs_per_gpu  # the simulated GPU's concurrent sequences: the emulated KV slots
        self.s, self.k = self.e.time_scale, self.e.tokens_per_token
        self.costs = ScaledSwitchCostModel(cfg.switching.costs, cfg.switching.optimizations, self.s)  # wall seconds
        self.overlap = cfg.switching.costs.deferred_overlap_fraction
        if self.r.model != "physics":
            raise ValueError("cluster.device=emulated needs sim.rollout.model=physics (decode physics to emulate), "
                             f"not {self.r.model!r}")

    def decode_iteration_s(self, active: int, context: float) -> float:
        """One real decode iteration of ``active`` sequences at mean context ``context`` real tokens."""
        if active <= 0:
            return 0.0
        r, k = self.r, self.k
        u = r.compute_per_seq_s + context * k * r.kv_bytes_per_token / (r.hbm_gbps * 1e9)
        return self.s * k * (r.iteration_fixed_s + active * u)

    def prefill_s(self, prompt_tokens: float) -> float:
        """Prefill of ``prompt_tokens`` real tokens (count each distinct prompt once: :func:`distinct_prompt_tokens`)."""
        return self.s * prompt_tokens * self.k / self.r.prefill_tokens_per_s

    def train_s(self, prompt_lens: Sequence[int], response_lens: Sequence[int], n_train: int) -> float:
        """Forward and backward of these samples (real token counts) on one of ``n_train`` data-parallel trainers."""
        if len(prompt_lens) != len(response_lens):
            raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
        if n_train < 1:
            raise ValueError(f"n_train must be >= 1, got {n_train}")
        if not prompt_lens:
            return 0.0
        k, t = self.k, self.t
        seq = [k * (p + q) for p, q in zip(prompt_lens, response_lens)]
        m1 = sum(seq) / len(seq)
        ctx = sum(x * x for x in seq) / len(seq) / (2 * m1) if m1 > 0 else 0.0
        tokens = sum(seq) if self.trained == "sequence" else k * sum(response_lens)
        eff = efficiency(n_train, t.scaling_per_doubling)
        return self.s * tokens * (1.0 + t.attention_per_context_token * ctx) / (t.tokens_per_gpu_s * n_train * eff)

    def optimizer_step_s(self) -> float:
        return self.s * self.t.step_overhead_s

    def weight_sync_s(self) -> float:
        return self.costs.weight_sync_s()

    def switch_ops_s(self, from_train: int, to_train: int, world: int, rank: int) -> dict[SwitchOp, float]:
        """Seconds each op of the worker's switch lasts on ``rank`` (see ``WORKER_SWITCH_OPS``): the critical planned
        ops of its group (moving, or staying trainer) and of every rank (stop-the-world), each on its carrier op.
        Empty for a rank the switch does not involve."""
        was, will = rank < from_train, rank < to_train
        if not (was or will) or from_train == to_train:
            return {}
        group = OpGroup.MOVING if was != will else OpGroup.TRAINERS
        out = {op: 0.0 for op in WORKER_SWITCH_OPS}
        for p in self.costs.plan(Topology(from_train, world - from_train), Topology(to_train, world - to_train)):
            if p.critical and p.group in (group, OpGroup.ALL):
                out[_CARRIER.get(p.op, SwitchOp.ENGINE_BUILD)] += p.cost_s
        return out

    def deferred_stage_in_s(self, from_train: int, to_train: int, world: int, trained_s: float) -> float:
        """What a new trainer set's deferred optimizer state adds at its first optimizer step: the background
        stage-in the forward/backward before it (``trained_s`` modelled wall seconds) did not hide
        (``max(0, stage-in - deferred_overlap_fraction x trained_s)``, as the sample-level simulator charges it)."""
        bg = sum(p.cost_s for p in self.costs.plan(Topology(from_train, world - from_train), Topology(to_train, world - to_train))
                 if not p.critical and p.group is OpGroup.TRAINERS)
        return max(0.0, bg - self.overlap * trained_s)


def distinct_prompt_tokens(prompts: Iterable[Sequence[int]]) -> int:
    """Prompt tokens counted once per distinct prompt (the responses of a group share their prompt's prefill)."""
    return sum(len(p) for p in {tuple(p) for p in prompts})
