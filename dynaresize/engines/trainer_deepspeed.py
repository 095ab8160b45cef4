"""The training engine: DeepSpeed ZeRO-1/2 on a pre-built trainer group. The only module that imports deepspeed.

Why it looks like this (see docs/workers.md, "DeepSpeed on a new group without new communicators"):

- DeepSpeed gets the trainer group through an ``mpu`` object (:class:`GroupMPU`) and ``dist_init_required=False``;
  without an ``mpu`` it clones the world group with a collective ``new_group``. Only members build the engine.
- ZeRO stage 1/2 with ``round_robin_gradients: false``, ``torch_adam: true`` (no FusedAdam JIT on CPU), fp32 or
  bf16 with fp32 master weights and moments (``train.precision``: ``dynaresize.engines.precision`` has the settings
  and why they keep the ZeRO optimizer). A slice goes through in micro-batches of ``train.micro_batch_tokens``
  (every trainer the same number of backward passes), with ``train.activation_checkpointing`` optionally.
- The global batch is fixed whatever the trainer count: each trainer gets a slice, and the loss of a slice is
  scaled by ``dp * local_samples / global_samples`` so that DeepSpeed's gradient average over ``dp`` ranks is the
  gradient of the global-batch mean, also when the batch does not divide evenly.
- ZeRO layout (read from ``stage_1_and_2.py``): per parameter group, parameters are flattened in order with an
  alignment gap after each one (independent of ``dp``), giving a *logical* flat vector of length ``L``; DeepSpeed
  pads it to a multiple of ``2*dp`` and rank ``r`` owns ``[r*ps, (r+1)*ps)``. :class:`Partition` describes one
  rank's slice of fp32 master, ``exp_avg``, ``exp_avg_sq`` in those global coordinates, so a reshard is a pure
  copy of overlapping ranges (``dynaresize.engines.reshard``).
- Optimizer state can be installed *deferred*: :meth:`ZeroTrainer.defer_optimizer_state` registers a step
  pre-hook on the inner torch optimizer that installs the moments right before the first update, i.e. after the
  first forward/backward on the new topology.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from dynaresize.engines.precision import PrecisionError, ds_precision, resolve_precision

# Must be set before deepspeed is imported: its accelerator (and hence gloo vs NCCL) is chosen once, at import.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


class TrainerError(RuntimeError):
    """A training-engine problem: bad batch, wrong topology, state that does not fit this engine."""


def preload() -> None:
    """Import DeepSpeed and the lazily-imported modules its first ``initialize`` would pay 3-6 s for."""
    import torch._dynamo  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    # The first initialize() imports the Muon optimizer module, which calls torch.compile at import time and so
    # pulls in all of inductor (5-7 s on 2 cores). Pay it at start-up, not on a switch's critical path.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's shared-memory all-reduce for CPU *inference* (TorchBackend builds it)


def warm_backend() -> None:
    """Create DeepSpeed's communication wrapper around the existing world group now; it creates no process group.
    Call once after the world group exists.

    On CPU, DeepSpeed's wrapper JIT-compiles its shared-memory op (``deepspeed_shm_comm``) at this point: about 50 s
    on 2 cores in every fresh environment, again whenever the compile command differs from the cached one, and with
    a file lock that makes every rank of the job wait for the one that compiles (a Slurm job with a 1-minute limit
    spent all of it there). The op serves only ``inference_all_reduce``, which training never calls, so it is
    marked unavailable here and the wrapper falls back to the process group, as it does on any machine without it.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)  # computed once, on first access
        if isinstance(compatible, dict):
            compatible[SHM_OP] = False
    deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, auto_mpi_discovery=False, verbose=False)


class GroupMPU:
    """What DeepSpeed asks of an ``mpu``: our pre-built trainer group as its data-parallel group, no model parallel.

    Deliberately no ``initialize_sequence_parallel`` (DeepSpeed would create groups through it).
    """

    def __init__(self, group, ranks: tuple[int, ...]):
        self._group = group
        self._ranks = tuple(ranks)

    def get_data_parallel_group(self):
        return self._group

    def get_data_parallel_world_size(self) -> int:
        return len(self._ranks)

    def get_data_parallel_rank(self) -> int:
        return self._ranks.index(dist.get_rank())

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._ranks)

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        return None


