"""KL to a reference policy: the loss computes the reference's logprobs itself, on each trainer's micro-batch.

The reference is the initial policy (the model directory the run started from, as in GRPO, Shao et al.
arXiv 2402.03300, and verl's ``use_kl_loss``), frozen and held by every trainer rank beside the policy: its
logprobs of the batch's tokens go into ``batch["ref_logprobs"]`` before :class:`GrpoLoss` adds the k3 KL
``exp(ref - logp) - (ref - logp) - 1`` per token, weighted by ``train.kl_coef``. A rank that becomes a trainer
after a resize loads it from the same directory, so the KL term does not depend on which ranks train.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaresize.rl.grpo import CollatedBatch, GrpoLoss, sequence_logprobs


@dataclass(frozen=True)
class WithReference:
    """``loss_fn(model, batch)`` that fills ``ref_logprobs`` from ``reference`` (no gradient), then runs ``loss``."""

    loss: GrpoLoss
    reference: torch.nn.Module

    def __call__(self, model: torch.nn.Module, batch: CollatedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if "ref_logprobs" not in batch:
            mask = batch["response_mask"].float()
            with torch.no_grad():
                ref = sequence_logprobs(self.reference, batch["input_ids"], batch["attention_mask"], mask, self.loss.temperature)
            batch = {**batch, "ref_logprobs": ref}
        return self.loss(model, batch)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with no parameter requiring a gradient (the reference never trains)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
