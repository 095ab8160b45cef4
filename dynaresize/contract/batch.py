"""The training batch of one step as it crosses Redis: the coordinator writes it as JSON under one key
(``dr:<job>:batch:<step>``, built by :func:`dynaresize.job.batching.build_batch`); each trainer reads it back and
takes its contiguous slice."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainBatch:
    step: int
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    advantages: list[float]
    rewards: list[float]
    versions: list[int]
    keys: list[str]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> "TrainBatch":
        d = json.loads(raw)
        tb = cls(**d)
        n = len(tb.keys)
        if not all(len(getattr(tb, f)) == n for f in ("prompt_ids", "response_ids", "logprobs", "advantages", "rewards", "versions")):
            raise ValueError("training batch fields have different lengths")
        return tb
