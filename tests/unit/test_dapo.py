"""DAPO options (arXiv 2503.14476) as pure functions, with hand-computed values: clip-higher in the GRPO loss, soft
overlong punishment, dynamic-sampling group selection and its round plan, and the bad configs they refuse."""

from __future__ import annotations

import math
import random

import pytest
import torch
import yaml

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.job.filtering import BatchAssembler, UnfilledBatchError
from dynaresize.contract.workqueue import SampleResult, WorkItem
from dynaresize.rl import GrpoLoss
from dynaresize.rl.dapo import OverlongShaping, informative, next_round_prompts, overlong_penalty, select_groups

pytestmark = pytest.mark.unit


def one_token_batch(ratio: float, adv: float) -> tuple[torch.Tensor, dict]:
    """A batch of one sequence with one response token whose new/old ratio is ``ratio``."""
    batch = {
        "response_mask": torch.tensor([[0.0, 1.0]]),
        "old_logprobs": torch.tensor([[0.0, 0.0]]),
        "advantages": torch.tensor([adv]),
    }
    logp = torch.tensor([[0.0, math.log(ratio)]])
    return logp, batch


# ----------------------------------------------------------------------------------------------------------
# clip-higher


@pytest.mark.parametrize("ratio,adv,want", [
    (1.5, 1.0, -1.28),  # clipped at 1 + 0.28 (not 1.2): a rare good token may grow further
    (1.1, 1.0, -1.1),  # inside the wider upper range: unclipped
    (0.5, 1.0, -0.5),  # below 1 - 0.2 with A > 0: min picks the unclipped term
    (0.5, -1.0, 0.8),  # clipped at 1 - 0.2
    (0.75, -1.0, 0.8),
    (1.5, -1.0, 1.5),  # A < 0, ratio above: unclipped
])
def test_asymmetric_clip_by_hand(ratio, adv, want):
    loss_fn = GrpoLoss(clip_eps=0.2, clip_eps_low=0.2, clip_eps_high=0.28)
    logp, batch = one_token_batch(ratio, adv)
    loss, metrics = loss_fn.from_logprobs(logp, batch)
    assert float(loss) == pytest.approx(want, abs=1e-6)


def test_the_symmetric_key_is_the_default_of_both_bounds():
    assert GrpoLoss(clip_eps=0.3).clip_range == pytest.approx((0.7, 1.3))
    assert GrpoLoss(clip_eps=0.3, clip_eps_high=0.28).clip_range == pytest.approx((0.7, 1.28))
    assert GrpoLoss(clip_eps=0.3, clip_eps_low=0.1).clip_range == pytest.approx((0.9, 1.3))
    for ratio, adv in [(1.5, 1.0), (0.5, -1.0), (1.05, 1.0)]:  # the same numbers as before the new keys existed
        logp, batch = one_token_batch(ratio, adv)
        sym = GrpoLoss(clip_eps=0.2).from_logprobs(logp, batch)[0]
        both = GrpoLoss(clip_eps=0.9, clip_eps_low=0.2, clip_eps_high=0.2).from_logprobs(logp, batch)[0]
        assert float(sym) == float(both)


def test_clip_keys_come_from_the_config():
    cfg = load_config(None, ["train.clip_eps=0.25", "train.clip_eps_high=0.28"])
    loss_fn = GrpoLoss.from_config(cfg.train, cfg.rollout.temperature)
    assert loss_fn.clip_range == pytest.approx((0.75, 1.28))
    assert GrpoLoss.from_config(load_config(None, []).train).clip_range == pytest.approx((0.8, 1.2))


def test_token_level_normalisation_is_unchanged_by_the_clip_keys():
    # two sequences, 1 and 3 response tokens, every ratio 1: loss = -(sum of advantages per token) / 4 tokens
    batch = {"response_mask": torch.tensor([[1.0, 0, 0], [1.0, 1, 1]]), "old_logprobs": torch.zeros(2, 3),
             "advantages": torch.tensor([1.0, -1.0])}
    loss, _ = GrpoLoss(clip_eps_low=0.1, clip_eps_high=0.3).from_logprobs(torch.zeros(2, 3), batch)
    assert float(loss) == pytest.approx(-(1 - 3) / 4)
    loss_seq, _ = GrpoLoss(loss_norm="sequence", clip_eps_high=0.3).from_logprobs(torch.zeros(2, 3), batch)
    assert float(loss_seq) == pytest.approx(0.0)  # (-1 + 1) / 2 sequences


# ----------------------------------------------------------------------------------------------------------
# overlong shaping


@pytest.mark.parametrize("length,want", [(1, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0), (17, -1.0)])
def test_overlong_penalty_by_hand(length, want):
    assert overlong_penalty(length, max_tokens=16, buffer=4) == pytest.approx(want)


def test_overlong_factor_scales_the_penalty():
    assert overlong_penalty(14, 16, 4, factor=0.5) == pytest.approx(-0.25)
    assert OverlongShaping(16, 4, 2.0).penalty(16) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(3, 16, 0)


