"""The memory model (``dynaresize.memory``) applied to a config: which architecture, which settings, which capacity;
the table ``dynaresize config check`` prints, and the errors ``config check`` and ``dynaresize run`` raise before
any rank starts. docs/memory.md.

Where the architecture comes from, first found: ``model.architecture`` (a config.json, or a directory holding one:
what a submit host uses when ``model.path`` names a directory on the cluster only, e.g.
configs/models/qwen3-8b/config.json); ``model.path``'s config.json when that directory is here; the tiny model's
shape (``model.tiny``) when no ``model.path`` is set. Otherwise nothing is checked and the table says why.

Where the capacity comes from: ``cluster.gpu_memory_gb``; else for ``cluster.device: cuda`` the device's own total
(:func:`cuda_memory_bytes`, read where the check runs: on a host without a GPU, nothing is checked and it says so);
else (cpu, emulated without a figure) nothing is checked.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dynaresize.config.loader import ConfigError
from dynaresize.memory import (GB, GIB, GPU_RUNTIME_OVERHEAD, MIB, Architecture, MemoryModelError, MemoryTable,
                               Settings, load_architecture, plan, resolve_precision)


class MemoryFitError(ConfigError):
    """A config whose memory does not fit (or whose memory inputs are unusable); one line with the figures."""


@dataclass(frozen=True)
class MemoryReport:
    table: MemoryTable | None
    why_unchecked: str | None  # set when no check ran (no architecture or no capacity known)
    arch_source: str
    capacity_source: str


@functools.lru_cache(maxsize=1)
def cuda_memory_bytes() -> int | None:
    """Total memory of the first visible CUDA device (``torch.cuda.mem_get_info``), or None without one. Asked in a
    short child process: a CUDA context made here would stay in the coordinator's process for the whole run and take
    ~0.5 GiB of the GPU a rank computes on."""
    code = "import torch; print(torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            return None
        return int(out.stdout.strip().splitlines()[-1]) or None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def tiny_architecture(tiny) -> Architecture:
    """The built-in tiny model (dynaresize/models/tiny.py: Llama, tied embeddings, float32)."""
    return Architecture(layers=tiny.num_layers, hidden=tiny.hidden_size, heads=tiny.num_heads, kv_heads=tiny.num_heads,
                        head_dim=tiny.hidden_size // tiny.num_heads, intermediate=tiny.intermediate_size,
                        vocab=tiny.vocab_size, tied=True, dtype="float32", source="model.tiny")


def architecture_for(cfg) -> tuple[Architecture | None, str]:
    """The architecture the memory model sizes, and where it came from (or why there is none)."""
    m = cfg.model
    arch_path = getattr(m, "architecture", None)
    try:
        if arch_path:
            return load_architecture(arch_path, "model.architecture"), f"model.architecture {arch_path}"
        if m.path:
            if (Path(m.path).expanduser() / "config.json").is_file():
                return load_architecture(m.path, "model.path"), f"model.path {m.path}"
            return None, f"model.path {m.path!r} is not on this host: set model.architecture to a copy of its config.json"
    except MemoryModelError as e:
        raise MemoryFitError(str(e)) from None
    return tiny_architecture(m.tiny), "model.tiny"


def sequence_tokens(cfg) -> int:
    """One sequence's tokens as far as the config knows: the longest prompt (rollout.max_prompt_tokens, when set)
    plus rollout.max_tokens."""
    return int(cfg.rollout.max_prompt_tokens or 0) + cfg.rollout.max_tokens


def settings_from_config(cfg, arch: Architecture) -> Settings:
    """The memory settings of ``cfg`` in the modelled model's tokens (emulated: x emulation.tokens_per_token)."""
    device = cfg.cluster.device
    k = cfg.emulation.tokens_per_token if device == "emulated" else 1.0
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else arch.dtype
    seq = int(round(sequence_tokens(cfg) * k))
    mbt = cfg.train.micro_batch_tokens
    gpu = device in ("cuda", "emulated")
    vllm_gpu = cfg.rollout.engine == "vllm" and device == "cuda"
    return Settings(
        precision=resolve_precision(cfg.train.precision, dtype),
        weight_bytes=4 if dtype == "float32" else 2,
        zero_stage=cfg.train.zero_stage,
        seq_tokens=seq,
        micro_batch_tokens=int(round(mbt * k)) if mbt else None,
        batch_sequences=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        activation_checkpointing=cfg.train.activation_checkpointing,
        rollout_engine=cfg.rollout.engine,
        rollout_share=cfg.rollout.vllm.gpu_memory_utilization if vllm_gpu else None,
        kv_tokens=cfg.rollout.kv_slots * seq,
        kv_bytes=int(cfg.sim.rollout.kv_cache_gb * GB) if device == "emulated" else None,
        keeps_slept_engine=vllm_gpu,
        overhead=GPU_RUNTIME_OVERHEAD if gpu else 0,
        staging_buffer=cfg.staging.buffer_mb * MIB,
        sync_bucket=cfg.rollout.sync_bucket_mb * MIB,
        snapshot_every=cfg.faults.snapshot_every,
    )


def _snapshot_host(t) -> str:
    """The in-memory snapshots' host memory on the trainer that holds the most (faults.snapshot_every), at the
    split where it is largest; empty when snapshots are off."""
    most = max(t.splits, key=lambda sp: sp.trainer.part("snapshots"))
    got = most.trainer.part("snapshots")
    return f", snapshots up to {got / GIB:.1f} GiB (trainer at {most.n_train}, faults.snapshot_every)" if got else ""


