"""From generated samples to a training batch: rewards (scored on the rollout ranks), group-relative advantages,
staleness check.

The coordinator does this once per step, in sample order (prompt, index), so the batch is the same whichever ranks
generated it and however many trainers will split it. The batch goes to trainers as JSON under one Redis key;
each trainer takes its contiguous slice.
"""

from __future__ import annotations

import torch

from dynaresize.contract.batch import TrainBatch
from dynaresize.contract.workqueue import SampleResult, WorkItem
from dynaresize.rl.dapo import OverlongShaping
from dynaresize.rl.grpo import Advantage, advantages
from dynaresize.tasks.base import Task


class StalenessError(RuntimeError):
    """A sample older than the staleness bound reached a training batch (the pipeline must never allow it)."""


def sample_seed(seed: int, step: int, prompt: int, index: int) -> int:
    """The per-sample generation seed: a pure function of (run seed, step, prompt, index), < 2**63."""
    import hashlib

    h = hashlib.blake2b(f"{seed}:{step}:{prompt}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def work_items(task: Task, tokenizer, seed: int, step: int, prompts: int, group: int, first: int = 0,
               stride: int | None = None) -> tuple[list[WorkItem], list[str]]:
    """The step's work: ``prompts`` x ``group`` items (prompt-major), and the prompts' plain texts, for prompt indices
    ``first .. first + prompts - 1`` (``first > 0``: an extra round of dynamic sampling). A prompt is rendered by
    :func:`~dynaresize.models.hf.render_prompt` (chat messages through the model's chat template); each item carries
    what its reward needs (data source, ground truth, extra info) to the rollout rank that scores it. ``stride``:
    prompts a step may use at most (a dataset task's records per step; default ``prompts``), so extra rounds of one
    step never take the next step's records."""
    from dynaresize.models.hf import prompt_text, render_prompt
    from dynaresize.tasks.base import sample_of

    per_step = stride or (first + prompts)
    samples = [sample_of(task, seed, step, p, per_step) for p in range(first, first + prompts)]
    items = []
    for p, smp in enumerate(samples, start=first):
        ids = render_prompt(tokenizer, smp.prompt)
        items += [WorkItem(step, p, i, list(ids), sample_seed(seed, step, p, i), info=smp.to_info()) for i in range(group)]
    return items, [prompt_text(smp.prompt) for smp in samples]


def val_seed(seed: int, prompt: int, index: int) -> int:
    """Seed of validation response ``index`` to validation prompt ``prompt``: the same draws at every pass."""
    return sample_seed(seed, -1, prompt, index)


def val_items(samples, tokenizer, seed: int, version: int, k: int) -> list[WorkItem]:
    """A validation pass: ``k`` items per validation sample, keyed ``<version>.<prompt>.<index>``."""
    from dynaresize.models.hf import render_prompt

    items = []
    for p, smp in enumerate(samples):
        ids = render_prompt(tokenizer, smp.prompt)
        items += [WorkItem(version, p, i, list(ids), val_seed(seed, p, i), info=smp.to_info()) for i in range(k)]
    return items


def reward_errors(samples: list[SampleResult]) -> list[str]:
    """The reward failures the rollout ranks reported (each text names its sample key), in sample order."""
    return [s.extra["reward_error"] for s in samples if s.extra.get("reward_error")]


def reward_of(s: SampleResult) -> float:
    """The score the rollout rank gave sample ``s`` (every rank scores what it generates)."""
    if not isinstance(s.extra.get("reward"), (int, float)):
        raise RuntimeError(f"sample {s.key}: no reward in its result (rank {s.rank} did not score it)")
    return float(s.extra["reward"])


def check_staleness(step: int, samples: list[SampleResult], bound: int) -> None:
    """Batch ``step`` may only hold samples of policy versions >= step - bound."""
    oldest = min((s.version for s in samples), default=step)
    if oldest < step - bound:
        bad = [s.key for s in samples if s.version < step - bound][:5]
        raise StalenessError(
            f"batch {step} holds samples of version {oldest} < {step} - {bound} (staleness bound), e.g. {bad}"
        )


def ordered_samples(step: int, items: list[WorkItem], samples: list[SampleResult]) -> list[SampleResult]:
    """``samples`` in the order of ``items``; every item must have its sample."""
    by_key = {s.key: s for s in samples}
    missing = [it.key for it in items if it.key not in by_key]
    if missing:
        from dynaresize.job.errors import JobError

        raise JobError(f"batch {step} cannot be built: {len(missing)} of its {len(items)} samples have no result "
                       f"(e.g. {', '.join(missing[:3])}); the run stopped before training it. Every sample generated "
                       "so far stays in the run's Redis, and a resume puts back the claims of the stopped processes, "
                       "so the missing ones are generated then")
    return [by_key[it.key] for it in items]


def score_samples(
    items: list[WorkItem], ordered: list[SampleResult], texts: list[str], task: Task, tokenizer,
    overlong: OverlongShaping | None = None,
) -> tuple[list[float], list[float]]:
    """``(scores, rewards)`` per sample: the score the rollout rank gave it (``reward_of``; a result without one, as
    hand-built ones in tests, is scored here by the task's own reward), and the reward the advantage is computed from
    (the score plus the overlong penalty when shaping is on, else the score itself)."""
    scores, rewards = [], []
    for it, s in zip(items, ordered):
        if "reward" in s.extra:
            score = reward_of(s)
        else:
            score = float(task.reward(texts[it.prompt], tokenizer.decode(s.response_ids, skip_special_tokens=True)))
        scores.append(score)
        rewards.append(score + overlong.penalty(len(s.response_ids)) if overlong is not None else score)
    return scores, rewards


def build_batch(
    step: int, items: list[WorkItem], samples: list[SampleResult], texts: list[str], task: Task, tokenizer,
    group: int, bound: int, advantage: Advantage = "grpo", overlong: OverlongShaping | None = None,
    scored: dict[str, float] | None = None,
) -> TrainBatch:
    """Score every sample, compute advantages per prompt group (``advantage``: ``algorithm.advantage``), and check
    the staleness bound.

    ``texts`` is indexed by prompt index; ``scored`` (sample key -> reward), when given, is used instead of
    scoring again (dynamic sampling scored every group already)."""
    ordered = ordered_samples(step, items, samples)
    check_staleness(step, ordered, bound)
    if scored is None:
        _, rewards = score_samples(items, ordered, texts, task, tokenizer, overlong)
    else:
        rewards = [float(scored[it.key]) for it in items]
    adv = advantages(torch.tensor(rewards), group, advantage)
    return TrainBatch(
        step=step,
        prompt_ids=[it.prompt_ids for it in items],
        response_ids=[s.response_ids for s in ordered],
        logprobs=[s.logprobs for s in ordered],
        advantages=[float(a) for a in adv],
        rewards=rewards,
        versions=[s.version for s in ordered],
        keys=[it.key for it in items],
    )
