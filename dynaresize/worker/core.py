"""One worker rank: holds the engines, executes commands, never restarts on a role change.

``Worker.handle(kind, payload) -> result`` is the whole command-execution core; it knows nothing of the transport
(Redis streams in ``dynaresize.worker.main``, JSON over pipes in ``dynaresize.worker.local`` for tests and
benchmarks). Roles are positional (``dynaresize.comm.groups``): with ``n_train`` trainers, ranks ``0..n_train-1``
train, the rest roll out.

A role switch (``switch_role``, run by every rank of the union of old and new trainer sets, which is itself a
pre-built group) is this list of named operations, each written to the event log as a ``switch_op``::

    offload            old trainers: ZeRO partitions (fp32 master, Adam moments) to host     critical
    comm_select        pick the pre-built trainer / union groups (never create one)          critical
    weight_sync        new trainers whose weights are stale get rank 0's, chunked            critical
    engine_build       DeepSpeed engine on the new trainer group / torch rollout engine      critical
    optimizer_reshard  ZeRO ranges copied old rank -> new rank, point to point               critical
    optimizer_stage_in moments installed at the first optimizer step (step pre-hook)         background

Ranks outside the union keep generating: a switch never stops them.

The barrier-free schedule (``dynaresize.schedule``) uses four more commands, still one at a time in stream order:

- ``generate`` with ``prompts``: the rank claims exactly those prompts' samples (``DataPlane.claim_prompts``) and
  generates them ``pull_batch`` at a time; asked for a version it has fetched, it installs that one first;
- ``fetch_weights``: a rollout rank starts receiving a version into fresh host tensors (a second buffer) on a
  background thread while it decodes with the old one (at most ``max_incoming`` versions at a time): with
  ``transport: comm`` (the default schedule's) from rank 0 point to point over the world group built at start-up
  (:mod:`dynaresize.comm.transport`); with ``file`` (the fallback) read from ``<weights_dir>/v<version>`` (written
  by rank 0's ``optimizer_step(publish=True, transport="file")``); the interval is logged (``weight_sync``,
  ``background``) at the next command. It runs beside the decode (``CONCURRENT``); ``pushed``: rank 0 sends it
  whatever this rank answers, so one receive is posted even for a version it holds (into a buffer it drops);
- ``push_weights`` (comm): rank 0 sends a version kept at the optimizer step, or a relay (a rollout rank,
  ``pipeline.weights_relay`` > 0) the version it received (once its own receive ended and checked), to ranks that
  posted (or, ``pushed``, will post) a receive from it; rank 0's star on one background thread per destination, a
  relay's sends (``one_at_a_time``) one after another; acked once queued; beside the decode (``CONCURRENT``);
- ``train_chunk``: forward and backward of a chunk of complete groups, loss as a sum (``ZeroTrainer.accumulate``);
- ``optimizer_step``: the step of the chunks accumulated since the last one, divided by the whole batch's
  normaliser (``ZeroTrainer.step``); with ``publish`` rank 0 keeps a host copy of the new weights (comm) or stages
  them to the run's weights directory (file).

The weight transfers are the only work a rank does off its main thread: point-to-point sends and receives over the
world group (no collective, no other group), or a file read.

Continuous batching across commands (``rollout.max_running`` not 0; the transport drives it through :meth:`Worker.begin`,
:meth:`Worker.advance` and :meth:`Worker.take_done`): a ``generate`` with ``prompts`` claims its samples and adds
them to the rollout engine's running decode (:mod:`dynaresize.engines.protocol`), where they enter as KV slots free;
the command is done, its results completed to the data plane ``pull_batch`` at a time and its ack due, when its own
samples have ended, while the next command's samples keep decoding. Before a generate of another version installs
it, the engine finishes what the old version is decoding, so every sample keeps exactly one version; any other
command but ``ping`` first finishes the stream too (a fetch, a switch, a sync, training: in stream order, as today);
``shutdown`` and a fenced rank (the data plane refuses its results) abort it, their commands failing.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from dynaresize.comm import groups as G
from dynaresize.comm.transport import CommFetch, WeightSender
from dynaresize.comm.weights import WeightSyncError, broadcast_weights, send_weights_p2p
from dynaresize.contract.decode import DecodeSums
from dynaresize.engines import reshard as R
from dynaresize.engines.protocol import Request, SamplingParams
from dynaresize.engines.rollout_torch import TorchRollout
from dynaresize.engines.trainer_deepspeed import Partition, PartitionLayout, ZeroTrainer, token_nll_loss, warm_backend
from dynaresize.events import EventLog, EventType, Role, Stage, SwitchOp, format_ranks
from dynaresize.staging import Prefetch, Stager, StagingError
from dynaresize.worker.hooks import Hooks
from dynaresize.worker.snapshot import Snapshots

log = logging.getLogger("dynaresize.worker")


class WorkerError(RuntimeError):
    """A command this rank cannot execute in its current state (wrong role, wrong version, bad payload)."""


class DataPlane(Protocol):
    """Where rollout work comes from and training batches are read (Redis in a real run)."""

    def claim(self, step: int, rank: int, n: int, validation: bool = False) -> list[Any]: ...  # WorkItem-like

    def claim_prompts(self, step: int, rank: int, prompts: list[int], validation: bool = False) -> list[Any]: ...

    def complete(self, step: int, rank: int, results: list[Any], validation: bool = False) -> int: ...

    def batch(self, key: str) -> Any: ...  # TrainBatch-like


@dataclass
class WorkerSetup:
    rank: int
    world: int
    n_train: int  # trainers at start
    unit: int  # resize unit (ranks)
    train_cfg: Any  # TrainConfig
    rollout_cfg: Any  # RolloutConfig
    staging_cfg: Any  # StagingConfig
    deferred_optimizer: bool  # switching.optimizations.deferred_optimizer: restore optimizer state at the first step
    staging_dir: Path
    model_factory: Callable[[], torch.nn.Module]
    eos_ids: list[int]
    pad_id: int
    global_batch: int  # samples per training step (B x G), fixed whatever the trainer count
    device: str = "cpu"
    events: EventLog | None = None
    data: DataPlane | None = None
    loss_fn: Callable | None = None  # default: GRPO from dynaresize.rl when the batch has advantages, else token NLL
    checkpoint_dir: Path | None = None  # stage_state writes <checkpoint_dir>/<tag>/ (shared, resumable) when set
    model_dir: str | None = None  # HF directory of the model (the vLLM engine loads its architecture from it)
    score: Callable[[Any, list[int]], dict[str, Any]] | None = None  # (work item, response ids) -> {"reward", "reward_error"?}
    hooks: Hooks = field(default_factory=Hooks)  # fault points and extra commands: no-ops in production (worker.hooks)
    weights_dir: Path | None = None  # published weights, <weights_dir>/v<version> (optimizer_step publish, fetch_weights)
    emulator: Any = None  # dynaresize.emulation.engine.Emulator when cluster.device is emulated: work lasts modelled time
    algorithm_cfg: Any = None  # AlgorithmConfig: the loss's truncated importance sampling (algorithm.tis); None: off
    lr: Callable[[int], float] | None = None  # the LR of each optimizer step of the run (dynaresize.rl.lr); None: train.lr
    snapshot_every: int = 0  # faults.snapshot_every: in-memory snapshots of a trainer's state (worker.snapshot); 0: off


@dataclass
class _Incoming:
    """A version being received (or received) into host memory on a background thread, not installed yet: from
    rank 0 over the communicators (``CommFetch``) or, the file fallback, read from its snapshot (``Prefetch``)."""

    version: int
    path: Path | str  # the snapshot read, or where the weights come from (comm)
    read: Prefetch | CommFetch
    logged: bool = False


@dataclass
class _Streamed:
    """A generate command whose samples decode in the rollout engine's stream: claimed items, completed to the data
    plane ``pull_batch`` at a time (as the one-batch path does) once a slice's samples all ended."""

    command_id: str
    step: int
    version: int
    validation: bool
    prompts: list[int]
    items: list[Any]
    pull_batch: int
    started: float
    results: dict[int, Any] = field(default_factory=dict)  # item position -> SampleResult
    completed: set[int] = field(default_factory=set)  # slices (start positions) completed to the data plane
    tokens: int = 0
    installed_s: float = 0.0  # the install of its version before it began (waiting for the fetch's read, loading it)


