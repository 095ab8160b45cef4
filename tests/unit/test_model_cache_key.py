"""The tiny model's cache key covers what its build reads and nothing else (``dynaresize.models.store.cache_key``).

A data file the build does not read (a validation file), a training file moved, renamed or rewritten as Parquet with
the same records, a reward or a val_* setting: the same key, so the cached model is reused (each used to rebuild it,
minutes of warm-start for the same weights). The training records' content, their order, the seed, the task class
and its params, the model shape: another key."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynaresize.config.loader import load_config
from dynaresize.models.store import cache_key

pytestmark = pytest.mark.unit


def rows(n: int, answer: int = 0) -> list[dict]:
    return [{"prompt": f"What is {i}+{answer}?", "data_source": "toy", "reward_model": {"ground_truth": str(i + answer)},
             "extra_info": {"index": i}} for i in range(n)]


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def key(train, *more: str, val=None) -> str:
    extra = [f"task.dataset.val_files=[{val}]"] if val else []
    return cache_key(load_config(None, ["task.name=dataset", f"task.dataset.train_files=[{train}]", *extra, *more]))


def test_what_the_build_does_not_read_keeps_the_key(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(12))
    base = key(train)
    assert key(train, val=write_jsonl(tmp_path / "val.jsonl", rows(3))) == base  # a new validation file
    assert key(train, val=write_jsonl(tmp_path / "val2.jsonl", rows(5, 9))) == base  # another one
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    moved.write_text(train.read_text())
    assert key(moved) == base  # same records at another path
    assert key(write_jsonl(tmp_path / "spaced.jsonl", rows(12)).rename(tmp_path / "b.json")) == base
    pq.write_table(pa.Table.from_pylist(rows(12)), tmp_path / "train.parquet")
    assert key(tmp_path / "train.parquet") == base  # the same records as Parquet
    for setting in ("task.dataset.val_every=3", "task.dataset.val_samples=8", "task.dataset.val_max_prompts=2",
                    "task.dataset.epochs=50", "reward.function=dynaresize.rewards.math:compute_score",
                    "task.curriculum.max_len_end=30", "run.steps=99", "rollout.temperature=0.7"):
        assert key(train, setting) == base, setting
    assert key(train, "task.name=dynaresize.tasks.dataset:DatasetTask") == base  # the short name is the class


def test_what_the_build_reads_changes_the_key(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(12))
    base = key(train)
    assert key(write_jsonl(tmp_path / "other.jsonl", rows(12, 1))) != base  # other answers
    assert key(write_jsonl(tmp_path / "more.jsonl", rows(13))) != base  # one more record
    assert key(write_jsonl(tmp_path / "order.jsonl", rows(12)[::-1])) != base  # another order
    assert key(train, "task.dataset.shuffle=false") != base
    assert key(train, "run.seed=1") != base
    assert key(train, "model.tiny.hidden_size=64") != base
    generated = cache_key(load_config(None, []))
    assert generated != base
    assert cache_key(load_config(None, ["task.curriculum.max_len_end=30"])) != generated  # a generated task's curriculum
    assert cache_key(load_config(None, ["task.name=sort_letters"])) != generated
