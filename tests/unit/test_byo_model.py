"""Model directories: the checks a user's directory goes through, stop tokens, dtype, prompt rendering, and the
tiny model's trained tokenizer (real tokenizers, real files; no model weights are needed for these)."""

from __future__ import annotations

import json

import pytest
import torch

from dynaresize.config.loader import ConfigError
from dynaresize.models.hf import (
    check_chat_template, check_model_dir, model_dtype, pad_token_id, render_prompt, stop_token_ids,
)
from dynaresize.models.tokenizer import CHAT_TEMPLATE, train_tokenizer

pytestmark = pytest.mark.unit

CORPUS = [f"Ann has {i} pens and buys {i % 7} more. How many pens does Ann have now? \\boxed{{{i + i % 7}}}" for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=320, max_token_chars=4)


def model_dir(tmp_path, *, tokenizer=True, weights=True, config="{}"):
    d = tmp_path / "m"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def test_trained_tokenizer_is_subword_bytes_and_has_a_chat_template(tok):
    pieces = [tok.decode([i]) for i in tok("Ann has 12 pens", add_special_tokens=False)["input_ids"]]
    assert any(len(p.strip()) > 1 for p in pieces) and max(len(p) for p in pieces) <= 4  # merged, capped
    assert "1" in pieces and "2" in pieces  # digits one per token
    for text in ("Ann has 3 pens", "ünïcode ✓ never seen"):  # byte-level: nothing is unknown, decode round-trips
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.chat_template == CHAT_TEMPLATE and tok.pad_token_id != tok.eos_token_id
    ids = render_prompt(tok, [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3?"}])
    assert tok.decode(ids) == "<bos><|system|>Add.<eos><|user|>2+3?<eos><|assistant|>"
    assert render_prompt(tok, "2+3?") == tok("2+3?")["input_ids"] and render_prompt(tok, "2+3?")[0] == tok.bos_token_id
    assert train_tokenizer(CORPUS, 320, 4).get_vocab() == tok.get_vocab()  # deterministic


def test_missing_chat_template_with_chat_data_names_directory_and_record(tok, tmp_path):
    tok.save_pretrained(tmp_path / "t")
    from dynaresize.models.hf import load_tokenizer

    bare = load_tokenizer(tmp_path / "t")
    bare.chat_template = None
    with pytest.raises(ConfigError) as e:
        check_chat_template(bare, "/models/base", "data/train.parquet: row 4: field 'prompt'")
    assert str(e.value).startswith("model directory '/models/base': its tokenizer has no chat template")
    assert "data/train.parquet: row 4: field 'prompt' is a list of chat messages" in str(e.value)
    check_chat_template(load_tokenizer(tmp_path / "t"), "/x", "anything")  # saved with its template: fine


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"config": None}, "no config.json there (not an HF model directory)"),
        ({"config": "{not json"}, "config.json is not readable JSON"),
        ({"tokenizer": False}, "no tokenizer there (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json)"),
        ({"weights": False}, "no weights there (none of model.safetensors"),
    ],
)
def test_a_directory_that_is_not_a_model_is_one_message(tmp_path, kw, needle):
    d = model_dir(tmp_path, **kw)
    with pytest.raises(ConfigError) as e:
        check_model_dir(d)
    assert str(e.value).startswith(f"model.path = {str(d)!r}: {needle}") and "\n" not in str(e.value)


def test_no_such_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path = '.*/nope': no such directory"):
        check_model_dir(tmp_path / "nope")
    assert check_model_dir(model_dir(tmp_path)) == tmp_path / "m"


def test_stop_tokens_pad_fallback_and_dtype(tok, tmp_path):
    d = model_dir(tmp_path, config=json.dumps({"dtype": "bfloat16"}))
    assert stop_token_ids(d, tok) == [tok.eos_token_id]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tok.eos_token_id, True]}))
    assert stop_token_ids(d, tok) == sorted({7, tok.eos_token_id})  # end of turn and end of text; a bool is no id
    assert model_dtype(d) == torch.bfloat16 and model_dtype(d, "float32") == torch.float32
    (d / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert model_dtype(d) == torch.float16
    (d / "config.json").write_text("{}")
    assert model_dtype(d) == torch.float32

    class NoPad:
        pad_token_id, eos_token_id = None, 5

    assert pad_token_id(NoPad()) == 5 and pad_token_id(tok) == tok.pad_token_id