def test_overlong_shaping_is_off_unless_enabled():
    assert OverlongShaping.from_config(load_config(None, [])) is None
    on = OverlongShaping.from_config(load_config(None, ["algorithm.overlong.enabled=true", "algorithm.overlong.buffer=8",
                                                        "rollout.max_tokens=32"]))
    assert on == OverlongShaping(32, 8, 1.0)


# ----------------------------------------------------------------------------------------------------------
# dynamic sampling: selection by prompt order


def test_select_groups_worked_example():
    sel = select_groups([[1, 1], [0, 1], [0, 0], [1, 0], [0, 1]], need=2)
    assert sel.kept == (1, 3) and sel.dropped == (0, 2) and sel.surplus == (4,) and sel.full
    assert sel.trained == (1, 3)


def test_select_groups_pads_with_the_earliest_dropped_groups():
    sel = select_groups([[1, 1], [0, 0], [0, 1], [1, 1]], need=3, pad=True)
    assert sel.kept == (2,) and sel.dropped == (0, 1, 3) and sel.filler == (0, 1) and not sel.full
    assert sel.trained == (0, 1, 2)
    assert select_groups([[1, 1], [0, 1]], need=2, pad=False).trained == (1,)


def test_a_group_is_informative_when_its_rewards_differ():
    assert informative([0.0, 0.5]) and not informative([0.3, 0.3, 0.3]) and not informative([1.0])


@pytest.mark.parametrize("kept,rounds_done,want", [(3, 0, 4), (4, 0, 0), (5, 1, 0), (0, 1, 4), (0, 2, 0)])
def test_next_round_is_bounded_by_max_rounds(kept, rounds_done, want):
    assert next_round_prompts(kept, need=4, rounds_done=rounds_done, max_rounds=2, round_prompts=4) == want


