"""Rollout engine on vLLM (GPU only): sleep mode, in-place weight loading, per-sample seeded sampling with logprobs.

UNVERIFIED: written against vLLM's public API as read from its source (no GPU and no vLLM wheel on the machines
this project is developed on); ``tests/gpu/test_vllm_engine.py`` exercises it where a GPU and vLLM exist. It is the
only module that imports vllm, and it does so lazily, so importing it on a CPU machine is harmless.

Same protocol as :class:`dynaresize.engines.rollout_torch.TorchRollout` (``generate``, ``load_weights``,
``named_weights``, ``sleep``, ``wake_up``, ``version``), so the worker does not care which one it holds.

Choices (see docs/workers.md):

- ``LLM(model_dir, enable_sleep_mode=True, logprobs_mode="processed_logprobs", enforce_eager=...)``: processed
  logprobs are those of the distribution actually sampled (after temperature / top-p), like the torch engine's.
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and its single worker in this process, so a weight
  update is a function run on the worker through ``collective_rpc`` that calls ``model.load_weights`` on the
  received tensors directly (no serialisation of tensors between processes).
- Leaving the rollout role: ``sleep(level)`` (1: weights to pinned host memory, KV cache dropped; 2: both
  dropped). Coming back: ``wake_up(["weights"])``, load the current weights, ``wake_up(["kv_cache"])``, then
  ``reset_prefix_cache()`` (cached prefixes were computed with the old weights).
- Token ids in, token ids out (``skip_tokenizer_init``): prompts arrive rendered by the model directory's own
  tokenizer (chat messages through its chat template, on the coordinator), stop tokens are its EOS ids
  (``dynaresize.models.hf.stop_token_ids``), and the rollout rank decodes and scores with the same tokenizer. The
  chat-template path is exercised on CPU with the torch engine only; with vLLM on a GPU it is unverified.
- One ``SamplingParams`` per sample, ``seed`` = the work item's seed: vLLM then draws that request from its own
  generator, so a sample does not depend on which rank or batch generates it.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch

from dynaresize.engines.rollout_torch import Generation, RolloutError, SamplingParams


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return torch.cuda.is_available()


class VllmRollout:
    """vLLM engine for one rank (one GPU). ``model_dir``: the HF directory the trainer was built from."""

    def __init__(self, model_dir: str, eos_ids: Iterable[int], vllm_cfg: Any, seed: int = 0, dtype: str = "bfloat16"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise RolloutError(f"rollout.engine=vllm but vllm cannot be imported ({e}); install the 'gpu' extra") from e
        if not torch.cuda.is_available():
            raise RolloutError("rollout.engine=vllm needs a CUDA GPU")
        kwargs: dict[str, Any] = dict(
            enable_sleep_mode=True,
            gpu_memory_utilization=vllm_cfg.gpu_memory_utilization,
            enforce_eager=vllm_cfg.enforce_eager,
            dtype=dtype,
            seed=seed,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,  # token ids in, token ids out
        )
        if vllm_cfg.max_model_len:
            kwargs["max_model_len"] = vllm_cfg.max_model_len
        self.llm = LLM(model=str(model_dir), **kwargs)
        self.eos = sorted(set(int(e) for e in eos_ids))
        self.sleep_level = int(vllm_cfg.sleep_level)
        self.version = 0
        self.asleep = False
        self._names = _hf_names_and_shapes(model_dir)

    # -- weights --------------------------------------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Names, shapes and dtypes a weight sync must deliver (HF checkpoint names; tensors on the meta device)."""
        return self._names

    def load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running model in place (vLLM fuses/reshapes them itself)."""
        batch = [(n, t) for n, t in items]
        if not batch:
            return

        def _load(worker) -> int:  # runs inside the (in-process) vLLM worker
            model = worker.model_runner.model
            dev = next(model.parameters()).device
            loaded = model.load_weights(weights=((n, t.to(dev, non_blocking=True)) for n, t in batch))
            return len(loaded) if loaded is not None else len(batch)

        self.llm.collective_rpc(_load)

    def finish_weight_update(self, version: int) -> None:
        torch.cuda.synchronize()
        self.llm.reset_prefix_cache()
        self.version = version

    # -- memory ---------------------------------------------------------------------------------------------

    def sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``["weights"]`` first (then load weights), then ``["kv_cache"]``; ``None`` wakes everything."""
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    # -- sampling -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Generation]:
        if self.asleep:
            raise RolloutError("generate() on a sleeping vLLM engine (wake_up first)")
        if len(prompts) != len(seeds):
            raise RolloutError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sps = [VSP(n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                   logprobs=0, seed=int(s) & ((1 << 63) - 1), stop_token_ids=self.eos, detokenize=False)
               for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids)]
            if len(lps) != len(ids):
                raise RolloutError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            gens.append(Generation(ids, lps))
        return gens


def _hf_names_and_shapes(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The HF model's parameters (names in checkpoint format) on the meta device: the receive list of a sync."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, p.detach()) for n, p in model.named_parameters()]
