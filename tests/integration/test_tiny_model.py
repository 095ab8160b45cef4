"""The local model pipeline on CPU: build + warm-start + cache, HF round trip, generation, and GRPO updates that
move the policy the right way (real torch model, real tokenizer, no hub)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.models import ensure_model, load_model, load_tokenizer, store
from dynaresize.models.store import tokenizer_corpus
from dynaresize.models.tokenizer import train_tokenizer
from dynaresize.rl import GrpoLoss, collate, group_advantages, sequence_logprobs
from dynaresize.rl.local import generate, grpo_step
from dynaresize.tasks import load_task

pytestmark = pytest.mark.integration

SMALL = [
    "model.tiny.hidden_size=64", "model.tiny.num_layers=1", "model.tiny.intermediate_size=128",
    "model.tiny.warmstart_steps=150", "model.tiny.warmstart_batch=32",
    "task.curriculum.max_len_start=4", "task.curriculum.max_len_end=4",
]


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory):
    torch.set_num_threads(1)
    return load_config(None, SMALL + [f"model.cache_dir={tmp_path_factory.mktemp('models')}"])


@pytest.fixture(scope="module")
def model_dir(small_cfg):
    return ensure_model(small_cfg)


def test_build_is_a_normal_hf_directory_loadable_by_auto_classes(small_cfg, model_dir):
    assert {"config.json", "model.safetensors", "tokenizer.json", store.META_FILE} <= {p.name for p in model_dir.iterdir()}
    assert any(p.name in ("chat_template.jinja", "tokenizer_config.json") for p in model_dir.iterdir())
    meta = json.loads((model_dir / store.META_FILE).read_text())
    assert meta["key"] == model_dir.name == store.cache_key(small_cfg)
    assert meta["warm_start"]["loss_last"] < meta["warm_start"]["loss_first"] / 2  # the warm-start learned
    assert meta["warm_start"]["greedy_reward_first"] > 0.5  # RL starts from a policy that often succeeds
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.tie_word_embeddings and model.config.head_dim == 32
    fresh = train_tokenizer(tokenizer_corpus(load_task(small_cfg.task), small_cfg.run.seed), small_cfg.model.tiny.vocab_size)
    for text in ("r:0123=", "s:zyx=", "r:1 2=", "héllo wörld"):  # same ids as a fresh training; bytes: nothing unknown
        assert tok(text)["input_ids"] == fresh(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert 256 < len(tok) <= small_cfg.model.tiny.vocab_size  # the byte alphabet, the specials, what merges the text had
    assert tok.pad_token_id != tok.eos_token_id and tok.padding_side == "left"
    assert tok("r:42=")["input_ids"][0] == tok.bos_token_id
    pieces = [tok.decode([i]) for i in tok("r:9876543210=", add_special_tokens=False)["input_ids"]]
    assert pieces[2:12] == list("9876543210")  # digits one per token (arithmetic stays learnable)
    chat = tok.apply_chat_template([{"role": "user", "content": "r:42="}], add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><|user|>r:42=<eos><|assistant|>"


def test_second_call_uses_the_cache(small_cfg, model_dir, monkeypatch):
    def no_rebuild(*a, **k):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(store, "build_tiny_model", no_rebuild)
    assert ensure_model(small_cfg) == model_dir
    other = small_cfg.model_copy(update={"run": small_cfg.run.model_copy(update={"seed": 1})})
    assert store.cache_key(other) != store.cache_key(small_cfg)  # the seed is part of the recipe


def test_a_cached_model_is_found_without_importing_the_build(small_cfg, model_dir):
    """The coordinator asks for the model before any rank starts: on a cache hit it must not pay for the model
    class, tokenizer training and warm-start imports (transformers' whole modeling stack, ~1 s of CPU)."""
    code = (
        "import sys\n"
        "from dynaresize.config.loader import load_config\n"
        "from dynaresize.models.store import ensure_model\n"
        f"cfg = load_config(None, {SMALL + [f'model.cache_dir={small_cfg.model.cache_dir}']!r})\n"
        "print(ensure_model(cfg))\n"
        "print(sorted(m for m in ('transformers.modeling_utils', 'dynaresize.models.tiny', 'dynaresize.models.warmstart',"
        " 'dynaresize.models.tokenizer') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    found, imported = out.stdout.splitlines()[-2:]
    assert found == str(model_dir)
    assert imported == "[]", imported


def test_a_failed_build_leaves_no_partial_directory(tmp_path, monkeypatch):
    cfg = load_config(None, SMALL + [f"model.cache_dir={tmp_path}", "model.tiny.warmstart_steps=1"])

    def crash(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr("dynaresize.models.warmstart.warm_start", crash)  # the build imports it when it runs
    with pytest.raises(RuntimeError, match="killed mid-build"):
        ensure_model(cfg)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_model_path_must_be_an_hf_directory(tmp_path):
    with pytest.raises(ConfigError, match="model.path = .*no config.json"):
        ensure_model(load_config(None, [f"model.path={tmp_path}"]))


def test_model_path_is_used_as_is(model_dir, small_cfg):
    assert ensure_model(load_config(None, [f"model.path={model_dir}"])) == model_dir


def test_generation_decodes_to_task_text(small_cfg, model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    task = load_task(small_cfg.task)
    prompts = [task.prompt(0, 0, i) for i in range(16)]
    sampled = generate(model, tok, prompts, max_tokens=8, seed=3)
    chars = "".join(o.text for o in sampled)  # a byte vocabulary can sample any byte; the warm-start makes it rare
    assert sum(c in task.alphabet for c in chars) >= 0.9 * len(chars)
    assert generate(model, tok, prompts, max_tokens=8, seed=3) == sampled  # seeded sampling is reproducible
    greedy = generate(model, tok, prompts, max_tokens=8, greedy=True)
    assert sum(task.reward(o.prompt, o.text) for o in greedy) / len(greedy) > 0.5
    assert all(set(o.text) <= set(task.alphabet) for o in greedy)
    assert all(o.response_ids[-1] == tok.eos_token_id for o in greedy if len(o.response_ids) < 8)


def test_sequence_logprobs_ignore_padding(model_dir):
    model = load_model(model_dir)
    prompts, responses = [[1, 31, 40, 50, 60, 41], [1, 31, 40, 70, 41]], [[60, 50, 2], [70, 70, 70, 2]]
    batch = collate(prompts, responses, pad_id=0)
    together = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    for i in range(2):
        alone = collate(prompts[i : i + 1], responses[i : i + 1], pad_id=0)
        one = sequence_logprobs(model, alone["input_ids"], alone["attention_mask"], alone["response_mask"])
        width = one.shape[1]
        assert torch.allclose(together[i, :width], one[0], atol=1e-5)
    # left padding (the generation layout) gives the same per-token values thanks to explicit position ids
    ids = torch.tensor([[0, 0, 1, 31, 40, 70, 41, 70, 70, 70, 2]])
    attn = (ids != 0).long()
    resp = torch.zeros_like(ids, dtype=torch.float32)
    resp[0, -4:] = 1
    left = sequence_logprobs(model, ids, attn, resp)
    assert torch.allclose(left[0, -4:], together[1, 5:9], atol=1e-5)


def test_grpo_updates_favour_positive_advantages(small_cfg, model_dir):
    """On a fixed sampled batch, a few clipped updates raise the logprob of above-average responses, lower the
    below-average ones, and raise the batch's importance-weighted reward."""
    torch.manual_seed(0)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    task = load_task(small_cfg.task)
    prompts = [task.prompt(0, 0, i) for i in range(4) for _ in range(8)]
    outs = generate(model, tok, prompts, max_tokens=8, seed=11)
    rewards = torch.tensor([task.reward(o.prompt, o.text) for o in outs])
    adv = group_advantages(rewards, 8)
    assert (adv > 0).any() and (adv < 0).any()  # the fixed seed gives mixed groups
    batch = collate([o.prompt_ids for o in outs], [o.response_ids for o in outs], tok.pad_token_id, advantages=adv)
    with torch.no_grad():
        batch["old_logprobs"] = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    loss_fn = GrpoLoss(clip_eps=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(4):
        loss, metrics = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    lengths = batch["response_mask"].sum(-1)
    assert losses[0] == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), abs=1e-5)  # ratio 1: -token-mean A
    assert losses[-1] < losses[0] - 0.02, losses  # the surrogate objective improves
    with torch.no_grad():
        new = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    delta = ((new - batch["old_logprobs"]) * batch["response_mask"]).sum(-1)
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
    weights = torch.exp(delta) / torch.exp(delta).sum()  # self-normalised importance weights of the fixed samples
    assert float((weights * rewards).sum()) > float(rewards.mean())


def test_on_policy_grpo_steps_run_and_report(small_cfg, model_dir):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    task = load_task(small_cfg.task)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = [grpo_step(model, tok, task, opt, GrpoLoss(), seed=0, step=s, prompts_per_step=4, group_size=4, max_tokens=8) for s in range(3)]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 and r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)
    assert all(r["grad_norm"] >= 0 and r["response_len"] >= 1 for r in rows)
