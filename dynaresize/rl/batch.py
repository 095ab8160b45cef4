"""Pack prompts and sampled responses into the training batch the GRPO loss reads (right-padded, aligned).

Each sample is (prompt token ids incl. BOS, response token ids incl. EOS if it ended, behaviour logprobs of the
response tokens, advantage). The packed tensors follow the layout in ``dynaresize.rl``: ``old_logprobs[i, t]``
is the logprob of ``input_ids[i, t]``, so response logprobs land right after the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def collate(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[float] | torch.Tensor | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``response_mask`` (+ the optional per-token/per-seq keys)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    n, width = len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    resp = torch.zeros((n, width), dtype=torch.float32)
    per_token = {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    out_tok = {k: torch.zeros((n, width), dtype=torch.float32) for k, v in per_token.items() if v is not None}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        lp, lr = len(p), len(r)
        ids[i, : lp + lr] = torch.tensor([*p, *r], dtype=torch.long)
        attn[i, : lp + lr] = 1
        resp[i, lp : lp + lr] = 1
        for key, tensor in out_tok.items():
            values = per_token[key][i]
            if len(values) != lr:
                raise ValueError(f"sample {i}: {len(values)} {key} for {lr} response tokens")
            tensor[i, lp : lp + lr] = torch.as_tensor(values, dtype=torch.float32)
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp, **out_tok}
    if advantages is not None:
        batch["advantages"] = torch.as_tensor(advantages, dtype=torch.float32).flatten()
        if batch["advantages"].numel() != n:
            raise ValueError(f"{batch['advantages'].numel()} advantages for {n} samples")
    return batch
