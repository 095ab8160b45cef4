"""The export's reading of ZeRO partitions (``dynaresize.models.export``), on checkpoints staged here with the real
Stager in the layout the trainer writes: 3 trainers, DeepSpeed's tail padding (the flat vector padded to a multiple
of 2 x dp), parameters of several shapes. The masters come back as the named parameters; a rank 0 weight that
disagrees with them is refused, naming the parameter. (The real DeepSpeed layout: tests/integration/test_export.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from dynaresize.config.loader import dump_config, load_config
from dynaresize.job import checkpoint_files as ckpt
from dynaresize.job.state import JobState
from dynaresize.models.export import ExportError, find_checkpoint, master_weights, _check_against_weights
from dynaresize.rundir import create_run_dir
from dynaresize.staging import Stager

pytestmark = pytest.mark.unit

PARAMS = {"model.embed_tokens.weight": (3, 5), "model.norm.weight": (7,), "model.layers.0.mlp.up_proj.weight": (2, 2)}


def stage_checkpoint(run_dir, step: int, dp: int, weights: dict[str, torch.Tensor], skew: dict[str, float] | None = None):
    flat = torch.cat([t.reshape(-1) for t in weights.values()])
    length = flat.numel()
    padded = math.ceil(length / (2 * dp)) * 2 * dp
    flat = torch.cat([flat, torch.zeros(padded - length)])
    size = padded // dp
    tag = ckpt.claim_tag(run_dir, step, {"epoch": 1})
    st = Stager(run_dir / "checkpoints" / tag, buffer_mb=1, chunk_mb=1)
    for r in range(dp):
        part = flat[r * size:(r + 1) * size].clone()
        st.stage(f"rank{r}-optim", {"g0.master": part, "g0.exp_avg": torch.zeros(size), "g0.exp_avg_sq": torch.ones(size)},
                 {"rank": r, "version": step, "n_train": dp,
                  "partitions": [{"group": 0, "length": length, "dp": dp, "dp_rank": r, "size": size, "step": float(step)}]})
    held = {n: t + (skew or {}).get(n, 0.0) for n, t in weights.items()}
    st.stage("rank0-weights", held, {"rank": 0, "version": step, "n_train": dp})
    ckpt.save_tag_state(run_dir, tag, JobState(step=step, version=step, n_train=dp, checkpoint=f"checkpoints/{tag}"))
    return padded - length


@pytest.fixture
def run_dir(tmp_path):
    d = create_run_dir(tmp_path, "layout")
    (d / "config.yaml").write_text(dump_config(load_config(None)))
    return d


def test_three_trainers_with_tail_padding_give_the_named_parameters(run_dir):
    torch.manual_seed(0)
    weights = {n: torch.randn(s) for n, s in PARAMS.items()}
    assert stage_checkpoint(run_dir, 2, 3, {n: torch.zeros(s) for n, s in PARAMS.items()}) == 4
    assert stage_checkpoint(run_dir, 4, 3, weights) == 4  # 26 values padded to 30: 10 a trainer
    ck = find_checkpoint(run_dir)
    assert (ck.tag, ck.step, ck.version, ck.n_train) == ("step-4", 4, 4, 3)
    got, dtype = master_weights(ck)
    assert dtype == "float32" and list(got) == list(PARAMS)
    assert all(torch.equal(got[n], weights[n]) for n in PARAMS)
    assert _check_against_weights(ck, got) == 3
    assert find_checkpoint(run_dir, 2).version == 2
    with pytest.raises(ExportError, match=r"no checkpoint of step 3; the run has steps 2, 4"):
        find_checkpoint(run_dir, 3)


def test_weights_that_disagree_with_the_masters_are_refused(run_dir):
    weights = {n: torch.randn(s) for n, s in PARAMS.items()}
    stage_checkpoint(run_dir, 1, 2, weights, skew={"model.norm.weight": 1e-3})
    ck = find_checkpoint(run_dir)
    got, _ = master_weights(ck)
    with pytest.raises(ExportError, match=r"parameter 'model.norm.weight' from the fp32 masters differs .* by up to 0.001"):
        _check_against_weights(ck, got)


def test_a_run_without_checkpoints_is_named(run_dir):
    with pytest.raises(ExportError, match=r"no complete checkpoint under"):
        find_checkpoint(run_dir)
    tag = ckpt.claim_tag(run_dir, 3, {"epoch": 1})  # claimed, never completed (no coordinator.json)
    assert tag == "step-3"
    with pytest.raises(ExportError, match=r"no complete checkpoint under"):
        find_checkpoint(run_dir)