class LossFn(Protocol):
    """``loss_fn(model, batch) -> (loss, stats)`` on this rank's slice of the batch. ``loss`` is either the mean
    over the slice (the engine weights it by the slice's share of samples) or, when the batch carries a 0-d
    ``loss_denominator`` (e.g. the global token count), already normalised to the global batch."""

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]: ...


def token_nll_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over samples of the per-sample mean next-token NLL on ``loss_mask`` tokens (a simple test loss)."""
    ids = batch["input_ids"]
    attn = batch.get("attention_mask", torch.ones_like(ids))
    mask = batch.get("loss_mask", attn).float()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    nll = nll.view(ids.shape[0], -1) * mask[:, 1:]
    per_sample = nll.sum(1) / mask[:, 1:].sum(1).clamp(min=1)
    loss = per_sample.mean()
    return loss, {"nll": float(loss.detach())}


@dataclass(frozen=True)
class PartitionLayout:
    """Where one rank's ZeRO partition of one parameter group sits in the logical flat vector."""

    group: int  # parameter-group index
    length: int  # L: logical flat length (params + alignment gaps), the same for every dp size
    dp: int  # trainers
    dp_rank: int
    size: int  # ps: partition size = padded length / dp

    @property
    def start(self) -> int:
        return self.dp_rank * self.size

    @property
    def valid(self) -> int:
        """Elements of this partition inside ``[0, length)`` (the rest is DeepSpeed's tail padding)."""
        return max(0, min(self.size, self.length - self.start))

    def to_json(self) -> dict[str, int]:
        return {"group": self.group, "length": self.length, "dp": self.dp, "dp_rank": self.dp_rank, "size": self.size}


@dataclass
class Partition:
    """One rank's optimizer state for one parameter group: fp32 master and Adam moments (1-D, ``layout.size``)."""

    layout: PartitionLayout
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float

    def tensors(self) -> dict[str, torch.Tensor]:
        g = self.layout.group
        return {f"g{g}.master": self.master, f"g{g}.exp_avg": self.exp_avg, f"g{g}.exp_avg_sq": self.exp_avg_sq}


