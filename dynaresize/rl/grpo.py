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


Advantage = Literal["grpo", "grpo_no_std", "rloo"]  # ``algorithm.advantage``


def advantages(rewards, group_size: int, estimator: Advantage = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages of consecutive groups of ``group_size`` under ``estimator`` (``algorithm.advantage``;
    verl's ``algorithm.adv_estimator``):

    * ``grpo``: ``(r - mean) / (std + eps)``, std with n-1 (verl ``grpo``, ``norm_adv_by_std_in_grpo: true``);
    * ``grpo_no_std``: ``r - mean`` (Dr. GRPO, arXiv 2503.20783; verl ``norm_adv_by_std_in_grpo: false``);
    * ``rloo``: ``r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean)``, the leave-one-out baseline (Ahmadian et al.
      2024; verl ``rloo``).

    Worked example, rewards ``[1, 0, 0, 1]``: grpo ``[0.866, -0.866, -0.866, 0.866]``, grpo_no_std ``[0.5, -0.5,
    -0.5, 0.5]``, rloo ``[0.667, -0.667, -0.667, 0.667]`` (e.g. ``1 - (0 + 0 + 1) / 3``). A group of one has no
    baseline: advantage 0 under every estimator."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale_by_std=True, eps=eps)
    adv = group_advantages(rewards, group_size, scale_by_std=False)
    if estimator == "grpo_no_std":
        return adv
    if estimator == "rloo":
        return adv * (group_size / (group_size - 1)) if group_size > 1 else adv * 0.0
    raise ValueError(f"advantage estimator must be grpo, grpo_no_std or rloo, got {estimator!r}")


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
    return logprobs_and_entropy(model, input_ids, attention_mask, response_mask, temperature, entropy=False)[0]


def logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sequence_logprobs`` and, with ``entropy``, the policy's entropy ``-sum_v p(v) log p(v)`` of the distribution
    each token was drawn from (``[N, L]``, aligned the same way, at ``temperature``; verl's ``entropy_from_logits``
    on the temperature-scaled logits), from one forward."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    tok = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy:
        ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) * response_mask
    return torch.nn.functional.pad(tok, (1, 0)) * response_mask, ent


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
    entropy_coef: float = 0.0  # the loss subtracts entropy_coef x the token entropy (normalised like the loss)

    @classmethod
    def from_config(cls, train, temperature: float = 1.0, algorithm=None) -> "GrpoLoss":
        """From a ``TrainConfig`` (and the rollout temperature, so logprobs match the sampling distribution) and,
        for TIS, the ``AlgorithmConfig`` (``algorithm.tis``)."""
        tis = getattr(algorithm, "tis", None)
        on = tis is not None and tis.enabled
        return cls(clip_eps=train.clip_eps, kl_coef=train.kl_coef, loss_norm=train.loss_norm, temperature=temperature,
                   clip_eps_low=train.clip_eps_low, clip_eps_high=train.clip_eps_high,
                   tis_cap=float(tis.cap) if on else None, tis_level=tis.level if on else "token",
                   entropy_coef=float(getattr(train, "entropy_coef", 0.0)))

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(1 - low, 1 + high)``: the ratio interval outside which the surrogate stops pulling."""
        low = self.clip_eps if self.clip_eps_low is None else self.clip_eps_low
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        return 1 - low, 1 + high

    def __call__(self, model: torch.nn.Module, batch: CollatedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["response_mask"].float()
        logp, ent = logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"], mask, self.temperature)
        return self.from_logprobs(logp, batch, ent)

    def from_logprobs(self, logp: torch.Tensor, batch: CollatedBatch,
                      entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss given current per-token logprobs and (optional) token entropies (pure tensor maths; what the tests
        check by hand). With ``entropy_coef > 0`` each token's loss is ``surrogate - entropy_coef x entropy`` (verl's
        ``pg_loss - entropy_coeff x entropy``, aggregated the same way), so a gradient step raises the entropy."""
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
        if entropy is not None and self.entropy_coef > 0:
            per_token = per_token - self.entropy_coef * entropy
        elif self.entropy_coef > 0:
            raise ValueError("GrpoLoss: entropy_coef > 0 needs the token entropies (from_logprobs(..., entropy=))")
        loss = masked_mean(per_token, mask, self.loss_norm, batch.get("loss_denominator"))
        metrics = {
            "loss": float(loss.detach()),
            "clip_frac": float(clip_frac),
            "ratio_mean": float((ratio.detach() * mask).sum() / mask.sum().clamp(min=1)),
            "kl": float(kl),
            "tokens": float(mask.sum()),
            **({"entropy": float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))} if entropy is not None else {}),
            **mismatch_stats(logp, behaviour, mask, batch.get("version_lag")),
        }
        if self.tis_cap is not None:
            metrics.update(tis_stats(logp, behaviour, mask, weights, self.tis_cap, self.tis_level))
        return loss, metrics
