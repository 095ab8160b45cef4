"""Worker ranks as local processes driven over pipes (JSON both ways): for tests and benchmarks, no Redis.

The same :class:`~dynaresize.worker.core.Worker` runs inside; only the transport differs from a real run
(``dynaresize.worker.main`` reads the rank's durable command stream in Redis). A command to several ranks is sent
to all of them before any answer is awaited, because most commands are collective.

    with LocalCluster(world=4, n_train=2, tmp=path, hooks="tests.support.hooks:RankHooks.from_env") as c:
        c.call("train_direct", {"input_ids": ids, "n_train": 2, "version_after": 1}, ranks=[0, 1])

``hooks`` names (``module:attribute``) a callable that each rank process calls for its
:class:`~dynaresize.worker.hooks.Hooks` (the inline-batch and inspection commands of the tests live there).
``redis`` (an endpoint file and a job id) gives every rank the data plane of a real run (work queue and training
batches in that Redis); ``weights_dir`` is where published weights go (``optimizer_step``, ``fetch_weights``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

from dynaresize.net import free_port

TINY_MODEL = {"vocab_size": 48, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "tie_word_embeddings": True}


class LocalWorkerError(RuntimeError):
    """A local worker answered a command with an error (the message carries its rank and traceback tail)."""


def tiny_qwen2(spec: dict[str, Any], seed: int = 0):
    """A config-built Qwen2 causal LM (no hub access); the same seed gives the same weights on every rank.
    ``spec["dtype"]`` (e.g. ``"bfloat16"``): its parameters' dtype (default float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = dict(spec)
    dtype = getattr(torch, spec.pop("dtype", "float32"))
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**spec)).to(dtype)


def rollout_rank(module, data, staging_dir: Path, weights_dir: Path | None = None, rollout: dict[str, Any] | None = None,
                 eos_ids: Iterable[int] = (), pad_id: int = 0, rank: int = 0, events=None, vllm=None):
    """One rollout rank's :class:`~dynaresize.worker.core.Worker` in this process, over ``data`` (a real data plane):
    no process group (a rollout rank's generate, fetch and install make no collective call). Drive it with
    :class:`~dynaresize.worker.main.RankHandler` and a real :class:`~dynaresize.control.commands.CommandReceiver`.
    ``vllm``: a :class:`~dynaresize.engines.rollout_vllm.VllmRollout` built beforehand (a build takes seconds, so
    one engine may serve several ranks made in turn, as :meth:`Worker.start` builds one per process): the rank's
    engine, loaded with ``module``'s weights as version 0 (``rollout.engine`` is then ``vllm``)."""
    from dynaresize.staging import Stager
    from dynaresize.worker.config import RolloutConfig, StagingConfig, TrainConfig
    from dynaresize.worker.core import Worker, WorkerSetup

    rollout = {**(rollout or {}), **({"engine": "vllm"} if vllm is not None else {})}
    setup = WorkerSetup(rank=rank, world=rank + 1, n_train=0, unit=1, train_cfg=TrainConfig(),
                        rollout_cfg=RolloutConfig(**rollout), staging_cfg=StagingConfig(), deferred_optimizer=False,
                        staging_dir=Path(staging_dir), model_factory=lambda: module, eos_ids=list(eos_ids), pad_id=pad_id,
                        global_batch=1, events=events, data=data, weights_dir=weights_dir)
    w = Worker(setup, None, module, 0)
    w.stager = Stager(staging_dir, 8, 4, 1)
    w.vllm = vllm
    w._build_rollout()
    return w