class FakeTokenizer:
    """Token i decodes to the letter chr(ord('a') + i); 0 is EOS (a special token, dropped by decode)."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 1) for i in ids if i != 0)


class FirstLetterTask:
    """Reward 1 when the response starts with 'a' (token 1), else 0: a binary reward."""

    def reward(self, prompt: str, response: str) -> float:
        return 1.0 if response.startswith("a") else 0.0


def items_of(step: int, prompts: range, group: int) -> list[WorkItem]:
    return [WorkItem(step, p, i, [5, p], seed=0) for p in prompts for i in range(group)]


def results_of(items: list[WorkItem], rewarded: dict[str, bool], length: int = 2) -> list[SampleResult]:
    out = []
    for it in items:
        first = 1 if rewarded.get(it.key) else 2
        ids = [first] + [3] * (length - 1)
        out.append(SampleResult(it.step, it.prompt, it.index, ids, [-0.5] * len(ids), version=it.step, rank=9))
    return out


def assembler(**kw) -> BatchAssembler:
    base = dict(task=FirstLetterTask(), tokenizer=FakeTokenizer(), need=2, group=2, bound=1, filtering=True,
                max_rounds=2, round_prompts=2, pad=True)
    return BatchAssembler(**{**base, **kw})


def test_assembler_plans_rounds_and_keeps_groups_by_prompt_order():
    a = assembler()
    items = items_of(3, range(2), 2)
    texts = ["p0", "p1"]
    # prompt 0: both rewarded (dropped); prompt 1: one rewarded (kept) -> one more round of 2 prompts
    rewarded = {"3.0.0": True, "3.0.1": True, "3.1.0": True}
    assert a.next_round(3, items, texts, results_of(items, rewarded)) == 2
    more = items_of(3, range(2, 4), 2)
    rewarded |= {"3.2.1": True, "3.3.0": True}  # prompts 2 and 3 both informative: 3 is surplus
    items, texts = items + more, texts + ["p2", "p3"]
    samples = results_of(items, rewarded)
    assert a.next_round(3, items, texts, samples) == 0
    random.Random(0).shuffle(samples)  # arrival order is irrelevant
    batch, stats = a.build(3, items, texts, samples)
    assert batch.keys == ["3.1.0", "3.1.1", "3.2.0", "3.2.1"]
    assert batch.rewards == [1.0, 0.0, 0.0, 1.0]
    assert stats.groups_generated == 4 and stats.groups_kept == 2 and stats.groups_dropped == 1
    assert stats.groups_filler == 0 and stats.rounds == 1


def test_assembler_pads_or_fails_when_the_rounds_run_out():
    items = items_of(0, range(6), 2)  # 2 + 2 rounds x 2 prompts, only prompt 4 informative
    texts = [f"p{p}" for p in range(6)]
    samples = results_of(items, {"0.4.0": True, "0.1.0": True, "0.1.1": True})
    a = assembler()
    assert a.next_round(0, items, texts, samples) == 0  # max_rounds reached
    batch, stats = a.build(0, items, texts, samples)
    assert batch.keys == ["0.0.0", "0.0.1", "0.4.0", "0.4.1"]  # filler: prompt 0, the earliest dropped
    assert batch.advantages[:2] == [0.0, 0.0] and stats.groups_filler == 1
    with pytest.raises(UnfilledBatchError, match=r"found 1 of 2 groups with unequal rewards in 6 prompts"):
        assembler(pad=False).build(0, items, texts, samples)


def test_assembler_applies_overlong_shaping_before_filtering():
    # both responses score 1, but one is 4 tokens long with L_max 4, buffer 2: reward 1 - 1 = 0 -> informative
    a = assembler(need=1, overlong=OverlongShaping(4, 2, 1.0))
    items = items_of(0, range(1), 2)
    samples = results_of(items, {"0.0.0": True, "0.0.1": True})
    samples[1] = SampleResult(0, 0, 1, [1, 3, 3, 3], [-0.1] * 4, version=0, rank=1)
    batch, stats = a.build(0, items, ["p0"], samples)
    assert batch.rewards == [1.0, 0.0] and stats.score_mean == 1.0 and stats.overlong_penalty_mean == pytest.approx(-0.5)


def test_without_filtering_every_group_is_trained_in_prompt_order():
    a = assembler(filtering=False, need=2)
    items = items_of(1, range(2), 2)
    samples = results_of(items, {})
    assert a.next_round(1, items, ["p0", "p1"], samples) == 0
    batch, stats = a.build(1, items, ["p0", "p1"], list(reversed(samples)))
    assert batch.keys == ["1.0.0", "1.0.1", "1.1.0", "1.1.1"]
    assert stats.rounds is None and set(stats.as_dict()) == {"score_mean", "reward_mean", "overlong_penalty_mean"}


# ----------------------------------------------------------------------------------------------------------
# bad configs: one line naming the file, the key and the value


BAD = [
    ({"rollout": {"group_size": 1}, "algorithm": {"dynamic_sampling": {"enabled": True}}},
     "algorithm.dynamic_sampling.enabled = True", "needs rollout.group_size >= 2"),
    ({"rollout": {"max_tokens": 8}, "algorithm": {"overlong": {"enabled": True, "buffer": 8}}},
     "algorithm.overlong.buffer = 8", "allowed: 1..7"),
    ({"train": {"clip_eps_low": 1.0}}, "train.clip_eps_low = 1.0", "less than 1"),
    ({"train": {"clip_eps_high": -0.1}}, "train.clip_eps_high = -0.1", "greater than or equal to 0"),
    ({"algorithm": {"dynamic_sampling": {"max_rounds": 0}}}, "algorithm.dynamic_sampling.max_rounds = 0", "greater than or equal to 1"),
    ({"algorithm": {"dynamic_sampling": {"on_unfilled": "skip"}}}, "algorithm.dynamic_sampling.on_unfilled = 'skip'", "'pad' or 'fail'"),
    ({"algorithm": {"dynamic_sampling": {"rounds": 3}}}, "algorithm.dynamic_sampling.rounds = 3", "unknown key"),
    ({"metrics": {"tensorboard": "yes please"}}, "metrics.tensorboard = 'yes please'", "valid boolean"),
    ({"metrics": {"wandb": {"online": True}}}, "metrics.wandb.online = True", "unknown key"),
]


@pytest.mark.parametrize("content,named,says", BAD, ids=[b[1].split(" = ")[0] for b in BAD])
def test_bad_algorithm_and_metrics_configs(tmp_path, content, named, says):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(content))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"invalid config: {f}: {named}: "), msg
    assert says in msg


# ----------------------------------------------------------------------------------------------------------
# KL to the reference policy


class BigramLM(torch.nn.Module):
    """A tiny causal LM: logits of the next token from the current one (an embedding table), HF-style output."""

    def __init__(self, vocab: int = 6, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return type("Out", (), {"logits": self.table(input_ids)})()


def test_with_reference_fills_ref_logprobs_and_adds_the_k3_kl():
    from dynaresize.rl import collate, sequence_logprobs
    from dynaresize.rl.reference import WithReference, frozen

    policy, ref = BigramLM(seed=1), frozen(BigramLM(seed=2))
    batch = collate([[1, 2], [3]], [[4, 5, 0], [2]], pad_id=0, old_logprobs=[[-1.0] * 3, [-1.0]], advantages=[1.0, -1.0])
    mask = batch["response_mask"]
    with torch.no_grad():
        logp = sequence_logprobs(policy, batch["input_ids"], batch["attention_mask"], mask)
        ref_lp = sequence_logprobs(ref, batch["input_ids"], batch["attention_mask"], mask)
    d = (ref_lp - logp) * mask
    want_kl = float(((torch.exp(d) - d - 1) * mask).sum() / mask.sum())
    loss_fn = GrpoLoss(kl_coef=0.1)
    loss, m = WithReference(loss_fn, ref)(policy, batch)
    assert m["kl"] == pytest.approx(want_kl, rel=1e-5) and m["kl"] > 0
    no_kl, _ = GrpoLoss(kl_coef=0.0)(policy, batch)
    assert float(loss.detach() - no_kl.detach()) == pytest.approx(0.1 * want_kl, rel=1e-4)
    loss.backward()  # the gradient reaches the policy, never the frozen reference
    assert policy.table.weight.grad is not None and ref.table.weight.grad is None
    _, same = WithReference(loss_fn, frozen(BigramLM(seed=1)))(BigramLM(seed=1), batch)
    assert same["kl"] == 0.0  # at the start the policy is the reference