def ds_config(train_cfg, global_batch: int, dp: int, precision: str = "fp32") -> dict[str, Any]:
    micro = max(1, math.ceil(global_batch / dp))
    return {
        "train_batch_size": micro * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(train_cfg.grad_clip),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": float(train_cfg.lr), "weight_decay": float(train_cfg.weight_decay), "torch_adam": True},
        },
        "zero_optimization": {
            "stage": int(train_cfg.zero_stage),
            "elastic_checkpoint": True,
            "round_robin_gradients": False,
        },
        # The caller owns the accumulation boundary: every ``step()`` finalises the gradients of all backward passes
        # since the last one (``train_step``: one; streaming, ``accumulate`` x k then ``step``: k).
        "managed_gradient_accumulation": False,
        **ds_precision(precision, int(train_cfg.zero_stage)),  # bf16 or fp32: dynaresize.engines.precision
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class ZeroTrainer:
    """A DeepSpeed engine over ``module`` on the pre-built group of ``ranks`` (this rank must be one of them)."""

    def __init__(self, module: torch.nn.Module, train_cfg, group, ranks: tuple[int, ...], global_batch: int):
        if train_cfg.zero_stage not in (1, 2):
            raise TrainerError(f"train.zero_stage={train_cfg.zero_stage}: resharding needs ZeRO stage 1 or 2")
        if dist.get_rank() not in ranks:
            raise TrainerError(f"rank {dist.get_rank()} is not in the trainer set {ranks}")
        import deepspeed

        self.ranks = tuple(ranks)
        self.dp = len(ranks)
        self.dp_rank = self.ranks.index(dist.get_rank())
        self.global_batch = int(global_batch)
        model_dtype = next(module.parameters()).dtype
        try:
            self.precision = resolve_precision(getattr(train_cfg, "precision", "auto"), model_dtype)
        except PrecisionError as e:
            raise TrainerError(str(e)) from None
        self.micro_batch_tokens: int | None = getattr(train_cfg, "micro_batch_tokens", None)
        self.checkpointing = bool(getattr(train_cfg, "activation_checkpointing", False))
        if self.checkpointing:
            if not callable(getattr(module, "gradient_checkpointing_enable", None)):
                raise TrainerError(f"train.activation_checkpointing: {type(module).__name__} is not a Hugging Face model "
                                   "(no gradient_checkpointing_enable)")
            # recompute each decoder layer in the backward; non-reentrant, so ZeRO's gradient hooks fire once per
            # parameter as without it (HF's default reentrant checkpoint re-enters backward)
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._hooks_before = _hook_keys(module)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=ds_config(train_cfg, global_batch, self.dp, self.precision),
            mpu=GroupMPU(group, self.ranks),
            dist_init_required=False,
        )
        self.module = module
        self._pending_hook = None
        self._pending: list[Partition] | Callable[[], list[Partition]] | None = None
        self._chunks = 0  # backward passes accumulated since the last optimizer step (streaming)

    # -- training -------------------------------------------------------------------------------------------

    def slice_of(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of a global batch of ``n`` samples (contiguous, sizes differ by at most one)."""
        base, extra = divmod(n, self.dp)
        start = self.dp_rank * base + min(self.dp_rank, extra)
        return start, start + base + (1 if self.dp_rank < extra else 0)

    def _local_part(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, int, int]:
        """This rank's slice of ``batch`` (per-sample tensors cut, 0-d ones kept), the batch's size ``n`` and the
        slice's ``[a, b)``. With more trainers than samples some slices are empty (``a == b``): see
        :meth:`_backward`."""
        n = int(next(iter(batch.values())).shape[0])
        if n < 1:
            raise TrainerError("a batch of 0 samples: nothing to train")
        a, b = self.slice_of(n)
        return _rows(batch, n, a, b), n, a, b

    def _backward(self, batch: dict[str, torch.Tensor], local: dict[str, torch.Tensor], n: int, a: int, b: int,
                  loss_fn: LossFn, weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and ``engine.backward(loss * weight)`` of this rank's slice ``local`` = ``batch[a:b]``, in
        micro-batches of at most ``train.micro_batch_tokens`` padded tokens (:meth:`micro_batches`). Returns the
        slice's loss and figures, as one forward of the whole slice would give them.

        Every trainer runs the same number of backward passes for a batch (:meth:`rounds`: the largest slice's
        micro-batch count), also one whose slice is empty (more trainers than samples) or shorter: ZeRO-2 reduces
        gradients inside every backward, ZeRO-1 at the step, and a trainer with fewer passes would leave the others
        in a collective it never joins (gloo: "Received data size doesn't match"). A pass without rows of its own
        runs the forward of the batch's first sample (a real, well-formed row that its own trainer trains too) with
        the loss multiplied by 0: every parameter gets a zero gradient through the same graph, the reduction sees
        every trainer, and the gradient sum is the real rows' alone. It adds nothing to the figures."""
        spans = self.micro_batches(local)
        rounds = self.rounds(n, int(batch["input_ids"].shape[1]))
        # a globally normalised loss (loss_denominator: the batch's count, or 1 for a streamed sum) adds up over the
        # micro-batches as it is; a mean over the slice is weighted by each micro-batch's share of the slice
        summed = "loss_denominator" in local
        parts: list[tuple[float, dict[str, float], int]] = []
        empty: dict[str, float] = {}
        for lo, hi in spans:
            micro = local if (lo, hi) == (0, b - a) else _rows(local, b - a, lo, hi)
            share = 1.0 if summed else (hi - lo) / (b - a)
            loss, stats = loss_fn(self.engine.module, micro)
            self.engine.backward(loss * (weight * share))
            parts.append((float(loss.detach()) * share, stats, hi - lo))
        for _ in range(rounds - len(spans)):
            loss, stats = loss_fn(self.engine.module, _rows(batch, n, 0, 1))
            self.engine.backward(loss * 0.0)
            if not parts:
                empty = {k: 0.0 for k in stats}
        if not parts:
            return torch.zeros(()), empty
        if len(parts) == 1:
            return torch.tensor(parts[0][0]), parts[0][1]
        total = sum(p[0] for p in parts)
        return torch.tensor(total), _merge_stats(parts, total)

    def _per_micro(self, length: int) -> int | None:
        """Sequences of padded ``length`` per micro-batch (None: no limit)."""
        if self.micro_batch_tokens is None:
            return None
        per = self.micro_batch_tokens // length
        if per < 1:
            raise TrainerError(f"train.micro_batch_tokens={self.micro_batch_tokens} is below one sequence: this "
                               f"batch is padded to {length} tokens (prompt + response); set it to at least {length}")
        return per

    def micro_batches(self, local: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """``[lo, hi)`` rows of a slice per forward: as many sequences as fit ``train.micro_batch_tokens`` at the
        slice's padded length (the whole slice when unset; none for an empty slice). The split changes how much is
        held at once, not what is computed: the micro-batches' gradients add up to the slice's (to float rounding)."""
        rows = int(local["input_ids"].shape[0])
        per = self._per_micro(int(local["input_ids"].shape[1]))
        step = rows if per is None else per
        return [(lo, min(rows, lo + step)) for lo in range(0, rows, max(1, step))]

    def rounds(self, n: int, length: int) -> int:
        """Backward passes every trainer runs for a batch of ``n`` samples padded to ``length``: the micro-batch
        count of the largest slice (``ceil(n / dp)`` rows), so that all trainers meet in the same collectives."""
        per = self._per_micro(length)
        return 1 if per is None else math.ceil(math.ceil(n / self.dp) / per)

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn = token_nll_loss) -> dict[str, float]:
        """One optimizer step on the *global* batch (every trainer passes the same batch; each takes its slice,
        possibly empty: a batch smaller than the trainer count trains too)."""
        if self._chunks:
            raise TrainerError(f"a whole-batch step while {self._chunks} streamed chunks wait for their step")
        local, n, a, b = self._local_part(batch)
        self.engine.train()
        # DeepSpeed averages gradients over dp ranks. With a global ``loss_denominator`` the loss function already
        # normalises to the global batch (undo the average: x dp); otherwise weight each slice by its share.
        share = 1.0 if "loss_denominator" in batch else (b - a) / n
        loss, stats = self._backward(batch, local, n, a, b, loss_fn, self.dp * share)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        out = {"loss_local": float(loss), "samples_local": float(b - a), **stats}
        if norm is not None:
            out["grad_norm"] = float(norm)
        return out

    # -- streaming: a batch trained in chunks of complete groups as they arrive, one optimizer step at the end -------

    def accumulate(self, chunk: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Forward and backward of this rank's slice of ``chunk``, a part of a batch whose normaliser (its token or
        sequence count) is not known yet: the loss is taken as a SUM (``loss_denominator`` = 1, so ``loss_fn`` must
        honour it, as :class:`~dynaresize.rl.grpo.GrpoLoss` does) and the gradients add up across chunks and trainers;
        :meth:`step` divides them by the whole batch's count. Every trainer must pass every chunk (ZeRO-2 reduces
        gradients inside each backward); a chunk of fewer samples than trainers leaves some slices empty, and those
        trainers take part with a zero contribution (:meth:`_backward`)."""
        chunk = {**chunk, "loss_denominator": torch.tensor(1.0)}
        local, n, a, b = self._local_part(chunk)
        self.engine.train()
        # DeepSpeed averages over the dp ranks: x dp makes it a sum
        loss, stats = self._backward(chunk, local, n, a, b, loss_fn, float(self.dp))
        self._chunks += 1
        return {"loss_sum_local": float(loss), "samples_local": float(b - a), **stats}

    def step(self, denominator: float) -> dict[str, float]:
        """The optimizer step of a batch trained by :meth:`accumulate`: the summed gradients are divided by
        ``denominator`` (the batch's global token count for ``loss_norm=token``, its sequence count for ``sequence``)
        before clipping and the update, so the step equals :meth:`train_step` on the whole batch up to float
        rounding. The division goes through the ZeRO optimizer's loss scale (the gradients are unscaled by it before
        the norm, the clip and the update; the reported grad norm is the unscaled one); it is 1 again afterwards."""
        if self._chunks == 0:
            raise TrainerError("optimizer step without any accumulated chunk")
        if not (math.isfinite(denominator) and denominator > 0):
            raise TrainerError(f"normaliser {denominator!r} of the batch must be a finite count > 0")
        opt = self.zero
        opt.override_loss_scale(float(denominator))
        try:
            self.engine.step()
        finally:
            opt.override_loss_scale(1.0)
            self._chunks = 0
        norm = self.engine.get_global_grad_norm()
        return {} if norm is None else {"grad_norm": float(norm)}

    @property
    def zero(self):
        return self.optimizer  # DeepSpeedZeroOptimizer

    # -- learning rate: set by the caller before each step (dynaresize.rl.lr: the run's schedule) -------------------

    def set_lr(self, lr: float) -> None:
        """The LR of the next optimizer step(s), on the inner torch optimizer's parameter groups (what its update
        reads). No DeepSpeed scheduler: the engine is rebuilt at every role switch, and the step count lives in the
        run, not in the engine."""
        if not (math.isfinite(lr) and lr >= 0):
            raise TrainerError(f"learning rate {lr!r} must be a finite number >= 0")
        for g in self.zero.optimizer.param_groups:
            g["lr"] = float(lr)

    # -- ZeRO partitions ------------------------------------------------------------------------------------

    def layouts(self) -> list[PartitionLayout]:
        opt = self.zero
        out = []
        for i in range(len(opt.bit16_groups)):
            metas = opt.round_robin_bit16_meta[i]
            length = opt.round_robin_bit16_offsets[i][-1] + metas[-1].numel()
            out.append(PartitionLayout(i, int(length), self.dp, self.dp_rank, int(opt.partition_size[i])))
        return out

    def export_partitions(self, copy: bool = True) -> list[Partition]:
        """This rank's fp32 master and Adam moments per parameter group (copies on CPU unless ``copy=False``)."""
        self._install_pending()
        opt = self.zero
        parts = []
        for lay in self.layouts():
            master = opt.single_partition_of_fp32_groups[lay.group]
            st = opt.optimizer.state.get(master, {})
            z = torch.zeros_like(master)
            m, v = st.get("exp_avg", z), st.get("exp_avg_sq", z)
            step = float(st["step"]) if "step" in st else 0.0
            f = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach())
            parts.append(Partition(lay, f(master), f(m), f(v), step))
        return parts

    def install_partitions(self, parts: list[Partition]) -> None:
        """Install optimizer state for exactly this rank's layout now (master, moments, step)."""
        opt = self.zero
        layouts = self.layouts()
        if len(parts) != len(layouts):
            raise TrainerError(f"got state for {len(parts)} parameter groups, engine has {len(layouts)}")
        for lay, part in zip(layouts, parts):
            if part.layout != lay:
                raise TrainerError(f"state layout {part.layout} does not match this engine's {lay}")
            master = opt.single_partition_of_fp32_groups[lay.group]
            with torch.no_grad():
                master.copy_(part.master.to(master.device))
            st = opt.optimizer.state[master]
            st["exp_avg"] = part.exp_avg.to(master.device, copy=True)
            st["exp_avg_sq"] = part.exp_avg_sq.to(master.device, copy=True)
            # torch AdamW keeps ``step`` as a 0-d float tensor (DeepSpeed quirk 1 concerns the legacy loader only)
            st["step"] = torch.tensor(float(part.step), dtype=torch.float32)
        opt._link_all_hp_params()  # quirk 3: relink fragments so DeepSpeed's own state getters see the state

    def defer_optimizer_state(self, source: list[Partition] | Callable[[], list[Partition]]) -> None:
        """Install optimizer state at the first optimizer step on this topology (a step pre-hook), so that getting
        it (``source`` may be a callable that waits for a background restore) overlaps forward and backward."""
        self._pending = source
        inner = self.zero.optimizer

        def _hook(opt, args, kwargs):
            self._install_pending()

        self._pending_hook = inner.register_step_pre_hook(_hook)

    def has_pending_state(self) -> bool:
        return self._pending is not None

    def _install_pending(self) -> None:
        if self._pending is None:
            return
        src, self._pending = self._pending, None
        if self._pending_hook is not None:
            self._pending_hook.remove()
            self._pending_hook = None
        self.install_partitions(src() if callable(src) else src)

    # -- weights and teardown -------------------------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The module's parameters (tied ones once), in a fixed order: what weight sync sends."""
        return [(n, p.detach()) for n, p in self.engine.module.named_parameters()]

    def destroy(self, detach: bool = True) -> torch.nn.Module:
        """Tear the engine down and hand back the module. ``detach``: give parameters their own storage (off
        ZeRO's flat buffer), for a rollout engine; a rank that trains again skips the copy (the next engine
        flattens them anyway). No communicator is touched."""
        self._pending = None
        if self._pending_hook is not None:
            self._pending_hook.remove()
            self._pending_hook = None
        module = self.engine.module
        self.engine.destroy()
        with torch.no_grad():
            for p in module.parameters():
                if detach:
                    p.data = p.data.clone()
                p.grad = None
        _remove_new_hooks(module, self._hooks_before)
        if self.checkpointing:
            module.gradient_checkpointing_disable()  # a rollout engine's forward keeps its KV cache
        self.engine = self.optimizer = None  # type: ignore[assignment]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return module


