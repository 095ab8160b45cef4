"""Training precision (``train.precision``): which one a run trains in, and the DeepSpeed settings that give it.

Pure (no DeepSpeed import): the bootstrap checks a run's precision against its model before any rank starts, and
the training engine (``trainer_deepspeed``) merges :func:`ds_precision` into its DeepSpeed config.

- ``bf16``: the module's weights and compute in bfloat16; DeepSpeed's ZeRO optimizer keeps the fp32 master
  weights and both Adam moments in its partitions (``single_partition_of_fp32_groups``, the inner AdamW's state:
  what ``engines.reshard`` moves, bit for bit), and reduces gradients across trainers in fp32
  (``communication_data_type``).
- ``fp32``: everything fp32 (DeepSpeed's precision modes off).

One dtype per rank: a rank's module is the same object in both roles (trainer, rollout engine), so the precision
must agree with the model's dtype (``model.dtype`` or the directory's): ``auto`` takes it, an explicit value that
disagrees is refused (converting the module at every switch would cost a copy of the weights each way and a
rollout engine would decode in another dtype than the one the run names).

Gradient accumulation across a batch's chunks and micro-batches (``data_types.grad_accum_dtype``), per stage,
read from DeepSpeed 0.19's ``runtime/engine.py`` (``_do_optimizer_sanity_check``):

- ZeRO-2: fp32. bf16 + fp32 accumulation stays on the ZeRO optimizer (``DeepSpeedZeroOptimizer``), whose
  gradient partition is then an fp32 buffer the reduce-scatter of every backward adds into.
- ZeRO-1: bf16. DeepSpeed routes bf16 + ZeRO-1 + fp32 accumulation to ``BF16_Optimizer``, which keeps its fp32
  state in another layout and has no elastic reshard path (nor ``override_loss_scale``, by which the streamed step
  divides by the batch's count); bf16 accumulation keeps the ZeRO optimizer and with it the in-memory reshard.
  What it costs (measured, docs/workers.md "Precision"): each chunk's gradient is added to the running sum in
  bf16 (8 bits of mantissa).
"""

from __future__ import annotations

from typing import Any

import torch

from dynaresize.config.loader import ConfigError


class PrecisionError(ConfigError):
    """A precision the run's model cannot train in (one message before any rank starts)."""


def resolve_precision(setting: str, model_dtype: torch.dtype) -> str:
    """``train.precision`` for a model of ``model_dtype``: ``auto`` -> ``bf16`` for a bfloat16 model, else
    ``fp32``; an explicit value must agree with the model's dtype (module docstring: one dtype per rank)."""
    natural = "bf16" if model_dtype == torch.bfloat16 else "fp32"
    if setting == "auto":
        if model_dtype not in (torch.bfloat16, torch.float32):
            raise PrecisionError(f"model dtype {model_dtype}: training supports bfloat16 (train.precision bf16) and "
                                 "float32 (fp32)")
        return natural
    if setting not in ("fp32", "bf16"):
        raise PrecisionError(f"train.precision={setting!r}: allowed auto, fp32, bf16")
    if setting != natural:
        want = "bfloat16" if setting == "bf16" else "float32"
        raise PrecisionError(
            f"train.precision={setting} needs the model in {want}, but it is {str(model_dtype).removeprefix('torch.')} "
            f"(model.dtype or the model directory's): set model.dtype={want}, or train.precision=auto. A rank holds "
            "one copy of the weights for both roles, in the model's dtype"
        )
    return setting


def grad_accum_dtype(precision: str, zero_stage: int) -> torch.dtype:
    """The dtype a batch's gradients add up in across its chunks and micro-batches (module docstring)."""
    return torch.bfloat16 if precision == "bf16" and zero_stage == 1 else torch.float32


def ds_precision(precision: str, zero_stage: int) -> dict[str, Any]:
    """The DeepSpeed config keys of a precision (merged into ``trainer_deepspeed.ds_config``)."""
    if precision == "fp32":
        return {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    if precision != "bf16":
        raise PrecisionError(f"precision {precision!r}: resolve it first (resolve_precision)")
    accum = "bf16" if grad_accum_dtype(precision, zero_stage) == torch.bfloat16 else "fp32"
    return {"fp16": {"enabled": False}, "bf16": {"enabled": True}, "communication_data_type": "fp32",
            "data_types": {"grad_accum_dtype": accum}}
