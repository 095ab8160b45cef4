"""rollout.max_prompt_tokens and rollout.on_overlong: the limit from the model's context and max_tokens, and a
dataset with overlong rows filtered (counts, the longest) or refused (file, row, length), at load, with a real
tokenizer (one token a word) and real JSONL/Parquet files."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynaresize.config.loader import ConfigError, load_config
from dynaresize.tasks.config import DatasetConfig
from dynaresize.tasks.dataset import DatasetTask
from dynaresize.tasks.prompt_length import (OverlongPromptError, PromptLimit, apply_prompt_limit, model_context,
                                            prompt_limit)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    """Whitespace words, one token each: a prompt of n words is n tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "w": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def row(words: int) -> dict:
    return {"prompt": " ".join(["w"] * words), "data_source": "toy", "reward_model": {"ground_truth": "1"}}


def test_the_limit_comes_from_the_context_and_max_tokens():
    assert prompt_limit(512, 48, None) == PromptLimit(464, "the model's context 512 - rollout.max_tokens 48")
    assert prompt_limit(512, 48, 400).tokens == 400 and prompt_limit(None, 48, 400).tokens == 400
    assert prompt_limit(None, 48, None) is None
    with pytest.raises(ConfigError, match=r"^rollout.max_prompt_tokens = 500: with rollout.max_tokens = 48 it exceeds "
                                          r"the model's context of 512 tokens \(at most 464\)$"):
        prompt_limit(512, 48, 500)
    with pytest.raises(ConfigError, match="rollout.max_tokens = 512: leaves no room for a prompt"):
        prompt_limit(512, 512, None)


def test_the_models_context_is_read_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert model_context(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert model_context(tmp_path) == 1024
    assert model_context(tmp_path / "nowhere") is None


def test_the_config_keys_exist_with_verls_defaults():
    ro = load_config(None, []).rollout
    assert (ro.max_prompt_tokens, ro.on_overlong) == (None, "filter")
    with pytest.raises(ConfigError, match="on_overlong"):
        load_config(None, ["rollout.on_overlong=truncate"])


def test_overlong_rows_are_filtered_and_counted(tokenizer, tmp_path):
    train = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row(5), row(30), row(8), row(1285), row(10)]), train)
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(row(n)) + "\n" for n in (3, 4)))
    task = DatasetTask(DatasetConfig(train_files=[str(train)], val_files=[str(val)], shuffle=False))
    report = apply_prompt_limit(task, tokenizer, PromptLimit(10, "the model's context 58 - rollout.max_tokens 48"), "filter")
    assert [len(s.prompt.split()) for s in task.train] == [5, 8, 10] and len(task.val) == 2
    assert (report.dropped, report.kept) == ({"train": 2}, {"train": 3})
    assert report.describe() == (f"rollout.on_overlong=filter: 2 of 5 train prompts dropped (the longest 1,285 tokens, "
                                 f"{train}: row 3): longer than 10 tokens (the model's context 58 - rollout.max_tokens 48)")
    assert task.where["train"] == [f"{train}: row {i}" for i in (0, 2, 4)]
    assert task.sample(0, 1, 0, 2) == task.train[2]  # the order is drawn over the records kept
    assert apply_prompt_limit(task, tokenizer, PromptLimit(10, "x"), "filter") is None  # nothing too long now


def test_fail_names_the_file_row_and_length(tokenizer, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row(n)) + "\n" for n in (5, 1285, 40)))
    task = DatasetTask(DatasetConfig(train_files=[str(train)]))
    with pytest.raises(OverlongPromptError) as e:
        apply_prompt_limit(task, tokenizer, PromptLimit(464, "the model's context 512 - rollout.max_tokens 48"), "fail")
    assert str(e.value) == (f"{train}: line 2: field 'prompt': 1,285 tokens, longer than 464 (the model's context 512 "
                            f"- rollout.max_tokens 48); 1 of 3 train prompts are; set rollout.on_overlong=filter to "
                            f"drop them")
    assert len(task.train) == 3  # nothing dropped
    with pytest.raises(OverlongPromptError, match="all 3 train prompts are longer than 4 tokens .*the shortest has 5"):
        apply_prompt_limit(task, tokenizer, PromptLimit(4, "x"), "filter")
