"""verl's RL knobs, each against a direct computation: the advantage estimators, the entropy bonus and metric, the
LR schedule, mini-batch composition, top-k and greedy sampling (the processed distribution and its logprobs),
validation sampling settings, run.epochs, and the config rules that tie them together."""

from __future__ import annotations

import math

import pytest
import torch

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.rl.grpo import GrpoLoss, advantages
from dynaresize.rl.lr import LrSchedule
from dynaresize.rl.minibatch import MiniBatches, bounds

pytestmark = pytest.mark.unit


# -- algorithm.advantage ------------------------------------------------------------------------------------------

def direct_advantages(rewards: list[float], g: int, estimator: str) -> list[float]:
    out = []
    for lo in range(0, len(rewards), g):
        grp = rewards[lo:lo + g]
        mean = sum(grp) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (g - 1))
        for i, r in enumerate(grp):
            if estimator == "grpo":
                out.append((r - mean) / (std + 1e-6))
            elif estimator == "grpo_no_std":
                out.append(r - mean)
            else:  # leave-one-out: the mean of the group's other rewards
                out.append(r - (sum(grp) - r) / (g - 1))
    return out


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_each_advantage_estimator_equals_its_direct_computation(estimator):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(24, generator=g).round(decimals=1).tolist()
    got = advantages(torch.tensor(rewards), 4, estimator).tolist()
    assert got == pytest.approx(direct_advantages(rewards, 4, estimator), abs=1e-5)


def test_advantage_worked_example_and_a_group_of_one():
    r = [1.0, 0.0, 0.0, 1.0]
    assert advantages(r, 4, "grpo").tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert advantages(r, 4, "grpo_no_std").tolist() == [0.5, -0.5, -0.5, 0.5]
    assert advantages(r, 4, "rloo").tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    for est in ("grpo", "grpo_no_std", "rloo"):
        assert advantages([0.3, 0.9], 1, est).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="grpo, grpo_no_std or rloo"):
        advantages(r, 4, "gae")


def test_the_batch_assembler_uses_the_configured_estimator():
    from tests.unit.test_dapo import assembler, items_of, results_of

    items = items_of(3, range(2), 2)
    rewarded = {"3.0.0": True, "3.1.0": True}  # each group: rewards [1, 0]
    for est, want in (("grpo_no_std", [0.5, -0.5]), ("rloo", [1.0, -1.0])):
        batch, _ = assembler(filtering=False, advantage=est).build(3, items, ["p0", "p1"], results_of(items, rewarded))
        assert batch.advantages == pytest.approx(want * 2), est


# -- train.entropy_coef and the entropy metric ----------------------------------------------------------------------

def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def lm_batch():
    from dynaresize.rl.batch import collate

    return collate([[1, 5, 6], [1, 7]], [[9, 10, 2], [11, 2]], 0, [[-3.0] * 3, [-3.0] * 2], [1.0, -1.0])


def test_entropy_metric_and_bonus_equal_a_direct_computation():
    model, batch = tiny_lm(), lm_batch()
    temperature = 0.7
    with torch.no_grad():  # direct: -sum p log p of the distribution each response token was drawn from
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        logp = torch.log_softmax(logits / temperature, -1)
        ent = -(logp.exp() * logp).sum(-1)  # position t-1 predicts token t
        mask = batch["response_mask"]
        want = float((ent[:, :-1] * mask[:, 1:]).sum() / mask.sum())
    plain, m0 = GrpoLoss(temperature=temperature)(model, batch)
    bonus, m1 = GrpoLoss(temperature=temperature, entropy_coef=0.1)(model, batch)
    assert m0["entropy"] == pytest.approx(want, rel=1e-5) and m1["entropy"] == pytest.approx(want, rel=1e-5)
    assert float(bonus.detach()) == pytest.approx(float(plain.detach()) - 0.1 * want, rel=1e-5, abs=1e-6)
    bonus.backward()  # the bonus has a gradient (it is not detached)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_entropy_coef_is_read_from_the_config():
    cfg = load_config(None, ["train.entropy_coef=0.02"])
    assert GrpoLoss.from_config(cfg.train, 1.0, cfg.algorithm).entropy_coef == 0.02


# -- the LR schedule -----------------------------------------------------------------------------------------------

