"""The memory model: what one rank holds in device memory, per role and per split, from the model's ``config.json``
and the run's settings alone (no torch, no Redis, no clock). docs/memory.md has the formulas, their sources and the
Qwen3-8B table.

- :class:`Architecture`: the fields of an HF ``config.json`` the formulas need (layers, hidden, heads, KV heads,
  head_dim, intermediate, vocab, tied embeddings, dtype); :func:`load_architecture` reads one, naming the file and
  the missing field when it cannot.
- :class:`Settings`: the run's settings that size memory (precision, ZeRO stage, tokens per forward, checkpointing,
  the rollout engine's share or KV tokens, host buffers); :func:`settings_from_config` derives them from a config.
- :func:`plan`: a :class:`MemoryTable` of every split (trainer, rollout and switch peak per rank, each a breakdown
  of :class:`Part`), whether it fits a capacity, and what would make a split that does not fit fit.

Why a model and not a measurement: the policy, ``config check`` and the emulated accelerator must know before any
rank starts (and for GPUs this machine does not have) which splits a GPU can hold.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

GIB = 1 << 30
GB = 1e9
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Device memory a rank holds outside the model's own tensors (CUDA context, NCCL buffers, the caching allocator's
# fragmentation). ASSUMPTION: 1 GiB on a GPU (a CUDA context alone is ~0.5 GiB on H100); 0 on the CPU.
GPU_RUNTIME_OVERHEAD = 1 * GIB
# What a vLLM engine put to sleep keeps on its GPU (sleep level 1: weights offloaded to host, KV cache dropped;
# level 2: both dropped): its CUDA graphs (none with enforce_eager) and small buffers. ASSUMPTION: 0.5 GiB.
SLEPT_ENGINE = GIB // 2
# The fields :class:`Architecture` reads, HF name -> meaning (num_key_value_heads, head_dim, tie_word_embeddings and
# the dtype have defaults, as in transformers).
REQUIRED = {"num_hidden_layers": "layers", "hidden_size": "hidden size", "num_attention_heads": "attention heads",
            "intermediate_size": "MLP intermediate size", "vocab_size": "vocabulary size"}


class MemoryModelError(ValueError):
    """Input the memory model cannot use; the message names the file or key, the value and what is needed."""


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer of the Llama / Qwen2 / Qwen3 family, as its ``config.json`` describes it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str = "float32"
    qkv_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: an RMSNorm on each head's q and k
    source: str = "<inline>"

    @classmethod
    def from_config(cls, d: dict[str, Any], source: str = "<inline>") -> "Architecture":
        missing = [f"{k} ({what})" for k, what in REQUIRED.items() if not isinstance(d.get(k), int) or d[k] < 1]
        if missing:
            raise MemoryModelError(f"{source}: the memory model needs {', '.join(missing)}: missing or not a positive "
                                   "integer (an HF config.json of a Llama/Qwen2/Qwen3-style model has them)")
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        if heads % kv:
            raise MemoryModelError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32")
        if dtype not in DTYPE_BYTES:
            raise MemoryModelError(f"{source}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        mt = str(d.get("model_type", ""))
        return cls(layers=d["num_hidden_layers"], hidden=d["hidden_size"], heads=heads, kv_heads=kv, head_dim=head_dim,
                   intermediate=d["intermediate_size"], vocab=d["vocab_size"],
                   tied=bool(d.get("tie_word_embeddings", True)), dtype=dtype,
                   qkv_bias=bool(d.get("attention_bias", mt == "qwen2")), qk_norm=mt.startswith("qwen3"), source=source)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms

    @property
    def params(self) -> int:
        """Parameters, counted as the HF model holds them (a tied head is the embedding, counted once)."""
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token: layers x 2 (K and V) x KV heads x head_dim x bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def saved_per_token(self, b: int) -> tuple[int, int]:
        """Activation bytes one token leaves saved for the backward, (per layer, outside the layers), at compute
        bytes ``b`` and with SDPA/flash attention (no S x S scores). Counted on transformers' Llama/Qwen2/Qwen3 with
        ``torch.autograd.graph.saved_tensors_hooks`` (tools/bench_memory.py --saved reprints them): each RMSNorm saves
        its fp32 input and two tensors of the compute dtype ((4 + 2b) h); the MLP four of I (4b I); q, k and v 2b
        each (rope, attention), with Qwen3's q/k norms 4 + 3b; fp32 per-token scalars (norm statistics, the
        attention's log-sum-exp per head)."""
        h, qkv, i = self.hidden, self.q_dim + self.kv_dim, self.intermediate
        norm = (4 + 2 * b) * h
        attn = (4 + 3 * b) * qkv if self.qk_norm else 2 * b * qkv
        scalars = 4 * (2 + self.heads + ((self.heads + self.kv_heads) if self.qk_norm else 0))
        return 2 * norm + attn + 4 * b * i + scalars, norm + 8 + 4  # outside: the final norm, the ids, its statistic

    def loss_head_per_token(self) -> int:
        """Peak bytes of the loss head per token (``dynaresize.rl.grpo.sequence_logprobs``): the logits in fp32
        (``.float()``), divided by the temperature, ``log_softmax`` (kept for the backward); at the start of the
        backward the kept log-probabilities, the gather's gradient and the log-softmax's: three fp32 [tokens, vocab]
        tensors at once (the compute dtype's logits are gone by then; in the forward they, the fp32 copy and its
        quotient make at most 10 bytes)."""
        return 12 * self.vocab