def capacity_for(cfg, read_device=cuda_memory_bytes) -> tuple[int | None, str]:
    gb = cfg.cluster.gpu_memory_gb
    if gb:
        return int(gb * GB), f"cluster.gpu_memory_gb={gb:g}"
    if cfg.cluster.device == "cuda":
        total = read_device()
        if total:
            return total, "read from the CUDA device"
        return None, "cluster.device=cuda and no GPU on this host: set cluster.gpu_memory_gb to check here"
    return None, f"no memory figure for cluster.device={cfg.cluster.device}: set cluster.gpu_memory_gb to check"


def memory_report(cfg, read_device=cuda_memory_bytes) -> MemoryReport:
    """The memory table of ``cfg`` (None, with the reason, where no architecture or capacity is known)."""
    arch, arch_src = architecture_for(cfg)
    capacity, cap_src = capacity_for(cfg, read_device)
    if arch is None:
        return MemoryReport(None, arch_src, arch_src, cap_src)
    unit = cfg.cluster.gpus_per_node if cfg.cluster.granularity == "node" else 1
    table = plan(arch, settings_from_config(cfg, arch), cfg.cluster.gpus, capacity, unit)
    return MemoryReport(table, None if capacity is not None else cap_src, arch_src, cap_src)


def check_config(cfg, read_device=cuda_memory_bytes) -> MemoryReport:
    """:func:`memory_report`, raising :class:`MemoryFitError` when no split fits or the initial split does not."""
    rep = memory_report(cfg, read_device)
    t = rep.table
    if t is None or t.capacity is None:
        return rep
    refusal = t.refusal()
    if refusal:
        raise MemoryFitError(f"{rep.arch_source}: {refusal}")
    n = cfg.cluster.initial_train
    sp = t.split(n)
    if not sp.fits:
        role, m = sp.over()[0]
        hints = t.hints(n)
        raise MemoryFitError(
            f"cluster.initial_train={n}: a {role} rank of the split {n}:{sp.n_rollout} needs {m.device / GIB:.1f} GiB "
            f"of a {t.capacity / GIB:.1f} GiB GPU ({rep.capacity_source}): {m.describe()} GiB; "
            f"splits that fit: {_counts(t.feasible())} trainers" + (f"; would fit with: {', '.join(hints)}" if hints else ""))
    return rep


def feasible_trainer_counts(cfg, read_device=cuda_memory_bytes) -> set[int] | None:
    """The trainer counts that fit, or None where nothing is known (every count allowed). Raises nothing: a config
    that passed :func:`check_config` gives the same figures here. The simulator passes ``read_device=lambda: None``:
    its GPUs are not this host's, only ``cluster.gpu_memory_gb`` sizes them."""
    try:
        rep = memory_report(cfg, read_device)
    except ConfigError:
        return None
    if rep.table is None or rep.table.capacity is None:
        return None
    return set(rep.table.feasible())


def _counts(ns) -> str:
    ns = list(ns)
    if not ns:
        return "none"
    if ns == list(range(ns[0], ns[-1] + 1)):
        return f"{ns[0]}..{ns[-1]}" if len(ns) > 1 else str(ns[0])
    return ", ".join(map(str, ns))


def format_table(rep: MemoryReport, initial_train: int | None = None) -> str:
    """The memory table ``config check`` prints: each split, trainer / rollout / switch GiB, fits, what would fit."""
    t = rep.table
    if t is None:
        return f"memory: not checked ({rep.why_unchecked})"
    a, s = t.arch, t.settings
    cap = f"{t.capacity / GIB:.1f} GiB a GPU ({rep.capacity_source})" if t.capacity else f"not checked ({rep.why_unchecked})"
    mbt = s.micro_batch_tokens or f"whole slice ({s.seq_tokens} x sequences)"
    lines = [
        f"memory: {a.params / 1e9:.2f}B params ({rep.arch_source}), {s.precision}, ZeRO-{s.zero_stage}, "
        f"micro_batch_tokens {mbt}, activation checkpointing {'on' if s.activation_checkpointing else 'off'}; {cap}",
        f"  {'split':<7} {'trainer GiB':>11} {'rollout GiB':>11} {'switch GiB':>10}  {'fits':<4}  would fit with",
    ]
    for sp in t.splits:
        mark = "*" if sp.n_train == initial_train else " "
        fits = {None: "-", True: "yes", False: "no"}[sp.fits]
        hints = ", ".join(t.hints(sp.n_train))
        lines.append(f"  {sp.n_train}:{sp.n_rollout:<{5 - len(str(sp.n_train))}}{mark}{sp.trainer.device / GIB:>11.1f} "
                     f"{sp.rollout.device / GIB:>11.1f} {sp.switch.device / GIB:>10.1f}  {fits:<4}  {hints}")
    if t.splits:
        sp = t.splits[0]
        lines.append(f"  per rank: trainer at {sp.n_train}: {sp.trainer.describe()} GiB; rollout: {sp.rollout.describe()} GiB; "
                     f"host: staging {sp.trainer.part('staging buffer') / GIB:.1f} GiB (trainer), next weights "
                     f"{sp.rollout.host / GIB:.1f} GiB (rollout)" + _snapshot_host(t))
    if t.capacity is not None:
        lines.append(f"  feasible splits: {', '.join(f'{x.n_train}:{x.n_rollout}' for x in t.splits if x.fits) or 'none'}")
    return "\n".join(lines)
