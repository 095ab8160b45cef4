"""The RL workload: per step, B prompts x G responses with long-tailed lengths whose mean drifts over the run.

Each step's batch is drawn from its own generator seeded by (seed, step), so every policy and every static split
in a comparison sees exactly the same batches, and a batch does not depend on which steps were drawn before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynaresize.sim.config import WorkloadConfig


def mean_response(w: WorkloadConfig, step: int, steps: int) -> float:
    if w.response_tokens_by_step:
        return w.response_tokens_by_step[min(step, len(w.response_tokens_by_step) - 1)]
    x = step / max(1, steps - 1)
    if w.drift == "exponential":
        return w.response_tokens_start * (w.response_tokens_end / w.response_tokens_start) ** x
    return w.response_tokens_start + (w.response_tokens_end - w.response_tokens_start) * x


@dataclass(frozen=True)
class Batch:
    lengths: np.ndarray  # response lengths in dispatch order (float64)
    prompt_tokens: int  # sum over the B prompts (prefilled once each; the G responses share the prefix)
    prompt_mean: float
    tokens_generated: int
    tokens_trained: int  # prompt + response tokens of every sample
    samples: int


def make_batch(w: WorkloadConfig, seed: int, step: int, steps: int) -> Batch:
    rng = np.random.default_rng([seed, step])
    mean = mean_response(w, step, steps)
    s = w.response_sigma
    lengths = np.minimum(np.maximum(np.rint(rng.lognormal(math.log(mean) - s * s / 2, s, w.prompts_per_step * w.responses_per_prompt)), 1), w.max_response_tokens)
    if w.response_tokens_by_step:  # an observed mean: rescale the draw so the step generates that many tokens
        target = mean * len(lengths)
        for _ in range(6):  # a few passes: lengths at the cap cannot take their share of an upward rescale
            lengths = np.minimum(np.maximum(np.rint(lengths * (target / lengths.sum())), 1), w.max_response_tokens)
    ps = w.prompt_tokens_sigma
    prompts = np.maximum(np.rint(rng.lognormal(math.log(w.prompt_tokens_mean) - ps * ps / 2, ps, w.prompts_per_step)), 1)
    gen = int(lengths.sum())
    return Batch(
        lengths=lengths,
        prompt_tokens=int(prompts.sum()),
        prompt_mean=float(prompts.mean()),
        tokens_generated=gen,
        tokens_trained=gen + (int(prompts.sum()) * w.responses_per_prompt if w.trained_tokens == "sequence" else 0),
        samples=len(lengths),
    )