def test_lr_schedule_against_the_formula_and_the_worked_example():
    s = LrSchedule(1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, total_steps=6)
    assert [s(i) for i in range(6)] == pytest.approx([0.0, 5e-4, 1e-3, 8.682e-4, 5.5e-4, 2.318e-4], abs=1e-7)
    for i in range(2, 40):
        t = LrSchedule(2e-4, 3, "cosine", 0.05, 40)
        want = 2e-4 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (i - 3) / 37))) if i >= 3 else 2e-4 * i / 3
        assert t(i) == pytest.approx(want, rel=1e-12)
    assert [LrSchedule(1.0, 4)(i) for i in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]  # constant after warmup
    assert LrSchedule(1.0, 0, "cosine", 0.0, 10)(10) == pytest.approx(0.0, abs=1e-12)
    cfg = load_config(None, ["run.steps=5", "train.mini_batches=2", "train.epochs=3", "rollout.prompts_per_step=4"])
    assert LrSchedule.from_config(cfg.train, cfg.run.steps).total_steps == 30


# -- mini-batch composition ----------------------------------------------------------------------------------------

def rows(prompts: list[int], g: int = 2) -> list[tuple]:
    return [(f"7.{p}.{i}", [1], [2], [-1.0], 0.0, 6) for p in prompts for i in range(g)]


def test_mini_batches_follow_the_batchs_group_order_not_arrival():
    assert bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="6 groups do not split into 4"):
        bounds(6, 4)
    mb = MiniBatches(7, mini_batches=3, epochs=2, groups=6)
    mb.add(rows([3, 1]))
    assert mb.ready() == []  # mini-batch 0 needs groups 0 and 1
    mb.add(rows([0]))
    assert mb.ready() == [0]  # mini-batch 1 = groups 2, 3: group 2 is missing
    mb.streamed = 1
    mb.add(rows([5, 2, 4]))
    assert mb.ready() == [1, 2]
    assert [r[0] for r in mb.members(1)] == ["7.2.0", "7.2.1", "7.3.0", "7.3.1"]
    mb.streamed = 3
    assert mb.remaining() == [(1, 0), (1, 1), (1, 2)]  # the second pass, in order


def test_without_a_known_order_every_step_runs_at_the_end_in_prompt_order():
    mb = MiniBatches(0, mini_batches=2, epochs=1)  # dynamic sampling: the kept prompts are known at the end
    mb.add(rows([9, 2]))
    mb.add(rows([4, 7]))
    assert mb.ready() == []
    assert mb.remaining() == [(0, 0), (0, 1)]
    assert [r[0] for r in mb.members(0)] == ["7.2.0", "7.2.1", "7.4.0", "7.4.1"]
    assert [r[0] for r in mb.members(1)] == ["7.7.0", "7.7.1", "7.9.0", "7.9.1"]
    short = MiniBatches(0, 2, 1, groups=4)
    short.add(rows([0, 1, 2]))
    with pytest.raises(ValueError, match="its 4 groups; missing e.g. \\[3\\]"):
        short.remaining()


# -- rollout.top_k and greedy sampling -----------------------------------------------------------------------------

def test_processed_logits_keep_the_top_k_then_top_p_and_greedy_keeps_the_argmax():
    from dynaresize.engines.protocol import SamplingParams
    from dynaresize.engines.rollout_torch import processed_logits

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    lp = torch.log_softmax(processed_logits(logits, SamplingParams(temperature=0.5, top_k=3)), -1)
    direct = torch.log_softmax(logits[0, :3] / 0.5, -1)  # the 3 largest, renormalised, at temperature 0.5
    assert lp[0, :3].tolist() == pytest.approx(direct.tolist(), abs=1e-6) and torch.isinf(lp[0, 3:]).all()
    # top_k 3, then top_p 0.8 of what is left: p = [0.665, 0.245, 0.090] at T=1 -> the first two reach 0.8
    both = torch.log_softmax(processed_logits(logits, SamplingParams(top_k=3, top_p=0.8)), -1)
    assert torch.isfinite(both[0]).tolist() == [True, True, False, False, False]
    greedy = torch.log_softmax(processed_logits(logits, SamplingParams(temperature=0.0)), -1)
    assert greedy[0, 0] == 0.0 and torch.isinf(greedy[0, 1:]).all()
    assert torch.equal(processed_logits(logits, SamplingParams()), logits)  # all off: the raw logits


