"""The memory model (dynaresize/memory.py, docs/memory.md) against memory measured here, on the CPU.

Three sizes of one Qwen3-style architecture (random weights, transformers), ~5M, ~50M and ~200M parameters; each
measurement runs in a fresh subprocess and reports the growth of its resident memory: the peak (VmHWM, reset through
/proc/self/clear_refs after the imports and the baseline) minus the baseline (VmRSS), with glibc's allocator told to
give large blocks back at once (MALLOC_MMAP_THRESHOLD_), so that the peak is the live tensors'.

- trainer: a bf16 training step (its gradient buffers and Adam moments allocated first) in DeepSpeed's ZeRO-1/2 layout at one rank, built in torch (bf16 weights and
  gradients, an fp32 flat master copy and its fp32 gradient, fused AdamW moments on it), the loss through the
  project's own ``sequence_logprobs`` (fp32 log-softmax over the vocabulary): predicted = the model states at n = 1
  plus the activations at the step's tokens (without checkpointing, and with HF gradient checkpointing);
- rollout: bf16 weights and a static KV cache of the size the model predicts for the tokens asked, one decode step
  through it: predicted = weights + KV cache.

What it does not measure: host buffers (staging, the next version's weights: plain allocations of their size), the
runtime overhead of a GPU (CUDA context), vLLM's share (a GPU setting). Run on the first GPU: tools/gpu_check.sh.

    python tools/bench_memory.py            # the table, then one JSON line with max_rel_error (target <= 0.15)
    python tools/bench_memory.py --sizes small --roles trainer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SIZES = {  # Qwen3-style: GQA 4:1 or 2:1, head_dim 32/64, untied embeddings, vocabulary 16,384
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=384, vocab_size=16384, tokens=1024),
    "medium": dict(hidden_size=512, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                   intermediate_size=1536, vocab_size=16384, tokens=1024),
    "large": dict(hidden_size=1024, num_hidden_layers=14, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  intermediate_size=3072, vocab_size=16384, tokens=512),
}
KV_TOKENS = 32768  # the rollout measurement's KV cache: 8 sequences x 4096 tokens


def hf_config(size: str) -> dict:
    d = {k: v for k, v in SIZES[size].items() if k != "tokens"}
    return {**d, "model_type": "qwen3", "tie_word_embeddings": False, "dtype": "bfloat16"}


def predicted(size: str, role: str) -> tuple[int, int]:
    """(predicted bytes, model parameters) from the memory model alone."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dynaresize.memory import Architecture, Settings, activations, model_states, rollout

    arch = Architecture.from_config(hf_config(size))
    if role == "rollout":
        s = Settings(weight_bytes=2, kv_tokens=KV_TOKENS, second_weights_on_host=True)
        return rollout(arch, s, 1, None).device, arch.params
    s = Settings(precision="bf16", zero_stage=2, activation_checkpointing=role == "trainer+ckpt")
    return sum(p.bytes for p in model_states(arch, s, 1)) + activations(arch, s, SIZES[size]["tokens"]).bytes, arch.params


# -- the measurement, in a fresh process ---------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _build(size: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = {k: v for k, v in hf_config(size).items() if k not in ("model_type", "dtype")}
    cfg = Qwen3Config(**d, attn_implementation="sdpa")
    with torch.device("meta"):
        m = Qwen3ForCausalLM(cfg)
    m = m.to(torch.bfloat16).to_empty(device="cpu")  # bf16 from the start: no fp32 copy on the way
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.fill_(1.0) if n.endswith("norm.weight") else p.normal_(0.0, 0.02)
    m.model.rotary_emb.inv_freq = m.model.rotary_emb.original_inv_freq.to("cpu") if hasattr(
        m.model.rotary_emb, "original_inv_freq") else m.model.rotary_emb.inv_freq
    return m, cfg


