"""Supervised warm-start: teach the tiny model the task's answer format so RL starts from a policy that sometimes
succeeds (RL from a random policy gets zero reward and no signal).

Teacher forcing on ``<bos> prompt answer <eos>`` with the loss on the answer and EOS only; AdamW, 10-step warm-up,
cosine decay to 10%. Prompts come from the task with a seed of their own (not the RL prompts), step index = SFT
step, so a curriculum's later (longer) lengths dominate once past its ramp.
"""

from __future__ import annotations

import math
import time

import torch

from dynaresize.rl.batch import collate
from dynaresize.rl.grpo import sequence_logprobs
from dynaresize.tasks.base import Task

SFT_SEED_OFFSET = 7919  # keeps warm-start prompts apart from the RL prompts of the same seed


def answer_batch(tokenizer, task: Task, prompts: list[str]) -> dict[str, torch.Tensor]:
    prompt_ids = tokenizer(prompts)["input_ids"]
    answers = tokenizer([task.answer(p) for p in prompts], add_special_tokens=False)["input_ids"]
    return collate(prompt_ids, [a + [tokenizer.eos_token_id] for a in answers], tokenizer.pad_token_id)


def warm_start(model, tokenizer, task: Task, *, steps: int, lr: float, batch_size: int, seed: int = 0) -> dict[str, float]:
    """Train in place for ``steps`` steps; returns ``{"seconds", "loss_first", "loss_last", "steps"}``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(10, max(steps // 10, 1))

    def schedule(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(steps - warmup, 1)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    t0, losses = time.perf_counter(), []
    for i in range(steps):
        batch = answer_batch(tokenizer, task, [task.prompt(seed + SFT_SEED_OFFSET, i, j) for j in range(batch_size)])
        mask = batch["response_mask"]
        logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)
        loss = -logp.sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return {
        "seconds": time.perf_counter() - t0,
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        "steps": steps,
    }
