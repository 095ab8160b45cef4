"""Config of the resizing policy (section ``policy``) and of the switch cost model it plans with (``switching``).

The policy itself is pure (``dynaresize/policy/policy.py``); this file only holds its knobs. The cost model's
knobs (:class:`SwitchCostConfig`, :class:`OptimizationsConfig`) live here too because the policy needs them to price
a plan. They form the top-level section ``switching`` (:class:`SwitchingConfig`), read by the runtime policy, the
simulator and the workers alike (``switching.optimizations.deferred_optimizer`` is the one setting that says whether
a trainer defers its optimizer state); ``dynaresize calibrate`` writes ``switching.costs`` from a real run and
``dynaresize simulate --costs FILE`` reads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from dynaresize.config.base import RuleError, Section
from dynaresize.events import SwitchOp


class PolicyConfig(Section):
    enabled: bool = Field(True, description="Resize at runtime; false holds the initial split (the static baseline)")
    ewma_alpha: float = Field(0.5, gt=0, le=1, description="Weight of the newest observation in the stage-time EWMA")
    imbalance_threshold: float = Field(
        0.15, ge=0, description="Relative stage-time imbalance |rollout-train|/max that counts as a signal"
    )
    consecutive_signals: int = Field(2, ge=1, description="Signals in a row needed before a resize is considered")
    min_dwell_steps: int = Field(3, ge=0, description="Steps a topology must be kept before it may change")
    cooldown_steps: int = Field(2, ge=0, description="Steps after a resize during which signals are ignored")
    payback_horizon_steps: int = Field(10, ge=1, description="Horizon over which the expected saving is summed")
    payback_margin: float = Field(1.5, ge=1, description="Expected saving must exceed the switch cost times this margin")
    min_relative_gain: float = Field(
        0.0, ge=0, lt=1, description="A resize must cut the predicted step time by at least this fraction (0: off; guards against noise)"
    )
    payback_check: bool = Field(True, description="Apply the payback check (false only for the greedy baseline)")
    tail_ewma_alpha: float | None = Field(
        0.2, gt=0, le=1, description="EWMA weight of the rollout tail (the longest response: noisy from step to step, "
        "its mean moves slowly; null: ewma_alpha)"
    )
    noise_alpha: float = Field(0.1, gt=0, le=1, description="EWMA weight of the tail's and the train work's step-to-step "
                               "variance (0.2 -> 0.1 at stop 42: at 0.2 a few calm steps halved the variance and let a "
                               "noise move through, 16 GPUs x 300 tokens seed 1 at step level, +1.08%; robustness at step "
                               "level 23 -> 24 / 24, held-out seeds 48 / 48 either way)")
    follow_shifts: bool = Field(
        False, description="A shift of the workload's size (tokens generated + trained a step beyond noise_z standard "
        "deviations of its step-to-step noise, consecutive_signals steps in a row in one direction) carries the tail and "
        "the train work to the new size at once, is not measured as noise, and restarts the play check's batches "
        "(dynaresize/policy/predictor.py, StageModel.update). Off: a sudden x4 rise of the response length is held as "
        "noise for 25-37 steps (configs/sim/shift_8gpu.yaml; docs/simulator.md, 'A sudden shift'). Opt-in until it is "
        "shown not to cost the stationary cases"
    )
    tail_cv_prior: float = Field(
        0.2, ge=0, description="Prior coefficient of variation of the tail before the variance is learned (ASSUMPTION: the "
        "longest of a few hundred lognormal responses varies by ~20% from step to step)"
    )
    noise_z: float = Field(
        2.0, ge=0, description="A resize needs a predicted saving per step above this many standard errors of that "
        "prediction (from the measured noise; 0: off)"
    )
    backoff_steps: int = Field(
        30, ge=0, description="Back-off against oscillation: a resize within this many steps of k earlier ones needs "
        "(1 + k) x noise_z standard errors (0: off)"
    )
    near_best_fraction: float = Field(
        1.0, gt=0, le=1, description="Take the candidate nearest the current split whose predicted saving per step is at "
        "least this share of the best candidate's (1: the best; smaller: shorter moves where the model is surer)"
    )
    memory_tolerance: float = Field(
        0.1, ge=0, description="A split left before is predicted no faster than it was measured (corrected for the "
        "drift since), and is returned to when it measured faster than the current one, while the model's prediction "
        "for it stays within this relative distance of the one when it was left, or else the workload's size (tokens "
        "generated and trained per step) does (0: no memory)"
    )
    train_scaling_per_doubling: float = Field(
        0.95, gt=0.5, le=1, description="Policy's assumed data-parallel efficiency kept per doubling of trainers"
    )
    rollout_model: Literal["work", "decode"] = Field(
        "decode", description="predictor=capacity: a split's rollout stage as work / n_rollout (GPU-seconds measured on "
        "one split) or from the observed batches' decode profile (decode: each GPU's busy span from its share's longest "
        "response, its tokens and its KV slots, scaled by the ratio measured; dynaresize/policy/decode_profile.py), where "
        "the observation carries its batch (the barrier-free schedule; else work). decode is the default since stop 39: "
        "24 stationary cases, the runtime's mechanisms, 22 within 1% and <= 2 switches against 17 with work, level on "
        "the drifting scenarios (docs/simulator.md, 'The decode profile')"
    )
    decode_shape_alpha: float = Field(
        0.1, gt=0, le=1, description="rollout_model=decode: EWMA weight of the profile's shape (each group's longest "
        "response relative to the mean; a batch's few longest vary by tens of % from batch to batch), after a running "
        "mean over the first observations; its level (tokens, decode costs) follows ewma_alpha (robustness, 24 cases: "
        "0.05-0.1 within 1% on 21, 0.2 on 20 with up to 6 switches)"
    )
    predictor: Literal["capacity", "pipeline"] = Field(
        "capacity", description="What predicts a split's period: capacity (rollout = tail + work / n_rollout, train = "
        "work / n_train) or pipeline (plays the split forward on the run's own recent batches with the simulator's "
        "decode model, the versions and streaming training: sees batches in flight and decode waves; used where the "
        "observation carries its batch, i.e. the barrier-free schedule, else capacity). docs/simulator.md, 'A predictor "
        "of the barrier-free pipeline'"
    )
    play_check: bool = Field(
        True, description="predictor=capacity: a move the capacity model proposes is checked by playing the barrier-free "
        "pipeline forward on the run's recent batches (the pipeline predictor's play): the current split against the "
        "splits within pipeline_window units of the proposed one; the move goes to the best that plays faster (another "
        "than the proposed one: beyond the noise), else the policy holds. Only where the observations carry their batches "
        "(the barrier-free schedule); plays only when a move is proposed. docs/simulator.md, 'The play check'"
    )
    play_check_budget: int = Field(
        1_000_000, ge=1, description="play_check: the sequences decoded across one check's plays (a play decodes every "
        "sequence of its batches: ~21 batches): the current and the proposed split, then the splits nearest the proposed "
        "one while the budget lasts; no check where those two plays alone exceed it (64 GPUs, 2,048 sequences a batch: "
        "10 plays; 512 GPUs, 8,192: 5; 4096 GPUs, 32,768: none)"
    )
    pipeline_trace_steps: int = Field(8, ge=1, description="predictor=pipeline and play_check: recent batches replayed (4 -> 8 smoothed the played period: 8 GPUs at 3000 tokens 3 switches +2.3% -> 1 switch -0.1%)")
    pipeline_lead_steps: float | None = Field(
        1.0, ge=0, description="predictor=pipeline and play_check: the batches are replayed as the run will be this many batches after "
        "the newest, along the linear trend of their mean response length, training per group, per-sequence decode cost "
        "and KV slots where that trend is significant (pipeline_trend_z); null: replayed as observed"
    )
    pipeline_trend_z: float = Field(
        2.0, ge=0, description="predictor=pipeline and play_check: a trend is followed only when its slope is more than this many "
        "standard errors from flat"
    )
    pipeline_noise: Literal["agree", "played", "max"] = Field(
        "agree", description="predictor=pipeline: the noise test of a played gain (positive in every mode): beyond its "
        "spread over the replayed batches, or the capacity model predicting a gain for the same split beyond its own "
        "noise (agree); beyond that spread alone (played); beyond the larger of that spread and the capacity model's "
        "sensitivity to its estimates (max)"
    )
    pipeline_window: int = Field(
        4, ge=0, description="predictor=pipeline: candidates within this many units of the current split or of the "
        "capacity model's best are played forward; play_check: within this many units of the proposed split (0: every "
        "candidate; the check's within its budget)"
    )
    forced_splits: dict[int, int] = Field(
        default_factory=dict,
        description="Scripted resizes for tests and experiments: {step: trainers} switches at those steps, bypassing the policy "
        "(one due while a switch is still in flight: at the first step after it)",
    )


class OptimizationsConfig(Section):
    """Which of DynaResize's switch optimisations are on (all off = naive stop-the-world switching)."""

    process_reuse: bool = Field(True, description="Keep worker processes; a switch changes the logical role only")
    comm_reuse: bool = Field(True, description="Pre-build communicators for every candidate split; a switch selects one")
    bounded_staging: bool = Field(True, description="Stage state through a bounded host buffer to node-local NVMe")
    deferred_optimizer: bool = Field(True, description="Load optimizer state lazily, overlapped with the first forward/backward")

    @classmethod
    def naive(cls) -> "OptimizationsConfig":
        return cls(process_reuse=False, comm_reuse=False, bounded_staging=False, deferred_optimizer=False)


