"""Prompt length against the model's context: ``rollout.max_prompt_tokens`` and ``rollout.on_overlong`` (verl's
``data.max_prompt_length`` and ``filter_overlong_prompts``), applied when a dataset is loaded, before any rank starts.

Why here and not in the engine: a prompt plus ``rollout.max_tokens`` longer than the model's positions either runs
past what the model was built for (the torch engine, silently) or is refused by vLLM mid-run ("maximum context length
is 512 tokens"). Checked once at start-up, every record that could fail is dropped with a count (``filter``) or named
with its file, row and length (``fail``).

:func:`prompt_limit` is the decision (pure); :func:`apply_prompt_limit` measures a dataset task's records with the
model's own rendering (:func:`dynaresize.models.hf.render_prompt`) and keeps or refuses them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynaresize.config.base import ConfigError

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")  # config.json names


class OverlongPromptError(ConfigError):
    """A prompt longer than ``rollout.max_prompt_tokens`` with ``on_overlong: fail``: file, row, length, limit."""


@dataclass(frozen=True)
class PromptLimit:
    tokens: int  # the longest prompt allowed
    why: str  # where the figure comes from, for messages


@dataclass
class LengthReport:
    """What :func:`apply_prompt_limit` found: per split, records kept and dropped, and the longest dropped."""

    limit: PromptLimit
    kept: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    longest: dict[str, tuple[int, str]] = field(default_factory=dict)  # split -> (tokens, where) of its longest prompt

    def describe(self) -> str:
        parts = []
        for split in self.kept:
            n = self.kept[split] + self.dropped[split]
            tokens, where = self.longest[split]
            parts.append(f"{self.dropped[split]} of {n} {split} prompts dropped (the longest {tokens:,} tokens, {where})")
        return f"rollout.on_overlong=filter: {'; '.join(parts)}: longer than {self.limit.tokens:,} tokens ({self.limit.why})"


def model_context(model_dir: str | Path) -> int | None:
    """The model's positions, from its config.json (None when it names none)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    for key in CONTEXT_KEYS:
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return int(cfg[key])
    return None


def prompt_limit(context: int | None, max_tokens: int, max_prompt_tokens: int | None, source: str = "the model's context",
                 ) -> PromptLimit | None:
    """The longest prompt allowed: ``max_prompt_tokens`` when set (refused when it and ``max_tokens`` overflow the
    context), else the context minus ``max_tokens``; None when neither bounds it. ``source`` names the context."""
    if context is not None and max_tokens >= context:
        raise ConfigError(f"rollout.max_tokens = {max_tokens}: leaves no room for a prompt in {source} of {context:,} tokens")
    if max_prompt_tokens is not None:
        if context is not None and max_prompt_tokens + max_tokens > context:
            raise ConfigError(f"rollout.max_prompt_tokens = {max_prompt_tokens}: with rollout.max_tokens = {max_tokens} it "
                              f"exceeds {source} of {context:,} tokens (at most {context - max_tokens:,})")
        return PromptLimit(max_prompt_tokens, f"rollout.max_prompt_tokens={max_prompt_tokens}")
    if context is None:
        return None
    return PromptLimit(context - max_tokens, f"{source} {context:,} - rollout.max_tokens {max_tokens}")


def apply_prompt_limit(task: Any, tokenizer, limit: PromptLimit, on_overlong: str) -> LengthReport | None:
    """Measure every record of a dataset task (one with ``records`` and ``keep``) and drop the overlong ones
    (``filter``) or refuse the first (``fail``); None for other tasks (generated prompts are short by design) or when
    nothing is too long."""
    from dynaresize.models.hf import render_prompt

    if not (callable(getattr(task, "records", None)) and callable(getattr(task, "keep", None))):
        return None
    report = LengthReport(limit)
    for split in ("train", "val"):
        records = task.records(split)
        if not records:
            continue
        lengths = [len(render_prompt(tokenizer, r.prompt)) for r in records]
        over = [i for i, n in enumerate(lengths) if n > limit.tokens]
        if not over:
            continue
        if on_overlong == "fail":
            i = over[0]
            raise OverlongPromptError(
                f"{task.where[split][i]}: field 'prompt': {lengths[i]:,} tokens, longer than {limit.tokens:,} "
                f"({limit.why}); {len(over)} of {len(records)} {split} prompts are; set rollout.on_overlong=filter to "
                f"drop them")
        if len(over) == len(records):
            raise OverlongPromptError(f"all {len(records)} {split} prompts are longer than {limit.tokens:,} tokens "
                                      f"({limit.why}); the shortest has {min(lengths):,}")
        top = max(over, key=lambda i: lengths[i])
        report.longest[split] = (lengths[top], task.where[split][top])
        report.dropped[split], report.kept[split] = len(over), len(records) - len(over)
        task.keep(split, [i for i, n in enumerate(lengths) if n <= limit.tokens])
    return report if report.dropped else None
