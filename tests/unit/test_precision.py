"""``train.precision`` resolved against the model's dtype, and the DeepSpeed settings each precision gets
(``dynaresize.engines.precision``; the engine itself: tests/integration/test_train_precision.py)."""

from __future__ import annotations

import json

import pytest
import torch

from dynaresize.config.loader import ConfigError
from dynaresize.engines.precision import PrecisionError, ds_precision, grad_accum_dtype, resolve_precision

pytestmark = pytest.mark.unit


def test_auto_follows_the_model_and_an_explicit_value_must_agree():
    assert resolve_precision("auto", torch.bfloat16) == "bf16"
    assert resolve_precision("auto", torch.float32) == "fp32"
    assert resolve_precision("bf16", torch.bfloat16) == "bf16"
    with pytest.raises(PrecisionError, match="train.precision=fp32 needs the model in float32, but it is bfloat16"):
        resolve_precision("fp32", torch.bfloat16)
    with pytest.raises(PrecisionError, match="model dtype torch.float16"):
        resolve_precision("auto", torch.float16)
    assert issubclass(PrecisionError, ConfigError)  # the CLI prints it as one line, exit 2


def test_the_deepspeed_settings_keep_the_zero_optimizer():
    # ZeRO-2 accumulates in fp32; ZeRO-1 in bf16, since DeepSpeed 0.19 sends bf16 + ZeRO-1 + fp32 accumulation to
    # BF16_Optimizer (no elastic reshard); gradients are reduced in fp32 either way
    assert ds_precision("fp32", 1) == {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    two, one = ds_precision("bf16", 2), ds_precision("bf16", 1)
    assert two["bf16"] == {"enabled": True} and two["data_types"] == {"grad_accum_dtype": "fp32"}
    assert one["data_types"] == {"grad_accum_dtype": "bf16"}
    assert two["communication_data_type"] == one["communication_data_type"] == "fp32"
    assert grad_accum_dtype("bf16", 1) == torch.bfloat16 and grad_accum_dtype("bf16", 2) == torch.float32
    with pytest.raises(PrecisionError, match="resolve it first"):
        ds_precision("auto", 2)


def test_a_run_checks_the_model_directorys_dtype_before_any_rank_starts(tmp_path):
    from dynaresize.config.loader import load_config
    from dynaresize.job.bootstrap import _check_precision

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    _check_precision(load_config(None, []), tmp_path)  # auto: bf16
    cfg = load_config(None, ["train.precision=fp32"])
    with pytest.raises(PrecisionError, match="needs the model in float32, but it is bfloat16"):
        _check_precision(cfg, tmp_path)
