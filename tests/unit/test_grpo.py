"""GRPO maths against hand-computed numbers (worked out in the comments), masks, normalisation and KL."""

from __future__ import annotations

import math

import pytest
import torch

from dynaresize.rl import GrpoLoss, collate, group_advantages, masked_mean

pytestmark = pytest.mark.unit


def test_advantages_one_group_hand_computed():
    # rewards [1, 0, 0, 1]: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    assert adv.tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)


def test_advantages_groups_are_independent_and_equal_rewards_give_zero():
    # group 2: [0, 0.3, 0.9]: mean 0.4, deviations -0.4 -0.1 0.5, var (0.16+0.01+0.25)/2 = 0.21, std 0.458258
    adv = group_advantages([0.5, 0.5, 0.5, 0.0, 0.3, 0.9], 3)
    assert adv.tolist() == pytest.approx([0, 0, 0, -0.872872, -0.218218, 1.091089], abs=1e-5)


def test_advantages_without_std_and_group_of_one():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], 4, scale_by_std=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([0.3, 0.9], 1).tolist() == [0.0, 0.0]


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1.0, 0.0, 1.0], 4)


def hand_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two sequences of width 4. seq0: A=+1, response at t=1,2 with ratios 1.5, 0.5 (t=3 is pad carrying garbage).
    seq1: A=-1, response at t=1,2,3 with ratios 1.5, 0.5, 1.0."""
    ln = math.log
    old = torch.tensor([[0.0, -1.0, -2.0, -5.0], [0.0, -1.0, -2.0, -3.0]])
    new = torch.tensor([[0.0, -1.0 + ln(1.5), -2.0 + ln(0.5), 3.0], [0.0, -1.0 + ln(1.5), -2.0 + ln(0.5), -3.0]])
    batch = {
        "response_mask": torch.tensor([[0.0, 1, 1, 0], [0.0, 1, 1, 1]]),
        "old_logprobs": old,
        "advantages": torch.tensor([1.0, -1.0]),
    }
    return new, batch


# Per token -min(r*A, clip(r, 0.8, 1.2)*A):
#   seq0 (A=+1): r=1.5 -> -1.2 (clipped), r=0.5 -> -0.5
#   seq1 (A=-1): r=1.5 -> +1.5, r=0.5 -> +0.8 (clipped), r=1.0 -> +1.0
# token norm: (-1.2 - 0.5 + 1.5 + 0.8 + 1.0) / 5 = 1.6 / 5 = 0.32
# sequence norm: mean(-1.7 / 2, 3.3 / 3) = mean(-0.85, 1.1) = 0.125
def test_clipped_loss_token_norm_hand_computed():
    new, batch = hand_batch()
    loss, m = GrpoLoss(clip_eps=0.2, loss_norm="token").from_logprobs(new, batch)
    assert float(loss) == pytest.approx(0.32, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)  # seq0 t1 and seq1 t2 are on the clipped branch
    assert m["tokens"] == 5


def test_clipped_loss_sequence_norm_hand_computed():
    new, batch = hand_batch()
    loss, _ = GrpoLoss(clip_eps=0.2, loss_norm="sequence").from_logprobs(new, batch)
    assert float(loss) == pytest.approx(0.125, abs=1e-6)


def test_global_denominator_replaces_local_count():
    new, batch = hand_batch()
    loss, _ = GrpoLoss(loss_norm="token").from_logprobs(new, {**batch, "loss_denominator": torch.tensor(10.0)})
    assert float(loss) == pytest.approx(0.16, abs=1e-6)  # 1.6 / 10
    # two half-batches with the global denominator add up to the full-batch loss
    halves = [{k: v[i : i + 1] for k, v in batch.items()} | {"loss_denominator": torch.tensor(5.0)} for i in (0, 1)]
    parts = [GrpoLoss().from_logprobs(new[i : i + 1], h)[0] for i, h in enumerate(halves)]
    assert float(sum(parts)) == pytest.approx(0.32, abs=1e-6)


def test_gradient_is_zero_on_clipped_tokens_and_ratio_weighted_elsewhere():
    new, batch = hand_batch()
    new.requires_grad_(True)
    GrpoLoss(clip_eps=0.2).from_logprobs(new, batch)[0].backward()
    # d/dlogp of -r*A / 5 = -A*r/5 where unclipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, 0.0, -0.5 / 5, 0.0], [0.0, 1.5 / 5, 0.0, 1.0 / 5]])
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_k3_kl_term_hand_computed():
    new, batch = hand_batch()
    batch["ref_logprobs"] = (new - 0.1) * batch["response_mask"]
    # k3 with ref - logp = -0.1: exp(-0.1) + 0.1 - 1 = 0.0048374; token loss 0.32 + 0.1 * 0.0048374
    loss, m = GrpoLoss(kl_coef=0.1).from_logprobs(new, batch)
    assert m["kl"] == pytest.approx(0.0048374, abs=1e-6)
    assert float(loss) == pytest.approx(0.32 + 0.1 * 0.0048374, abs=1e-6)


def test_kl_without_reference_logprobs_is_a_clear_error():
    new, batch = hand_batch()
    with pytest.raises(KeyError, match="ref_logprobs"):
        GrpoLoss(kl_coef=0.1).from_logprobs(new, batch)


def test_masked_mean_ignores_empty_sequences():
    x = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert float(masked_mean(x, mask, "token")) == 3.0
    assert float(masked_mean(x, mask, "sequence")) == 1.5  # (3 + 0) / 2 sequences


def test_collate_aligns_response_logprobs_after_the_prompt():
    b = collate([[1, 7], [1, 8, 9]], [[5, 2], [6]], pad_id=0, old_logprobs=[[-0.5, -0.25], [-1.0]], advantages=[1.0, -1.0])
    assert b["input_ids"].tolist() == [[1, 7, 5, 2], [1, 8, 9, 6]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert b["old_logprobs"].tolist() == [[0, 0, -0.5, -0.25], [0, 0, 0, -1.0]]
    b = collate([[1]], [[5, 6, 2]], pad_id=0)
    with pytest.raises(ValueError, match="sample 0: 1 old_logprobs for 2 response tokens"):
        collate([[1]], [[5, 2]], pad_id=0, old_logprobs=[[-1.0]])


def test_from_config_reads_train_section():
    from dynaresize.worker.config import TrainConfig

    loss = GrpoLoss.from_config(TrainConfig(clip_eps=0.1, kl_coef=0.01, loss_norm="sequence"), temperature=0.7)
    assert loss == GrpoLoss(clip_eps=0.1, kl_coef=0.01, loss_norm="sequence", temperature=0.7)