def load_architecture(path: str | Path, what: str = "model.architecture") -> Architecture:
    """The architecture in ``path``: a ``config.json`` or a directory holding one."""
    p = Path(path).expanduser()
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise MemoryModelError(f"{what} = {str(path)!r}: no config.json there")
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise MemoryModelError(f"{what} = {str(path)!r}: {f} is not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise MemoryModelError(f"{what} = {str(path)!r}: {f} is not a JSON object")
    return Architecture.from_config(d, source=str(f))


@dataclass(frozen=True)
class Settings:
    """The run's settings that size memory (all in the model's tokens: an emulated run's are x tokens_per_token)."""

    precision: Literal["fp32", "bf16"] = "bf16"
    weight_bytes: int = 2  # the model's dtype (model.dtype): the rollout engine's weights and the weight sync
    zero_stage: int = 2
    seq_tokens: int = 2048  # one sequence: the longest prompt known plus rollout.max_tokens
    micro_batch_tokens: int | None = None  # null: a trainer's whole slice of the batch in one forward
    batch_sequences: int = 512  # sequences of one batch (prompts_per_step x group_size)
    activation_checkpointing: bool = False
    rollout_engine: Literal["vllm", "torch"] = "torch"
    rollout_share: float | None = None  # vLLM on a GPU: gpu_memory_utilization, the share of the GPU it takes
    kv_tokens: int = 0  # otherwise: the KV cache's tokens (KV slots x one sequence) ...
    kv_bytes: int | None = None  # ... or its bytes (the emulated GPU's sim.rollout.kv_cache_gb)
    keeps_slept_engine: bool = False  # vLLM on a GPU: a trainer keeps its engine asleep
    overhead: int = 0  # device memory outside the tensors (GPU_RUNTIME_OVERHEAD on a GPU)
    staging_buffer: int = 64 * MIB  # host: staging.buffer_mb
    sync_bucket: int = 64 * MIB  # rollout.sync_bucket_mb: the bucket a weight transfer fills (device of the sender)
    second_weights_on_host: bool = True  # the next version's weights, received into host memory (comm/weights.py)
    snapshot_every: int = 0  # faults.snapshot_every: in-memory snapshots (worker/snapshot.py) on the host; 0: none

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def tokens_per_forward(self, n_train: int) -> int:
        """What one forward of a trainer holds: micro_batch_tokens, else its whole slice of the batch."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return math.ceil(self.batch_sequences / n_train) * self.seq_tokens


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    note: str = ""
    host: bool = False  # host memory: reported, not counted against the device


@dataclass(frozen=True)
class RankMemory:
    role: Literal["trainer", "rollout", "switch"]
    n_train: int
    parts: tuple[Part, ...]

    @property
    def device(self) -> int:
        return sum(p.bytes for p in self.parts if not p.host)

    @property
    def host(self) -> int:
        return sum(p.bytes for p in self.parts if p.host)

    def part(self, name: str) -> int:
        return sum(p.bytes for p in self.parts if p.name == name)

    def describe(self) -> str:
        return ", ".join(f"{p.name} {p.bytes / GIB:.1f}" for p in self.parts if not p.host and p.bytes)


def model_states(arch: Architecture, s: Settings, n_train: int) -> tuple[Part, ...]:
    """Weights, gradients, fp32 gradient partition, fp32 master and Adam moments of one of ``n_train`` ZeRO ranks.
    DeepSpeed 0.19's ZeRO-1/2 optimizer keeps an fp32 copy of its partition (also in fp32 training, a clone) and
    the fp32 gradient of that partition (its estimator: 2 params_16bit + 18 / n = 2 grads_16bit + 4 grads_32bit +
    4 params_32bit + 8 optimizer states, for ZeRO-2; ZeRO-1 keeps the model-dtype gradients whole)."""
    p, b = arch.params, s.compute_bytes
    shard = n_train if s.zero_stage >= 1 else 1
    grad_shard = n_train if s.zero_stage >= 2 else 1
    return (Part("weights", p * b, f"{p / 1e9:.2f}B params x {b} B"),
            Part("gradients", p * b // grad_shard, "whole (ZeRO-1)" if grad_shard == 1 else f"/ {grad_shard} (ZeRO-2)"),
            Part("fp32 grad partition", 4 * p // shard),
            Part("fp32 master", 4 * p // shard),
            Part("adam moments", 8 * p // shard, "two fp32 moments"))


def activations(arch: Architecture, s: Settings, tokens: int) -> Part:
    """Peak activation bytes of one forward/backward of ``tokens`` tokens, the loss head's logits included."""
    b = s.compute_bytes
    layer, outside = arch.saved_per_token(b)
    head = arch.loss_head_per_token()
    if s.activation_checkpointing:  # each layer keeps its input; one layer's activations are recomputed at a time
        per_token = arch.layers * b * arch.hidden + layer + outside + head
        note = f"{tokens} tokens, checkpointed"
    else:
        per_token = arch.layers * layer + outside + head
        note = f"{tokens} tokens"
    return Part("activations", per_token * tokens, note + f", logits {head * tokens / GIB:.1f} GiB")


def trainer(arch: Architecture, s: Settings, n_train: int) -> RankMemory:
    parts = model_states(arch, s, n_train) + (
        activations(arch, s, s.tokens_per_forward(n_train)),
        Part("sync bucket", s.sync_bucket, "rank 0 sends the weights in buckets"),
    )
    if s.keeps_slept_engine:
        parts += (Part("slept engine", SLEPT_ENGINE, "vLLM asleep while the rank trains"),)
    parts += (Part("runtime", s.overhead), Part("staging buffer", s.staging_buffer, "host", host=True))
    return RankMemory("trainer", n_train, parts + snapshots(arch, s, n_train))


def snapshots(arch: Architecture, s: Settings, n_train: int) -> tuple[Part, ...]:
    """Host memory of the in-memory snapshots (``faults.snapshot_every``; dynaresize/worker/snapshot.py) on the
    trainer that holds the most: its own partition and its ring predecessor's (fp32 master and two moments, 12 P / n
    each), on ranks 0 and 1 also the weights (``b P``: rank 0's own, rank 1's copy of rank 0's), twice (the two
    newest complete snapshots; the older one goes when the next one starts). None with snapshots off or a single trainer (no peer)."""
    if not s.snapshot_every or n_train < 2:
        return ()
    p = arch.params
    one = 2 * (12 * p // n_train) + p * s.compute_bytes
    return (Part("snapshots", 2 * one, "own + peer's partition, rank 0's weights; x2 (the two newest)", host=True),)


def rollout(arch: Architecture, s: Settings, n_train: int, capacity: int | None) -> RankMemory:
    wb = arch.params * s.weight_bytes
    if s.rollout_share is not None and capacity is not None:  # vLLM takes its share; the KV cache is what is left
        engine = int(s.rollout_share * capacity)
        kv = max(0, engine - wb)
        parts = (Part("weights", wb), Part("kv cache", kv, f"{kv // arch.kv_bytes_per_token(s.weight_bytes):,} tokens "
                                           f"(vLLM's share {s.rollout_share:g} minus the weights)"))
    else:
        kv = s.kv_bytes if s.kv_bytes is not None else s.kv_tokens * arch.kv_bytes_per_token(s.weight_bytes)
        parts = (Part("weights", wb), Part("kv cache", kv, f"{kv // arch.kv_bytes_per_token(s.weight_bytes):,} tokens"))
        if s.rollout_engine == "torch" and s.kv_bytes is None:  # transformers' SDPA path repeats one layer's K and V to every query head
            parts += (Part("attention workspace", kv // arch.layers * arch.heads // arch.kv_heads,
                           "one layer's KV repeated to all heads (HF repeat_kv)"),)
    parts += (Part("next weights", wb, "the next version, received while decoding", host=s.second_weights_on_host),
              Part("runtime", s.overhead))
    return RankMemory("rollout", n_train, parts)


def switch(t: RankMemory, r: RankMemory) -> RankMemory:
    """What a rank moving between roles holds at once (dynaresize/worker/core.py ``_cmd_switch_role``: the old role
    is offloaded or put to sleep before the new one is built): the larger role plus what the other leaves behind
    (a slept engine is already part of the trainer's figure; a trainer's ZeRO partitions go to host memory)."""
    big = t if t.device >= r.device else r
    return RankMemory("switch", t.n_train, big.parts)


@dataclass(frozen=True)
class SplitMemory:
    n_train: int
    n_rollout: int
    trainer: RankMemory
    rollout: RankMemory
    switch: RankMemory
    capacity: int | None

    @property
    def fits(self) -> bool | None:
        if self.capacity is None:
            return None
        return self.trainer.device <= self.capacity and self.rollout.device <= self.capacity

    def over(self) -> list[tuple[str, RankMemory]]:
        """The roles over capacity (empty when it fits or nothing is known)."""
        if self.capacity is None:
            return []
        return [(m.role, m) for m in (self.trainer, self.rollout) if m.device > self.capacity]


@dataclass(frozen=True)
class MemoryTable:
    arch: Architecture
    settings: Settings
    capacity: int | None
    splits: tuple[SplitMemory, ...]

    def split(self, n_train: int) -> SplitMemory:
        for sp in self.splits:
            if sp.n_train == n_train:
                return sp
        raise KeyError(n_train)

    def feasible(self) -> tuple[int, ...]:
        """Trainer counts that fit (all of them when no capacity is known)."""
        return tuple(sp.n_train for sp in self.splits if sp.fits is not False)

    def hints(self, n_train: int) -> list[str]:
        """What would make the split with ``n_train`` trainers fit, each change alone."""
        sp, s, out = self.split(n_train), self.settings, []
        cap = self.capacity
        if cap is None or sp.fits:
            return out
        if sp.trainer.device > cap:
            more = [x.n_train for x in self.splits if x.n_train > n_train and x.trainer.device <= cap]
            if more:
                out.append(f"more trainers ({more[0]})")
            fixed = sp.trainer.device - sp.trainer.part("activations")
            per_tok = activations(self.arch, s, 1).bytes
            t_max = (cap - fixed) // per_tok if per_tok else 0
            if t_max >= s.seq_tokens and t_max < s.tokens_per_forward(n_train):
                out.append(f"train.micro_batch_tokens <= {t_max}")
            if not s.activation_checkpointing and trainer(self.arch, replace(s, activation_checkpointing=True), n_train).device <= cap:
                out.append("train.activation_checkpointing=true")
            if s.zero_stage < 2 and trainer(self.arch, replace(s, zero_stage=2), n_train).device <= cap:
                out.append("train.zero_stage=2")
        if sp.rollout.device > cap:
            out.append("a smaller rollout.vllm.gpu_memory_utilization" if s.rollout_share is not None
                       else "fewer KV tokens (rollout.max_running, rollout.max_tokens)")
        return out

    def refusal(self) -> str | None:
        """Why no split fits, with the figures, or None. Where the model states alone fit the fewest-byte trainer, the
        activations are the cause and the hints say what would fit; where they do not, the model needs ZeRO-3/FSDP
        or tensor-parallel rollout, which are out of scope."""
        if self.capacity is None or self.feasible():
            return None
        cap = self.capacity
        gpus = self.splits[0].n_train + self.splits[0].n_rollout if self.splits else 0
        head = f"no split of {gpus} GPUs fits {cap / GIB:.1f} GiB"
        roll = self.splits[0].rollout if self.splits else None
        if roll is not None and roll.device > cap:
            return f"{head}: a rollout rank needs {roll.device / GIB:.1f} GiB ({roll.describe()} GiB)"
        best = min(self.splits, key=lambda x: x.trainer.device)
        t = best.trainer
        figures = f"the fewest trainer bytes are {t.device / GIB:.1f} GiB at {best.n_train} trainers ({t.describe()} GiB)"
        if t.device - t.part("activations") <= cap:
            hints = self.hints(best.n_train)
            return (f"{head}: {figures}; the activations do not fit"
                    + (f"; would fit with: {', '.join(hints)}" if hints else ""))
        return (f"{head}: {figures}; a model that needs its weights sharded (ZeRO-3/FSDP) or tensor-parallel rollout "
                "is out of scope")


def plan(arch: Architecture, s: Settings, gpus: int, capacity: int | None, unit: int = 1) -> MemoryTable:
    """Every split of ``gpus`` ranks in steps of ``unit``, each with its trainer, rollout and switch figures."""
    splits = []
    for n in range(unit, gpus, unit):
        t, r = trainer(arch, s, n), rollout(arch, s, n, capacity)
        splits.append(SplitMemory(n, gpus - n, t, r, switch(t, r), capacity))
    return MemoryTable(arch, s, capacity, tuple(splits))


def resolve_precision(train_precision: str, dtype: str) -> Literal["fp32", "bf16"]:
    """``train.precision`` with ``auto`` resolved: bf16 where the model's dtype is bfloat16, else fp32."""
    if train_precision in ("fp32", "bf16"):
        return train_precision  # type: ignore[return-value]
    return "bf16" if dtype == "bfloat16" else "fp32"
