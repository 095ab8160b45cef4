"""GRPO: group-relative advantages and the clipped policy-gradient loss (with an optional k3 KL to a reference).

Per-token tensors are ``[N, L]`` and aligned with ``input_ids``: position ``t`` holds ``log p(input_ids[t] |
input_ids[:t])``; ``response_mask`` is 1 on response tokens (the sampled answer and its EOS), 0 on prompt and pad.

Worked example (hand-computed; the same numbers are in tests/unit/test_grpo.py). One group of 4 responses, rewards
``[1, 0, 0, 1]``: mean 0.5, sample std (n-1) ``sqrt(1/3) = 0.5774``, advantages ``[+0.866, -0.866, -0.866,
+0.866]``. For a token with advantage ``A = 1`` and ``clip_eps = 0.2``:

* new/old ratio 1.5: ``-min(1.5 * 1, 1.2 * 1) = -1.2`` (clipped: no incentive to push further);
* ratio 0.5: ``-min(0.5, 0.8) = -0.5`` (unclipped: the gradient still pulls it back up).

With ``A = -1`` the roles swap: ratio 1.5 gives ``-min(-1.5, -1.2) = 1.5``, ratio 0.5 gives ``0.8``.
k3 KL with ``logp - ref = 0.1``: ``exp(-0.1) + 0.1 - 1 = 0.004837``.

Clip-higher (DAPO, arXiv 2503.14476, section 3.1): the ratio is clipped to ``[1 - clip_eps_low, 1 + clip_eps_high]``;
a larger upper bound lets low-probability tokens with a positive advantage grow (against entropy collapse).
DAPO uses ``clip_eps_low = 0.2, clip_eps_high = 0.28``. With those and ``A = 1``: ratio 1.5 gives
``-min(1.5, 1.28) = -1.28``; with ``A = -1``: ratio 0.5 gives ``-min(-0.5, -0.8) = 0.8``, ratio 1.5 gives ``1.5``.
Both bounds default to ``clip_eps`` (the symmetric PPO/GRPO clip).

Loss normalisation (``loss_norm``): ``token`` (the default, and DAPO's "token-level policy gradient loss", section
3.3) sums the per-token loss over every response token of the whole batch and divides by that batch's token
count (``loss_denominator``, set by the trainer ranks to the global count); ``sequence`` averages per sequence,
then over sequences (the original GRPO). The options of this module change neither.

Truncated importance sampling (``tis_cap``, ``algorithm.tis``): the ratio is taken against this forward's own
logprobs (detached) instead of the rollout's, and each token's surrogate is weighted by ``min(pi_train /
pi_rollout, tis_cap)``; worked example and sources in ``dynaresize.rl.mismatch``. Off (the default) the loss is the
one above, bit for bit. Either way the metrics carry the rollout/trainer mismatch sums of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dynaresize.rl.mismatch import TisLevel, mismatch_stats, tis_stats, tis_weights

CollatedBatch = dict[str, torch.Tensor]  # what dynaresize.rl.batch.collate returns


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` per consecutive group of ``group_size`` (std with n-1, like verl/TRL).

    ``scale_by_std=False`` returns ``r - mean_group`` (Dr. GRPO). A group of one, or one with equal rewards,
    gets advantage 0. Returns a flat float tensor of ``len(rewards)``.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.flatten()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding (left or right), as HF generate computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probabilities ``[N, L]`` of ``input_ids`` under a causal LM; 0 where ``response_mask`` is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    tok = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(tok, (1, 0)) * response_mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor, norm: Literal["token", "sequence"], denominator=None) -> torch.Tensor:
    """``token``: sum over all masked tokens / their count; ``sequence``: mean per sequence, then mean.

    ``denominator`` (optional) replaces the local count (tokens or sequences): pass the global batch's count so
    that micro-batches and data-parallel shards add up to the full-batch loss.
    """
    if norm == "token":
        den = mask.sum() if denominator is None else denominator
        return (x * mask).sum() / torch.clamp(torch.as_tensor(den, dtype=x.dtype), min=1)
    per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    den = per_seq.numel() if denominator is None else denominator
    return per_seq.sum() / max(float(den), 1.0)


@dataclass(frozen=True)
class GrpoLoss:
    """``loss_fn(model, batch) -> (loss, metrics)``; see ``dynaresize.rl`` for the batch keys."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    loss_norm: Literal["token", "sequence"] = "token"
    temperature: float = 1.0
    clip_eps_low: float | None = None  # lower clip: ratio >= 1 - clip_eps_low (None: clip_eps)
    clip_eps_high: float | None = None  # upper clip: ratio <= 1 + clip_eps_high (None: clip_eps)
    tis_cap: float | None = None  # truncated importance sampling on pi_train / pi_rollout, capped here (None: off)
    tis_level: TisLevel = "token"  # TIS weight per token or per sequence (dynaresize.rl.mismatch)

    @classmethod
    def from_config(cls, train, temperature: float = 1.0, algorithm=None) -> "GrpoLoss":
        """From a ``TrainConfig`` (and the rollout temperature, so logprobs match the sampling distribution) and,
        for TIS, the ``AlgorithmConfig`` (``algorithm.tis``)."""
        tis = getattr(algorithm, "tis", None)
        on = tis is not None and tis.enabled
        return cls(clip_eps=train.clip_eps, kl_coef=train.kl_coef, loss_norm=train.loss_norm, temperature=temperature,
                   clip_eps_low=train.clip_eps_low, clip_eps_high=train.clip_eps_high,
                   tis_cap=float(tis.cap) if on else None, tis_level=tis.level if on else "token")

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(1 - low, 1 + high)``: the ratio interval outside which the surrogate stops pulling."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return 1 - low, 1 + high

    def __call__(self, model: torch.nn.Module, batch: CollatedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["response_mask"].float()
        logp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, self.temperature)
        return self.from_logprobs(logp, batch)

    def from_logprobs(self, logp: torch.Tensor, batch: CollatedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss given current per-token logprobs (pure tensor maths; what the tests check by hand)."""
        mask = batch["response_mask"].float()
        adv = batch["advantages"].float()
        adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
        behaviour = batch["old_logprobs"]
        if self.tis_cap is not None:  # decoupled PPO: the ratio against pi_train (this forward), TIS on the rest
            weights = tis_weights(logp, behaviour, mask, self.tis_cap, self.tis_level)
            log_ratio = (logp - logp.detach()) * mask
        else:
            log_ratio = (logp - behaviour) * mask
        ratio = torch.exp(log_ratio)
        lo, hi = self.clip_range
        clipped = torch.clamp(ratio, lo, hi)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if self.tis_cap is not None:
            per_token = per_token * weights
        clip_frac = ((ratio * adv > clipped * adv).float() * mask).sum() / mask.sum().clamp(min=1)
        kl = torch.zeros((), dtype=per_token.dtype)
        if self.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise KeyError("GrpoLoss: kl_coef > 0 needs batch['ref_logprobs'] (reference policy logprobs)")
            d = (batch["ref_logprobs"] - logp) * mask
            kl_tok = torch.exp(d) - d - 1
            per_token = per_token + self.kl_coef * kl_tok
            kl = masked_mean(kl_tok.detach(), mask, self.loss_norm)
        loss = masked_mean(per_token, mask, self.loss_norm, batch.get("loss_denominator"))
        metrics = {
            "loss": float(loss.detach()),
            "clip_frac": float(clip_frac),
            "ratio_mean": float((ratio.detach() * mask).sum() / mask.sum().clamp(min=1)),
            "kl": float(kl),
            "tokens": float(mask.sum()),
            **mismatch_stats(logp, behaviour, mask, batch.get("version_lag")),
        }
        if self.tis_cap is not None:
            metrics.update(tis_stats(logp, behaviour, mask, weights, self.tis_cap, self.tis_level))
        return loss, metrics