def test_the_torch_engine_samples_within_the_top_k_with_its_processed_logprobs():
    from dynaresize.engines.protocol import SamplingParams
    from dynaresize.engines.rollout_torch import TorchRollout

    model = tiny_lm().eval()
    eng = TorchRollout(model, eos_ids=[2], pad_id=0, max_running=4)
    prompts, k = [[1, 5, 6], [1, 7], [1, 3, 4, 8]], 3
    gens = eng.generate(prompts, [11, 12, 13], SamplingParams(max_tokens=6, temperature=1.3, top_k=k))
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            ids = torch.tensor([p + g.token_ids])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / 1.3
            top = torch.topk(logits, k, -1)
            direct = torch.log_softmax(top.values, -1)  # the renormalised top k
            for t, tok in enumerate(g.token_ids):
                assert tok in top.indices[t].tolist(), f"token {tok} is outside the top {k}"
                j = top.indices[t].tolist().index(tok)
                assert g.logprobs[t] == pytest.approx(float(direct[t, j]), abs=1e-4)
    greedy = eng.generate(prompts, [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0))
    again = eng.generate(prompts, [4, 5, 6], SamplingParams(max_tokens=6, top_k=1))  # top-1 is greedy too
    assert [g.token_ids for g in greedy] == [g.token_ids for g in again]
    assert all(lp == 0.0 for g in greedy for lp in g.logprobs)


# -- validation sampling, run.epochs, the config rules -------------------------------------------------------------

def test_validation_sampling_defaults_to_the_rollouts_and_takes_its_own():
    from dynaresize.job.rollout import validation_sampling

    assert validation_sampling(load_config(None, ["rollout.temperature=0.9", "rollout.top_p=0.95"])) == (0.9, 0.95)
    cfg = load_config(None, ["rollout.temperature=0.9", "task.dataset.val_temperature=0", "task.dataset.val_top_p=0.5"])
    assert validation_sampling(cfg) == (0.0, 0.5)


def test_a_validation_generate_carries_the_validation_sampling_and_training_the_rollouts():
    from types import SimpleNamespace

    from dynaresize.contract.protocol import parse_payload
    from dynaresize.job.rollout import RolloutWork

    cfg = load_config(None, ["rollout.temperature=0.9", "rollout.top_k=5", "task.dataset.val_temperature=0"])
    work = RolloutWork(SimpleNamespace(cfg=cfg, state=SimpleNamespace(version=3)), svc=None)
    val, train = work.payload(3, version=3, prompts=[0], validation=True), work.payload(4, version=3, prompts=[1])
    assert (val["temperature"], val["top_p"], val["top_k"]) == (0.0, 1.0, 5)
    assert (train["temperature"], train["top_p"], train["top_k"]) == (0.9, 1.0, 5)
    for payload in (val, train):
        parse_payload("generate", payload)  # what a worker accepts (temperature 0: greedy)


def test_run_epochs_become_steps_floor_of_records_per_step(tmp_path):
    import json

    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"data_source": "x", "prompt": f"q{i}", "reward_model": {"ground_truth": str(i)}})
                         + "\n" for i in range(21)))
    base = ["task.name=dataset", f"task.dataset.train_files=[{f}]", "rollout.prompts_per_step=4"]
    cfg = load_config(None, [*base, "run.epochs=3"])
    assert (cfg.run.steps, cfg.run.epochs) == (15, None)  # floor(21 / 4) = 5 steps a pass
    with pytest.raises(ConfigError, match="run.epochs=2 and run.steps=7 are both set"):
        load_config(None, [*base, "run.epochs=2", "run.steps=7"])
    with pytest.raises(ConfigError, match="do not fill one step of rollout.prompts_per_step=32"):
        load_config(None, [*base, "run.epochs=1", "rollout.prompts_per_step=32"])
    with pytest.raises(ConfigError, match="has none \\(task.name: dataset\\); set run.steps"):
        load_config(None, ["run.epochs=1"])


@pytest.mark.parametrize("overrides, message", [
    (["train.mini_batches=3", "rollout.prompts_per_step=8"], "train.mini_batches=3 must divide rollout.prompts_per_step=8"),
    (["train.epochs=2", "algorithm.tis.enabled=true"], "several optimizer steps per RL step"),
    (["rollout.top_k=0"], "top_k=0 is not a value"),
    (["algorithm.advantage=gae"], "algorithm.advantage"),
    (["task.dataset.val_temperature=-1"], "val_temperature"),
])
def test_bad_knobs_are_one_clear_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, overrides)
