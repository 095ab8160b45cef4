"""``ensure_model(cfg) -> Path``: the HF model directory every engine loads (vLLM, DeepSpeed, the torch sampler).

With ``model.path`` set it is checked (:func:`dynaresize.models.hf.check_model_dir`: config.json, a tokenizer,
weights) and returned. Otherwise the tiny model is built locally into the same layout (a byte-level BPE tokenizer
with a chat template trained on the task's text, a LLaMA-style model from ``model.tiny``, supervised warm-start on
prompts rendered exactly as in rollout) and cached under
``model.cache_dir/<hash>`` (default ``~/.cache/dynaresize/models``), the hash covering what the build reads and
nothing else (:func:`cache_key`: the model shape, the warm-start settings, the task class, params and curriculum, a
dataset's training records, the seed); so the second run skips it. The build goes
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

from dynaresize.models.hf import check_model_dir, load_model, load_tokenizer, prompt_text
from dynaresize.tasks.base import reference_answer, sample_of
from dynaresize.tasks.registry import load_task

log = logging.getLogger(__name__)
BUILD_VERSION = 3  # bump when the build recipe changes, so old caches are not reused
META_FILE = "dynaresize_model.json"
EVAL_PROMPTS = 64
CORPUS_SAMPLES = 4000  # task samples the tokenizer is trained on
CORPUS_SEED_OFFSET = 6151  # corpus prompts apart from the RL and warm-start ones


def default_cache_dir() -> Path:
    return Path(os.environ.get("DYNARESIZE_CACHE", "~/.cache/dynaresize")).expanduser() / "models"


def cache_key(cfg) -> str:
    """Hash of what the built model depends on (``cfg`` is the root ``Config``): the tiny shape and warm-start
    settings, the seed, and the task as the build reads it (:func:`task_recipe`). Nothing else: a new validation
    file, a training file moved or rewritten with the same records, another reward function or ``val_*`` setting
    reuses the cached model (each of those once rebuilt it: minutes of warm-start for the same weights)."""
    recipe = {"version": BUILD_VERSION, "tiny": cfg.model.tiny.model_dump(), "task": task_recipe(cfg), "seed": cfg.run.seed}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


def task_recipe(cfg) -> dict:
    """What of ``task`` the build reads: the task class and its params, the curriculum when the class takes one, and
    for a dataset, its training records as the build sees them (prompt and reference answer, in file order) and
    their order (``shuffle``); not the files' names or bytes, the validation split, nor the val_* settings. The
    reward is not part of it either: it only measures the warm-start's greedy reward, a figure of the metadata."""
    from dynaresize.tasks.registry import _accepts, resolve_class

    cls = resolve_class(cfg.task.name)
    out: dict = {"class": f"{cls.__module__}:{cls.__qualname__}", "params": cfg.task.params}
    if _accepts(cls, "curriculum"):
        out["curriculum"] = cfg.task.curriculum.model_dump()
    if _accepts(cls, "dataset"):
        task, h = load_task(cfg.task), hashlib.sha256()
        records = getattr(task, "train", None)
        if isinstance(records, list):  # DatasetTask: the build samples its training records only
            for s in records:
                h.update(json.dumps([s.prompt, reference_answer(task, s)], sort_keys=True, default=str).encode() + b"\n")
        else:  # a class of the user's that reads the files its own way: their bytes, whatever it reads of them
            for f in [*cfg.task.dataset.train_files, *cfg.task.dataset.val_files]:
                h.update(Path(f).expanduser().read_bytes())
        out["dataset"] = {"shuffle": cfg.task.dataset.shuffle, "train_records": h.hexdigest()[:16]}
    return out


@contextmanager
def _locked(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_model(cfg) -> Path:
    """Return the model directory for the root ``Config`` ``cfg``, building and caching the tiny model if needed."""
    if cfg.model.path:
        return check_model_dir(cfg.model.path)
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
    """Train the tokenizer, build the model, warm-start it, save both to ``out_dir``; returns the metadata written
    there. Everything is then read back from ``out_dir`` like any HF directory (no object of this build is used).

    What only a build needs (the model class, tokenizer training, the warm-start) is imported here: a run whose
    model is cached, and every worker rank, start without it."""
    from dynaresize.models.tiny import build_model
    from dynaresize.models.tokenizer import train_tokenizer
    from dynaresize.models.warmstart import SFT_SEED_OFFSET, greedy_reward, warm_start
    from dynaresize.rewards import load_reward

    task = load_task(cfg.task)
    reward = load_reward(cfg, task)
    tiny = cfg.model.tiny
    tokenizer = train_tokenizer(tokenizer_corpus(task, cfg.run.seed), tiny.vocab_size, tiny.max_token_chars)
    model = build_model(tiny, tokenizer, seed=cfg.run.seed)
    log.info("building the tiny model: %d parameters, vocabulary %d, warm-start %d steps",
             sum(p.numel() for p in model.parameters()), len(tokenizer), tiny.warmstart_steps)
    sft = warm_start(model, tokenizer, task, steps=tiny.warmstart_steps, lr=tiny.warmstart_lr, batch_size=tiny.warmstart_batch, seed=cfg.run.seed)
    for label, step in (("greedy_reward_first", 0), ("greedy_reward_late", 10**6)):  # start / past any ramp
        samples = [sample_of(task, cfg.run.seed + 2 * SFT_SEED_OFFSET, step, i, EVAL_PROMPTS) for i in range(EVAL_PROMPTS)]
        longest = max(len(tokenizer(reference_answer(task, s), add_special_tokens=False)["input_ids"]) for s in samples)
        sft[label] = greedy_reward(model, tokenizer, reward, samples, longest + 2)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"build_version": BUILD_VERSION, "key": cache_key(cfg), "task": cfg.task.model_dump(), "tiny": tiny.model_dump(),
            "seed": cfg.run.seed, "vocab_size": len(tokenizer), "warm_start": sft, "greedy_reward_by": reward.name}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    log.info("warm-start done in %.1f s, greedy reward %.3f (late lengths %.3f)", sft["seconds"], sft["greedy_reward_first"], sft["greedy_reward_late"])
    return meta


def tokenizer_corpus(task, seed: int, n: int = CORPUS_SAMPLES) -> list[str]:
    """Text the tiny tokenizer is trained on: the task's prompts and reference answers (a dataset's records cycle),
    over the steps a run visits (a curriculum's later, longer problems included)."""
    out = []
    for i in range(n):
        s = sample_of(task, seed + CORPUS_SEED_OFFSET, i % 100, i // 100, n // 100)  # 100 steps x n/100 distinct positions
        out.append(prompt_text(s.prompt) + reference_answer(task, s))
    return out


__all__ = ["cache_key", "ensure_model", "load_model", "load_tokenizer", "tokenizer_corpus"]
