"""Config of what runs inside a worker rank (sections ``model``, ``rollout``, ``train``, ``staging``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dynaresize.config.base import RuleError, Section


class TinyModelConfig(Section):
    hidden_size: int = Field(128, ge=8, description="Hidden size of the locally built Qwen2-style model")
    num_layers: int = Field(2, ge=1, description="Transformer layers of the tiny model")
    num_heads: int = Field(2, ge=1, description="Attention heads (head_dim = hidden/heads; vLLM wants a multiple of 8, >= 32)")
    intermediate_size: int = Field(512, ge=8, description="MLP intermediate size of the tiny model")
    max_positions: int = Field(512, ge=16, description="max_position_embeddings of the tiny model")
    vocab_size: int = Field(384, ge=280, description="Entries of the tiny model's byte-level BPE tokenizer (256 bytes, 6 specials, merges)")
    max_token_chars: int = Field(2, ge=1, description="Longest piece (characters) a merge of the tiny tokenizer may make")
    warmstart_steps: int = Field(300, ge=0, description="Supervised warm-start steps before RL (cached by config hash)")
    warmstart_lr: float = Field(3e-3, gt=0, description="Learning rate of the supervised warm-start")
    warmstart_batch: int = Field(64, ge=1, description="Batch size of the supervised warm-start")


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local HF causal-LM directory (config.json, tokenizer, weights; its own chat template, EOS and "
        "pad tokens); unset builds the tiny model locally in the same layout (no hub access either way)"
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Shape of the locally built model")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Parameter dtype of the trainer and rollout engines (auto: the model directory's own, float32 if unset)"
    )
    architecture: str | None = Field(
        None, description="The model's config.json (or a directory holding one) that the memory model sizes ranks and "
        "splits from (docs/memory.md); null: model.path's config.json when that directory is on this host, else the "
        "tiny model's shape. For a submit host without the model, and for an emulated run of a bigger model"
    )
    cache_dir: str | None = Field(None, description="Where built models are cached (default: ~/.cache/dynaresize/models)")


class VllmConfig(Section):
    gpu_memory_utilization: float = Field(
        0.45, gt=0, le=1, description="CUDA: vLLM gpu_memory_utilization, the share of the GPU it takes (leave room for "
        "the trainer). Not used on CPU, where vLLM reads it as a share of host memory: see cpu_kv_cache_mb"
    )
    cpu_kv_cache_mb: int = Field(
        256, ge=16, description="CPU: host memory of vLLM's KV cache (MiB; its kv_cache_memory_bytes, the finer form of "
        "VLLM_CPU_KVCACHE_SPACE), allocated at the engine's build on every rank and kept while the rank trains (no "
        "sleep mode on CPU); 256 MiB holds 131,072 tokens of the quickstart's tiny model"
    )
    enforce_eager: bool = Field(True, description="Skip CUDA graphs and compilation (faster start, cheaper sleep)")
    sleep_level: Literal[1, 2] = Field(
        1, description="CUDA: vLLM sleep level when a rank leaves the rollout role (1: weights offloaded to host, KV "
        "cache dropped; 2: both dropped). CPU has no sleep mode: the engine stays whole"
    )
    max_model_len: int | None = Field(None, ge=16, description="vLLM max_model_len (<= the model's max_position_embeddings)")


class RolloutConfig(Section):
    engine: Literal["torch", "vllm"] = Field("torch", description="Rollout engine: torch/transformers (CPU or GPU) or vLLM (its CPU build on cluster.device=cpu, sleep mode on cuda)")
    prompts_per_step: int = Field(8, ge=1, description="B: prompts per RL step")
    group_size: int = Field(8, ge=1, description="G: responses per prompt (the GRPO group)")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1 disables it)")
    top_k: int = Field(
        -1, ge=-1, description="Sample from the top_k most likely tokens only (-1: off; 0 is not a value, as in verl); "
        "applied after the temperature and before top_p in both engines, and the rollout logprobs are those of that "
        "processed distribution"
    )
    max_tokens: int = Field(48, ge=1, description="Maximum response tokens")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt (tokens, as rendered for the model) a dataset record may have (verl's "
        "data.max_prompt_length); null: the model's context (max_position_embeddings; vLLM: max_model_len when lower) "
        "minus max_tokens. Checked when the dataset is loaded, before any rank starts; its sum with max_tokens may not "
        "exceed the context"
    )
    on_overlong: Literal["filter", "fail"] = Field(
        "filter", description="A record whose prompt is longer than max_prompt_tokens: drop it, with the count and the "
        "longest reported (filter, verl's filter_overlong_prompts), or refuse the run naming its file, row and length (fail)"
    )
    pull_batch: int = Field(8, ge=1, description="Sequences a rollout rank pulls from the work queue at a time")
    max_running: int | None = Field(
        None, ge=0, description="KV slots of a rollout rank (continuous batching; vLLM: its max_num_seqs): sequences decoded together, the "
        "samples of its next generate command entering as slots free, for the version it holds (emulated: capped by "
        "sim.rollout.max_seqs_per_gpu). null: rollout.pull_batch slots (the rows the one-batch path decodes together; "
        "a command's samples beyond the free slots wait for them). 0: no continuous "
        "batching, one pull_batch slice decoded at a time"
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings (engine=vllm only)")
    sync_bucket_mb: int = Field(64, ge=1, description="Weight sync trainer -> rollout moves parameters in buckets of this size (MiB)")

    @model_validator(mode="after")
    def _top_k_is_on_or_off(self) -> "RolloutConfig":
        if self.top_k == 0:  # vLLM reads 0 as off, transformers as "no token": one spelling of off (verl's -1)
            raise RuleError("top_k", 0, "top_k=0 is not a value: -1 turns top-k off, k >= 1 keeps the k most likely tokens")
        return self

    @property
    def kv_slots(self) -> int:
        """A rank's KV slots (vLLM's ``max_num_seqs``): ``max_running``, else (null, or 0: no stream) ``pull_batch``."""
        return self.max_running or self.pull_batch


class TrainConfig(Section):
    engine: Literal["deepspeed"] = Field("deepspeed", description="Training engine")
    zero_stage: Literal[0, 1, 2] = Field(1, description="DeepSpeed ZeRO stage (1 or 2 support resharding across trainer counts)")
    lr: float = Field(1e-4, gt=0, description="Learning rate of the RL update")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip (0 disables)")
    clip_eps: float = Field(0.2, ge=0, description="PPO/GRPO ratio clip epsilon; the default of clip_eps_low and clip_eps_high")
    clip_eps_low: float | None = Field(
        None, ge=0, lt=1, description="Lower ratio clip: ratio >= 1 - clip_eps_low (null: clip_eps); DAPO clip-higher, arXiv 2503.14476"
    )
    clip_eps_high: float | None = Field(
        None, ge=0, description="Upper ratio clip: ratio <= 1 + clip_eps_high (null: clip_eps); DAPO uses 0.28 with low 0.2"
    )
    kl_coef: float = Field(0.0, ge=0, description="Coefficient of the KL penalty to the reference policy (0 disables it)")
    loss_norm: Literal["token", "sequence"] = Field(
        "token", description="Normalise the loss over all tokens of the batch (token) or per sequence, then mean (sequence)"
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps over which the LR rises linearly from 0 to train.lr (verl's "
        "optim.lr_warmup_steps; the first update runs at LR 0, as there); counted over the whole run, across role "
        "switches and resumes (dynaresize.rl.lr)"
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="LR after the warmup: constant, or cosine down to min_lr_ratio x train.lr at the run's "
        "last optimizer step (run.steps x mini_batches x epochs; verl's optim.lr_scheduler_type)"
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="cosine: the LR's floor as a share of train.lr (verl's optim.min_lr_ratio)"
    )
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass over each RL step's batch: its groups split, in the batch's "
        "group order, into this many mini-batches of equal size (rollout.prompts_per_step must divide), each stepped "
        "and normalised by its own token (or sequence) count; verl's ppo_mini_batch_size = prompts_per_step / "
        "mini_batches. The policy version still advances once per RL step (docs/algorithm.md)"
    )
    epochs: int = Field(
        1, ge=1, description="Passes over each RL step's mini-batches (verl's ppo_epochs): mini_batches x epochs "
        "optimizer steps per RL step"
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: the loss subtracts entropy_coef x the policy's token entropy (normalised "
        "like the loss; verl's actor.entropy_coeff). The metric loss/entropy is reported whatever its value"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Training precision: bf16 (bf16 compute, fp32 master weights, Adam moments and gradient "
        "accumulation in the ZeRO partitions) or fp32; auto: bf16 where model.dtype (or the model directory's dtype) is "
        "bfloat16, else fp32 (docs/memory.md)"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="The most tokens (padded sequence length x sequences) a trainer puts through one forward; "
        "a chunk's slice is split into micro-batches whose gradients accumulate (verl's ppo_max_token_len_per_gpu); "
        "null: one forward per slice. Must hold one whole sequence"
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each layer's activations in the backward instead of keeping them (less memory, "
        "about one more forward of compute; verl's enable_gradient_checkpointing)"
    )


class StagingConfig(Section):
    dir: str | None = Field(
        None, description="Node-local staging directory (NVMe on clusters); default: $SLURM_TMPDIR or the temp dir, per job"
    )
    buffer_mb: int = Field(64, ge=1, description="Size of the bounded host buffer that staged state passes through (MiB)")
    chunk_mb: int = Field(8, ge=1, description="Chunk size of staged files (MiB); one checksum per chunk")
    writer_threads: int = Field(2, ge=1, description="Asynchronous writer threads (each checksums and writes its chunks; 2 use two cores)")
    checksum: Literal["auto", "xxh3", "crc32", "blake2b"] = Field(
        "auto", description="Per-chunk checksum of staged files (auto: xxh3 if the xxhash package is installed, else crc32)"
    )
    fsync: bool = Field(False, description="fsync staged data before the manifest (node-local scratch rarely needs it)")
