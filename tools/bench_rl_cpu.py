"""Single-process GRPO on the configured task (default: the quickstart's ReverseDigits), on CPU.

What reward rise to expect from the pieces alone (task, tokenizer, tiny model, warm-start, GRPO loss), with no
workers, Redis or resizing: builds (or reuses from the cache) the warm-started model, evaluates greedy reward,
runs N on-policy GRPO steps of B prompts x G samples, evaluates again. Prints a table, then one JSON line.

    .venv/bin/python tools/bench_rl_cpu.py                       # quickstart config, 20 steps, 1 thread
    .venv/bin/python tools/bench_rl_cpu.py --steps 40 -o train.lr=1e-4 -o rollout.group_size=8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dynaresize.config.loader import load_config
from dynaresize.models import ensure_model, load_model, load_tokenizer
from dynaresize.models.store import META_FILE
from dynaresize.rl import GrpoLoss
from dynaresize.rl.local import evaluate, grpo_step
from dynaresize.tasks import load_task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    ap.add_argument("-o", "--override", action="append", default=[], help="dotted config override, e.g. train.lr=1e-4")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default: run.steps)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.override)
    steps = args.steps or cfg.run.steps
    task = load_task(cfg.task)

    t0 = time.perf_counter()
    path = ensure_model(cfg)
    build_s = time.perf_counter() - t0
    meta = json.loads((path / META_FILE).read_text())
    model, tok = load_model(path), load_tokenizer(path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    loss_fn = GrpoLoss.from_config(cfg.train, cfg.rollout.temperature)

    def greedy(step: int) -> float:
        prompts = [task.prompt(cfg.run.seed + 104729, step, i) for i in range(args.eval_prompts)]
        return evaluate(model, tok, task, prompts, cfg.rollout.max_tokens)

    before = {"first": greedy(0), "last": greedy(steps - 1)}
    print(f"model {path} (built/loaded in {build_s:.1f} s; warm-start {meta['warm_start']['seconds']:.1f} s when built)")
    print(f"{'step':>4} {'reward':>7} {'len':>5} {'max':>4} {'loss':>8} {'clip':>5} {'sec':>5}")
    rows, t_rl = [], time.perf_counter()
    for step in range(steps):
        t = time.perf_counter()
        m = grpo_step(model, tok, task, opt, loss_fn, seed=cfg.run.seed, step=step, prompts_per_step=cfg.rollout.prompts_per_step,
                      group_size=cfg.rollout.group_size, max_tokens=cfg.rollout.max_tokens, grad_clip=cfg.train.grad_clip)
        m["seconds"] = time.perf_counter() - t
        rows.append(m)
        print(f"{step:>4} {m['reward']:>7.3f} {m['response_len']:>5.1f} {m['response_len_max']:>4} {m['loss']:>8.4f} {m['clip_frac']:>5.2f} {m['seconds']:>5.2f}")
    rl_s = time.perf_counter() - t_rl
    after = {"first": greedy(0), "last": greedy(steps - 1)}
    k = max(1, min(3, steps // 4))
    summary = {
        "bench": "rl_cpu",
        "steps": steps,
        "batch": f"{cfg.rollout.prompts_per_step}x{cfg.rollout.group_size}",
        "lr": cfg.train.lr,
        "threads": args.threads,
        "warmstart_s": round(meta["warm_start"]["seconds"], 2),
        "warmstart_steps": meta["warm_start"]["steps"],
        "rl_s": round(rl_s, 2),
        "s_per_step": round(rl_s / steps, 3),
        "reward_first": round(sum(r["reward"] for r in rows[:k]) / k, 4),
        "reward_last": round(sum(r["reward"] for r in rows[-k:]) / k, 4),
        "greedy_before": {key: round(v, 4) for key, v in before.items()},
        "greedy_after": {key: round(v, 4) for key, v in after.items()},
    }
    print(f"sampled reward: first {k} steps {summary['reward_first']:.3f} -> last {k} {summary['reward_last']:.3f}; "
          f"greedy (step-0 lengths / last-step lengths) {before['first']:.3f}/{before['last']:.3f} -> {after['first']:.3f}/{after['last']:.3f}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
