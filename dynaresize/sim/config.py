"""Config of the discrete-event simulator (section ``sim``): workload and hardware physics.

The cluster size, initial split and granularity come from ``cluster``, the staleness bound from ``pipeline``, the
hysteresis from ``policy``, the switch costs and optimisations from ``switching`` and the seed from ``run``, so one
experiment file drives both a real run and a simulated one. Defaults describe a Qwen3-8B-like model on H20-like
GPUs; each number says where it comes from (DESIGN = ../shared/DESIGN.md public figures, ASSUMPTION = our estimate).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dynaresize.config.base import RuleError, Section

log = logging.getLogger("dynaresize.config")

# the step-level model's old schedule names: pipelined is the runtime's barrier schedule (the name the runtime uses),
# lockstep the retired runtime loop (the runtime now reads its own pipeline.schedule=lockstep as barrier)
_OLD_SCHEDULES = {"pipelined": "barrier", "lockstep": "barrier_lockstep"}
# trainer-gen (idle trainers generating groups of the next batch) was removed from the scheduler core and the
# simulator (issue 25): it was never used in any resizing run (docs/simulator.md, "Removed: trainer-gen")
_REMOVED_PIPELINE = ("trainer_rollout", "trainer_gen_cost_s", "trainer_gen_kv_fraction", "trainer_gen_rate")
_TRAINER_GEN_GONE = ("trainer-gen was removed: with resizing it never sent a trainer generating in any simulator "
                     "scenario, so removing it cost 0.0% of throughput; see docs/simulator.md, 'Removed: trainer-gen'")
_NEW_SCHEDULES = {"barrier": "the runtime's name for the same static one-step-off schedule",
                  "barrier_lockstep": "the retired runtime loop it models, both pools started together each step"}


class WorkloadDynamicSamplingConfig(Section):
    """DAPO-style dynamic sampling (arXiv 2503.14476, "dynamic sampling"; verl's recipe/dapo ``filter_groups``).

    Each prompt has a success probability drawn around the step's accuracy; its G responses get Bernoulli rewards;
    a group whose rewards are all equal (all correct or all wrong) has no GRPO advantage and is dropped. Prompts are
    generated (in rounds, or as a stream in prompt order) until the batch holds ``prompts_per_step`` kept groups,
    the first ones in prompt order, or until ``max_oversample`` x ``prompts_per_step`` prompts were generated.
    As accuracy rises, more groups are all-correct, so the rollout work per trained sample grows.
    """

    enabled: bool = Field(False, description="Drop groups whose rewards are all equal and generate more prompts (off: every group is kept)")
    accuracy_start: float = Field(
        0.3, ge=0, le=1, description="Mean per-prompt success probability at the first step (ASSUMPTION: a math RL run "
        "starting from a base model)"
    )
    accuracy_end: float = Field(
        0.8, ge=0, le=1, description="Mean per-prompt success probability at the last step (linear in between; ASSUMPTION)"
    )
    accuracy_by_step: list[float] = Field(
        default_factory=list, description="Mean success probability of each step (replaces start/end; later steps keep "
        "the last value)"
    )
    difficulty_concentration: float = Field(
        2.0, gt=0, description="Per-prompt success probability ~ Beta(acc x c, (1 - acc) x c): small c = many prompts "
        "always or never solved (ASSUMPTION)"
    )
    mode: Literal["rounds", "stream"] = Field(
        "rounds", description="rounds: generate whole rounds of prompts and keep the first kept groups (verl's DAPO "
        "recipe); stream: generate prompts in order and stop at the one that completes the batch"
    )
    round_prompts_factor: float = Field(
        3.0, gt=0, description="Prompts per round (and per drawn chunk in stream mode) as a multiple of prompts_per_step "
        "(verl recipe/dapo: gen_prompt_bsz = 3 x train_prompt_bsz)"
    )
    max_oversample: float = Field(
        30.0, ge=1, description="At most this many x prompts_per_step prompts generated per step; fewer kept groups are "
        "trained if they run out (verl recipe/dapo: max_num_gen_batches = 10 rounds of 3x; verl raises there instead)"
    )
    truncated_fails: bool = Field(
        True, description="A response at max_response_tokens scores 0 (DAPO: an overlong response is punished; it has "
        "no final answer to verify)"
    )


class WorkloadTaskConfig(Section):
    """One task of a mix: its own response and prompt length distributions (lognormal)."""

    name: str = Field(..., min_length=1, description="Task name (for reports)")
    response_tokens_mean: float = Field(..., gt=0, description="Mean response length of this task, tokens")
    response_sigma: float = Field(1.0, ge=0, description="Lognormal shape of this task's response lengths")
    prompt_tokens_mean: float | None = Field(None, gt=0, description="Mean prompt length of this task (default: workload.prompt_tokens_mean)")


class WorkloadConfig(Section):
    prompts_per_step: int = Field(32, ge=1, description="Prompts per RL step (B)")
    responses_per_prompt: int = Field(8, ge=1, description="Responses sampled per prompt (G)")
    prompt_tokens_mean: float = Field(512, gt=0, description="Mean prompt length, tokens (lognormal)")
    prompt_tokens_sigma: float = Field(0.3, ge=0, description="Lognormal shape of prompt lengths")
    response_tokens_start: float = Field(1000, gt=0, description="Mean response length at the first step, tokens")
    response_tokens_end: float = Field(4000, gt=0, description="Mean response length at the last step (equal to start: stationary)")
    drift: Literal["linear", "exponential", "logistic", "step"] = Field(
        "linear", description="How the mean response length moves from start to end: linear, exponential (a constant "
        "rate per step), logistic (an S-curve: slow at first, fastest at drift_midpoint, flattening out; the shape "
        "long-CoT RL runs report, e.g. DeepSeek-R1-Zero's training length, Nature 2025 Fig. 1b; the S shape ASSUMPTION) "
        "or step (start until drift_midpoint of the run, end from there: a sudden shift, e.g. a new data mix)"
    )
    drift_midpoint: float = Field(0.5, gt=0, lt=1, description="drift=logistic: the share of the run where the length grows "
                                  "fastest (ASSUMPTION); drift=step: the share of the run where it jumps from start to end")
    drift_width: float = Field(
        0.12, gt=0, le=1, description="drift=logistic: the S-curve's width as a share of the run (about 4 x this from 12% to "
        "88% of the growth; ASSUMPTION)"
    )
    response_sigma: float = Field(1.0, ge=0, description="Lognormal shape of response lengths (1.0: a long tail)")
    max_response_tokens: int = Field(16384, ge=1, description="Response length cap (max_tokens)")
    response_tokens_by_step: list[float] = Field(
        default_factory=list, description="Observed mean response length of each step (replaces the drift; later steps keep "
        "the last value; each step's lengths are rescaled to this mean; dynaresize calibrate writes it from a log)"
    )
    trained_tokens: Literal["sequence", "response"] = Field(
        "sequence", description="What a trained token counts: prompt + response (sequence) or the response only, as the "
        "CPU runtime logs tokens_trained (a calibrated rate is per logged token)"
    )
    cap_share: float = Field(
        0.0, ge=0, lt=1, description="Share of responses that run to max_response_tokens whatever their drawn length "
        "(degenerate repetition, unfinished reasoning; 0: off, only draws above the cap are cut; ASSUMPTION)"
    )
    cap_share_end: float | None = Field(
        None, ge=0, lt=1, description="Share of responses at max_response_tokens at the last step (linear from cap_share "
        "at the first; none: cap_share throughout). Long-CoT runs report a truncated share that grows as lengths reach "
        "the context limit (DeepScaleR's 8K stage; DAPO arXiv 2503.14476 shapes or filters overlong samples for it)"
    )
    tasks: list[WorkloadTaskConfig] = Field(
        default_factory=list, description="A task mix: each prompt belongs to one task (drawn by task_weights) and its "
        "responses follow that task's lengths; replaces the drift (response_tokens_start/end) when set"
    )
    task_weights: dict[int, list[float]] = Field(
        default_factory=dict, description="{from_step: one weight per task}: the mix from that step on (needs step 0; "
        "weights are normalised)"
    )
    dynamic_sampling: WorkloadDynamicSamplingConfig = Field(
        default_factory=WorkloadDynamicSamplingConfig, description="DAPO-style dynamic sampling: groups with all-equal rewards dropped, more prompts generated"
    )
    trace: str | None = Field(
        None, description="A run's batches.jsonl (or its run directory): step k's batch is that step's logged samples "
        "(response lengths in prompt order, one prompt length per prompt, all kept) instead of a draw; replaces every "
        "other driver (dynaresize.sim.trace)"
    )
    trace_token_scale: float = Field(
        1.0, gt=0, description="trace: each logged length times this (an emulated run: emulation.tokens_per_token)"
    )


class RolloutPhysicsConfig(Section):
    """Decode is memory-bound: one decode iteration on a GPU costs iteration_fixed_s + active x (compute + KV read).

    ``model: empirical`` replaces that physics by a stage-time fit of a real run (``dynaresize calibrate``):
    rollout_s(n) = empirical_overhead_s + tokens_generated / (n x empirical_tokens_per_gpu_s).
    """

    model: Literal["physics", "empirical"] = Field(
        "physics", description="physics: decode from GPU figures below; empirical: overhead + tokens / (GPUs x rate), fitted by dynaresize calibrate"
    )
    empirical_overhead_s: float = Field(0.0, ge=0, description="model=empirical: fixed seconds per rollout stage (does not shrink with GPUs)")
    empirical_tokens_per_gpu_s: float = Field(1000.0, gt=0, description="model=empirical: generated tokens/s per rollout GPU")

    iteration_fixed_s: float = Field(
        0.0075, gt=0, description="Per decode iteration: weights read (16.4 GB at 4 TB/s: 4.1 ms) + scheduling, sampling (ASSUMPTION: ~7.5 ms ITL)"
    )
    compute_per_seq_s: float = Field(0.00022, ge=0, description="Per sequence per iteration: 2 x 8.2 GFLOP at 74 TFLOP/s (ASSUMPTION H20 at 50%)")
    kv_bytes_per_token: float = Field(147456, ge=0, description="KV-cache bytes per token (Qwen3-8B: 36 layers x 8 heads x 128 x 2 x bf16)")
    hbm_gbps: float = Field(3200, gt=0, description="Effective HBM bandwidth for KV reads, GB/s (ASSUMPTION: 80% of H20's 4.0 TB/s)")
    kv_cache_gb: float = Field(70, gt=0, description="KV-cache memory per GPU, GB (ASSUMPTION: 96 GB x 0.9 - weights)")
    max_seqs_per_gpu: int = Field(256, ge=1, description="Scheduler cap on concurrent sequences per GPU (vLLM max_num_seqs)")
    prefill_tokens_per_s: float = Field(4500, gt=0, description="Prefill throughput per GPU, tokens/s (compute-bound; ASSUMPTION)")


class TrainPhysicsConfig(Section):
    tokens_per_gpu_s: float = Field(
        630, gt=0, description="Trained tokens/s per GPU (148 TFLOP/s x 35% MFU / 10 x 8.2 GFLOP: fwd old+ref, fwd+bwd; ASSUMPTION)"
    )
    scaling_per_doubling: float = Field(0.95, gt=0.5, le=1, description="Data-parallel efficiency kept per doubling of trainers (ASSUMPTION)")
    step_overhead_s: float = Field(2.0, ge=0, description="Fixed per training step: optimizer step, barriers (ASSUMPTION)")
    attention_per_context_token: float = Field(
        0.0, ge=0, description="Extra cost per trained token per token of context before it, relative to the dense cost "
        "(Qwen3-8B: 4 x 36 layers x 4096 / (2 x 8.2e9) = 3.6e-5; 0 = linear in tokens, as dynaresize calibrate fits)"
    )


class PipelineModelConfig(Section):
    """Which pipeline model ``dynaresize simulate`` runs, and which barrier-free mechanisms it turns on.

    ``step``: the step-level model (dynaresize/sim/engine.py, one formula per stage; fast at any scale).
    ``samples``: the sample-level model (dynaresize/sim/samples.py): per-GPU continuous batching driven by the pure
    scheduler core (dynaresize/schedule/), the only one that models the mechanisms below.
    """

    model: Literal["step", "samples"] = Field("step", description="step: stage-level model; samples: per-GPU continuous batching driven by the scheduler core")
    continuous_rollout: bool = Field(
        False, description="model=samples: no rollout barrier; a rank takes the next batch once it holds its version (simulated only; the runtime follows)"
    )
    streaming_training: bool = Field(
        False, description="model=samples: trainers start on complete groups before the batch is complete, step when it is (simulated only)"
    )
    claim_groups: int = Field(4, ge=1, description="model=samples: groups a rollout GPU claims at a time when its KV slots free up (ASSUMPTION)")
    stream_chunks: int = Field(8, ge=1, description="model=samples: streaming training starts a chunk once 1/stream_chunks of a batch's groups are ready")
    claim_ahead: bool = Field(
        False, description="model=samples: a rollout GPU claims its next groups one command_latency_s before its slots "
        "free, so its refills never wait the control plane (the runtime's rank holds one group queued beyond its KV slots' worth); off: it "
        "claims when they free"
    )
    train_queue: int = Field(
        1, ge=1, le=2, description="model=samples: training commands (chunks, then the optimizer step) the trainers hold at "
        "once, run in the order sent (the runtime's pipeline.train_queue; 2 hides the control-plane latency between two)"
    )
    gradient_helpers: bool = Field(
        False, description="model=samples: idle rollout ranks holding the version a batch trains from compute gradients of its groups (simulated only)"
    )
    helper_rate: float = Field(0.9, gt=0, le=1, description="model=samples: a gradient helper's forward/backward rate relative to one trainer GPU (ASSUMPTION)")
    helper_cost_s: float = Field(
        1.2, ge=0, description="model=samples: a helper's overhead per help: engine sleep and wake (DESIGN: level 1 0.1-6 s) plus one "
        "gradient send (as a weight sync) (ASSUMPTION)"
    )
    tail_consolidation: bool = Field(
        False, description="model=samples: a rollout rank whose last sequences hold it back from the next version's work "
        "(or from its switch) hands them, with their KV cache, to a rank still decoding the same version (simulated only)"
    )
    kv_move_gbps: float = Field(
        25.0, gt=0, description="model=samples: tail consolidation moves the KV cache at this rate, GB/s (ASSUMPTION: a "
        "200 Gb/s RDMA link per GPU; NVLink within a node is faster)"
    )
    consolidation_min_gain: float = Field(
        2.0, ge=1, description="model=samples: a tail moves only if it would have decoded this many times longer than the move takes"
    )
    link_model: Literal["free", "star", "relay"] = Field(
        "free", description="model=samples: how a weight version's delivery is priced. free: every rank receives it "
        "weight_bytes / switching.costs.nccl_gbps after it asked, as if the sender's link were free (the model before "
        "issue 46); star: trainer rank 0 sends it to each rollout rank over its one link (the runtime's comm "
        "transport today); relay: every rank holding it forwards it to at most relay_fanout of the next ranks that "
        "asked (dynaresize/schedule/relay.py). star and relay charge each sender's link (dynaresize/sim/links.py)"
    )
    relay_fanout: int = Field(
        2, ge=1, le=16, description="model=samples, link_model=relay: receivers one holder of a version sends it to "
        "(one at a time); --compare's relay row uses it whatever link_model says"
    )
    link_gbps: float = Field(
        50.0, gt=0, description="model=samples, link_model=star|relay: network bandwidth of one rank's link, GB/s "
        "(ASSUMPTION: one 400 Gb/s NIC per GPU, as on H100/H20 nodes)"
    )

    @model_validator(mode="before")
    @classmethod
    def _removed_settings(cls, v: Any) -> Any:
        """Settings of a removed mechanism load with one warning and are dropped (an old config keeps working)."""
        if not isinstance(v, dict):
            return v
        gone = [k for k in _REMOVED_PIPELINE if k in v]
        if gone:
            v = {k: x for k, x in v.items() if k not in _REMOVED_PIPELINE}
            log.warning("sim.pipeline: %s removed (%s); the setting is ignored, delete it", ", ".join(gone), _TRAINER_GEN_GONE)
        return v


class SimConfig(Section):
    steps: int = Field(200, ge=2, description="RL steps to simulate")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig, description="Prompts, responses and their length drift")
    rollout: RolloutPhysicsConfig = Field(default_factory=RolloutPhysicsConfig, description="Decode physics of a rollout GPU")
    train: TrainPhysicsConfig = Field(default_factory=TrainPhysicsConfig, description="Training physics of a trainer GPU")
    schedule: Literal["barrier", "barrier_lockstep"] = Field(
        "barrier", description="The step-level model's schedule, both the static one-step-off pipeline with its step "
        "barrier. barrier: the runtime's pipeline.schedule=barrier, ideal: each stage starts when its inputs exist (a "
        "batch's rollout once the previous one ended and its version exists, then the blocking weight sync; training "
        "once the batch is complete); barrier_lockstep: the retired runtime loop (an old run's pipeline.schedule="
        "lockstep): both pools start a step together after the previous step's stages, the blocking weight sync and "
        "step_gap_s. Old names: pipelined (barrier), lockstep (barrier_lockstep)"
    )
    step_gap_s: float = Field(
        0.0, ge=0, description="schedule=barrier_lockstep: coordinator seconds per step when neither pool works (batch "
        "assembly, command round trips; dynaresize calibrate measures it)"
    )
    command_latency_s: float = Field(
        0.0, ge=0, description="Control-plane latency: seconds from the moment the coordinator decides a command (generate, "
        "train chunk, optimizer step, weight fetch, gradient help) to the moment it takes effect on the rank; both models "
        "(dynaresize calibrate fits it from a run's gaps between commands; the emulated runtime here: ~0.05 s, MEASURED "
        "in issue 28; 0: an ideal control plane)"
    )
    pipeline: PipelineModelConfig = Field(default_factory=PipelineModelConfig, description="Pipeline model and barrier-free mechanisms")
    write_events: bool = Field(True, description="Write events.jsonl (off: faster, for sweeps)")
    compare_static_max: int = Field(
        64, ge=1, description="--compare: at most this many static splits, evenly spaced (all when fewer candidates)"
    )

    @field_validator("schedule", mode="before")
    @classmethod
    def _old_schedule_names(cls, v: Any) -> Any:
        new = _OLD_SCHEDULES.get(v) if isinstance(v, str) else None
        if new is None:
            return v
        log.warning("sim.schedule: %s is now %s (%s); set sim.schedule: %s", v, new, _NEW_SCHEDULES[new], new)
        return new

    @model_validator(mode="after")
    def _check(self) -> "SimConfig":
        w = self.workload
        if w.trace is not None:
            self._check_trace()
        for key in ("response_tokens_start", "response_tokens_end"):
            if getattr(w, key) > w.max_response_tokens:
                raise RuleError(("workload", key), getattr(w, key),
                                f"mean response length above max_response_tokens ({w.max_response_tokens})")
        if w.tasks:
            if w.response_tokens_by_step:
                raise RuleError(("workload", "tasks"), [t.name for t in w.tasks], "tasks and response_tokens_by_step exclude each other")
            for i, t in enumerate(w.tasks):
                if t.response_tokens_mean > w.max_response_tokens:
                    raise RuleError(("workload", "tasks", i, "response_tokens_mean"), t.response_tokens_mean,
                                    f"mean response length above max_response_tokens ({w.max_response_tokens})")
            if 0 not in w.task_weights:
                raise RuleError(("workload", "task_weights"), w.task_weights, "needs the mix from step 0 (a key 0)")
            for step, ws in w.task_weights.items():
                if step < 0 or len(ws) != len(w.tasks) or min(ws) < 0 or sum(ws) <= 0:
                    raise RuleError(("workload", "task_weights", step), ws,
                                    f"want a step >= 0 and {len(w.tasks)} weights >= 0 (one per task), not all 0")
        elif w.task_weights:
            raise RuleError(("workload", "task_weights"), w.task_weights, "task_weights without tasks")
        for i, x in enumerate(w.dynamic_sampling.accuracy_by_step):
            if not 0 <= x <= 1:
                raise RuleError(("workload", "dynamic_sampling", "accuracy_by_step", i), x, f"{x} outside [0, 1]")
        for i, x in enumerate(w.response_tokens_by_step):
            if not 1 <= x <= w.max_response_tokens:
                raise RuleError(("workload", "response_tokens_by_step", i), x,
                                f"{x} outside [1, max_response_tokens={w.max_response_tokens}]")
        return self

    def _check_trace(self) -> None:
        """A trace excludes the drawn drivers and must cover sim.steps; its file problems name file, line, key."""
        from dynaresize.sim.trace import TraceError, load_trace

        w = self.workload
        drivers = [("tasks", bool(w.tasks)), ("response_tokens_by_step", bool(w.response_tokens_by_step)),
                   ("dynamic_sampling", w.dynamic_sampling.enabled), ("cap_share", w.cap_share > 0),
                   ("cap_share_end", w.cap_share_end is not None)]
        for key, on in drivers:
            if on:
                raise RuleError(("workload", key), getattr(w, key) if key != "dynamic_sampling" else True,
                                f"trace ({w.trace}) and {key} exclude each other: a trace replays logged lengths as they are")
        try:
            tr = load_trace(w.trace)
        except TraceError as e:
            raise RuleError(("workload", "trace"), w.trace, str(e)) from None
        if self.steps > len(tr.steps):
            raise RuleError(("steps",), self.steps, f"beyond the trace {tr.path} ({len(tr.steps)} steps)")
