"""The CUDA paths the memory model and bf16 training need, on a real GPU: UNVERIFIED until this runs (no GPU was
lent to the work that wrote it; tools/gpu_check.sh runs it). Skips cleanly without CUDA.

- a bf16 training step on CUDA in DeepSpeed's ZeRO-1/2 layout at one rank (tools/bench_memory.py's step): finite loss, and
  peak allocated memory within 15% of the memory model's trainer figure (model states + activations);
- a rollout rank's weights and KV cache: within 15% of the model's rollout figure;
- an NCCL process group (world of one) reduces bf16 tensors;
- ``cluster.device: cuda`` without ``gpu_memory_gb`` reads the device's memory (config check and the policy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_memory as B  # noqa: E402

from dynaresize.memory import Architecture, Settings, activations, model_states, rollout  # noqa: E402


def _model(size: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = {k: v for k, v in B.hf_config(size).items() if k not in ("model_type", "dtype")}
    cfg = Qwen3Config(**d, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return m, cfg


@pytest.mark.parametrize("ckpt", [False, True])
def test_bf16_step_on_cuda_within_the_memory_model(ckpt):
    from dynaresize.rl.grpo import sequence_logprobs

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m, cfg = _model("medium")
    if ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(m.parameters())
    total = sum(p.numel() for p in params)
    master = torch.empty(total, dtype=torch.float32, device="cuda")  # the ZeRO partition at n = 1, as the bench
    master.grad = torch.zeros_like(master)
    o = 0
    for p in params:
        master[o:o + p.numel()].copy_(p.detach().reshape(-1))
        p.grad = torch.zeros_like(p)
        o += p.numel()
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    opt.step()  # a zero gradient: allocates the moments
    tokens = B.SIZES["medium"]["tokens"]
    ids = torch.randint(0, cfg.vocab_size, (tokens // 256, 256), device="cuda")
    mask = torch.ones_like(ids)
    loss = -sequence_logprobs(m, ids, mask, mask).sum() / mask.sum()
    loss.backward()
    assert torch.isfinite(loss)
    o = 0
    with torch.no_grad():
        for p in params:  # into the fp32 partition and back, slice by slice (no whole-model temporaries)
            master.grad[o:o + p.numel()].copy_(p.grad.reshape(-1))
            o += p.numel()
        opt.step()
        o = 0
        for p in params:
            p.copy_(master[o:o + p.numel()].view_as(p))
            o += p.numel()
    got = torch.cuda.max_memory_allocated() - base
    arch = Architecture.from_config(B.hf_config("medium"))
    s = Settings(precision="bf16", zero_stage=2, activation_checkpointing=ckpt)
    want = sum(p.bytes for p in model_states(arch, s, 1)) + activations(arch, s, tokens).bytes
    assert abs(got - want) / got <= 0.15, (got, want)


def test_rollout_weights_and_kv_cache_within_the_memory_model():
    from transformers import StaticCache

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m, cfg = _model("medium")
    cache = StaticCache(config=cfg, max_cache_len=B.KV_TOKENS // 8)
    with torch.no_grad():
        m(input_ids=torch.zeros(8, 1, dtype=torch.long, device="cuda"), past_key_values=cache, use_cache=True,
          cache_position=torch.tensor([0], device="cuda"), logits_to_keep=1)
    got = torch.cuda.max_memory_allocated() - base
    r = rollout(Architecture.from_config(B.hf_config("medium")), Settings(kv_tokens=B.KV_TOKENS), 1, None)
    # the attention workspace (K and V repeated to all heads) is what transformers' SDPA path does on the CPU; on CUDA
    # it may pass the KV heads to SDPA as they are (enable_gqa): either figure, within 15%
    floor = r.device - r.part("attention workspace")
    assert 0.85 * floor <= got <= 1.15 * r.device, (got, floor, r.device)


def test_nccl_group_reduces_bf16(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
        dist.all_reduce(t)
        assert t.dtype == torch.bfloat16 and float(t.sum()) == 1024.0
    finally:
        dist.destroy_process_group()


def test_cuda_device_memory_is_read_when_not_configured():
    from dynaresize.config.loader import load_config
    from dynaresize.config.memory import capacity_for, cuda_memory_bytes

    total = cuda_memory_bytes()
    assert total and total == torch.cuda.get_device_properties(0).total_memory
    cap, src = capacity_for(load_config("configs/gpu-8x1.yaml", ["cluster.gpu_memory_gb=null"]))
    assert cap == total and src == "read from the CUDA device"
