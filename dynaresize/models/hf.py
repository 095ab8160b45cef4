"""A local Hugging Face model directory, the one kind of model every engine loads: checks, tokens, prompts, dtype.

``model.path`` (a user's Qwen or Llama directory) and the built-in tiny model (built into the same layout) go
through these functions alike. Nothing here reaches a hub: ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``.

* :func:`check_model_dir` fails with one message (the path and what is missing) when the directory has no
  ``config.json``, no tokenizer, or no weights; :func:`check_chat_template` when chat messages meet a tokenizer
  without a chat template.
* :func:`render_prompt`: a string prompt is tokenised as is (the tokenizer adds its BOS if it has one), a list of
  chat messages goes through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
* :func:`stop_token_ids`: the tokenizer's EOS plus ``generation_config.json``'s ``eos_token_id`` (instruct models
  often list two: end of turn and end of text); :func:`pad_token_id` falls back to EOS when there is no pad token
  (padding is masked everywhere, so that is safe).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from dynaresize.config.loader import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelDirError(ConfigError):
    """A model directory that cannot be used; the message names the path and what is missing."""


def offline() -> None:
    """Never reach a hub from this process (set before transformers first looks at the environment)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def check_model_dir(path: str | Path, what: str = "model.path") -> Path:
    """``path`` as a directory holding config.json, a tokenizer and weights; :class:`ModelDirError` otherwise."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelDirError(f"{what} = {str(path)!r}: no such directory")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"{what} = {str(path)!r}: no config.json there (not an HF model directory)")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{what} = {str(path)!r}: config.json is not readable JSON ({e})") from None
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{what} = {str(path)!r}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelDirError(f"{what} = {str(path)!r}: no weights there (none of {', '.join(WEIGHT_FILES)})")
    return p


def load_tokenizer(path: str | Path):
    """The directory's own tokenizer (offline); :class:`ModelDirError` naming the path when it does not load."""
    offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is one clear message about the directory
        raise ModelDirError(f"model directory {str(path)!r}: its tokenizer does not load ({type(e).__name__}: {e})") from None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The causal LM from a local directory (never the hub)."""
    offline()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def model_dtype(path: str | Path, setting: str = "auto") -> torch.dtype:
    """``model.dtype``: ``auto`` is the directory's own (config.json ``dtype`` / ``torch_dtype``; float32 if unset)."""
    if setting != "auto":
        return DTYPES[setting]
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return DTYPES.get(str(name), torch.float32)


def stop_token_ids(path: str | Path, tokenizer) -> list[int]:
    """EOS of the tokenizer plus ``generation_config.json``'s ``eos_token_id`` (an int or a list)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, int) and not isinstance(e, bool):
                ids.add(e)
    return sorted(ids)


def pad_token_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(tokenizer, model_dir: str | Path, where: str) -> None:
    """Chat messages need a chat template; ``where`` names the record that uses them (file, row, field)."""
    if not has_chat_template(tokenizer):
        raise ModelDirError(
            f"model directory {str(model_dir)!r}: its tokenizer has no chat template (no chat_template in "
            f"tokenizer_config.json, no chat_template.jinja), but {where} is a list of chat messages; use string "
            f"prompts, or a model directory with a chat template"
        )


def render_prompt(tokenizer, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt: a string as is (with the tokenizer's special tokens), chat messages through the
    tokenizer's chat template with the generation prompt (the assistant turn's opening) appended."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    out = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """The plain text of a prompt (message contents joined by newlines): tokenizer training, logs."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
