"""vLLM's CPU build against the project's torch engine, side by side in one process, on the quickstart's tiny model.

    .venv/bin/python tools/bench_vllm_cpu.py                    # 64 prompts x up to 32 tokens, 5 rounds
    .venv/bin/python tools/bench_vllm_cpu.py --model-dir DIR    # any HF directory vLLM can load

What it measures (one thread for both: what a rank has on the local launcher, OMP_NUM_THREADS=1):
- the import of vLLM and the engine build (``VllmRollout`` as a rank builds it: float32, the KV cache of
  ``rollout.vllm.cpu_kv_cache_mb``), wall seconds;
- generate throughput (response tokens / s) of each engine on the same prompts and per-sample seeds, rounds
  alternating between the two (so machine load hits both alike), after one warm-up round each; the ratio of the
  medians is the figure to read on a shared machine;
- host memory: this process's RSS before the vLLM build, after it, after generating, and after ``sleep()`` (the
  CPU has no sleep mode: what a rank keeps of its vLLM engine while it trains).

A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", help="HF model directory (default: the quickstart's tiny model, built if not cached)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv-mb", type=int, default=256, help="rollout.vllm.cpu_kv_cache_mb")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from dynaresize.config.loader import load_config
    from dynaresize.engines.protocol import SamplingParams
    from dynaresize.engines.rollout_torch import TorchRollout
    from dynaresize.models import ensure_model, load_model, load_tokenizer
    from dynaresize.models.hf import pad_token_id, stop_token_ids
    from dynaresize.worker.config import VllmConfig

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model(load_config("configs/quickstart.yaml", []))
    tok = load_tokenizer(model_dir)
    eos = stop_token_ids(model_dir, tok)
    words = ["a:dk=", "b:fm=", "c:gp=", "q:ru=", "x:yz=", "e:kt=", "m:pz=", "d:hq="]
    prompts = [tok(words[i % len(words)])["input_ids"] for i in range(args.prompts)]
    seeds = list(range(1000, 1000 + args.prompts))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0)

    torch_engine = TorchRollout(load_model(model_dir, torch.float32), eos, pad_token_id(tok))
    mem = {"before_vllm_mb": rss_mb()}
    t0 = time.perf_counter()
    from dynaresize.engines.rollout_vllm import VllmRollout, import_vllm

    import_vllm()
    import_s = time.perf_counter() - t0
    mem["after_import_mb"] = rss_mb()
    t0 = time.perf_counter()
    vllm_engine = VllmRollout(str(model_dir), eos, VllmConfig(cpu_kv_cache_mb=args.kv_mb, max_model_len=256), platform="cpu")
    build_s = time.perf_counter() - t0
    mem["after_build_mb"] = rss_mb()

    engines = {"torch": torch_engine, "vllm": vllm_engine}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds + 1):  # round 0: warm-up, not counted
        for name, eng in engines.items():
            t0 = time.perf_counter()
            gens = eng.generate(prompts, seeds, params)
            dt = time.perf_counter() - t0
            if r:
                rates[name].append(sum(len(g.token_ids) for g in gens) / dt)
    mem["after_generate_mb"] = rss_mb()
    vllm_engine.sleep()
    import gc

    gc.collect()
    mem["after_sleep_mb"] = rss_mb()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{'engine':<8} {'tokens/s (median)':>18} {'min':>8} {'max':>8}")
    for k, v in rates.items():
        print(f"{k:<8} {med[k]:>18.0f} {min(v):>8.0f} {max(v):>8.0f}")
    print(f"vllm / torch: x{med['vllm'] / med['torch']:.2f}; vLLM import {import_s:.1f} s, engine build {build_s:.1f} s")
    print(f"RSS MiB: before vLLM {mem['before_vllm_mb']:.0f}, after its import {mem['after_import_mb']:.0f}, after the "
          f"build {mem['after_build_mb']:.0f}, after "
          f"generating {mem['after_generate_mb']:.0f}, after sleep() {mem['after_sleep_mb']:.0f} (kept while training: "
          f"{mem['after_sleep_mb'] - mem['before_vllm_mb']:.0f}, of which the import {mem['after_import_mb'] - mem['before_vllm_mb']:.0f}; "
          f"KV cache {args.kv_mb})")
    print(json.dumps({"tokens_per_s": {k: round(v) for k, v in med.items()}, "ratio_vllm_torch": round(med["vllm"] / med["torch"], 3),
                      "import_s": round(import_s, 2), "build_s": round(build_s, 2),
                      "kept_after_sleep_mb": round(mem["after_sleep_mb"] - mem["before_vllm_mb"]), "kv_cache_mb": args.kv_mb,
                      **{k: round(v) for k, v in mem.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
