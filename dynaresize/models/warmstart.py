"""Supervised warm-start: teach the tiny model the task's answer format so RL starts from a policy that sometimes
succeeds (RL from a random policy gets zero reward and no signal).

Teacher forcing on ``prompt answer <eos>`` with the loss on the answer and EOS only; the prompt is rendered as
in rollout (:func:`dynaresize.models.hf.render_prompt`: plain text with BOS, or chat messages through the chat
template). AdamW, 10-step warm-up, cosine decay to 10%. Prompts come from the task with a seed of their own (not
the RL prompts of a generated task), step index = SFT step, so a curriculum's later (longer) lengths dominate once
past its ramp; a dataset task's records are drawn in its own order.
"""

from __future__ import annotations

import math
import time

import torch

from dynaresize.models.hf import pad_token_id, render_prompt
from dynaresize.rl.batch import collate
from dynaresize.rl.grpo import sequence_logprobs
from dynaresize.tasks.base import Sample, reference_answer, sample_of

SFT_SEED_OFFSET = 7919  # keeps warm-start prompts apart from the RL prompts of the same seed


def answer_batch(tokenizer, task, samples: list[Sample]) -> dict[str, torch.Tensor]:
    prompt_ids = [render_prompt(tokenizer, s.prompt) for s in samples]
    answers = tokenizer([reference_answer(task, s) for s in samples], add_special_tokens=False)["input_ids"]
    return collate(prompt_ids, [a + [tokenizer.eos_token_id] for a in answers], pad_token_id(tokenizer))


@torch.no_grad()
def greedy_reward(model, tokenizer, reward, samples: list[Sample], max_tokens: int) -> float:
    """Mean reward of greedy answers to ``samples`` (rendered as in rollout, scored by the run's reward)."""
    prompts = [render_prompt(tokenizer, s.prompt) for s in samples]
    pad, width = pad_token_id(tokenizer), max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    total = 0.0
    for i, s in enumerate(samples):
        resp = out[i, width:].tolist()
        if tokenizer.eos_token_id in resp:
            resp = resp[: resp.index(tokenizer.eos_token_id)]
        total += reward.score(f"eval.{i}", s.to_info(), tokenizer.decode(resp, skip_special_tokens=True)).score
    return total / max(len(samples), 1)


def warm_start(model, tokenizer, task, *, steps: int, lr: float, batch_size: int, seed: int = 0) -> dict[str, float]:
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
        batch = answer_batch(tokenizer, task, [sample_of(task, seed + SFT_SEED_OFFSET, i, j, batch_size) for j in range(batch_size)])
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
