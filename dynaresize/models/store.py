"""``ensure_model(cfg) -> Path``: the HF model directory every engine loads (vLLM, DeepSpeed, the torch sampler).

With ``model.path`` set it is checked and returned. Otherwise the tiny model is built locally (tokenizer from the
task's alphabet, a LLaMA-style model from ``model.tiny``, supervised warm-start) and cached under
``model.cache_dir/<hash>`` (default ``~/.cache/dynaresize/models``), the hash covering the model shape, the
warm-start settings, the task (name, params, curriculum) and the seed; so the second run skips it. The build goes
to a temporary directory next to the final one and is renamed into place, under a file lock: a crash never leaves
a half-written model, and concurrent callers wait for one build. Nothing here touches a hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from dynaresize.models.tiny import build_model
from dynaresize.models.tokenizer import build_tokenizer
from dynaresize.models.warmstart import SFT_SEED_OFFSET, warm_start
from dynaresize.tasks.registry import load_task

log = logging.getLogger(__name__)
BUILD_VERSION = 2  # bump when the build recipe changes, so old caches are not reused
META_FILE = "dynaresize_model.json"
EVAL_PROMPTS = 64


def default_cache_dir() -> Path:
    return Path(os.environ.get("DYNARESIZE_CACHE", "~/.cache/dynaresize")).expanduser() / "models"


def cache_key(cfg) -> str:
    """Hash of everything the built model depends on (``cfg`` is the root ``Config``)."""
    recipe = {
        "version": BUILD_VERSION,
        "tiny": cfg.model.tiny.model_dump(),
        "task": cfg.task.model_dump(),
        "seed": cfg.run.seed,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _config_error(msg: str) -> Exception:
    from dynaresize.config.loader import ConfigError

    return ConfigError(msg)


def ensure_model(cfg) -> Path:
    """Return the model directory for the root ``Config`` ``cfg``, building and caching the tiny model if needed."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise _config_error(f"model.path = {cfg.model.path!r}: no config.json there (not an HF model directory)")
        return path
    root = Path(cfg.model.cache_dir).expanduser() if cfg.model.cache_dir else default_cache_dir()
    final = root / cache_key(cfg)
    if (final / META_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if (final / META_FILE).is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            build_tiny_model(cfg, tmp)
            if final.exists():  # a stale, incomplete directory (no META_FILE): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def build_tiny_model(cfg, out_dir: Path) -> dict:
    """Build tokenizer + model, warm-start it, save both to ``out_dir``; returns the metadata written there."""
    from dynaresize.rl.local import evaluate

    task = load_task(cfg.task)
    tiny = cfg.model.tiny
    tokenizer = build_tokenizer(task.alphabet)
    model = build_model(tiny, tokenizer, seed=cfg.run.seed)
    log.info("building the tiny model: %d parameters, warm-start %d steps", sum(p.numel() for p in model.parameters()), tiny.warmstart_steps)
    sft = warm_start(model, tokenizer, task, steps=tiny.warmstart_steps, lr=tiny.warmstart_lr, batch_size=tiny.warmstart_batch, seed=cfg.run.seed)
    for label, step in (("greedy_reward_first", 0), ("greedy_reward_late", 10**6)):  # start / past any ramp
        prompts = [task.prompt(cfg.run.seed + 2 * SFT_SEED_OFFSET, step, i) for i in range(EVAL_PROMPTS)]
        sft[label] = evaluate(model, tokenizer, task, prompts, max(len(task.answer(p)) for p in prompts) + 2)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"build_version": BUILD_VERSION, "key": cache_key(cfg), "task": cfg.task.model_dump(), "tiny": tiny.model_dump(),
            "seed": cfg.run.seed, "alphabet": task.alphabet, "warm_start": sft}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    log.info("warm-start done in %.1f s, greedy reward %.3f (late lengths %.3f)", sft["seconds"], sft["greedy_reward_first"], sft["greedy_reward_late"])
    return meta


def load_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load the causal LM from a local directory (never the hub)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