def _rows(batch: dict[str, torch.Tensor], n: int, a: int, b: int) -> dict[str, torch.Tensor]:
    """Rows ``[a, b)`` of every per-sample tensor of a batch of ``n`` samples (0-d ones, e.g. the denominator, kept)."""
    return {k: (v[a:b] if v.dim() and v.shape[0] == n else v) for k, v in batch.items()}


def _merge_stats(parts: list[tuple[float, dict[str, float], int]], loss: float) -> dict[str, float]:
    """One slice's figures from its micro-batches' (``(weighted loss, figures, samples)`` each), as one forward of
    the slice reports them: mismatch/TIS sums added and maxima maxed (``reduce_stats``), ``tokens`` added, ``loss``
    the slice's, other figures (KL, clip fraction, ratio, ...) token-weighted means (sample-weighted without
    ``tokens``). A key only some micro-batches report is left out."""
    from dynaresize.rl.mismatch import reduce_stats

    stats = [p[1] for p in parts]
    keys = [k for k in stats[0] if all(k in st for st in stats)]
    out = reduce_stats(stats)
    tokens = [float(st.get("tokens", 0.0)) for st in stats]
    weights = tokens if "tokens" in keys and sum(tokens) > 0 else [float(p[2]) for p in parts]
    for k in keys:
        if k in out:
            continue
        if k == "tokens":
            out[k] = sum(tokens)
        elif k == "loss":
            out[k] = loss
        else:
            out[k] = sum(float(st[k]) * w for st, w in zip(stats, weights)) / sum(weights)
    return {k: out[k] for k in keys}


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hook_keys(module: torch.nn.Module) -> dict[int, dict[str, set]]:
    return {id(m): {d: set(getattr(m, d).keys()) for d in _HOOK_DICTS} for m in module.modules()}


def _remove_new_hooks(module: torch.nn.Module, before: dict[int, dict[str, set]]) -> None:
    for m in module.modules():
        old = before.get(id(m), {})
        for d in _HOOK_DICTS:
            hooks = getattr(m, d)
            for k in list(hooks.keys()):
                if k not in old.get(d, set()):
                    del hooks[k]
