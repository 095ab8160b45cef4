"""The RL workload: per step, B prompts x G responses with long-tailed lengths whose mean drifts over the run.

Each step's batch is drawn from its own generator seeded by (seed, step), so every policy and every static split
in a comparison sees exactly the same batches, and a batch does not depend on which steps were drawn before it.

Drivers (``sim.workload``, each off by default; with all off the draws are exactly those of the plain model):

- **drift and long tail** (default): lognormal lengths, shape ``response_sigma``, mean moving from
  ``response_tokens_start`` to ``response_tokens_end`` (or an observed ``response_tokens_by_step``);
- **task mix** (``tasks`` + ``task_weights``): each prompt belongs to a task drawn by the step's weights (piecewise
  constant, changing at the given steps); its G responses follow that task's lengths;
- **max-length cap** (``cap_share``, ``cap_share_end``): that share of responses runs to ``max_response_tokens``
  whatever its drawn length (draws above the cap are cut there in any case); with ``cap_share_end`` the share moves
  linearly from the first step to the last (long-CoT runs: more responses hit the context limit as lengths grow);
- **length growth curve** (``drift``): linear, exponential, logistic (an S-curve, ``drift_midpoint`` and
  ``drift_width``: a length that takes off, as long-CoT RL runs report, then flattens) or step (``start`` until
  ``drift_midpoint`` of the run, ``end`` from there: a sudden shift the policy must follow);
- **trace** (``trace``): a run's logged lengths, step by step (:mod:`dynaresize.sim.trace`); no draw, every other
  driver off;
- **dynamic sampling** (``dynamic_sampling``, DAPO): per-prompt success probability ~ Beta around the step's accuracy,
  G Bernoulli rewards per prompt, groups with all-equal rewards dropped; prompts are generated in chunks of
  ``round_prompts_factor`` x B (chunk c from ``rng(seed, step, c)``; chunk 0 is the plain batch's generator) until
  B groups are kept, the first B in prompt order, or ``max_oversample`` x B prompts were generated. ``rounds``
  generates every prompt of the last round (the surplus is generated, not trained); ``stream`` stops at the prompt
  that completes the batch.

A :class:`Batch` lists every generated response in dispatch order (prompt order, the G responses of a prompt
consecutive) with its prompt index and whether it is trained (``kept``). ``tokens_generated`` counts every
generated response token; ``tokens_trained`` and ``samples`` count the kept samples only.
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
    if w.drift == "step":  # a sudden change (a new data mix, a changed prompt template): start, then end from the midpoint
        return w.response_tokens_end if x >= w.drift_midpoint else w.response_tokens_start
    if w.drift == "logistic":
        x = logistic_share(x, w.drift_midpoint, w.drift_width)
    return w.response_tokens_start + (w.response_tokens_end - w.response_tokens_start) * x


def logistic_share(x: float, mid: float, width: float) -> float:
    """The share of the growth reached at ``x`` (0..1 of the run) on an S-curve centred at ``mid``, rescaled so that
    it is exactly 0 at the first step and 1 at the last."""
    f = lambda z: 1.0 / (1.0 + math.exp(-(z - mid) / width))  # noqa: E731
    lo, hi = f(0.0), f(1.0)
    return (f(x) - lo) / (hi - lo)


def cap_share(w: WorkloadConfig, step: int, steps: int) -> float:
    """The share of responses at the length cap at ``step``: ``cap_share``, or linear to ``cap_share_end``."""
    if w.cap_share_end is None:
        return w.cap_share
    return w.cap_share + (w.cap_share_end - w.cap_share) * step / max(1, steps - 1)


def task_weights(w: WorkloadConfig, step: int) -> np.ndarray:
    """The task mix in force at ``step`` (normalised): the entry of ``task_weights`` with the largest key <= step."""
    at = max(k for k in w.task_weights if k <= step)
    ws = np.asarray(w.task_weights[at], dtype=np.float64)
    return ws / ws.sum()


def accuracy(w: WorkloadConfig, step: int, steps: int) -> float:
    """Mean per-prompt success probability at ``step`` (dynamic sampling)."""
    d = w.dynamic_sampling
    if d.accuracy_by_step:
        return d.accuracy_by_step[min(step, len(d.accuracy_by_step) - 1)]
    return d.accuracy_start + (d.accuracy_end - d.accuracy_start) * step / max(1, steps - 1)


@dataclass(frozen=True)
class Batch:
    lengths: np.ndarray  # every generated response's length, dispatch order (float64; prompt order, G per prompt)
    prompt_tokens: int  # sum over the generated prompts (prefilled once each; the G responses share the prefix)
    prompt_mean: float  # mean over the generated prompts
    tokens_generated: int  # every generated response token (kept or dropped)
    tokens_trained: int  # prompt + response tokens of every kept sample (response only: trained_tokens=response)
    samples: int  # kept (trained) samples
    prompt_index: np.ndarray  # per response: index of its prompt (int64, non-decreasing)
    prompt_lengths: np.ndarray  # per generated prompt: its length in tokens (float64)
    kept: np.ndarray  # per response: trained (bool); whole groups
    prompt_task: np.ndarray  # per generated prompt: its task (int64; 0 without a task mix)
    prompt_correct: np.ndarray  # per generated prompt: responses rewarded 1 (int64; dynamic sampling only, else -1)

    @property
    def prompts_generated(self) -> int:
        return len(self.prompt_lengths)

    @property
    def group_size(self) -> int:
        return len(self.lengths) // len(self.prompt_lengths)

    @property
    def groups_kept(self) -> int:
        return int(np.count_nonzero(self.kept)) // self.group_size


def _draw(w: WorkloadConfig, rng: np.random.Generator, n: int, step: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths (n x G, flat), prompt lengths (n) and tasks (n) of n prompts. Without a task mix and a cap share the
    draws are the plain model's: n x G lognormal lengths, then n lognormal prompt lengths, in that order."""
    G, cap = w.responses_per_prompt, w.max_response_tokens
    ps = w.prompt_tokens_sigma
    if w.tasks:
        task = rng.choice(len(w.tasks), size=n, p=task_weights(w, step))
        mean = np.array([t.response_tokens_mean for t in w.tasks])[task]
        sig = np.array([t.response_sigma for t in w.tasks])[task]
        pmean = np.array([t.prompt_tokens_mean or w.prompt_tokens_mean for t in w.tasks])[task]
        mu_r, sg_r = np.repeat(np.log(mean) - sig * sig / 2, G), np.repeat(sig, G)
        lengths = np.minimum(np.maximum(np.rint(rng.lognormal(mu_r, sg_r)), 1), cap)
        prompts = np.maximum(np.rint(rng.lognormal(np.log(pmean) - ps * ps / 2, ps)), 1)
    else:
        task = np.zeros(n, dtype=np.int64)
        mean = mean_response(w, step, steps)
        s = w.response_sigma
        lengths = np.minimum(np.maximum(np.rint(rng.lognormal(math.log(mean) - s * s / 2, s, n * G)), 1), cap)
        if w.response_tokens_by_step:  # an observed mean: rescale the draw so the step generates that many tokens
            target = mean * len(lengths)
            for _ in range(6):  # a few passes: lengths at the cap cannot take their share of an upward rescale
                lengths = np.minimum(np.maximum(np.rint(lengths * (target / lengths.sum())), 1), cap)
        prompts = np.maximum(np.rint(rng.lognormal(math.log(w.prompt_tokens_mean) - ps * ps / 2, ps, n)), 1)
    share = cap_share(w, step, steps)
    if share > 0:
        lengths[rng.random(n * G) < share] = cap
    return lengths, prompts, task.astype(np.int64)


