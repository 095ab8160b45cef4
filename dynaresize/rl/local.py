"""A single-process GRPO reference loop: sample, score, advantage, one clipped update. No Redis, no workers.

Used by the CPU tests and ``tools/bench_rl_cpu.py`` to show that the pieces (task, tokenizer, tiny model, loss)
make RL work, and as the semantic reference the distributed job must match. Sampling uses HF ``generate`` with
``top_k=0, top_p=1`` (transformers 5 would otherwise apply top_k=50) seeded per (seed, step); the behaviour
logprobs come from a second forward pass at the same weights (equal within 1e-5 to the sampler's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaresize.rl.batch import collate
from dynaresize.rl.grpo import GrpoLoss, group_advantages, sequence_logprobs
from dynaresize.tasks.base import Task


@dataclass(frozen=True)
class Rollout:
    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]  # sampled tokens, EOS included when the response ended
    text: str  # decoded response without special tokens


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_tokens: int, temperature: float = 1.0, greedy: bool = False, seed: int = 0) -> list[Rollout]:
    """Sample (or greedily decode) one response per prompt; the global torch RNG is seeded with ``seed``."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(
        **enc,
        max_new_tokens=max_tokens,
        do_sample=not greedy,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    model.train(was_training)
    width = enc["input_ids"].shape[1]
    rollouts = []
    for i, prompt in enumerate(prompts):
        ids = out[i, width:].tolist()
        if tokenizer.eos_token_id in ids:  # generate pads only after EOS; before it every token was sampled
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        rollouts.append(Rollout(prompt, prompt_ids, ids, tokenizer.decode(ids, skip_special_tokens=True)))
    return rollouts


def evaluate(model, tokenizer, task: Task, prompts: list[str], max_tokens: int) -> float:
    """Mean reward of greedy answers."""
    outs = generate(model, tokenizer, prompts, max_tokens, greedy=True)
    return sum(task.reward(o.prompt, o.text) for o in outs) / max(len(outs), 1)


def grpo_step(
    model,
    tokenizer,
    task: Task,
    optimizer: torch.optim.Optimizer,
    loss_fn: GrpoLoss,
    *,
    seed: int,
    step: int,
    prompts_per_step: int,
    group_size: int,
    max_tokens: int,
    scale_by_std: bool = True,
    grad_clip: float = 1.0,
) -> dict[str, float]:
    """One on-policy GRPO step on ``prompts_per_step x group_size`` samples; returns reward and loss metrics."""
    prompts = [task.prompt(seed, step, i) for i in range(prompts_per_step)]
    expanded = [p for p in prompts for _ in range(group_size)]
    rollouts = generate(model, tokenizer, expanded, max_tokens, loss_fn.temperature, seed=seed * 1_000_003 + step)
    rewards = torch.tensor([task.reward(r.prompt, r.text) for r in rollouts])
    batch = collate(
        [r.prompt_ids for r in rollouts],
        [r.response_ids for r in rollouts],
        tokenizer.pad_token_id,
        advantages=group_advantages(rewards, group_size, scale_by_std),
    )
    with torch.no_grad():
        batch["old_logprobs"] = sequence_logprobs(
            model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], loss_fn.temperature
        )
    model.train()
    loss, metrics = loss_fn(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    optimizer.step()
    lengths = [len(r.response_ids) for r in rollouts]
    return {"step": step, "reward": float(rewards.mean()), "response_len": sum(lengths) / len(lengths), "response_len_max": max(lengths), **metrics}
