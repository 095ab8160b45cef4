"""GRPO maths shared by the coordinator (advantages) and the trainers (loss), plus a single-process reference loop.

The loss-function contract (what a training engine, e.g. the DeepSpeed adapter, calls)::

    loss_fn(model, batch) -> (loss, metrics)
    loss_fn = GrpoLoss.from_config(cfg.train, temperature=cfg.rollout.temperature)

``loss`` is a scalar tensor to backpropagate; ``metrics`` a dict of floats (loss, clip_frac, ratio_mean, kl, tokens,
and the training-inference mismatch sums ``mismatch_*`` / ``tis_*`` of ``dynaresize.rl.mismatch``).
``batch`` is a dict of tensors on the model's device, built by ``collate`` (right-padded, N sequences, width L):

=================  ==========  ===========================================================================
key                shape       meaning
=================  ==========  ===========================================================================
input_ids          [N, L] long prompt (BOS first) then response (EOS last if it ended), then pad
attention_mask     [N, L] long 1 on real tokens
response_mask      [N, L] f32  1 on response tokens (the ones the loss covers)
old_logprobs       [N, L] f32  behaviour policy's logprob of input_ids[:, t] (from the rollout), 0 elsewhere
advantages         [N] f32     per sequence, from ``group_advantages`` (or [N, L] per token)
ref_logprobs       [N, L] f32  reference policy's logprobs; required when kl_coef > 0 (``WithReference``
                               in ``dynaresize.rl.reference`` fills them from the initial policy)
loss_denominator   [] f32      optional: the GLOBAL count (tokens for loss_norm=token, sequences for
                               loss_norm=sequence) replacing the local one, so micro-batches and ranks add up
version_lag        [N] long    optional: trainer version - the sample's version (0: the mismatch figures of
                               that sample compare the same weights; ``dynaresize.rl.mismatch``)
=================  ==========  ===========================================================================

Batch-size invariance: with ``loss_denominator`` set to the global batch's count, the sum over micro-batches (and
over data-parallel ranks) of each loss equals the full-batch loss; an engine that averages gradients over ``dp``
ranks must then multiply the loss by ``dp`` (or sum gradients instead) to get the same update for any trainer count.
"""

from __future__ import annotations

import importlib

__all__ = ["GrpoLoss", "collate", "group_advantages", "masked_mean", "position_ids", "sequence_logprobs"]
_WHERE = {"collate": "dynaresize.rl.batch", **{n: "dynaresize.rl.grpo" for n in __all__ if n != "collate"}}


def __getattr__(name: str):
    """Lazy: ``dynaresize.rl.config`` is read by every config load, and importing torch there would start torch's
    threads before the Slurm entry blocks SIGTERM (a preemption's signal would then miss its watcher thread)."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