def informative(correct: np.ndarray, group_size: int) -> np.ndarray:
    """The dynamic-sampling rule: a group is kept iff its rewards are not all equal (0 < correct < G)."""
    return (correct > 0) & (correct < group_size)


def _correct(w: WorkloadConfig, rng: np.random.Generator, lengths: np.ndarray, p_acc: float) -> np.ndarray:
    """Per prompt of one chunk: how many of its G responses are rewarded 1."""
    d, G = w.dynamic_sampling, w.responses_per_prompt
    n = len(lengths) // G
    a = min(max(p_acc, 1e-9), 1 - 1e-9)
    p = rng.beta(a * d.difficulty_concentration, (1 - a) * d.difficulty_concentration, n)
    reward = rng.random((n, G)) < p[:, None]
    if d.truncated_fails:
        reward &= lengths.reshape(n, G) < w.max_response_tokens
    return reward.sum(axis=1).astype(np.int64)


def _trace_batch(w: WorkloadConfig, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Step ``step`` of the trace ``w.trace`` (dynaresize.sim.trace): every logged sample, kept, lengths scaled."""
    from dynaresize.sim.trace import load_trace, scaled

    ts = load_trace(w.trace).steps[step]
    lengths, prompts = scaled(ts.response_tokens, w.trace_token_scale), scaled(ts.prompt_tokens, w.trace_token_scale)
    return (lengths, prompts, np.zeros(len(prompts), dtype=np.int64), np.ones(len(lengths), dtype=bool),
            np.full(len(prompts), -1, dtype=np.int64))


def make_batch(w: WorkloadConfig, seed: int, step: int, steps: int) -> Batch:
    B, G = w.prompts_per_step, w.responses_per_prompt
    d = w.dynamic_sampling
    rng = np.random.default_rng([seed, step])
    if w.trace is not None:
        lengths, prompts, task, kept, correct = _trace_batch(w, step)
        G = len(lengths) // len(prompts)  # the trace's group size, not responses_per_prompt
    elif not d.enabled:
        lengths, prompts, task = _draw(w, rng, B, step, steps)
        kept = np.ones(len(lengths), dtype=bool)
        correct = np.full(len(prompts), -1, dtype=np.int64)
    else:
        chunk = max(1, math.ceil(d.round_prompts_factor * B))
        limit = max(B, math.floor(d.max_oversample * B))
        acc = accuracy(w, step, steps)
        parts: list[tuple[np.ndarray, ...]] = []
        have, made, c = 0, 0, 0
        while have < B and made < limit:
            r = rng if c == 0 else np.random.default_rng([seed, step, c])
            n = min(chunk, limit - made)
            L, P, T = _draw(w, r, n, step, steps)
            C = _correct(w, r, L, acc)
            ok = informative(C, G)
            keep = ok & (np.cumsum(ok) <= B - have)  # the first kept groups in prompt order
            if d.mode == "stream" and have + int(ok.sum()) >= B:  # stop at the prompt that completes the batch
                n = int(np.flatnonzero(np.cumsum(ok) == B - have)[0]) + 1
                L, P, T, C, keep = L[: n * G], P[:n], T[:n], C[:n], keep[:n]
            parts.append((L, P, T, keep, C))
            have += int(keep.sum())
            made += n
            c += 1
        lengths = np.concatenate([p[0] for p in parts])
        prompts = np.concatenate([p[1] for p in parts])
        task = np.concatenate([p[2] for p in parts])
        kept = np.repeat(np.concatenate([p[3] for p in parts]), G)
        correct = np.concatenate([p[4] for p in parts])
    n_prompts = len(prompts)
    pidx = np.repeat(np.arange(n_prompts, dtype=np.int64), G)
    gen = int(lengths.sum())
    n_kept = int(kept.sum())
    trained = int(lengths[kept].sum())
    if w.trained_tokens == "sequence":
        trained += int(prompts[pidx[kept]].sum())
    return Batch(
        lengths=lengths,
        prompt_tokens=int(prompts.sum()),
        prompt_mean=float(prompts.mean()),
        tokens_generated=gen,
        tokens_trained=trained,
        samples=n_kept,
        prompt_index=pidx,
        prompt_lengths=prompts.astype(np.float64),
        kept=kept,
        prompt_task=task,
        prompt_correct=correct,
    )
