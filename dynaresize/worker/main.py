"""``dynaresize worker``: one long-lived worker rank of a run (started by the job launcher or by ``srun``).

What it does, in order:

1. reads ``<run_dir>/config.yaml`` and ``<run_dir>/launch.json`` (model directory, split, version, checkpoint);
2. registers in the run's Redis and heartbeats (``dynaresize.control.registry``);
3. creates the world group and **every** candidate trainer / weight-sync group once, while a thread loads the
   model from disk (communicator creation overlaps model loading);
4. builds its engine (trainer or rollout) and, on a resume, restores its staged state;
5. applies its durable command stream (``dynaresize.control.commands.CommandReceiver``), acking each command
   with :meth:`Worker.handle`'s result, until ``shutdown``. A role change never restarts this process.

Two entries, one body (:func:`serve`): :func:`main` for ranks the local launcher starts::

    python -m dynaresize.worker.main --run-dir RUN --rank R --world N --master-addr H --master-port P --job-id J

and :func:`run_worker` for ranks ``srun`` starts (``dynaresize.slurm.entry worker``): rank and world from Slurm,
Redis from the rendezvous file, the world group's port from ``launch.json`` and rank 0's host through Redis.
"""

from __future__ import annotations

import argparse
import gc
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
    p.add_argument("--launch", type=int, default=None, help="the launch this process belongs to (default: the one "
                   "launch.json names when it is read; the local launcher passes it)")


