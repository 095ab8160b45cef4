"""The root of an experiment config: one typed model composed of each component's own section.

Each component keeps its section next to itself (``dynaresize/<component>/config.py``); this file only composes
them and holds the few sections that belong to the job as a whole (``run``, ``cluster``, ``pipeline``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dynaresize.config.base import RuleError, Section
from dynaresize.control.config import RedisConfig
from dynaresize.emulation.config import EmulationConfig
from dynaresize.metrics.config import MetricsConfig
from dynaresize.policy.config import PolicyConfig, SwitchingConfig
from dynaresize.rl.config import AlgorithmConfig
from dynaresize.sim.config import SimConfig
from dynaresize.slurm.config import SlurmConfig
from dynaresize.tasks.config import RewardConfig, TaskConfig
from dynaresize.worker.config import ModelConfig, RolloutConfig, StagingConfig, TrainConfig

log = logging.getLogger("dynaresize.config")


class RunConfig(Section):
    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="Run name; the run directory is <output_dir>/<name>-<timestamp>")
    output_dir: str = Field("runs", description="Parent directory of run directories (shared storage on a cluster)")
    seed: int = Field(0, ge=0, description="Seed of everything random; each sample is seeded by (seed, step, prompt, index)")
    steps: int = Field(20, ge=1, description="RL steps (training updates) to run")
    epochs: int | None = Field(
        None, ge=1, description="Run length in passes over a dataset task's training records instead of run.steps "
        "(not both): run.steps = floor(records / rollout.prompts_per_step) x epochs, verl's total_epochs with its "
        "drop_last dataloader; resolved when the config is loaded (the run directory's config.yaml holds the steps)"
    )
    checkpoint_every: int = Field(5, ge=0, description="Steps between checkpoints (0: only at the end and on signals)")
    keep_checkpoints: int = Field(
        2, ge=1, description="Complete checkpoints kept under <run_dir>/checkpoints (older ones are removed); a resume "
        "falls back through them when the newest is damaged"
    )
    progress: bool = Field(True, description="Show a progress bar on the terminal")


class ClusterConfig(Section):
    device: Literal["cpu", "cuda", "emulated"] = Field(
        "cpu", description="Device kind of worker ranks: cpu (one slot per rank), cuda (one GPU per rank), or emulated "
        "(an EMULATED GPU: the real engines on the CPU, each operation lasting the wall time the GPU profile in sim.* "
        "and switching.costs predicts, scaled by emulation.time_scale)"
    )
    gpus: int = Field(4, ge=2, description="Worker ranks (GPUs, or CPU device slots); at least one per role")
    gpus_per_node: int = Field(4, ge=1, description="Ranks per node; a node is the resize unit when granularity=node")
    granularity: Literal["gpu", "node"] = Field("gpu", description="Smallest number of GPUs moved between roles: one GPU or one node")
    initial_train: int = Field(2, ge=1, description="Trainer ranks at start; the rest start as rollout ranks")
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one device in GB (1e9 bytes) that the memory model sizes every rank and split "
        "against (docs/memory.md); null: read from the device for cuda, unchecked for cpu and emulated"
    )
    fork_ranks: bool = Field(
        True, description="Local runs: fork the ranks from one parent that has made their imports (torch, transformers, "
        "DeepSpeed) once (dynaresize.job.zygote); false: start each rank as a fresh Python process (Slurm: always)"
    )

    @model_validator(mode="after")
    def _split_is_valid(self) -> "ClusterConfig":
        if self.initial_train >= self.gpus:
            raise RuleError(
                "initial_train", self.initial_train,
                f"initial_train={self.initial_train} leaves no rollout rank out of gpus={self.gpus}; allowed: 1..{self.gpus - 1}",
            )
        if self.granularity == "node":
            if self.gpus % self.gpus_per_node:
                raise RuleError(
                    "gpus", self.gpus,
                    f"granularity=node needs gpus ({self.gpus}) to be a multiple of gpus_per_node ({self.gpus_per_node})",
                )
            if self.initial_train % self.gpus_per_node:
                raise RuleError(
                    "initial_train", self.initial_train,
                    f"granularity=node needs initial_train ({self.initial_train}) to be a multiple of gpus_per_node ({self.gpus_per_node})",
                )
        return self


class PipelineConfig(Section):
    staleness_bound: int = Field(1, ge=0, description="Batch k is trained only on samples from policy versions >= k - bound (0: synchronous)")
    schedule: Literal["barrier_free", "barrier"] = Field(
        "barrier_free", description="How the one-step-off pipeline runs, on the scheduler core (dynaresize.schedule). "
        "barrier_free: continuous rollout (a rollout rank takes the next batch's groups as soon as it holds the version "
        "that batch needs; weight versions reach each rank in the background) and (streaming_training) trainers that "
        "start on complete groups. barrier: the core with its step barrier (a batch opens once the previous one is "
        "complete and its version exists, one blocking weight sync over the pre-built groups, training once the batch "
        "is complete): the static one-step-off baseline. Both train the same samples, versions and loss. Old names: "
        "continuous (barrier_free), lockstep (barrier)",
    )
    streaming_training: bool = Field(
        True, description="continuous schedule: trainers run forward/backward on a batch's complete GRPO groups as they "
        "arrive and take the optimizer step once the batch is complete (false: they wait for the whole batch)",
    )
    stream_min_groups: int = Field(
        4, ge=1, description="continuous schedule: the fewest complete groups a training chunk starts with (each chunk "
        "is one forward/backward with its own gradient reduction: small chunks start training sooner and cost more)",
    )
    train_queue: int = Field(
        2, ge=1, le=2, description="Training commands (chunks of a batch, then its optimizer step) the trainers hold at "
        "once, run in the order sent: 2 queues the next chunk, or the batch's step, behind the one running, so the "
        "trainers never wait a control-plane round trip between two (the same groups, in the same order, with the same "
        "loss normalisation; a chunk sent early holds the groups ready then). 1: one at a time",
    )
    groups_per_command: int = Field(
        4, ge=1, description="GRPO groups in one generate command, decoded together and reported together when the "
        "last ends (1: each group as it completes, so it can stream to training at once). A rollout rank holds its KV "
        "slots' worth of groups (at least one command's) and one group more queued, so it never waits for the "
        "coordinator between two",
    )
    weights_transport: Literal["comm", "file"] = Field(
        "comm", description="barrier_free schedule: how a new policy version reaches the rollout ranks while they decode "
        "with the old one. comm: from trainer rank 0 point to point over the communicators built at start-up (gloo on "
        "CPU, NCCL on GPUs) into a second buffer on each rollout rank. file (the fallback): rank 0 stages it under "
        "<run_dir>/weights/v<k> at its optimizer step and each rollout rank reads it (every rank reads the whole model "
        "from shared storage per step). The barrier schedule always uses one blocking sync over the pre-built groups",
    )
    weights_relay: int = Field(
        2, ge=0, le=16, description="weights_transport=comm: who sends a new version to the rollout ranks that fetch it "
        "(dynaresize/schedule/relay.py plans it). 0: the star, trainer rank 0 sends it to each of them (its link "
        "carries it once per rollout rank: at 4096 GPUs longer than a step, docs/simulator.md 'Weight delivery'); "
        "f >= 1: the relay, a rank that received it forwards it from its second buffer while it decodes, one receiver "
        "at a time, to at most f of the ranks that asked after it (every link carries a version at most f times); a "
        "lost relay's receivers get it from another holder. 2: each link twice, a tree of log2 depth",
    )


    @model_validator(mode="before")
    @classmethod
    def _retired_mixed_switch(cls, data: Any) -> Any:
        """``mixed_switch`` (the retired lockstep loop's mixed step) is read and ignored, with one line saying why:
        every run directory written before carries it."""
        if isinstance(data, dict) and "mixed_switch" in data:
            data = {k: v for k, v in data.items() if k != "mixed_switch"}
            log.warning("pipeline.mixed_switch is ignored: the mixed step went with the lockstep loop (the barrier-free "
                        "schedule lets the other rollout ranks keep decoding while a switch waits for the training-batch "
                        "boundary); remove the key")
        return data

    @field_validator("schedule", mode="before")
    @classmethod
    def _old_names(cls, v: Any) -> Any:
        if v == "lockstep":
            log.warning("pipeline.schedule: lockstep is now barrier (the same static one-step-off schedule, on the "
                        "scheduler core); set pipeline.schedule: barrier")
        return {"continuous": "barrier_free", "lockstep": "barrier"}.get(v, v) if isinstance(v, str) else v


class FaultsConfig(Section):
    shrink: bool = Field(
        True, description="A lost rollout rank (dead, or silent past the heartbeat deadline) is fenced off and the job "
        "goes on with fewer ranks; false: such a loss restarts the ranks from the last checkpoint like any other",
    )
    max_restarts: int = Field(
        2, ge=0, description="Automatic restarts of every rank from the last checkpoint after a loss the job cannot "
        "absorb (a trainer, rank 0, or any rank in a collective); local runs only: under Slurm the job requeues itself",
    )
    disk_full_wait_s: float = Field(
        60.0, ge=0, description="How long a checkpoint waits for space after it failed on a full disk (ENOSPC/EDQUOT), "
        "trying again once space came back. Past it, the final checkpoint (the final weights) ends the run "
        "'incomplete' (never 'completed'); a checkpoint at a step boundary (run.checkpoint_every) stops the run "
        "(exit 1) instead of training on with no checkpoint it can write; both name the path, the space left and the "
        "resume command. 0: no wait",
    )
    snapshot_every: int = Field(
        1, ge=0, description="Every this many optimizer steps each trainer keeps a copy of its ZeRO partition (fp32 "
        "master, Adam moments, step; rank 0 also the weights) in host memory and sends one to the next trainer in "
        "ring order; the coordinator keeps its step state. A lost trainer then costs at most this many steps: the "
        "survivors write the snapshot out as a checkpoint of that step and every rank restarts from it (docs/FAULTS.md "
        "row 33). Host memory: docs/memory.md. 0: off (a lost trainer restarts from the last disk checkpoint)",
    )


# Keys that moved to another place: an old config that still sets one fails naming the key and where it lives now.
DATASET_TASKS = ("dataset", "dynaresize.tasks.dataset:DatasetTask")  # task.name of the dataset task (run.epochs)

MOVED_KEYS: dict[tuple[str, ...], str] = {
    ("sim", "costs"): "switching.costs",
    ("sim", "optimizations"): "switching.optimizations",
    ("staging", "deferred_optimizer"): "switching.optimizations.deferred_optimizer",
}


def moved_key(data: Any, prefix: tuple[str, ...] = ()) -> RuleError | None:
    """The error for the first moved key set in ``data`` (a config mapping rooted at ``prefix``), else None."""
    for path, new in MOVED_KEYS.items():
        if path[: len(prefix)] != prefix:
            continue
        node = data
        for part in path[len(prefix):]:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return RuleError(path[len(prefix):], node, f"{'.'.join(path)} has moved to {new}")
    return None


class Config(Section):
    """A whole experiment. Top-level keys are sections; ``extends`` (a path) is resolved by the loader."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, length and output")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ranks, devices and split granularity")
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="One-step-off pipeline settings")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Resizing policy and its hysteresis")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis server and control plane")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine and sampling")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training engine and RL loss")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="DAPO options: dynamic sampling, overlong reward shaping")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metric loggers: TensorBoard, W&B offline (JSONL always)")
    staging: StagingConfig = Field(default_factory=StagingConfig, description="Bounded state staging to node-local disk")
    task: TaskConfig = Field(default_factory=TaskConfig, description="RL task: generated prompts or a dataset")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function, run on the rollout ranks")
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="Slurm submission")
    sim: SimConfig = Field(default_factory=SimConfig, description="Discrete-event simulator")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="What the job does when a rank is lost")
    emulation: EmulationConfig = Field(
        default_factory=EmulationConfig, description="The emulated accelerator (cluster.device: emulated): time scale, token scale"
    )
    switching: SwitchingConfig = Field(
        default_factory=SwitchingConfig, description="Switch cost model and optimisations (runtime policy, workers and simulator)"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: Any) -> Any:
        err = moved_key(data)
        if err is not None:
            raise err
        return data

    @model_validator(mode="after")
    def _forced_splits_fit_the_cluster(self) -> "Config":
        c = self.cluster
        unit = c.gpus_per_node if c.granularity == "node" else 1
        for step, n in self.policy.forced_splits.items():
            if step < 0 or not (unit <= n <= c.gpus - unit) or n % unit:
                raise RuleError(
                    ("policy", "forced_splits", step), n,
                    f"{{{step}: {n}}} is not a valid forced split for cluster.gpus={c.gpus} "
                    f"(allowed: multiples of {unit} from {unit} to {c.gpus - unit}, at steps >= 0)"
                )
        return self

    @model_validator(mode="after")
    def _run_length_is_given_once(self) -> "Config":
        if self.run.epochs is None:
            return self
        if "steps" in self.run.model_fields_set:
            raise RuleError(("run", "epochs"), self.run.epochs, f"run.epochs={self.run.epochs} and run.steps="
                            f"{self.run.steps} are both set: give the run's length one way (run.epochs counts passes "
                            "over the dataset, run.steps RL steps)")
        if self.task.name not in DATASET_TASKS:
            raise RuleError(("run", "epochs"), self.run.epochs, f"run.epochs counts passes over a dataset's training "
                            f"records, and task.name={self.task.name!r} has none (task.name: dataset); set run.steps")
        return self

    @model_validator(mode="after")
    def _mini_batches_fit_the_batch(self) -> "Config":
        tr, b = self.train, self.rollout.prompts_per_step
        if b % tr.mini_batches:
            raise RuleError(("train", "mini_batches"), tr.mini_batches, f"train.mini_batches={tr.mini_batches} must "
                            f"divide rollout.prompts_per_step={b} (equal mini-batches of whole groups; verl's "
                            "ppo_mini_batch_size = prompts_per_step / mini_batches)")
        if tr.mini_batches * tr.epochs > 1 and self.algorithm.tis.enabled:
            raise RuleError(("algorithm", "tis", "enabled"), True, "truncated importance sampling takes the PPO ratio "
                            "against each forward's own logprobs, which several optimizer steps per RL step "
                            f"(train.mini_batches={tr.mini_batches} x train.epochs={tr.epochs}) would make 1 at every "
                            "step (no clipping): use one of them, not both")
        return self

    @model_validator(mode="after")
    def _vllm_fits_the_device(self) -> "Config":
        if self.rollout.engine == "vllm" and self.cluster.device == "emulated":
            raise RuleError(("rollout", "engine"), "vllm", "the emulated accelerator paces the torch engine's work; "
                            "rollout.engine: vllm runs on cluster.device cpu (vLLM's CPU build) or cuda")
        return self

    @model_validator(mode="after")
    def _training_fits_the_model(self) -> "Config":
        """``train.micro_batch_tokens`` must hold one whole sequence (a response of ``rollout.max_tokens`` after a
        prompt of at least one token, or ``rollout.max_prompt_tokens`` where set), and an explicit
        ``train.precision`` must agree with an explicit ``model.dtype`` (dynaresize.engines.precision: one dtype per
        rank; with ``model.dtype: auto`` the run checks the model directory's before any rank starts)."""
        t, ro = self.train, self.rollout
        prompt = ro.max_prompt_tokens
        need = ro.max_tokens + (prompt or 1)
        if t.micro_batch_tokens is not None and t.micro_batch_tokens < need:
            what = f"rollout.max_prompt_tokens={prompt}" if prompt else "a prompt of at least 1 token"
            raise RuleError(("train", "micro_batch_tokens"), t.micro_batch_tokens,
                            f"a micro-batch must hold one whole sequence: rollout.max_tokens={ro.max_tokens} response "
                            f"tokens after {what} need at least {need} (more: the longest prompt)")
        want = {"bfloat16": "bf16", "float32": "fp32"}.get(self.model.dtype)
        if t.precision != "auto" and want is not None and t.precision != want:
            raise RuleError(("train", "precision"), t.precision,
                            f"model.dtype={self.model.dtype} trains in {want} (a rank holds one copy of the weights, "
                            f"for both roles, in the model's dtype): set train.precision={want} or auto, or "
                            f"model.dtype={'bfloat16' if t.precision == 'bf16' else 'float32'}")
        return self

    @model_validator(mode="after")
    def _algorithm_fits_the_rollout(self) -> "Config":
        ds, ov, ro = self.algorithm.dynamic_sampling, self.algorithm.overlong, self.rollout
        if ds.enabled and ro.group_size < 2:
            raise RuleError(
                ("algorithm", "dynamic_sampling", "enabled"), True,
                f"dynamic sampling drops groups whose rewards are all equal: it needs rollout.group_size >= 2, got {ro.group_size}",
            )
        if ov.enabled and ov.buffer >= ro.max_tokens:
            raise RuleError(
                ("algorithm", "overlong", "buffer"), ov.buffer,
                f"the overlong interval must be shorter than rollout.max_tokens={ro.max_tokens}; allowed: 1..{ro.max_tokens - 1}",
            )
        return self
