"""The policy's vocabulary: topologies, per-step observations, planned switch ops and decisions.

All frozen dataclasses or enums, so a decision can be logged, compared and replayed; nothing here does I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dynaresize.events import SwitchOp


@dataclass(frozen=True, slots=True, order=True)
class Topology:
    """A split of the job's GPUs: ``n_train`` trainer ranks and ``n_rollout`` rollout ranks (both >= 1)."""

    n_train: int
    n_rollout: int

    def __post_init__(self) -> None:
        if self.n_train < 1 or self.n_rollout < 1:
            raise ValueError(f"topology {self.n_train}:{self.n_rollout} needs at least one GPU per role")

    @property
    def total(self) -> int:
        return self.n_train + self.n_rollout

    def __str__(self) -> str:
        return f"{self.n_train}:{self.n_rollout}"


@dataclass(frozen=True, slots=True)
class PipelineWorkload:
    """One finished batch as the barrier-free pipeline predictor replays it
    (:mod:`dynaresize.policy.pipeline_predictor`): the batch's own response lengths and training cost, and the
    rollout GPUs' decode model. Observed, not configured: the simulator fills it from the batch it simulated, the
    runtime from the batch's samples and its rollout engine's measured iteration costs
    (:mod:`dynaresize.job.workload`, with ``policy.predictor: pipeline``)."""

    lengths: tuple[float, ...]  # response tokens per sequence, group by group (group_size consecutive per group)
    group_size: int
    kv_slots: int  # sequences a rollout GPU holds at once (KV memory, max_num_seqs)
    iteration_s: float  # fixed seconds per decode iteration of a GPU
    seq_iteration_s: float  # seconds per decode iteration per active sequence (compute + KV reads)
    prefill_s_per_group: float  # prefill seconds per group admitted (stalls the GPU's decoding)
    train_s_per_group: tuple[float, ...]  # training compute per group on one trainer GPU, seconds
    step_overhead_s: float = 0.0  # the optimizer step
    sync_s: float = 0.0  # a weight version reaching a rollout GPU after the optimizer step
    command_latency_s: float = 0.0  # the control plane, per command (measured; 0: unknown)
    staleness: int = 1  # batches in flight: batch j is made by version j - staleness
    claim_groups: int = 4  # a GPU asks for work when this many groups of slots are free (or it drained)
    stream_min_groups: int = 1  # streaming training starts a chunk once this many groups are ready
    helper_rate: float = 0.0  # gradient helpers (simulator only, played by sim.mechanisms.HelperPlay): rate vs a trainer (0: none)
    helper_cost_s: float = 0.0  # gradient helpers: overhead per help
    helper_margin: float = 1.5  # a help must save more than its cost times this
    train_chunks: int = 8  # with helpers, a training chunk takes at most 1/train_chunks of the batch (micro-chunks)
    train_queue: int = 1  # training commands the trainers hold at once, run in order (2: no round trip between two)
    # tail consolidation (simulator only, played by sim.mechanisms.ConsolidationPlay): a move must save this many times
    # its time (0: none), the KV cache's seconds per token moved, prompt tokens per prefill second (a group's prompt KV)
    consolidation_min_gain: float = 0.0
    kv_move_s_per_token: float = 0.0
    prefill_tokens_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Observation:
    """What the coordinator (or the simulator) measured for one finished RL step."""

    step: int  # the step whose training just finished
    topology: Topology  # split the step ran on
    rollout_s: float  # wall time of the rollout stage (generation, excluding weight sync)
    train_s: float  # wall time of the training stage
    rollout_tail_s: float = 0.0  # time the longest response needs alone (does not shrink with more GPUs)
    weight_sync_s: float = 0.0  # trainer -> rollout weight sync before a rollout
    tokens_generated: int = 0
    tokens_trained: int = 0
    # the step overlapped a resize or the pipeline's fill: its times describe no split's steady state (not learned)
    mixed: bool = False
    steps_left: int | None = None  # steps still to train after the next decision takes effect (None: unknown)
    workload: PipelineWorkload | None = None  # the batch, for the pipeline predictor (None: capacity model only)

    @property
    def period_s(self) -> float:
        """The step's measured pipeline period: the slower of its rollout (+ weight sync) and its training."""
        return max(self.rollout_s + self.weight_sync_s, self.train_s)


class ResizeAction(str, enum.Enum):
    HOLD = "hold"
    RESIZE = "resize"


