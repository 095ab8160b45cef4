"""Config of what runs inside a worker rank (sections ``model``, ``rollout``, ``train``, ``staging``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynaresize.config.base import Section


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
    max_tokens: int = Field(48, ge=1, description="Maximum response tokens")
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