def measure(size: str, role: str, warm: bool = True) -> int:
    import gc

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    from dynaresize.rl.grpo import sequence_logprobs

    if warm:  # the same work once on a tiny model first: the runtime's own memory (kernels' code, thread pools,
        # allocator arenas; on a GPU: the CUDA context, the model's "runtime" part) stays out of the figure
        SIZES["warm"] = dict(SIZES["small"], num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                             vocab_size=512, tokens=256)
        measure("warm", role, warm=False)
        gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    m, cfg = _build(size)
    if role == "rollout":
        from transformers import StaticCache

        batch = 8
        cache = StaticCache(config=cfg, max_cache_len=KV_TOKENS // batch)
        with torch.no_grad():
            ids = torch.randint(0, cfg.vocab_size, (batch, 1))
            m(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.tensor([0]), logits_to_keep=1)
        return _status("VmHWM") - base
    if role == "trainer+ckpt":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    params = [p for p in m.parameters()]
    total = sum(p.numel() for p in params)
    master = torch.empty(total, dtype=torch.float32)  # the ZeRO partition at n = 1: fp32 master ...
    flat_grad = torch.zeros(total, dtype=torch.float32)  # ... and its fp32 gradient
    o = 0
    for p in params:
        master[o:o + p.numel()].copy_(p.detach().reshape(-1))
        o += p.numel()
    master.grad = flat_grad
    opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
    for p in params:  # the steady state of the first step: gradient buffers and Adam moments allocated up front
        p.grad = torch.zeros_like(p)
    opt.step()  # a zero gradient: allocates the moments
    tokens = SIZES[size]["tokens"]
    seq = 256
    for _ in range(1):
        ids = torch.randint(0, cfg.vocab_size, (tokens // seq, seq))
        mask = torch.ones_like(ids)
        logp = sequence_logprobs(m, ids, mask, mask)
        (-logp.sum() / mask.sum()).backward()
        o = 0
        for p in params:  # reduce into the fp32 partition, no temporary of the whole gradient
            flat_grad[o:o + p.numel()].copy_(p.grad.reshape(-1))
            o += p.numel()
        opt.step()
        o = 0
        with torch.no_grad():
            for p in params:
                p.copy_(master[o:o + p.numel()].view_as(p))
                p.grad.zero_()  # kept allocated, as DeepSpeed keeps its gradient buffers
                o += p.numel()
        del logp
    return _status("VmHWM") - base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--roles", nargs="*", default=["trainer", "trainer+ckpt", "rollout"],
                    choices=["trainer", "trainer+ckpt", "rollout"])
    ap.add_argument("--measure", nargs=2, metavar=("SIZE", "ROLE"), help=argparse.SUPPRESS)  # the subprocess
    a = ap.parse_args()
    if a.measure:
        print(json.dumps({"bytes": measure(*a.measure)}))
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH")])))
    rows, worst = [], 0.0
    print(f"{'size':<7} {'params':>8} {'role':<13} {'tokens':>7} {'predicted MiB':>13} {'measured MiB':>12} {'rel err':>8}")
    for size in a.sizes:
        for role in a.roles:
            pred, params = predicted(size, role)
            out = subprocess.run([sys.executable, __file__, "--measure", size, role], env=env, capture_output=True,
                                 text=True, timeout=900)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            got = json.loads(out.stdout.strip().splitlines()[-1])["bytes"]
            err = abs(pred - got) / got
            worst = max(worst, err)
            toks = KV_TOKENS if role == "rollout" else SIZES[size]["tokens"]
            print(f"{size:<7} {params / 1e6:>7.1f}M {role:<13} {toks:>7} {pred / 2**20:>13.1f} {got / 2**20:>12.1f} {err:>8.3f}")
            rows.append({"size": size, "params": params, "role": role, "predicted": pred, "measured": got,
                         "rel_error": round(err, 4)})
    print(json.dumps({"max_rel_error": round(worst, 4), "target": 0.15, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