# Commands that run beside the stream (they change nothing it uses). fetch_weights only starts a receive (or a read)
# into a second buffer: the stream goes on with the version it holds, and the generate of the new version installs
# it after the old one's samples ended (settle). Its ack comes before the old version's generates end, so the core
# may hand this rank the new version's groups while the old ones decode (no round trip at the version's boundary),
# and a lost rank's groups of the old version after the rank installed the new one: the coordinator then has it
# receive the old version again (comm, ``again``) or the rank reads its snapshot again (file, ``_refetch``).
# push_weights only queues sends on background threads (a relay forwards from its second buffer while it decodes).
CONCURRENT = frozenset({"ping", "fetch_weights", "push_weights"})
# commands that change nothing a snapshot copies (the ZeRO partitions, the weights): they run beside its copy
SNAPSHOT_SAFE = frozenset({"ping", "generate", "fetch_weights", "push_weights", "train_chunk", "snapshot_held",
                           "materialize_snapshot"})
GROUPS_CREATED_METRIC = "comm/groups_created_after_startup"  # logged by each rank at its shutdown (0 expected)


@dataclass
class Worker:
    setup: WorkerSetup
    groups: G.CommGroups
    module: torch.nn.Module
    n_train: int
    version: int = 0
    trainer: ZeroTrainer | None = None
    rollout: TorchRollout | None = None
    stager: Stager | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    vllm: Any = None  # VllmRollout, created once at start-up on every rank when rollout.engine=vllm
    ref_model: torch.nn.Module | None = None  # frozen reference policy for train.kl_coef > 0, loaded at first use
    incoming: dict[int, _Incoming] = field(default_factory=dict)  # fetched versions, by version (rollout ranks)
    max_incoming: int = 2  # fetched versions a rank holds at most (each a full copy of the weights in host memory)
    held: set[int] = field(default_factory=set)  # versions this rank fetched or installed (a refetch reads only these)
    sender: WeightSender | None = None  # rank 0 with the comm transport: held versions, background sends
    stream: dict[str, _Streamed] = field(default_factory=dict)  # generate commands decoding, by command id, in order
    done: list[tuple[str, dict[str, Any] | None, str | None]] = field(default_factory=list)  # (id, result, error)
    _stream_mark: float = 0.0  # end of the last rollout stage interval this rank logged from the stream
    decode_sums: DecodeSums = field(default_factory=DecodeSums)  # the stream's iterations since the last generate ack
    _decoding: int = 0  # sequences still decoding after the stream's last iteration (engines that do not say what waits)
    minibatches: Any = None  # dynaresize.rl.minibatch.MiniBatches of the RL step in training (train.mini_batches x epochs > 1)
    snaps: Snapshots | None = None  # in-memory snapshots (faults.snapshot_every; worker.snapshot): own and the peer's

    @classmethod
    def start(cls, setup: WorkerSetup) -> "Worker":
        """Build every group (collective, same order on all ranks), then the model and this rank's engine."""
        groups = G.CommGroups.build(unit=setup.unit, device=setup.device)
        warm_backend()  # every rank may become a trainer: DeepSpeed's comm wrapper now, not at the first switch
        module = setup.model_factory()
        if setup.device == "cuda":
            module = module.to(torch.device("cuda", torch.cuda.current_device()))
        w = cls(setup, groups, module, setup.n_train)
        w.snaps = Snapshots(setup.rank, None, w._dev, setup.staging_cfg.chunk_mb << 20)  # (the world group: the default)
        w.stager = Stager(setup.staging_dir, setup.staging_cfg.buffer_mb, setup.staging_cfg.chunk_mb,
                          setup.staging_cfg.writer_threads, setup.staging_cfg.checksum, setup.staging_cfg.fsync,
                          pin=setup.device == "cuda")
        if setup.rollout_cfg.engine == "vllm":
            # vLLM starts before the trainer allocates (on CUDA it checks free memory), once per process; trainers
            # put it to sleep right away (CUDA: sleep mode; CPU: the engine stays whole, docs/workers.md) and wake it
            # when they become rollout ranks.
            from dynaresize.engines.rollout_vllm import VllmRollout

            if setup.model_dir is None:
                raise WorkerError("rollout.engine=vllm needs the model directory (WorkerSetup.model_dir)")
            dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
            w.vllm = VllmRollout(setup.model_dir, setup.eos_ids, setup.rollout_cfg.vllm, dtype=dtype,
                                 platform="cuda" if setup.device == "cuda" else "cpu", max_seqs=w._slots)
        if w.is_trainer:
            if w.vllm is not None:
                w.vllm.sleep()
            w._build_trainer(setup.n_train)
        else:
            w._build_rollout()
        # Everything allocated so far lives as long as the process: keep it out of later cycle collections, so the
        # gc.collect() of a switch scans only what the engines created (1 s -> a few ms on a 2-core machine).
        gc.collect()
        gc.freeze()
        return w

    # -- state ----------------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.setup.rank

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.n_train

    @property
    def role(self) -> Role:
        return Role.TRAIN if self.is_trainer else Role.ROLLOUT

    def _build_trainer(self, n: int) -> None:
        self.trainer = ZeroTrainer(self.module, self.setup.train_cfg, self.groups.trainer_group(n),
                                   G.trainer_ranks(n), self.setup.global_batch)

    def _build_rollout(self) -> None:
        if self.vllm is not None:  # wake the weights, load this rank's current weights in place, then the KV cache
            self.vllm.wake_up(["weights"])
            self.vllm.load_weights(self._weights())
            self.vllm.finish_weight_update(self.version)
            self.vllm.wake_up(["kv_cache"])
            self.rollout = self.vllm
            return
        if self.setup.emulator is not None:
            from dynaresize.emulation.engine import EmulatedRollout

            self.rollout = EmulatedRollout(self.module, self.setup.eos_ids, self.setup.pad_id, "cpu",
                                           emulator=self.setup.emulator, max_running=self._slots)
        else:
            self.rollout = TorchRollout(self.module, self.setup.eos_ids, self.setup.pad_id, self.setup.device,
                                        max_running=self._slots)
        self.rollout.version = self.version

    @property
    def _slots(self) -> int:
        """KV slots of the rollout engine (``RolloutConfig.kv_slots``)."""
        return self.setup.rollout_cfg.kv_slots

    @property
    def _dev(self) -> torch.device:
        """Device of collective buffers: NCCL needs GPU tensors, gloo CPU ones."""
        return torch.device("cuda", torch.cuda.current_device()) if self.setup.device == "cuda" else torch.device("cpu")

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.module.named_parameters()]

    # -- command dispatch -----------------------------------------------------------------------------------

    def handle(self, kind: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """Execute one command; raises WorkerError (or a library error) for the transport to ack as failed."""
        payload = payload or {}
        self._log_reads()
        if self.snaps is not None and (kind not in SNAPSHOT_SAFE or (kind == "train_chunk" and self._steps_per_batch > 1)):
            self.snaps.settle()  # a snapshot being copied: nothing may change the state it copies before it has
        fn = getattr(self, f"_cmd_{kind}", None)
        if fn is None:
            extra = self.setup.hooks.commands().get(kind)
            if extra is None:
                raise WorkerError(f"rank {self.rank}: unknown command kind {kind!r}")
            fn = lambda **kw: extra(self, **kw)  # noqa: E731
        out = fn(**payload)
        self._report_pacing()
        return out

    # -- the emulated accelerator (cluster.device: emulated) ---------------------------------------------------

    def _pace(self, kind: str, start: float, modelled: Callable[[Any], float]) -> float:
        """End a span of real work begun at ``start``: with an emulator, it lasts ``modelled(emulator)`` wall
        seconds (or is recorded as an overrun); returns the span's end."""
        emu = self.setup.emulator
        if emu is None:
            return time.perf_counter()
        return emu.pacer.finish(kind, start, modelled(emu))

    def _report_pacing(self) -> None:
        emu = self.setup.emulator
        rec = emu.report() if emu is not None else None
        if rec is not None and self.setup.events is not None:
            from dynaresize.emulation.engine import OVERRUNS_METRIC

            self.setup.events.emit(EventType.METRIC, name=OVERRUNS_METRIC, value=emu.pacer.overruns, rank=self.rank,
                                   by_kind=rec)

    @staticmethod
    def _lengths(tb: Any) -> tuple[list[int], list[int]]:
        return [len(p) for p in tb.prompt_ids], [len(r) for r in tb.response_ids]

    def _cmd_ping(self, **_: Any) -> dict[str, Any]:
        return {"rank": self.rank, "role": self.role.value, "version": self.version, "n_train": self.n_train}

    def close(self) -> None:
        """Release what the rank holds beyond its commands, before it destroys its process groups: the vLLM
        engine, whose shutdown tears down the groups vLLM created on the rank's torch world, then that world
        (rollout_vllm's module docstring)."""
        if self.vllm is not None:
            self.vllm.close()

    def _cmd_shutdown(self, **_: Any) -> dict[str, Any]:
        self.stopped = True
        if self.setup.events is not None and self.groups is not None:  # the communicators were all built at start-up
            self.setup.events.emit(EventType.METRIC, name=GROUPS_CREATED_METRIC, value=self.groups.created_after_startup(),
                                   rank=self.rank)
        if self.setup.events is not None and self.snaps is not None and self.snaps.taken:  # what the snapshots cost
            for name, value in (("taken", self.snaps.taken), ("main_s", round(self.snaps.main_s, 6)),
                                ("background_s", round(self.snaps.background_s, 6))):
                self.setup.events.emit(EventType.METRIC, name=f"snapshot/{name}", value=value, rank=self.rank)
        return {}

    # -- generate -------------------------------------------------------------------------------------------

    def _cmd_generate(self, step: int, version: int, pull_batch: int, max_tokens: int, temperature: float, top_p: float,
                      validation: bool = False, prompts: list[int] | None = None, top_k: int = -1) -> dict[str, Any]:
        """Pull samples until the queue is empty, or (``prompts``) generate exactly those prompts' unfinished samples.
        A ``version`` this rank fetched (``fetch_weights``) is installed first; any other version but the one held
        is refused."""
        self._check_generate(version)
        installed_s = self._install(version) if version != self.version else 0.0
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        t0, samples, tokens = time.perf_counter(), 0, 0
        if prompts is None:
            while True:
                items = self.setup.data.claim(step, self.rank, pull_batch, validation=validation)
                if not items:
                    break
                n, k = self._generate_items(step, items, params, validation)
                samples, tokens = samples + n, tokens + k
        else:  # one claim (one token: a retried claim takes nothing new), generated a slice at a time
            items = self.setup.data.claim_prompts(step, self.rank, list(prompts), validation=validation)
            for i in range(0, len(items), pull_batch):
                n, k = self._generate_items(step, items[i:i + pull_batch], params, validation)
                samples, tokens = samples + n, tokens + k
        t1 = time.perf_counter()
        if not validation:  # a validation pass is not part of any step's rollout stage
            self._stage(Stage.ROLLOUT, step, t0, t1, tokens=tokens, samples=samples, version=self.version)
        out = {"samples": samples, "tokens": tokens, "busy_s": t1 - t0, "version": self.version,
               "install_s": installed_s}
        if prompts is not None:
            out["prompts"] = list(prompts)
        return out

    def _check_generate(self, version: int) -> None:
        if self.rollout is None:
            raise WorkerError(f"rank {self.rank} is a {self.role.value} rank, not a rollout rank")
        if version == self.version:
            self.incoming.pop(version, None)  # received again (comm, again) but still held: nothing to install
        if version != self.version and version not in self.incoming and not self._refetch(version):
            fetched = f" (fetched: {', '.join(map(str, sorted(self.incoming)))})" if self.incoming else ""
            raise WorkerError(f"rank {self.rank} holds policy version {self.version}{fetched}, generate asks for {version}")
        if self.setup.data is None:
            raise WorkerError("no data plane: generate needs a work queue")

    def _generate_items(self, step: int, items: list[Any], params: SamplingParams, validation: bool) -> tuple[int, int]:
        """Generate and score claimed items, then complete their results; returns (samples, response tokens)."""
        from dynaresize.contract.workqueue import SampleResult

        gens = self.rollout.generate([it.prompt_ids for it in items], [it.seed for it in items], params)
        score = self.setup.score or (lambda it, ids: {})  # rewards are computed here, beside generation
        results = [SampleResult(it.step, it.prompt, it.index, g.token_ids, g.logprobs, self.version, self.rank,
                                extra=score(it, g.token_ids)) for it, g in zip(items, gens)]
        self.setup.data.complete(step, self.rank, results, validation=validation)
        return len(results), sum(len(g.token_ids) for g in gens)


    # -- the stream: continuous batching across generate commands ------------------------------------------------

    def streams(self, kind: str, payload: dict[str, Any] | None) -> bool:
        """Whether this command joins the rollout engine's running decode (a generate of prompts, with slots)."""
        return (kind == "generate" and (payload or {}).get("prompts") is not None and self.rollout is not None
                and getattr(self.setup.rollout_cfg, "max_running", None) != 0 and hasattr(self.rollout, "add"))

    @property
    def streaming(self) -> bool:
        """Generate commands are decoding (their acks come from :meth:`advance`, through :meth:`take_done`)."""
        return bool(self.stream)

    def wants_more(self) -> bool:
        """The engine has a free KV slot and nothing waiting for one: the next generate command would decode now."""
        return self.streaming and self.rollout.running < int(getattr(self.rollout, "max_running", self._slots))

    def settle(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        """Before a command begins: finish what the stream decodes when the command must not overlap it (any command
        but a generate of the version held and ``ping``; a generate of another version installs it), or abort it
        (``shutdown``). The transport answers the commands that finished here before it begins the next one."""
        payload = payload or {}
        if self.streams(kind, payload):
            if payload.get("version", self.version) != self.version:
                self.finish_stream()
        elif kind == "shutdown":
            self.abort_stream("the rank shuts down")
        elif kind not in CONCURRENT:
            self.finish_stream()

    def begin(self, command_id: str, kind: str, payload: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Start one command (after :meth:`settle`). A generate of prompts joins the running decode and returns None:
        its result comes later from :meth:`take_done`. Any other command runs as :meth:`handle` does."""
        payload = payload or {}
        self.settle(kind, payload)  # a no-op when the transport settled first
        if not self.streams(kind, payload):
            return self.handle(kind, payload)
        self._log_reads()
        out = self._begin_generate(command_id, **payload)
        self._report_pacing()
        return out

    def _begin_generate(self, command_id: str, step: int, version: int, pull_batch: int, max_tokens: int,
                        temperature: float, top_p: float, validation: bool = False,
                        prompts: list[int] | None = None, top_k: int = -1) -> dict[str, Any] | None:
        self._check_generate(version)
        installed_s = 0.0
        if version != self.version:  # every sample keeps one version: the old one's end before the new one installs
            self.finish_stream()
            installed_s = self._install(version)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        items = self.setup.data.claim_prompts(step, self.rank, list(prompts or []), validation=validation)
        t0 = time.perf_counter()
        s = _Streamed(command_id, step, self.version, validation, list(prompts or []), items, pull_batch, t0,
                      installed_s=installed_s)
        if not items:
            return self._streamed_result(s, t0)
        self.rollout.add([Request(f"{command_id}/{i}", tuple(it.prompt_ids), it.seed, params)
                          for i, it in enumerate(items)])
        self.stream[command_id] = s
        return None

    def _count_iteration(self, running: int, waiting: int | None, ended: int, seconds: float) -> None:
        """The iteration's sequences decoded and admitted (``running``/``waiting``: the engine's before it), added to
        :attr:`decode_sums`. An engine that says what waits (torch, emulated) gives both exactly; one that does not
        (vLLM) is taken to decode what its KV slots hold and to admit what they freed."""
        eng = self.rollout
        after = getattr(eng, "waiting", None)
        if waiting is not None and after is not None:
            admitted = max(0, waiting - after)
            active = eng.running - after + ended
        else:
            active = min(running, self._slots)
            admitted = max(0, active - self._decoding)
        self._decoding = max(0, active - ended)
        if active > 0:
            self.decode_sums.add(active, admitted, seconds)

    def advance(self) -> None:
        """One iteration of the rollout engine's stream (timed and counted for the fit of the engine's iteration cost,
        :mod:`dynaresize.contract.decode`): score the samples that ended, complete each slice whose samples all
        ended, and move the commands whose samples all ended to :attr:`done`."""
        if not self.stream:
            self._decoding = 0
            return
        from dynaresize.contract.fencing import FencedRankError
        from dynaresize.contract.workqueue import SampleResult

        eng = self.rollout
        running, waiting = eng.running, getattr(eng, "waiting", None)
        t0 = time.perf_counter()
        try:
            finished = eng.step()
        except Exception as e:  # noqa: BLE001 - the engine failed: every command decoding fails with it
            self.abort_stream(f"the rollout engine failed: {type(e).__name__}: {e}")
            return
        self._count_iteration(running, waiting, len(finished), time.perf_counter() - t0)  # (before its acks)
        score = self.setup.score or (lambda it, ids: {})
        touched: dict[str, _Streamed] = {}
        ended = False
        for f in finished:
            cid, _, pos = f.key.rpartition("/")
            s = self.stream.get(cid)
            if s is None:
                continue
            if s.version != self.version:  # cannot happen (a version installs once the stream ended): never mixed
                self._fail(s, f"began with version {s.version}, the engine holds {self.version}")
                continue
            it, g = s.items[int(pos)], f.generation
            try:
                extra = score(it, g.token_ids)
            except Exception as e:  # noqa: BLE001 - the scorer is guarded; anything else fails this command alone
                self._fail(s, f"scoring {it.key}: {type(e).__name__}: {e}")
                continue
            s.results[int(pos)] = SampleResult(it.step, it.prompt, it.index, g.token_ids, g.logprobs, s.version,
                                               self.rank, extra=extra)
            s.tokens += len(g.token_ids)
            touched[cid] = s
        for cid, s in touched.items():
            if cid not in self.stream:
                continue
            try:
                for a in range(0, len(s.items), s.pull_batch):
                    b = min(len(s.items), a + s.pull_batch)
                    if a not in s.completed and all(i in s.results for i in range(a, b)):
                        self.setup.data.complete(s.step, self.rank, [s.results[i] for i in range(a, b)],
                                                 validation=s.validation)
                        s.completed.add(a)
            except FencedRankError as e:  # this rank was declared lost: everything it decodes is moot
                self.abort_stream(f"fenced: {e}")
                return
            except Exception as e:  # noqa: BLE001 - the data plane failed for this command: an error ack
                self._fail(s, f"{type(e).__name__}: {e}")
                continue
            if len(s.results) == len(s.items):
                del self.stream[cid]
                self.done.append((cid, self._streamed_result(s, time.perf_counter()), None))
                ended = True
        if ended:  # the emulation's pacing record once per finished command, as handle() writes it per command
            self._report_pacing()

    def _streamed_result(self, s: _Streamed, end: float) -> dict[str, Any]:
        """The ack of a streamed generate, as the one-batch path's; its rollout stage interval starts where the
        rank's previous one ended (intervals of one rank do not overlap: busy time is counted once)."""
        start = max(s.started, self._stream_mark)
        self._stream_mark = end
        samples = len(s.items)
        if not s.validation:
            self._stage(Stage.ROLLOUT, s.step, start, end, tokens=s.tokens, samples=samples, version=s.version)
        out = {"samples": samples, "tokens": s.tokens, "busy_s": end - start, "version": s.version,
               "prompts": list(s.prompts), "install_s": s.installed_s}
        if not s.validation and self.decode_sums.n:  # the iterations since the last ack go with this one
            out["decode"], self.decode_sums = self.decode_sums.to_wire(), DecodeSums()
        return out

    def _fail(self, s: _Streamed, error: str) -> None:
        self.rollout.abort([f"{s.command_id}/{i}" for i in range(len(s.items))])
        self.stream.pop(s.command_id, None)
        self.done.append((s.command_id, None, f"WorkerError: rank {self.rank}: {error}"))

    def finish_stream(self) -> None:
        """Decode until every streamed command is done (before a new version, or a command that needs the rank)."""
        while self.stream:
            if self.rollout is None or self.rollout.running == 0:
                for s in list(self.stream.values()):
                    self._fail(s, "its samples left the rollout engine unfinished")
                return
            self.advance()

    def abort_stream(self, reason: str) -> None:
        """Drop every streamed request; their commands fail with ``reason`` (samples already completed stay)."""
        for s in list(self.stream.values()):
            self._fail(s, f"aborted: {reason}")

    def take_done(self) -> list[tuple[str, dict[str, Any] | None, str | None]]:
        """The streamed commands finished since the last call: (command id, result, error), in the order they ended."""
        out, self.done = self.done, []
        return out

    # -- train ----------------------------------------------------------------------------------------------

    def _cmd_train(self, step: int, batch_key: str, n_train: int, version_after: int) -> dict[str, Any]:
        if self.setup.data is None:
            raise WorkerError("no data plane: train needs the batch store")
        t0 = time.perf_counter()
        if self._steps_per_batch > 1:  # (one optimizer step per command: the mini-batches go through train_chunk)
            raise WorkerError(f"rank {self.rank}: train takes one optimizer step; train.mini_batches x epochs = "
                              f"{self._steps_per_batch} trains through train_chunk and optimizer_step")
        tb = self.setup.data.batch(batch_key)
        pending = self.trainer is not None and self.trainer.has_pending_state()
        out = self.train_batch(self._tensors_of(tb), n_train, version_after)

        t1 = self._pace("train", t0, lambda e: e.fwd_bwd_s(*self._lengths(tb), n_train) + e.step_s(pending))
        self._stage(Stage.TRAIN, step, t0, t1, tokens=out["tokens"], version=out["version"])
        return out

    def _trainer_for(self, n_train: int, version_after: int | None = None) -> ZeroTrainer:
        """This rank's training engine, after checking that the command fits its role, topology and version."""
        if self.trainer is None:
            raise WorkerError(f"rank {self.rank} is a {self.role.value} rank, not a trainer")
        if n_train != self.n_train:
            raise WorkerError(f"rank {self.rank} trains with {self.n_train} trainers, the command says {n_train}")
        if version_after is not None and version_after != self.version + 1:
            raise WorkerError(f"rank {self.rank} is at version {self.version}; the update would make it {version_after}")
        return self.trainer

    def _stepped(self, trainer: ZeroTrainer, step: Callable[[], dict[str, float]]) -> tuple[dict[str, float], float, float]:
        """Run an optimizer step (``step``) and log the deferred optimizer state's stage-in when it went in there,
        hidden behind the forward/backward before it. Returns (stats, start, end)."""
        pending = trainer.has_pending_state()
        t0 = time.perf_counter()
        stats = step()
        t1 = time.perf_counter()
        if pending:
            moved = sum(lay.size * 12 for lay in trainer.layouts())  # fp32 master + exp_avg + exp_avg_sq
            self._op(self._pending_switch, SwitchOp.OPTIMIZER_STAGE_IN, t0, t1, critical=False, bytes=moved)
        return stats, t0, t1

    @staticmethod
    def _tokens(batch: dict[str, torch.Tensor]) -> int:
        return int(batch["response_mask"].sum()) if "response_mask" in batch else int(batch["input_ids"].numel())

    def train_batch(self, batch: dict[str, torch.Tensor], n_train: int, version_after: int, loss_fn=None) -> dict[str, Any]:
        trainer = self._trainer_for(n_train, version_after)
        self._set_lr(trainer, version_after - 1, 0)
        stats, t0, t1 = self._stepped(trainer, lambda: trainer.train_step(batch, loss_fn or self._loss_fn(batch)))
        self.version = version_after
        return {"loss": float(stats.get("loss", stats.get("loss_local", 0.0))), "metrics": stats, "tokens": self._tokens(batch),
                "busy_s": t1 - t0, "version": self.version}

    def _cmd_train_chunk(self, step: int, batch_key: str, n_train: int, version: int,
                         batch_groups: int | None = None) -> dict[str, Any]:
        """Forward and backward of this rank's part of a chunk of complete groups; the loss is a sum, the gradients
        wait for ``optimizer_step``. ``tokens`` and ``samples`` are the whole chunk's (for the batch's normaliser).
        With several optimizer steps per RL step (``train.mini_batches x epochs > 1``) the chunk's groups are held
        and each first-pass mini-batch steps once its groups are in (:meth:`_mini_chunk`)."""
        trainer = self._trainer_for(n_train)
        if version != self.version:
            raise WorkerError(f"rank {self.rank} is at version {self.version}; the chunk trains from version {version}")
        if self.setup.data is None:
            raise WorkerError("no data plane: train_chunk needs the batch store")
        tb = self.setup.data.batch(batch_key)
        if self._steps_per_batch > 1:
            return self._mini_chunk(trainer, step, tb, batch_groups)
        batch = self._tensors_of(tb)
        t0 = time.perf_counter()
        stats = trainer.accumulate(batch, self._loss_fn(batch))
        t1 = self._pace("train_chunk", t0, lambda e: e.fwd_bwd_s(*self._lengths(tb), n_train))
        self.setup.hooks.point(self.rank, "train_chunk.accumulated", f"step-{step}")
        tokens, samples = self._tokens(batch), int(batch["input_ids"].shape[0])
        self._stage(Stage.TRAIN, step, t0, t1, tokens=tokens, samples=samples, version=self.version, chunk=True)
        from dynaresize.rl.mismatch import reduce_stats

        from dynaresize.metrics import LOSS_MEANS

        loss_means = {k: float(stats[k]) for k in (*LOSS_MEANS, "tokens") if k in stats}
        return {"loss_sum": float(stats["loss_sum_local"]), "tokens": tokens, "samples": samples, "busy_s": t1 - t0,
                "version": self.version, "metrics": {**reduce_stats([stats]), **loss_means}}

    def _cmd_optimizer_step(self, step: int, n_train: int, version_after: int, denominator: float,
                            publish: bool = False, transport: str = "file", keep_from: int | None = None) -> dict[str, Any]:
        """The optimizer step of the chunks accumulated since the last one, their summed gradients divided by the
        whole batch's ``denominator``. With ``publish``, rank 0 then keeps a host copy of the new weights for
        ``push_weights`` (``comm``; copies older than ``keep_from`` dropped), or stages them as
        ``<weights_dir>/v<version_after>`` (``file``, the fallback; manifest last: a reader sees the whole snapshot
        or none)."""
        trainer = self._trainer_for(n_train, version_after)
        target = None
        if publish and self.rank == 0 and transport == "file":
            if self.setup.weights_dir is None:
                raise WorkerError(f"rank {self.rank}: optimizer_step publish=True needs the run's weights directory "
                                  "(WorkerSetup.weights_dir)")
            target = Path(self.setup.weights_dir).resolve() / f"v{version_after}"
        pending = trainer.has_pending_state()
        if self._steps_per_batch > 1:
            stats, t0, t1 = self._mini_finish(trainer, step)
        else:
            lr = self._set_lr(trainer, step, 0)
            stats, t0, t1 = self._stepped(trainer, lambda: trainer.step(denominator))
            stats = {**stats, **({"lr": lr} if lr is not None else {})}
        t1 = self._pace("optimizer_step", t0, lambda e: e.step_s(pending))
        self.version = version_after
        self._stage(Stage.TRAIN, step, t0, t1, version=self.version, optimizer_step=True)
        self._snapshot(trainer, n_train)
        published, end = 0, t1
        if target is not None:
            assert self.stager is not None
            res = self.stager.stage(str(target), {n: t for n, t in self._weights()}, {"version": version_after})
            published, end = res.bytes, time.perf_counter()
            self._stage(Stage.WEIGHT_SYNC, step, t1, end, version=version_after, bytes=published, publish=True)
        elif publish and self.rank == 0:  # comm: the copy the sends read while the trainers go on
            published = self._sender().hold(version_after, self._weights(), keep_from)
            end = time.perf_counter()
            self._stage(Stage.WEIGHT_SYNC, step, t1, end, version=version_after, bytes=published, publish=True,
                        transport="comm")
        return {"version": self.version, "metrics": stats, "busy_s": end - t0, "published_bytes": published}

    # -- mini-batches and epochs (train.mini_batches, train.epochs; dynaresize.rl.minibatch) and the LR schedule --------

    @property
    def _steps_per_batch(self) -> int:
        tc = self.setup.train_cfg
        return int(getattr(tc, "mini_batches", 1)) * int(getattr(tc, "epochs", 1))

    def _set_lr(self, trainer: ZeroTrainer, rl_step: int, index: int) -> float | None:
        """Set the LR of optimizer step ``index`` of RL step ``rl_step`` (the run's step ``rl_step x steps per
        batch + index``) from the run's schedule, before that step."""
        if self.setup.lr is None:
            return None
        lr = float(self.setup.lr(rl_step * self._steps_per_batch + index))
        trainer.set_lr(lr)
        return lr

    def _mini_state(self, step: int, groups: int | None):
        from dynaresize.rl.minibatch import MiniBatches

        mb = self.minibatches
        if mb is None or mb.step != step:
            tc = self.setup.train_cfg
            mb = self.minibatches = MiniBatches(step, int(tc.mini_batches), int(tc.epochs), groups)
        return mb

    def _mini_step(self, trainer: ZeroTrainer, step: int, index: int, rows: list) -> dict[str, float]:
        """One optimizer step on the samples ``rows`` (one mini-batch), normalised by the mini-batch's own count;
        ``loss_sum_local``: this rank's loss before that normalisation (what a chunk reports)."""
        from dynaresize.contract.batch import TrainBatch

        tb = TrainBatch(step, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows],
                        [0.0] * len(rows), [r[5] for r in rows], [r[0] for r in rows])
        batch = self._tensors_of(tb)
        lr = self._set_lr(trainer, step, index)
        stats, _, _ = self._stepped(trainer, lambda: trainer.train_step(batch, self._loss_fn(batch)))
        stats["loss_sum_local"] = float(stats["loss_local"]) * float(batch["loss_denominator"])
        if lr is not None:
            stats["lr"] = lr
        return stats

    def _mini_chunk(self, trainer: ZeroTrainer, step: int, tb: Any, groups: int | None) -> dict[str, Any]:
        """A chunk's groups held for their mini-batch; each first-pass mini-batch whose groups are all in now steps
        (in order). The ack's ``loss_sum`` and metrics are those of the mini-batches stepped here (0 and none when
        the chunk completes none); ``tokens`` and ``samples`` the chunk's, as on the one-step path."""
        mb = self._mini_state(step, groups)
        mb.add(list(zip(tb.keys, tb.prompt_ids, tb.response_ids, tb.logprobs, tb.advantages, tb.versions)))
        t0 = time.perf_counter()
        parts = []
        for m in mb.ready():
            parts.append(self._mini_step(trainer, step, m, mb.members(m)))
            mb.streamed = m + 1
        t1 = self._pace("train_chunk", t0, lambda e: e.fwd_bwd_s(*self._lengths(tb), trainer.dp))
        tokens, samples = sum(len(r) for r in tb.response_ids), len(tb.keys)
        self._stage(Stage.TRAIN, step, t0, t1, tokens=tokens, samples=samples, version=self.version, chunk=True,
                    mini_batches=len(parts))
        return {"loss_sum": sum(p["loss_sum_local"] for p in parts), "tokens": tokens, "samples": samples,
                "busy_s": t1 - t0, "version": self.version, "metrics": self._mini_metrics(parts)}

    @staticmethod
    def _mini_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
        """The first pass's figures over its mini-batches: mismatch sums added, loss means token-weighted."""
        from dynaresize.metrics import chunk_loss_means
        from dynaresize.rl.mismatch import reduce_stats

        return {**reduce_stats(parts), **chunk_loss_means(parts)} if parts else {}

    def _mini_finish(self, trainer: ZeroTrainer, step: int) -> tuple[dict[str, float], float, float]:
        """The RL step's steps not run yet: first-pass mini-batches whose order was unknown ahead (dynamic sampling),
        then the later epochs. Stats: the last step's grad norm and LR, and the first-pass figures of the mini-batches
        run here (``loss_sum``)."""
        mb = self.minibatches
        if mb is None or mb.step != step:
            raise WorkerError(f"rank {self.rank}: optimizer step of batch {step} without any of its chunks")
        self.minibatches = None
        t0 = time.perf_counter()
        try:
            todo = mb.remaining()
        except ValueError as e:
            raise WorkerError(f"rank {self.rank}, batch {step}: {e}") from None
        first, last = [], {}
        for epoch, m in todo:
            last = self._mini_step(trainer, step, epoch * mb.mini_batches + m, mb.members(m))
            if epoch == 0:
                first.append(last)
        t1 = time.perf_counter()
        stats = {k: last[k] for k in ("grad_norm", "lr") if k in last}
        if first:
            stats.update(self._mini_metrics(first), loss_sum=sum(p["loss_sum_local"] for p in first))
        return stats, t0, t1

    def _sender(self) -> WeightSender:
        if self.sender is None:
            self.sender = WeightSender(self.setup.rollout_cfg.sync_bucket_mb << 20, self._dev)
        return self.sender

    def _cmd_push_weights(self, version: int, ranks: list[int], one_at_a_time: bool = False) -> dict[str, Any]:
        """Send ``version`` to each of ``ranks`` (their ``fetch_weights`` started a receive from this rank), point to
        point on background threads; acked once queued. Trainer rank 0 sends the copy kept at its optimizer step; a
        rollout rank (a relay) the version it received (:meth:`WeightSender.relay`: once its own receive ended and
        its checksum matched; a failed one tells the receivers at once). A version not kept is this rank's own if it
        holds it (a resume, a restart: taken now). ``one_at_a_time``: the sends go one after another (the relay)."""
        if self.rank == 0 and self.trainer is None or self.rank != 0 and self.rollout is None:
            raise WorkerError(f"rank {self.rank} is a {self.role.value} rank: trainer rank 0 and rollout ranks (relays) "
                              "send weights (push_weights)")
        bad = sorted(r for r in ranks if r == self.rank or not 0 <= r < self.setup.world)
        if bad:
            raise WorkerError(f"rank {self.rank} cannot send weights to rank(s) {bad} (world of {self.setup.world})")
        sender = self._sender()
        if not sender.holds(version) and version == self.version:
            sender.hold(version, self._weights())
        try:
            sender.push(version, ranks, one_at_a_time)
        except WeightSyncError as e:
            raise WorkerError(f"rank {self.rank}: {e}") from None
        if self.rank != 0:
            self.setup.hooks.point(self.rank, "push_weights.relay", f"v{version}")
        return {"version": version, "ranks": list(ranks)}

    def _log_sends(self) -> None:
        """Log this rank's finished background sends (rank 0's, a relay's) on the main thread."""
        if self.sender is None:
            return
        for rec in self.sender.take_sent():
            extra = {"error": rec["error"]} if "error" in rec else {}
            self._stage(Stage.WEIGHT_SYNC, max(0, rec["version"] - 1), rec["start"], rec["end"], version=rec["version"],
                        bytes=int(rec.get("bytes", 0)), background=True, transport="comm", to=rec["rank"], **extra)

    def _loss_fn(self, batch: dict[str, torch.Tensor]):
        if self.setup.loss_fn is not None:
            return self.setup.loss_fn
        if "advantages" in batch:
            from dynaresize.rl.grpo import GrpoLoss

            loss = GrpoLoss.from_config(self.setup.train_cfg, self.setup.rollout_cfg.temperature, self.setup.algorithm_cfg)
            if loss.kl_coef > 0:  # KL to the initial policy (dynaresize.rl.reference)
                from dynaresize.rl.reference import WithReference

                return WithReference(loss, self._reference())
            return loss
        return token_nll_loss

    def _reference(self) -> torch.nn.Module:
        """The frozen reference policy (the run's initial model directory), loaded at the first use on this rank."""
        if self.ref_model is None:
            if self.setup.model_dir is None:
                raise WorkerError("train.kl_coef > 0 needs the model directory (WorkerSetup.model_dir) for the reference policy")
            from dynaresize.models.store import load_model
            from dynaresize.rl.reference import frozen

            self.ref_model = frozen(load_model(self.setup.model_dir)).to(self._dev)
        return self.ref_model

    def _tensors_of(self, tb: Any) -> dict[str, torch.Tensor]:
        from dynaresize.rl.batch import collate

        batch = collate(tb.prompt_ids, tb.response_ids, self.setup.pad_id, tb.logprobs, tb.advantages)
        # how many updates each sample's policy version is behind the weights this rank trains from (the mismatch
        # figures of lag 0 compare the same weights: dynaresize.rl.mismatch)
        batch["version_lag"] = torch.tensor([self.version - int(v) for v in tb.versions], dtype=torch.long)
        if self.setup.train_cfg.loss_norm == "token":
            batch["loss_denominator"] = batch["response_mask"].sum()
        else:
            batch["loss_denominator"] = torch.tensor(float(len(tb.prompt_ids)))
        return batch

    # -- weight sync ----------------------------------------------------------------------------------------

    def _cmd_sync_weights(self, version: int, n_train: int, lost: list[int] | None = None) -> dict[str, Any]:
        if n_train != self.n_train:
            raise WorkerError(f"rank {self.rank} has {self.n_train} trainers, sync says {n_train}")
        members = G.sync_ranks(n_train, self.setup.world)
        lost = sorted(set(lost or ()) & set(members))
        if self.rank not in members or self.rank in lost:
            return {"version": self.version, "bytes": 0, "seconds": 0.0}  # trainers other than dp-rank 0: nothing to do
        if self.rank == 0 and version != self.version:
            raise WorkerError(f"rank 0 holds version {self.version}, sync asks to send {version}")
        t0 = time.perf_counter()
        sink = self.rollout.load_weights if self.rollout is not None else None
        dev = self._dev
        if self.rollout is self.vllm and self.vllm is not None:
            # vLLM holds the live weights; the HF module of this rank is refreshed when it becomes a trainer
            named = self.vllm.named_weights()
        else:
            named = self._weights()
        if lost:  # the pre-built group has a member that is gone: its collectives would wait for it forever
            live = [r for r in members if r not in lost]
            got, moved = send_weights_p2p(named, 0, live, self.setup.rollout_cfg.sync_bucket_mb << 20, self.version,
                                          sink=sink, device=dev)
        else:
            got, moved = broadcast_weights(named, 0, self.groups.sync_group(n_train),
                                           self.setup.rollout_cfg.sync_bucket_mb << 20, self.version, sink=sink, device=dev)
        self.version = got
        if self.rollout is self.vllm and self.vllm is not None:
            self.vllm.finish_weight_update(got)
            self._module_stale = True
        if self.rollout is not None:
            self.rollout.version = got
        t1 = self._pace("weight_sync", t0, lambda e: e.model.weight_sync_s())
        self._stage(Stage.WEIGHT_SYNC, max(0, got - 1), t0, t1, version=got, bytes=moved)
        return {"version": got, "bytes": moved, "seconds": t1 - t0}

    # -- background weight transfer through the host -----------------------------------------------------------

    def _cmd_fetch_weights(self, version: int, transport: str = "file", again: bool = False,
                           keep: list[int] | None = None, pushed: bool = False, src: int = 0,
                           forward: bool = False) -> dict[str, Any]:
        """Start receiving ``version`` into host memory (a second buffer) on a background thread while the engine
        decodes with the one it holds: from rank 0 point to point over the world group (``comm``: rank 0 sends it
        once the coordinator pushes it), or read from the snapshot rank 0 published (``file``, the fallback).
        ``started`` is False when this rank already holds it (or a newer one) or is receiving it (``again``: comm,
        received even if held). A transfer error surfaces at the install. ``keep``: the versions the scheduler still
        counts for this rank; a fetched version it no longer counts (no batch needs it) is dropped first.
        ``pushed`` (comm): rank 0 sends this version here whatever this rank answers, so exactly one receive is posted
        for it, even when it is not needed (into a buffer dropped when it ends) or when the fetch is refused.
        ``src`` (comm): the rank that sends it (trainer rank 0, or a relay: ``dynaresize.schedule.relay`` plans who);
        ``again`` from another ``src`` than the receive under way (its relay was lost): that one is dropped and a
        new one posted. ``forward``: this rank may be asked to forward it (``push_weights``) once received."""
        owed = pushed and transport == "comm"
        inc = self.incoming.get(version)
        if again and transport == "comm" and inc is not None and isinstance(inc.read, CommFetch) and inc.read.src != src:
            del self.incoming[version]  # its relay was lost: the receive from it fails on its own thread
        try:
            if self.rollout is None:
                raise WorkerError(f"rank {self.rank} is a {self.role.value} rank: only a rollout rank fetches weights")
            if transport == "file" and self.setup.weights_dir is None:
                raise WorkerError(f"rank {self.rank}: fetch_weights needs the run's weights directory (WorkerSetup.weights_dir)")
            if version in self.incoming or (version <= self.version and not (again and transport == "comm")):
                self.held.add(version)  # the scheduler counts it held: a generate of it reads the snapshot again
                return {"version": version, "started": False}
            out = self._start_fetch(version, transport, keep, src, forward)
            owed = False
            return out
        finally:
            if owed:  # the send on its way has its one receive (its thread holds it); what it brings is dropped
                try:
                    CommFetch(self._weights(), src, version, self.setup.rollout_cfg.sync_bucket_mb << 20, self._dev)
                except Exception as e:  # noqa: BLE001 - rank 0's send to this rank then waits out its timeout
                    log.warning("rank %d: no receive posted for version %d pushed here: %s", self.rank, version, e)

    def _start_fetch(self, version: int, transport: str, keep: list[int] | None, src: int = 0,
                     forward: bool = False) -> dict[str, Any]:
        if keep is not None:
            for v in [v for v in self.incoming if v not in keep]:
                del self.incoming[v]  # a read still running ends on its own thread, its copy then freed
        if len(self.incoming) >= self.max_incoming:
            raise WorkerError(f"rank {self.rank} already holds {len(self.incoming)} fetched versions "
                              f"({', '.join(map(str, sorted(self.incoming)))}), at most {self.max_incoming}: "
                              f"install one (generate with its version) before fetching version {version}")
        if transport == "comm":
            read = CommFetch(self._weights(), src, version, self.setup.rollout_cfg.sync_bucket_mb << 20, self._dev)
            self.incoming[version] = _Incoming(version, read.source, read)
            self.held.add(version)
            if forward:  # a relay: what it receives (its second buffer) may go on to the next ranks
                self._sender().relay(version, read, [n for n, _ in self._weights()])
            self.setup.hooks.point(self.rank, "fetch_weights.started", f"v{version}")
            return {"version": version, "started": True}
        assert self.stager is not None
        path = Path(self.setup.weights_dir).resolve() / f"v{version}"
        self.incoming[version] = _Incoming(version, path, Prefetch(self.stager, path))
        self.held.add(version)
        self.setup.hooks.point(self.rank, "fetch_weights.started", f"v{version}")
        return {"version": version, "started": True}

    def _refetch(self, version: int) -> bool:
        """The scheduler core counts two weight buffers per rollout rank (the version decoding and one more): a rank
        that fetched version v, then installed a newer one over it, may still be given work of v (a lost rank's groups
        handed out again). The engine holds one set of weights, so v is read again from the snapshot rank 0 published
        (the barrier-free schedule keeps every version a batch in flight needs). False when there is none to read."""
        if self.setup.weights_dir is None or self.stager is None or version not in self.held:
            return False
        path = Path(self.setup.weights_dir).resolve() / f"v{version}"
        if not (path / "manifest.json").exists():  # a snapshot without its manifest does not exist (staging writes it last)
            return False
        self.incoming[version] = _Incoming(version, path, Prefetch(self.stager, path))
        return True

    def _log_reads(self) -> None:
        """Log the interval of every finished background read (or receive, or rank 0's send) not logged yet (on the
        main thread)."""
        for inc in self.incoming.values():
            self._log_read(inc)
        self._log_sends()

    def _log_read(self, inc: _Incoming) -> None:
        if inc.logged or inc.read.finished is None:
            return
        inc.logged = True
        try:
            tensors, _ = inc.read.result()
        except Exception:  # noqa: BLE001 - a failed read is reported by the install that needs it
            return
        how = {"transport": "comm"} if isinstance(inc.read, CommFetch) else {}
        self._stage(Stage.WEIGHT_SYNC, max(0, inc.version - 1), inc.read.started, inc.read.finished, version=inc.version,
                    bytes=sum(t.numel() * t.element_size() for t in tensors.values()), background=True, **how)

    def _install(self, version: int) -> float:
        """Install fetched ``version`` (waiting for its read if it still runs) into the rollout engine in place;
        fetched versions older than it are dropped. Returns its seconds (the wait for the read included): what the
        rank waited for the weight sync before it could generate (a generate's ack says it: ``install_s``)."""
        inc = self.incoming.pop(version)
        t0 = time.perf_counter()
        try:
            tensors, meta = inc.read.result()
        except (StagingError, WeightSyncError) as e:
            if isinstance(inc.read, CommFetch) and inc.read.src != 0 and version not in self.incoming:
                # from a relay (lost, or its copy refused): the next generates of this version fail the same way, so
                # the coordinator sends each again once a receive from another holder replaced this one
                self.incoming[version] = inc
            raise WorkerError(f"rank {self.rank}: the weights of version {version} ({inc.path}) cannot be installed: "
                              f"{e}") from None
        self._log_read(inc)
        if self.setup.emulator is not None:  # the transfer lasts the modelled weight sync from the fetch's start
            self.setup.emulator.fetched(inc.read.started, inc.read.finished - inc.read.started)
        if meta.get("version") != version:
            raise WorkerError(f"rank {self.rank}: {inc.path} holds version {meta.get('version')!r}, not {version}")
        named = []
        for n, p in self._weights():
            t = tensors.get(n)
            if t is None or t.shape != p.shape or t.dtype != p.dtype:
                got = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
                raise WorkerError(f"rank {self.rank}: {inc.path}: weight {n!r} is {got}, the model has {p.dtype}{list(p.shape)}")
            named.append((n, t))
        self.rollout.load_weights(named)  # the sync's path: in place (torch), or vLLM's own loader
        if self.rollout is self.vllm and self.vllm is not None:
            self.vllm.finish_weight_update(version)
            self._module_stale = True
        self.version = self.rollout.version = version
        for v in [v for v in self.incoming if v < version]:
            del self.incoming[v]
        t1 = time.perf_counter()
        self._stage(Stage.WEIGHT_SYNC, max(0, version - 1), t0, t1, version=version,
                    bytes=sum(t.numel() * t.element_size() for _, t in named), install=True)
        return t1 - t0

    # -- role switch ----------------------------------------------------------------------------------------

    def _stage(self, stage: Stage, step: int, start: float, end: float, **extra: Any) -> None:
        """One busy interval of this rank in the event log (what the analysis tools turn into utilisation)."""
        ev = self.setup.events
        if ev is not None:
            off = ev.now() - time.perf_counter()  # perf_counter -> run clock
            ev.emit(EventType.STAGE, step=step, stage=stage, ranks=str(self.rank), start=start + off, end=end + off, **extra)

    def _op(self, switch_id: str | None, op: SwitchOp, start: float, end: float, critical: bool = True, bytes: int = 0) -> None:
        if self.setup.emulator is not None and switch_id:
            end = self.setup.emulator.pace_switch_op(op, start, end)
        rec = {"switch_id": switch_id or "", "op": op.value, "rank": self.rank, "start": start, "end": end,
               "seconds": end - start, "critical": critical, "bytes": int(bytes)}
        self.ops.append(rec)
        ev = self.setup.events
        if ev is not None and switch_id:
            # perf_counter -> run clock: shift by the offset measured now
            off = ev.now() - time.perf_counter()
            ev.emit(EventType.SWITCH_OP, switch_id=switch_id, op=op, ranks=format_ranks([self.rank]),
                    start=start + off, end=end + off, critical=critical, bytes=int(bytes))

    def _cmd_switch_role(self, switch_id: str, step: int, from_train: int, to_train: int) -> dict[str, Any]:
        if from_train != self.n_train:
            raise WorkerError(f"rank {self.rank} has {self.n_train} trainers, switch {switch_id} says {from_train}")
        self.minibatches = None  # (none held: a switch comes between an RL step's optimizer step and the next chunk)
        if self.snaps is not None:
            self.snaps.drop()  # its partitions are the old trainer count's
        cands = self.groups.trainer_counts()
        if to_train not in cands:
            raise WorkerError(f"switch {switch_id}: {to_train} trainers is not a candidate topology {cands}")
        first = len(self.ops)
        was, will = self.rank < from_train, self.rank < to_train
        if self.rank >= max(from_train, to_train):  # not involved: keeps its role, engine and work
            self.n_train = to_train
            return {"role": self.role.value, "ops": []}
        old_role = self.role
        emu = self.setup.emulator
        if emu is not None:  # a split the emulated GPU cannot hold fails here, before anything moved (its OOM)
            emu.check_split(to_train, self.rank)
        if emu is not None:  # the modelled seconds of each op of this switch on this rank
            emu.begin_switch(from_train, to_train, self.rank)
        self.incoming.clear()  # fetched versions are for rollout engines: a rank that switches drops them
        pc = time.perf_counter
        # offload: old trainers' ZeRO partitions to host
        t0 = pc()
        old = self.trainer.export_partitions() if was else None
        nbytes = sum(p.master.numel() * 12 for p in old) if old else 0
        if was:
            self._op(switch_id, SwitchOp.OFFLOAD, t0, pc(), bytes=nbytes)
        self.setup.hooks.point(self.rank, "switch_role.offload", f"step-{step}")
        # comm_select
        t0 = pc()
        union = self.groups.union_group(from_train, to_train)
        self._op(switch_id, SwitchOp.COMM_SELECT, t0, pc())
        # weight_sync for new trainers with stale weights (rank 0's version is authoritative)
        t0 = pc()
        dev = self._dev
        v = torch.tensor([self.version], dtype=torch.int64, device=dev)
        dist.broadcast(v, src=0, group=union)
        stale = torch.tensor([int(will and (int(v) != self.version or getattr(self, "_module_stale", False)))], dtype=torch.int64, device=dev)
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=union)
        if int(stale):
            _, moved = broadcast_weights(self._weights(), 0, union, self.setup.rollout_cfg.sync_bucket_mb << 20, int(v), device=dev)
            self.version = int(v)
            self._module_stale = False
            self._op(switch_id, SwitchOp.WEIGHT_SYNC, t0, pc(), bytes=moved)
        # engine teardown and build
        t0 = pc()
        if self.trainer is not None:
            self.module = self.trainer.destroy(detach=not will)
            self.trainer = None
            if not will:
                self.ref_model = None  # a rollout rank needs no reference policy (reloaded if it trains again)
        if self.rollout is not None and will:
            self.rollout.sleep()
            self.rollout = None
        gc.collect()
        self.n_train = to_train
        if will:
            self._build_trainer(to_train)
        elif self.rollout is None:
            self.module.eval()
            self._build_rollout()
        self._op(switch_id, SwitchOp.ENGINE_BUILD, t0, pc())
        # optimizer reshard (point to point over the union group); installed at the first step
        t0 = pc()
        layouts = self.trainer.layouts() if will else None
        n_groups = len(layouts) if layouts else (len(old) if old else 0)
        n_groups_t = torch.tensor([n_groups], dtype=torch.int64, device=dev)
        dist.all_reduce(n_groups_t, op=dist.ReduceOp.MAX, group=union)
        new, sent = R.exchange(old, layouts, from_train, to_train, union, int(n_groups_t), device=dev)
        del old
        self._op(switch_id, SwitchOp.OPTIMIZER_RESHARD, t0, pc(), bytes=sent)
        if will:
            self._defer(new, switch_id)
        if emu is not None:
            emu.end_switch()
        result_ops = self.ops[first:]
        return {"role": self.role.value, "from_role": old_role.value, "ops": result_ops}

    def _defer(self, parts: list[Partition] | Callable[[], list[Partition]], switch_id: str) -> None:
        assert self.trainer is not None
        self._pending_switch = switch_id
        if self.setup.deferred_optimizer:
            self.trainer.defer_optimizer_state(parts)
        else:
            self.trainer.install_partitions(parts() if callable(parts) else parts)

    # -- staging --------------------------------------------------------------------------------------------

    def _snapshot_name(self, tag: str, what: str, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank  # (another rank's: a snapshot this rank holds a copy of)
        if self.setup.checkpoint_dir is not None:  # a checkpoint of the run: <checkpoint_dir>/<tag>/rank<r>-<what>
            return str(Path(self.setup.checkpoint_dir).resolve() / tag / f"rank{rank}-{what}")
        return f"{tag}-rank{rank}-{what}"  # node-local staging: <staging_dir>/<tag>-rank<r>-<what>

    def _cmd_stage_state(self, tag: str) -> dict[str, Any]:
        """Stage this rank's weights and, on a trainer, its ZeRO partitions to node-local disk (two snapshots, so
        a restore can take the weights now and the optimizer state later)."""
        assert self.stager is not None
        meta: dict[str, Any] = {"rank": self.rank, "version": self.version, "n_train": self.n_train}
        t0 = time.perf_counter()
        res = [self.stager.stage(self._snapshot_name(tag, "weights"), {n: t for n, t in self._weights()}, meta)]
        self.setup.hooks.point(self.rank, "stage_state.weights", tag)
        if self.trainer is not None:
            tensors, parts_meta = {}, []
            for p in self.trainer.export_partitions(copy=False):
                tensors.update(p.tensors())
                parts_meta.append({**p.layout.to_json(), "step": p.step})
            res.append(self.stager.stage(self._snapshot_name(tag, "optim"), tensors, {**meta, "partitions": parts_meta}))
        total = sum(r.bytes for r in res)
        self._op(None, SwitchOp.OPTIMIZER_STAGE_OUT, t0, time.perf_counter(), critical=False, bytes=total)
        return {"manifest": str(res[0].path / "manifest.json"), "manifests": [str(r.path / "manifest.json") for r in res],
                "bytes": total, "seconds": time.perf_counter() - t0}

    # -- in-memory snapshots (faults.snapshot_every; dynaresize.worker.snapshot) ---------------------------------------

    def _snapshot(self, trainer: ZeroTrainer, n_train: int) -> None:
        """After an optimizer step that makes ``version`` a multiple of ``snapshot_every``: copy what ``stage_state``
        would stage (partitions; rank 0: the weights too) and send it to the ring peer, on a background thread."""
        every = self.setup.snapshot_every
        if not every or self.snaps is None or n_train < 2 or self.version % every:
            return
        tensors, parts_meta = {}, []
        for p in trainer.export_partitions(copy=False):
            tensors.update(p.tensors())
            parts_meta.append({**p.layout.to_json(), "step": p.step})
        t0 = time.perf_counter()
        weights = {n: t for n, t in self._weights()} if self.rank == 0 else None
        self.snaps.take(self.version, n_train, tensors, parts_meta, weights)
        self.snaps.taken += 1
        self.snaps.main_s += time.perf_counter() - t0

    def _cmd_snapshot_held(self) -> dict[str, Any]:
        """The complete snapshots this rank holds: its own and its ring predecessor's (step, rank, weights)."""
        return self.snaps.held_summary() if self.snaps is not None else {"own": [], "held": []}

    def _cmd_materialize_snapshot(self, tag: str, step: int, optim: list[int], weights: list[int]) -> dict[str, Any]:
        """Write the snapshot of ``step`` as checkpoint ``tag``: ``rank<r>-optim`` for each rank of ``optim`` (this
        rank's own, or the copy it holds for its predecessor) and ``rank<r>-weights`` for each rank of ``weights``
        (all the same weights: every rank holds the trainers' version at a checkpoint), as ``stage_state`` writes
        them (the same files a disk checkpoint of that step holds; the restore path reads them)."""
        assert self.snaps is not None and self.stager is not None
        t0 = time.perf_counter()
        res = []
        for r in optim:
            snap = self.snaps.of(r, step)
            if snap is None:
                raise WorkerError(f"rank {self.rank} holds no snapshot of rank {r} at step {step}")
            res.append(self.stager.stage(self._snapshot_name(tag, "optim", r), snap.tensors("optim"),
                                         {**snap.meta(), "partitions": snap.index["partitions"]}))
        if weights:
            snap = self.snaps.with_weights(step)
            if snap is None:
                raise WorkerError(f"rank {self.rank} holds no weights snapshot of step {step}")
            for r in weights:
                res.append(self.stager.stage(self._snapshot_name(tag, "weights", r), snap.tensors("weights"), snap.meta(r)))
        total = sum(x.bytes for x in res)
        self._op(None, SwitchOp.OPTIMIZER_STAGE_OUT, t0, time.perf_counter(), critical=False, bytes=total)
        return {"manifest": str(res[0].path / "manifest.json") if res else "", "bytes": total,
                "manifests": [str(x.path / "manifest.json") for x in res], "seconds": time.perf_counter() - t0}

    def _cmd_restore_state(self, tag: str) -> dict[str, Any]:
        """Restore this rank's weights now (verified chunk by chunk, in place) and, on a trainer, its optimizer
        state on a background thread, installed at the first optimizer step. The trainer count must be the one
        the state was staged with (a different count goes through the reshard of ``switch_role``)."""
        self.minibatches = None  # a step boundary: no mini-batch of a batch in training survives it
        assert self.stager is not None
        t0 = time.perf_counter()
        name = self._snapshot_name(tag, "weights")
        if self.trainer is None and self.setup.checkpoint_dir is not None and not Path(name).exists():
            # this rank was declared lost before the checkpoint (it staged nothing): a rollout rank holds the same
            # weights as rank 0 after every sync, so it starts from rank 0's
            name = str(Path(self.setup.checkpoint_dir).resolve() / tag / "rank0-weights")
        _, meta = self.stager.load(name, into={n: t for n, t in self._weights()})
        self.version = int(meta["version"])
        if self.vllm is not None and self.rollout is self.vllm:  # vLLM holds its own copy: reload the restored weights
            self.vllm.load_weights(self._weights())
            self.vllm.finish_weight_update(self.version)
        if self.rollout is not None:
            self.rollout.version = self.version
        t1 = time.perf_counter()
        self._op(tag, SwitchOp.WEIGHT_LOAD, t0, t1)
        if self.trainer is not None:
            if meta["n_train"] != self.n_train:
                raise WorkerError(f"state {tag!r} of rank {self.rank} was staged with {meta['n_train']} trainers, "
                                  f"this rank has {self.n_train}")
            pf = Prefetch(self.stager, self._snapshot_name(tag, "optim"))

            def parts() -> list[Partition]:
                out, m = pf.result()  # raises StagingError on a corrupted chunk: never installed
                return [Partition(PartitionLayout(pj["group"], pj["length"], pj["dp"], pj["dp_rank"], pj["size"]),
                                  out[f"g{pj['group']}.master"], out[f"g{pj['group']}.exp_avg"],
                                  out[f"g{pj['group']}.exp_avg_sq"], pj["step"]) for pj in m["partitions"]]

            self._defer(parts, tag)
        return {"version": self.version, "seconds": t1 - t0}