def _validated(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    from dynaresize.contract.protocol import parse_payload

    return parse_payload(kind, payload).model_dump()


def main(args: argparse.Namespace, hooks=None) -> int:
    """Entry of a locally launched rank (``dynaresize.job.launcher``): everything comes on the command line.
    ``hooks``: :class:`~dynaresize.worker.hooks.Hooks` (a test-side entry passes its own; default: none)."""
    run_dir = Path(args.run_dir)
    endpoint = run_dir / "redis" / "redis.json"
    _defer_stop_signals(run_dir, endpoint)
    return serve(run_dir, args.rank, args.world, args.job_id, endpoint, args.master_addr, args.master_port, hooks=hooks,
                 launch_no=getattr(args, "launch", None))


def _defer_stop_signals(run_dir: Path, endpoint_file: Path) -> None:
    """An operator's stop of a local run (SIGTERM or SIGINT to every process of the job at once: ``pkill``, ``kill``
    of the process list) is the coordinator's to carry out: like a rank under Slurm, this one keeps serving until the
    coordinator has checkpointed it and sent ``shutdown``; it exits on its own when the coordinator's Redis refuses
    connections, or ``slurm.worker_term_timeout_s`` after the signal (:class:`~dynaresize.slurm.preempt.TermDeferral`)."""
    import signal

    from dynaresize.config.loader import load_config
    from dynaresize.slurm.preempt import TermDeferral

    timeout = load_config(run_dir / "config.yaml").slurm.worker_term_timeout_s
    TermDeferral(timeout, redis_gone(endpoint_file)).install(signals=(signal.SIGTERM, signal.SIGINT))


def redis_gone(endpoint_file: Path):
    """For a local rank's :class:`~dynaresize.slurm.preempt.TermDeferral`: True when the run's Redis (the
    coordinator's) refuses connections; False while it answers or its endpoint cannot be read (unknown is not gone)."""

    def gone() -> bool:
        from dynaresize.control.server import Endpoint

        try:
            ep = Endpoint.load(endpoint_file)
        except Exception:  # noqa: BLE001 - unreadable: unknown
            return False
        try:
            socket.create_connection((ep.host, ep.port), timeout=2.0).close()
            return False
        except OSError:
            return True

    return gone


def run_worker(ctx) -> int:
    """Entry of a rank started by ``srun`` (``dynaresize.slurm.entry``): rank and world from Slurm, the Redis
    endpoint from the rendezvous file, the world group's rendezvous (host of rank 0, port) from the launch file
    and Redis."""
    import time

    from dynaresize.slurm import rendezvous

    ident = ctx.identity
    if ident is None:
        raise RuntimeError("run_worker needs a Slurm identity (run it under srun, or use `dynaresize worker`)")
    rv = rendezvous.wait(ctx.run_dir, ident.job_id, ident.restart_count, timeout_s=600)
    launch_path = Path(ctx.run_dir) / "launch.json"
    deadline = time.monotonic() + 600
    while True:  # the coordinator writes launch.json after publishing the endpoint: wait for this incarnation's
        try:
            if launch_path.stat().st_mtime >= rv.written_at - 1.0:
                launch = json.loads(launch_path.read_text())
                break
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{launch_path}: not written by the coordinator of restart {ident.restart_count} within 600 s")
        time.sleep(0.2)
    os.environ.setdefault("LOCAL_RANK", str(ident.localid))
    if ident.gpus:
        os.environ.setdefault("DYNARESIZE_CUDA_DEVICE", str(ident.cuda_device))
    return serve(Path(ctx.run_dir), ident.procid, ident.ntasks, str(launch["job_id"]), rv.endpoint_file,
                 None, int(launch["master_port"]), local_rank=ident.localid)


def _master_addr(client, job_id: str, rank: int, incarnation: Any, timeout_s: float = 600.0) -> str:
    """Rank 0 publishes its host in Redis; the others wait for it (the world group's TCP rendezvous)."""
    import time

    from dynaresize.contract.keys import Keys

    key = f"{Keys(job_id).ns}:world_master:{incarnation}"
    if rank == 0:
        host = socket.gethostbyname(socket.gethostname())
        client.set(key, host, ex=7 * 24 * 3600)
        return host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = client.get(key)
        if v:
            return v.decode()
        time.sleep(0.2)
    raise TimeoutError(f"rank 0 did not publish its host ({key}) within {timeout_s:.0f} s")


def preload_rank_imports(engine: str = "torch") -> None:
    """The third-party imports of a rank (torch, transformers' model code, DeepSpeed and what its first initialize
    pulls in; vLLM's engine, worker and model runner when ``engine`` is vllm) and the project modules :func:`serve`
    uses. :mod:`dynaresize.job.zygote` makes them once for all the local ranks it forks; :func:`serve` finds them
    done there, and makes them itself in a rank ``srun`` started."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    from dynaresize.engines.trainer_deepspeed import preload

    preload()
    import dynaresize.comm.groups  # noqa: F401
    import dynaresize.contract.dataplane  # noqa: F401
    import dynaresize.control.commands  # noqa: F401
    import dynaresize.control.registry  # noqa: F401
    import dynaresize.models  # noqa: F401
    import dynaresize.worker.core  # noqa: F401

    if engine == "vllm":
        from dynaresize.engines.rollout_vllm import import_vllm

        import_vllm()


def serve(run_dir: Path, rank: int, world: int, job_id: str, endpoint_file, master_addr: str | None, master_port: int,
          local_rank: int | None = None, hooks=None, launch_no: int | None = None) -> int:
    """Run one worker rank until ``shutdown``: see the module docstring for the order of things."""
    # The imports below create millions of objects that live as long as the process (torch, transformers,
    # DeepSpeed): cycle collections during them rescan those again and again (~1 s of CPU per rank). None runs
    # until preload() is done; then one collection, and what is left is kept out of every later one.
    gc.disable()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    from dynaresize.config.loader import ConfigError, load_config

    cfg = load_config(run_dir / "config.yaml")
    try:
        launch = json.loads((run_dir / "launch.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run_dir / 'launch.json'}: unreadable launch file ({e})") from None
    if launch_no is None:  # started by srun: the launch file of this restart (run_worker waited for it)
        launch_no = int(launch.get("incarnation", 0))

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from dynaresize.comm import groups as G
    from dynaresize.control.commands import CommandReceiver
    from dynaresize.control.registry import Heartbeater, Registry, RegistrationRefused
    from dynaresize.control.server import connect
    from dynaresize.control.wire import RankState, Registration
    from dynaresize.rl.lr import LrSchedule
    from dynaresize.engines.trainer_deepspeed import preload
    from dynaresize.events import EventLog, Role
    from dynaresize.contract.dataplane import RedisDataPlane
    from dynaresize.models import load_model, load_tokenizer
    import transformers.modeling_utils  # noqa: F401 - in this thread: the model-load thread imports only its class
    from dynaresize.models.hf import model_dtype, pad_token_id, stop_token_ids
    from dynaresize.staging import default_dir
    from dynaresize.worker.core import Worker, WorkerSetup
    from dynaresize.emulation import torch_device
    from dynaresize.emulation.engine import Emulator
    from dynaresize.worker.hooks import Hooks

    events = EventLog(run_dir / "events.jsonl")
    client = connect(endpoint_file, role=f"rank{rank}", cfg=cfg.redis)
    staging_dir = Path(cfg.staging.dir) if cfg.staging.dir else default_dir(job_id)
    reg = Registration(
        job_id=job_id, rank=rank, host=socket.gethostname(), device=cfg.cluster.device,
        staging_dir=str(staging_dir), pid=os.getpid(), slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        node=os.environ.get("SLURMD_NODENAME"), gpu=os.environ.get("CUDA_VISIBLE_DEVICES"),
        local_id=int(os.environ["SLURM_LOCALID"]) if os.environ.get("SLURM_LOCALID", "").isdigit() else None,
        het_group=int(os.environ["DYNARESIZE_HET_GROUP"]) if os.environ.get("DYNARESIZE_HET_GROUP", "").isdigit() else None,
        launch=launch_no,  # its own launch, never a later one's launch.json (a slow start is refused as what it is)
    )
    hb = Heartbeater(Registry(client, job_id, cfg.redis), reg, events=events)
    try:
        hb.start()
    except RegistrationRefused as e:  # an earlier launch's process, or the rank is held by a live one: leave at once
        return _refused(e.reason, events, client)

    # model loading overlaps communicator creation
    model_dir = launch["model_dir"]
    loaded: dict[str, Any] = {}
    dtype = model_dtype(model_dir, cfg.model.dtype)

    def _load() -> None:
        try:
            loaded["model"] = load_model(model_dir, dtype)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            loaded["error"] = e

    loader = threading.Thread(target=_load, name="model-load", daemon=True)
    loader.start()
    preload()
    gc.collect()
    gc.freeze()
    gc.enable()
    if master_addr is None:
        master_addr = _master_addr(client, job_id, rank, launch_no)
    if cfg.cluster.device == "cuda" and os.environ.get("DYNARESIZE_CUDA_DEVICE"):
        local_rank = int(os.environ["DYNARESIZE_CUDA_DEVICE"])
    device = torch_device(cfg.cluster.device)  # an emulated accelerator computes on the CPU
    G.init_world(rank, world, master_addr, master_port, device=device, local_rank=local_rank)

    def model_factory():
        loader.join()
        if "error" in loaded:
            raise loaded["error"]
        return loaded["model"]

    tok = load_tokenizer(model_dir)
    eos = stop_token_ids(model_dir, tok)  # the tokenizer's EOS and generation_config.json's (end of turn, of text)
    setup = WorkerSetup(
        rank=rank, world=world, n_train=int(launch["n_train"]), unit=G.unit_from_cluster(cfg.cluster),
        train_cfg=cfg.train, rollout_cfg=cfg.rollout, staging_cfg=cfg.staging, staging_dir=staging_dir,
        deferred_optimizer=cfg.switching.optimizations.deferred_optimizer,
        model_factory=model_factory, eos_ids=eos, pad_id=pad_token_id(tok), score=_scorer(cfg, tok),
        global_batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size, device=device,
        events=events, data=RedisDataPlane(client, job_id), checkpoint_dir=run_dir / "checkpoints",
        model_dir=str(model_dir), hooks=hooks or Hooks(), weights_dir=run_dir / "weights",
        emulator=Emulator(cfg, world) if cfg.cluster.device == "emulated" else None,
        algorithm_cfg=cfg.algorithm, lr=LrSchedule.from_config(cfg.train, cfg.run.steps),
        snapshot_every=cfg.faults.snapshot_every,
    )
    worker = Worker.start(setup)
    worker.version = int(launch.get("version", 0))
    if launch.get("checkpoint"):
        worker.handle("restore_state", {"tag": Path(launch["checkpoint"]).name})
    if worker.rollout is not None:
        worker.rollout.version = worker.version
    hb.update(role=worker.role, state=RankState.IDLE)
    hb.beat_now()  # registered as ready before it answers a command (Heartbeater.beat_now says why)
    log.info("ready: %s, version %d, %d groups pre-built", worker.role.value, worker.version, G.group_creations())

    handler = RankHandler(worker, hb)
    receiver = CommandReceiver(client, job_id, rank, cfg.redis,
                               incarnation=lambda: hb.registration.incarnation, events=events)
    try:
        receiver.run_stream(handler, stop=lambda: worker.stopped or hb.superseded, idle_s=1.0)
    finally:
        receiver.close()
        hb.stop(deregister=True)
        worker.close()  # vLLM's engine first: it destroys its own groups on this world, and the world (if it did not)
        events.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if hb.superseded:
        return _refused(hb.refused or f"rank {rank} superseded", None, client)
    return 0


class RankHandler:
    """The rank's commands for :meth:`~dynaresize.control.commands.CommandReceiver.run_stream`: a generate of
    prompts joins the running decode (continuous batching, acked when its own samples ended), every other command
    runs as :meth:`Worker.handle` (after the decode it must not overlap ended: :meth:`Worker.begin`)."""

    def __init__(self, worker, hb=None):
        self.worker, self.hb = worker, hb or _NoHeartbeat()

    def begin(self, cmd) -> dict[str, Any] | None:
        from dynaresize.control.commands import PENDING
        from dynaresize.control.wire import RankState
        from dynaresize.events import Role

        kind = cmd.kind.value
        self.hb.update(state=RankState.SWITCHING if kind == "switch_role" else RankState.BUSY)
        out = None
        try:
            out = self.worker.begin(cmd.command_id, kind, _validated(kind, cmd.payload))
            return PENDING if out is None and self.worker.streams(kind, cmd.payload) else out
        finally:
            if self.worker.stopped:
                self.hb.update(state=RankState.STOPPING, role=Role.IDLE)
            else:
                self.hb.update(state=RankState.BUSY if self.worker.streaming else RankState.IDLE, role=self.worker.role)

    def settle(self, cmd) -> None:
        self.worker.settle(cmd.kind.value, cmd.payload)

    def advance(self) -> None:
        self.worker.advance()

    def take_done(self):
        from dynaresize.control.wire import RankState

        done = self.worker.take_done()
        if done and not self.worker.streaming and not self.worker.stopped:
            self.hb.update(state=RankState.IDLE, role=self.worker.role)
        return done

    def busy(self) -> bool:
        return self.worker.streaming

    def wants_more(self) -> bool:
        return self.worker.wants_more()

    def abort(self, reason: str) -> None:
        self.worker.abort_stream(reason)


class _NoHeartbeat:
    """A rank driven in-process (tests, tools/bench_rollout.py) has no registration to update."""

    def update(self, **_: Any) -> None:
        pass


def _scorer(cfg, tokenizer):
    """The rank's reward: decode a response (special tokens dropped) and score it with the run's reward function,
    guarded (``dynaresize.rewards.Reward``): a failing reward gives 0 and an error text, never a crashed rank."""
    from dynaresize.rewards import load_reward

    reward = load_reward(cfg)

    def score(item, token_ids: list[int]) -> dict[str, Any]:
        r = reward.score(item.key, item.info, tokenizer.decode(token_ids, skip_special_tokens=True))
        return {"reward": r.score, "reward_error": r.error} if r.error else {"reward": r.score}

    return score


REFUSED_EXIT = 3  # exit status of a rank process refused its rank (registration refused, or superseded)


def _refused(reason: str, events, client) -> int:
    """One clear line on stderr (and in the rank log), then leave: the rank belongs to another process."""
    log.error("%s", reason)
    print(f"dynaresize worker: {reason}", file=sys.stderr, flush=True)
    if events is not None:
        events.emit("control", what="refused", reason=reason)
        events.close()
    try:
        client.close()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    return REFUSED_EXIT


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="dynaresize worker", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
