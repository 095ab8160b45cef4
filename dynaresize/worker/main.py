"""``dynaresize worker``: one long-lived worker rank of a run (started by the job launcher or by ``srun``).

What it does, in order:

1. reads ``<run_dir>/config.yaml`` and ``<run_dir>/launch.json`` (model directory, split, version, checkpoint);
2. registers in the run's Redis and heartbeats (``dynaresize.control.registry``);
3. creates the world group and **every** candidate trainer / weight-sync group once, while a thread loads the
   model from disk (communicator creation overlaps model loading);
4. builds its engine (trainer or rollout) and, on a resume, restores its staged state;
5. applies its durable command stream (``dynaresize.control.commands.CommandReceiver``), acking each command
   with :meth:`Worker.handle`'s result, until ``shutdown``. A role change never restarts this process.

    python -m dynaresize.worker.main --run-dir RUN --rank R --world N --master-addr H --master-port P --job-id J
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("dynaresize.worker")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="run directory (config.yaml, launch.json, redis/, events.jsonl)")
    p.add_argument("--rank", type=int, required=True, help="global rank of this worker")
    p.add_argument("--world", type=int, required=True, help="number of worker ranks")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host of the world process group")
    p.add_argument("--master-port", type=int, required=True, help="rendezvous port of the world process group")
    p.add_argument("--job-id", required=True, help="job id (Redis namespace)")


class RedisDataPlane:
    """Work items and training batches in the run's Redis (the coordinator's ``RolloutQueue`` and batch keys)."""

    def __init__(self, client, job_id: str):
        from dynaresize.job.workqueue import RolloutQueue

        self.r = client
        self.q = RolloutQueue(client, job_id)

    def claim(self, step: int, rank: int, n: int):
        return self.q.claim(step, rank, n)

    def complete(self, step: int, rank: int, results) -> int:
        return self.q.complete(step, rank, results)

    def batch(self, key: str):
        from dynaresize.job.batching import TrainBatch

        raw = self.r.get(key)
        if raw is None:
            raise KeyError(f"training batch {key!r} is not in Redis (expired or never written)")
        return TrainBatch.from_json(raw)


def _validated(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    from dynaresize.job.protocol import PAYLOADS, parse_payload

    return parse_payload(kind, payload).model_dump() if kind in PAYLOADS else payload


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    run_dir = Path(args.run_dir)
    from dynaresize.config.loader import ConfigError, load_config

    cfg = load_config(run_dir / "config.yaml")
    try:
        launch = json.loads((run_dir / "launch.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run_dir / 'launch.json'}: unreadable launch file ({e})") from None

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from dynaresize.comm import groups as G
    from dynaresize.control.commands import CommandReceiver
    from dynaresize.control.registry import Heartbeater, Registry
    from dynaresize.control.server import connect
    from dynaresize.control.wire import RankState, Registration
    from dynaresize.engines.trainer_deepspeed import preload
    from dynaresize.events import EventLog, Role
    from dynaresize.models import load_model, load_tokenizer
    from dynaresize.staging import default_dir
    from dynaresize.worker.core import Worker, WorkerSetup

    events = EventLog(run_dir / "events.jsonl")
    client = connect(run_dir / "redis" / "redis.json", role=f"rank{args.rank}", cfg=cfg.redis)
    staging_dir = Path(cfg.staging.dir) if cfg.staging.dir else default_dir(args.job_id)
    reg = Registration(
        job_id=args.job_id, rank=args.rank, host=socket.gethostname(), device=cfg.cluster.device,
        staging_dir=str(staging_dir), pid=os.getpid(), slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        node=os.environ.get("SLURMD_NODENAME"), gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
        local_id=int(os.environ["SLURM_LOCALID"]) if os.environ.get("SLURM_LOCALID", "").isdigit() else None,
    )
    hb = Heartbeater(Registry(client, args.job_id, cfg.redis), reg, events=events)
    hb.start()

    # model loading overlaps communicator creation
    model_dir = launch["model_dir"]
    loaded: dict[str, Any] = {}

    def _load() -> None:
        try:
            loaded["model"] = load_model(model_dir)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            loaded["error"] = e

    loader = threading.Thread(target=_load, name="model-load", daemon=True)
    loader.start()
    preload()
    G.init_world(args.rank, args.world, args.master_addr, args.master_port, device=cfg.cluster.device)

    def model_factory():
        loader.join()
        if "error" in loaded:
            raise loaded["error"]
        return loaded["model"]

    tok = load_tokenizer(model_dir)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    setup = WorkerSetup(
        rank=args.rank, world=args.world, n_train=int(launch["n_train"]), unit=G.unit_from_cluster(cfg.cluster),
        train_cfg=cfg.train, rollout_cfg=cfg.rollout, staging_cfg=cfg.staging, staging_dir=staging_dir,
        model_factory=model_factory, eos_ids=eos, pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        global_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size, device=cfg.cluster.device,
        events=events, data=RedisDataPlane(client, args.job_id), checkpoint_dir=run_dir / "checkpoints",
        model_dir=str(model_dir),
    )
    worker = Worker.start(setup)
    worker.version = int(launch.get("version", 0))
    if launch.get("checkpoint"):
        worker.handle("restore_state", {"tag": Path(launch["checkpoint"]).name})
    if worker.rollout is not None:
        worker.rollout.version = worker.version
    hb.update(role=worker.role, state=RankState.IDLE)
    log.info("ready: %s, version %d, %d groups pre-built", worker.role.value, worker.version, G.group_creations())

    def handler(cmd) -> dict[str, Any]:
        kind = cmd.kind.value
        hb.update(state=RankState.SWITCHING if kind == "switch_role" else RankState.BUSY)
        try:
            return worker.handle(kind, _validated(kind, cmd.payload))
        finally:
            hb.update(state=RankState.STOPPING if worker.stopped else RankState.IDLE,
                      role=worker.role if not worker.stopped else Role.IDLE)

    receiver = CommandReceiver(client, args.job_id, args.rank, cfg.redis,
                               incarnation=lambda: hb.registration.incarnation, events=events)
    try:
        receiver.run(handler, stop=lambda: worker.stopped or hb.superseded, idle_s=1.0)
    finally:
        receiver.close()
        hb.stop(deregister=True)
        events.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dynaresize worker", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
