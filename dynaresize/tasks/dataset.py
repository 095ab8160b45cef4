"""DatasetTask (``task.name: dataset``): prompts from JSONL or Parquet files in verl's layout, a held-out split.

One record (a JSONL line, or a Parquet row)::

    {"prompt": [{"role": "user", "content": "Ann has 3 pens ... Put the answer in \\\\boxed{}."}],   # or a string
     "data_source": "byo_arith",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"index": 12, "answer": "3+4=7 \\\\boxed{7}"}}                          # optional

``prompt`` is a string (tokenised as is) or a list of chat messages (rendered by the model's chat template);
``reward_model.ground_truth`` and ``data_source`` are required, ``extra_info`` is an optional mapping (its ``answer``,
when a string, is what the tiny model's supervised warm-start teaches; else ``ground_truth``). All records are read
and checked at start-up: a malformed one is one :class:`DatasetError` naming the file, the row (Parquet; 0-based)
or line (JSONL; 1-based) and the field, before any rank starts.

Order (a pure function, so any rank and any run, resized or static, sees the same sample at a key): sample
``index`` of step ``step`` is training position ``pos = step * per_step + index``; epoch ``pos // N`` visits the
``N`` records in a permutation drawn from ``run.seed`` and the epoch (``shuffle: false``: file order).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator

from dynaresize.config.base import ConfigError
from dynaresize.tasks.base import Sample
from dynaresize.tasks.config import DatasetConfig

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ConfigError):
    """A dataset file or record that cannot be used: file, row or line, field, and what is wrong."""


def _shown(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every record of one file; ``where`` is ``"<file>: line N"`` or ``"<file>: row N"``."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DatasetError(f"{path}: unreadable ({e})") from None
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}: line {n}", json.loads(line)
            except ValueError as e:
                raise DatasetError(f"{path}: line {n}: not valid JSON ({e})") from None
    elif suffix in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
        for n, rec in enumerate(records):
            yield f"{path}: row {n}", rec
    else:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; allowed: {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")


def parse_record(where: str, rec: Any) -> Sample:
    """One record as a :class:`Sample`; :class:`DatasetError` (``where: field: problem``) when it does not fit."""
    if not isinstance(rec, dict):
        raise DatasetError(f"{where}: a record must be an object with a 'prompt', got {type(rec).__name__}")
    if "prompt" not in rec or rec["prompt"] is None:
        raise DatasetError(f"{where}: field 'prompt': missing (a string or a list of chat messages)")
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: field 'prompt': empty string")
    elif isinstance(prompt, list):
        if not prompt:
            raise DatasetError(f"{where}: field 'prompt': empty list of chat messages")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict):
                raise DatasetError(f"{where}: field 'prompt[{i}]': a chat message must be an object with 'role' and "
                                   f"'content', got {_shown(m)}")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise DatasetError(f"{where}: field 'prompt[{i}].{key}': must be a string, got {_shown(m.get(key))}")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise DatasetError(f"{where}: field 'prompt': must be a string or a list of chat messages, got {type(prompt).__name__}")
    rm = rec.get("reward_model")
    if not isinstance(rm, dict):
        raise DatasetError(f"{where}: field 'reward_model': missing or not an object (it holds 'ground_truth'), got {_shown(rm)}")
    if rm.get("ground_truth") is None:
        raise DatasetError(f"{where}: field 'reward_model.ground_truth': missing")
    gt = rm["ground_truth"]
    source = rec.get("data_source")
    if not isinstance(source, str) or not source:
        raise DatasetError(f"{where}: field 'data_source': must be a non-empty string, got {_shown(source)}")
    extra = rec.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: field 'extra_info': must be an object (or absent), got {_shown(extra)}")
    for name, value in (("reward_model.ground_truth", gt), ("extra_info", extra)):
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise DatasetError(f"{where}: field {name!r}: not JSON-serialisable ({e})") from None
        if name == "extra_info":
            extra = json.loads(text)  # plain JSON types only (what reaches the reward on another rank)
    return Sample(prompt=prompt, data_source=source, ground_truth=gt, extra_info=extra)


def read_records(files: list[str], what: str, wheres: list[str] | None = None) -> tuple[list[Sample], str | None]:
    """All records of ``files`` in order, and where the first chat-message prompt is (None: all strings);
    ``wheres``, when given, gets each record's ``file: row N`` / ``file: line N``."""
    out: list[Sample] = []
    chat = None
    for f in files:
        before = len(out)
        for where, rec in _rows(Path(f).expanduser()):
            out.append(parse_record(where, rec))
            if wheres is not None:
                wheres.append(where)
            if chat is None and out[-1].is_chat:
                chat = f"{where}: field 'prompt'"
        if len(out) == before:
            raise DatasetError(f"{f}: no records ({what})")
    return out, chat