class OpGroup(str, enum.Enum):
    """Which ranks run a planned op."""

    MOVING = "moving"  # ranks changing role
    TRAINERS = "trainers"  # trainers that keep their role (re-shard, rebuild)
    ALL = "all"  # every rank (stop-the-world switching)


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """One fine-grained switch operation with its estimated cost and whether it is on the critical path."""

    op: SwitchOp
    group: OpGroup
    cost_s: float
    critical: bool
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    action: ResizeAction
    target: Topology  # equals the current topology when holding
    reason: str
    plan: tuple[PlannedOp, ...] = ()
    critical_cost_s: float = 0.0  # estimated critical-path cost of the plan
    imbalance: float = 0.0
    expected_saving_s: float = 0.0  # over the payback horizon

    @property
    def resize(self) -> bool:
        return self.action is ResizeAction.RESIZE


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    """What the capacity predictor's decode model needs of the observed batches (``policy.rollout_model: decode``;
    the model and how a batch becomes one: :mod:`dynaresize.policy.decode_profile`)."""

    iteration_s: float  # fixed seconds per decode iteration of a GPU
    seq_iteration_s: float  # seconds per decode iteration per active sequence
    prefill_s_per_group: float
    kv_slots: int  # sequences a GPU holds at once
    groups: int  # groups per batch
    tokens: float  # response tokens per batch
    group_max: tuple[float, ...]  # each group's longest response, ascending (at most PROFILE_POINTS order statistics)


@dataclass(frozen=True, slots=True)
class Estimates:
    """Split-invariant EWMA state: work in GPU-seconds, so a resize does not invalidate what was learned."""

    rollout_work: float  # (rollout_s - tail) x n_rollout
    rollout_tail: float  # seconds
    train_work: float  # train_s x n_train x efficiency(n_train)
    sync: float  # seconds
    tail_var: float = 0.0  # EWMA variance of the observed tail, s^2 (the step-to-step noise of the longest response)
    train_var: float = 0.0  # EWMA variance of the observed train work, relative (squared fraction)
    observations: int = 1  # observations the estimates were learned from (0: none clean yet, they only carry batches)
    trace: tuple[PipelineWorkload, ...] = ()  # the newest observed batches (oldest first), for the pipeline predictor
    play: tuple[PipelineWorkload, ...] = ()  # the batches it replays: ``trace`` carried forward along its drift
    decode: DecodeProfile | None = None  # policy.rollout_model decode: the batches' decode profile (blended)
    rollout_ratio: float = 1.0  # with ``decode``: measured rollout bulk / the profile's, on the split measured (EWMA)
    ratio_rollout: int = 0  # with ``decode``: the rollout pool size the ratio was measured on
    ratio_steps: int = 1  # with ``decode``: the ratio's observations on it
    ratios: tuple[tuple[int, float], ...] = ()  # with ``decode``: (rollout pool size, its ratio) of the sizes left
    level: float = 0.0  # the workload's size, split-invariant: tokens generated + trained per step (EWMA; 0: unknown)
    level_var: float = 0.0  # EWMA variance of the step's size relative to the level (squared fraction)
    level_beyond: int = 0  # steps in a row whose size lay beyond the level's noise, signed by the direction (a shift)
    tail_size: float = 0.0  # the workload's size ``rollout_tail`` stands for (its EWMA, with the tail's weight; 0: unknown)
    work_size: float = 0.0  # the workload's size ``train_work`` stands for (its EWMA, with the train work's weight)
    shifted: bool = False  # this step confirmed a shift of the workload's size (StageModel.update)


@dataclass(frozen=True, slots=True)
class LeftSplit:
    """A split the policy left, and how far off the model was there: measured period / predicted period."""

    topology: Topology
    ratio: float  # mean of measured / predicted period over the clean steps spent there (the model's error there)
    ratio_var: float  # variance of that ratio from step to step
    predicted_s: float  # the model's period for it when it was left
    steps: int  # clean steps measured
    level: float = 0.0  # the workload's size when it was left (Estimates.level; 0: unknown)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Everything the policy remembers between steps (``initial_state()`` to start)."""

    estimates: Estimates | None = None
    signal_dir: int = 0  # +1: rollout is the slow stage, -1: training is, 0: none
    signal_count: int = 0
    steps_since_resize: int = 10**9
    cooldown_left: int = 0
    history: tuple[str, ...] = field(default=())  # topologies left, newest last (kept short; for diagnostics)
    here_ratio: float | None = None  # mean measured / predicted period of the clean steps on the current split
    here_ratio_var: float = 0.0  # its step-to-step variance
    here_steps: int = 0  # clean steps measured on the current split
    left: tuple[LeftSplit, ...] = field(default=())  # splits left (newest last, at most 4), for the memory guard
    resized_at: tuple[int, ...] = field(default=())  # steps of the latest resizes (at most 4), for the back-off
    forced_step: int = -1  # the last step of policy.forced_splits that came due (the runtime's PlannedPolicy)
    vetoed: Topology | None = None  # the last move the play check held (rule 9), not played again for a while
    vetoed_at: int = -1  # the step it was last held at
    vetoes: int = 0  # how many times in a row it was held