class SwitchCostConfig(Section):
    """Physical inputs of the switch cost model. Sources are cited per field; ASSUMPTION marks a guess.

    ``override_s`` replaces a formula by a measured duration (what ``dynaresize calibrate`` writes).
    """

    model_params_b: float = Field(8.2, gt=0, description="Model parameters in billions (Qwen3-8B: 8.2)")
    weight_bytes_per_param: float = Field(2.0, gt=0, description="Bytes per parameter of the weights (bf16)")
    optimizer_bytes_per_param: float = Field(12.0, ge=0, description="Optimizer bytes per parameter (fp32 master + Adam m, v)")
    pcie_gbps: float = Field(25.0, gt=0, description="Host<->device copy bandwidth per GPU, GB/s (ASSUMPTION: PCIe 5 x16, pinned)")
    nvme_gbps: float = Field(3.0, gt=0, description="Node-local NVMe bandwidth per GPU, GB/s (ASSUMPTION)")
    shared_fs_gbps: float = Field(2.0, gt=0, description="Shared filesystem bandwidth per GPU for checkpoints, GB/s (ASSUMPTION)")
    nccl_gbps: float = Field(
        100.0, gt=0, description="Trainer->rollout weight-broadcast bandwidth, GB/s (DESIGN: 7B synced in 0.02-0.3 s)"
    )
    drain_s: float = Field(0.5, ge=0, description="Abort and hand back in-flight rollout requests (ASSUMPTION)")
    process_restart_s: float = Field(30.0, ge=0, description="Kill and restart a worker: Python, CUDA, imports (ASSUMPTION)")
    comm_init_base_s: float = Field(4.5, ge=0, description="New communicator, fixed part (DESIGN: 4.5 s first all-reduce on 8 GPUs)")
    comm_init_per_gpu_s: float = Field(
        0.03, ge=0, description="New communicator, per GPU of the world (DESIGN: minutes at thousands of GPUs)"
    )
    comm_select_s: float = Field(0.01, ge=0, description="Select a pre-built communicator (ASSUMPTION)")
    rollout_engine_build_s: float = Field(14.0, ge=0, description="Start a vLLM engine for an 8B model (DESIGN: ~14 s)")
    train_engine_build_s: float = Field(5.0, ge=0, description="First DeepSpeed initialize in a process (DESIGN: 3-6 s measured here)")
    train_engine_rebuild_s: float = Field(0.2, ge=0, description="Later DeepSpeed initialize in a live process (DESIGN: 0.02-0.2 s)")
    wake_fixed_s: float = Field(0.5, ge=0, description="vLLM wake_up fixed part, KV cache re-allocation (DESIGN: level 1 0.1-6 s)")
    warmup_naive_s: float = Field(25.0, ge=0, description="First step of a fresh engine: compile, graphs (DESIGN: 39 s vs 14 s init)")
    warmup_s: float = Field(1.0, ge=0, description="First step after a logical role change (ASSUMPTION)")
    deferred_overlap_fraction: float = Field(
        0.9, ge=0, le=1, description="Share of a training step before the first optimizer step (window for deferred state)"
    )
    override_s: dict[str, float] = Field(
        default_factory=dict, description="Measured seconds per switch op (op name -> s) replacing the formula"
    )

    @field_validator("override_s")
    @classmethod
    def _known_ops(cls, v: dict[str, float]) -> dict[str, float]:
        allowed = [o.value for o in SwitchOp]
        for k, s in v.items():
            if k not in allowed:
                raise RuleError((k,), s, f"unknown switch op {k!r}; allowed: {', '.join(allowed)}")
            if s < 0:
                raise RuleError((k,), s, f"override for {k!r} is negative ({s})")
        return v


class SwitchingConfig(Section):
    """What a role switch costs and which optimisations it uses: one section for the runtime and the simulator."""

    costs: SwitchCostConfig = Field(
        default_factory=SwitchCostConfig, description="Switch cost model inputs the policy prices a plan with (dynaresize calibrate writes these)"
    )
    optimizations: OptimizationsConfig = Field(
        default_factory=OptimizationsConfig, description="Switch optimisations in use (the runtime's workers and the simulator's DynaResize run)"
    )