def record_index(n: int, shuffle: bool, seed: int, step: int, index: int, per_step: int) -> int:
    """Which of ``n`` records is sample ``index`` of step ``step``: a pure function (see the module docstring)."""
    epoch, i = divmod(step * per_step + index, n)
    if not shuffle:
        return i
    perm = list(range(n))
    random.Random(f"dataset:{seed}:{epoch}").shuffle(perm)
    return perm[i]


class DatasetTask:
    """Training and validation records from files (see the module docstring for the layout and the order)."""

    def __init__(self, dataset: DatasetConfig) -> None:
        if not dataset.train_files:
            raise DatasetError("task.dataset.train_files: empty; the dataset task needs at least one training file")
        self.cfg = dataset
        self.where: dict[str, list[str]] = {"train": [], "val": []}  # each record's file and row (line), for messages
        self.train, chat = read_records(dataset.train_files, "task.dataset.train_files", self.where["train"])
        self.val, val_chat = (read_records(dataset.val_files, "task.dataset.val_files", self.where["val"])
                              if dataset.val_files else ([], None))
        self._chat = chat or val_chat

    def records(self, split: str) -> list[Sample]:
        """The records of ``split`` (``train`` or ``val``), all of them, in file order."""
        return self.train if split == "train" else self.val

    def keep(self, split: str, kept: list[int]) -> None:
        """Only the records at indices ``kept`` of ``split`` stay (``rollout.on_overlong: filter``); the training
        order is then drawn over those (a pure function still: the same files and limit keep the same records)."""
        self.where[split] = [self.where[split][i] for i in kept]
        if split == "train":
            self.train = [self.train[i] for i in kept]
        else:
            self.val = [self.val[i] for i in kept]

    # -- the training stream --------------------------------------------------------------------------------

    def position(self, seed: int, step: int, index: int, per_step: int) -> int:
        """The training record behind sample ``index`` of step ``step`` (its row across train_files)."""
        return record_index(len(self.train), self.cfg.shuffle, seed, step, index, per_step)

    def sample(self, seed: int, step: int, index: int, per_step: int) -> Sample:
        return self.train[self.position(seed, step, index, per_step)]

    def reference(self, sample: Sample) -> str:
        answer = sample.extra_info.get("answer")
        return answer if isinstance(answer, str) and answer else str(sample.ground_truth)

    def steps_for_epochs(self, epochs: int, per_step: int) -> int:
        """``run.epochs`` as RL steps: ``floor(records / per_step) x epochs`` (verl's ``len(dataloader) x total_epochs``
        with ``drop_last``). The stream of records is continuous (:func:`record_index`), so the records a pass leaves
        over open the next pass instead of being dropped."""
        per_pass = len(self.train) // per_step
        if per_pass < 1:
            raise DatasetError(f"run.epochs={epochs}: the {len(self.train)} training records of task.dataset.train_files "
                               f"do not fill one step of rollout.prompts_per_step={per_step} prompts; set run.steps")
        return per_pass * epochs

    def check_run(self, steps: int, per_step: int) -> None:
        """``task.dataset.epochs`` bounds the run: refuse one that needs more records than that."""
        if self.cfg.epochs is not None and steps * per_step > self.cfg.epochs * len(self.train):
            need = math.ceil(steps * per_step / len(self.train))
            raise DatasetError(
                f"task.dataset.epochs = {self.cfg.epochs}: run.steps={steps} x rollout.prompts_per_step={per_step} needs "
                f"{steps * per_step} prompts, {need} epochs of the {len(self.train)} training records"
            )

    # -- validation -----------------------------------------------------------------------------------------

    def val_samples(self) -> list[Sample]:
        return self.val[: self.cfg.val_max_prompts] if self.cfg.val_max_prompts else list(self.val)

    def chat_record(self) -> str | None:
        """Where the first chat-message prompt is (``file: row N: field 'prompt'``), or None when all are strings."""
        return self._chat

    def fingerprint(self) -> str:
        """Hash of the files' bytes (the tiny model's tokenizer and warm-start depend on them)."""
        h = hashlib.sha256()
        for f in [*self.cfg.train_files, *self.cfg.val_files]:
            h.update(Path(f).expanduser().read_bytes())
        return h.hexdigest()[:16]