def _resolve(name: str):
    """``"package.module:attr.attr"`` -> that object."""
    import importlib

    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _child(rank: int, world: int, port: int, conn, spec_json: str) -> None:
    spec = json.loads(spec_json)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)
    from dynaresize.comm import groups as G
    from dynaresize.engines.trainer_deepspeed import preload

    preload()  # deepspeed + torch._dynamo now, not at the first initialize
    from dynaresize.config.schema import Config
    from dynaresize.events import EventLog
    from dynaresize.rl.lr import LrSchedule
    from dynaresize.worker.core import Worker, WorkerSetup
    from dynaresize.worker.hooks import Hooks

    cfg = Config.model_validate(spec.get("config", {}))
    data = None
    if spec.get("redis"):
        from dynaresize.contract.dataplane import RedisDataPlane
        from dynaresize.control.server import connect

        data = RedisDataPlane(connect(spec["redis"]["endpoint"], role=f"rank{rank}"), spec["redis"]["job_id"])
    G.init_world(rank, world, "127.0.0.1", port, timeout_s=spec.get("timeout_s", 300))
    model_spec = spec.get("model", TINY_MODEL)
    setup = WorkerSetup(
        rank=rank, world=world, n_train=spec["n_train"], unit=spec.get("unit", 1),
        train_cfg=cfg.train, rollout_cfg=cfg.rollout, staging_cfg=cfg.staging, staging_dir=Path(spec["staging_dir"]),
        deferred_optimizer=cfg.switching.optimizations.deferred_optimizer,
        model_factory=lambda: tiny_qwen2(model_spec, spec.get("seed", 0)),
        eos_ids=spec.get("eos_ids", [2]), pad_id=spec.get("pad_id", 0), global_batch=spec["global_batch"],
        events=EventLog(spec["events"]) if spec.get("events") else None,
        hooks=_resolve(spec["hooks"])() if spec.get("hooks") else Hooks(), data=data,
        weights_dir=Path(spec["weights_dir"]) if spec.get("weights_dir") else None,
        algorithm_cfg=cfg.algorithm, lr=LrSchedule.from_config(cfg.train, cfg.run.steps),
        snapshot_every=cfg.faults.snapshot_every,
    )
    try:
        worker = Worker.start(setup)
        conn.send_bytes(json.dumps({"ok": True, "result": {"ready": rank}}).encode())
    except BaseException:  # noqa: BLE001 - reported to the driver
        conn.send_bytes(json.dumps({"ok": False, "error": traceback.format_exc()}).encode())
        return
    while not worker.stopped:
        msg = json.loads(conn.recv_bytes())
        try:
            res = worker.handle(msg["kind"], msg.get("payload"))
            out = {"ok": True, "result": res}
        except Exception:  # noqa: BLE001 - a failed command is acked as failed; the worker keeps running
            out = {"ok": False, "error": traceback.format_exc()[-3000:]}
        conn.send_bytes(json.dumps(out).encode())
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class LocalCluster:
    """``world`` worker processes on this machine, ranks ``0..n_train-1`` training at start."""

    def __init__(self, world: int, n_train: int, tmp: str | Path, global_batch: int = 12, config: dict | None = None,
                 model: dict | None = None, events: str | Path | None = None, timeout_s: float = 240.0, seed: int = 0,
                 hooks: str | None = None, redis: tuple[str | Path, str] | None = None,
                 weights_dir: str | Path | None = None):
        self.world, self.timeout = world, timeout_s
        tmp = Path(tmp)
        spec = {"n_train": n_train, "global_batch": global_batch, "config": config or {},
                "staging_dir": str(tmp / "staging"), "model": model or TINY_MODEL, "seed": seed,
                "events": str(events) if events else None, "timeout_s": timeout_s, "hooks": hooks,
                "redis": {"endpoint": str(redis[0]), "job_id": redis[1]} if redis else None,
                "weights_dir": str(weights_dir) if weights_dir else None}
        if events and not Path(events).exists():  # one time axis for every process: they read t0 from run_start
            from dynaresize.events import EventLog, EventType

            with EventLog(events) as ev:
                ev.emit(EventType.RUN_START, run_id="local", source="runtime", world_size=world, wall_time=ev.t0)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(r, world, port, child, json.dumps(spec)), daemon=True, name=f"worker-{r}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(range(world), "start")

    def _collect(self, ranks: Iterable[int], what: str) -> dict[int, Any]:
        out, errors = {}, []
        deadline = time.monotonic() + self.timeout
        for r in ranks:
            left = deadline - time.monotonic()
            if not self.conns[r].poll(max(0.0, left)):
                errors.append(f"rank {r}: no answer to {what} within {self.timeout:.0f} s")
                continue
            try:
                msg = json.loads(self.conns[r].recv_bytes())
            except (EOFError, OSError):
                self.procs[r].join(timeout=5)
                errors.append(f"rank {r}: process died during {what} (exit code {self.procs[r].exitcode})")
                continue
            if msg["ok"]:
                out[r] = msg["result"]
            else:
                errors.append(f"rank {r}: {msg['error']}")
        if errors:
            raise LocalWorkerError(f"{what} failed:\n" + "\n".join(errors))
        return out

    def call(self, kind: str, payload: dict | dict[int, dict] | None = None, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Send ``kind`` to ``ranks`` (default all) and return their results by rank. ``payload`` may map rank ->
        payload."""
        ranks = list(range(self.world) if ranks is None else ranks)
        for r in ranks:
            p = payload.get(r, {}) if isinstance(payload, dict) and payload and all(isinstance(k, int) for k in payload) else payload
            self.conns[r].send_bytes(json.dumps({"kind": kind, "payload": p or {}}).encode())
        return self._collect(ranks, kind)

    def close(self) -> None:
        for r, c in enumerate(self.conns):
            if self.procs[r].is_alive():
                try:
                    c.send_bytes(json.dumps({"kind": "shutdown"}).encode())
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
