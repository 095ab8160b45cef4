"""What bf16 training costs in gradient accuracy, per ZeRO stage and chunk count (issue 44 item 1).

Two trainer processes (DeepSpeed on CPU, gloo) train the same batch of ``--samples`` random sequences on a tiny
Llama (2 layers, hidden 32, the one tests/integration/test_streaming_train.py trains), streamed in 1 to ``--chunks`` chunks, for one optimizer step;
AdamW's first step leaves ``exp_avg = (1 - beta1) g``, so the exported fp32 state holds the reduced gradient ``g``
the step used. Each row: ``|g - g_fp32| / |g_fp32|`` (2-norms) against the fp32 run in one chunk. ZeRO-2
accumulates a batch's chunks in fp32, ZeRO-1 in bf16 (dynaresize/engines/precision.py says why): the difference
between the two columns is what ZeRO-1's bf16 accumulation costs. Prints the table, then one JSON line.

    .venv/bin/python tools/bench_precision.py                 # 64 samples, 1/4/16/32 chunks, ZeRO-1 and -2, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def _module():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).float()


def _sum_nll(model, batch):
    """The token NLL summed over the chunk's samples (``accumulate`` takes a sum; the step divides by the batch)."""
    from dynaresize.engines.trainer_deepspeed import token_nll_loss

    loss, stats = token_nll_loss(model, batch)
    return loss * batch["input_ids"].shape[0], stats


def _worker(rank: int, rdzv: str, out: str, stage: int, samples: int, chunk_counts: list[int]) -> None:
    from dynaresize.engines.trainer_deepspeed import ZeroTrainer, warm_backend

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    warm_backend()
    group = dist.new_group([0, 1])
    ids = torch.randint(1, 40, (samples, 12), generator=torch.Generator().manual_seed(1))
    grads = {}
    for precision, k in [("fp32", 1)] + [("bf16", k) for k in chunk_counts]:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        cfg = types.SimpleNamespace(lr=1e-2, weight_decay=0.0, grad_clip=0.0, zero_stage=stage, precision=precision)
        t = ZeroTrainer(_module().to(dtype), cfg, group, (0, 1), global_batch=samples)
        edges = [round(i * samples / k) for i in range(k + 1)]
        for lo, hi in zip(edges, edges[1:]):
            t.accumulate({"input_ids": ids[lo:hi]}, _sum_nll)
        t.step(float(samples))
        grads[f"{precision}:{k}"] = torch.cat([p.exp_avg for p in t.export_partitions()]) / 0.1
        t.destroy()
    ref = grads.pop("fp32:1")
    errs = {key: float((g - ref).norm() / ref.norm()) for key, g in grads.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(errs))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 32])
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (1, 2):
            out = Path(tmp) / f"errs{stage}.json"
            mp.spawn(_worker, args=(str(Path(tmp) / f"rdzv{stage}"), str(out), stage, args.samples, args.chunks),
                     nprocs=2, join=True)
            rows[stage] = json.loads(out.read_text())
    print(f"{'chunks':>6}  {'ZeRO-1 (bf16 accumulation)':>27}  {'ZeRO-2 (fp32 accumulation)':>27}")
    for k in args.chunks:
        print(f"{k:>6}  {rows[1][f'bf16:{k}']:>26.2%}  {rows[2][f'bf16:{k}']:>26.2%}")
    last = args.chunks[-1]
    print(json.dumps({"samples": args.samples, "chunks": args.chunks,
                      "zero1_grad_rel_err": [round(rows[1][f"bf16:{k}"], 5) for k in args.chunks],
                      "zero2_grad_rel_err": [round(rows[2][f"bf16:{k}"], 5) for k in args.chunks],
                      "bf16_accumulation_cost_at_max_chunks": round(rows[1][f"bf16:{last}"] - rows[2][f"bf16:{last}"], 5)}))


if __name__ == "__main__":
    main()
