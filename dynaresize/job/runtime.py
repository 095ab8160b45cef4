"""The typed values the coordinator's components share: the job (config, state, clock, who holds which role) and
the services the bootstrap builds (the run's Redis and its clients, the model, the task, the launcher)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynaresize.config.schema import Config
from dynaresize.events import EventLog
from dynaresize.job.filtering import BatchAssembler
from dynaresize.job.state import JobState

if TYPE_CHECKING:  # the annotations only (no import cycle, no Redis or transformers import at this module's load)
    import redis as redis_client
    from transformers import PreTrainedTokenizerBase

    from dynaresize.contract.workqueue import RolloutQueue
    from dynaresize.control.commands import CommandBus
    from dynaresize.control.registry import Registry
    from dynaresize.control.server import RedisServer
    from dynaresize.metrics import Loggers
    from dynaresize.tasks.base import Task


@dataclass
class StepTimes:
    """What step k measured (the report's ``step_end`` and the loggers' ``time/*``), for batch k, the batch it trained."""

    rollout_s: float = 0.0  # batch k's generation: its generate commands' busy seconds per rollout rank
    train_s: float = 0.0  # batch k's training: its chunks and its optimizer step (the slowest trainer of each)
    # The seconds a rollout rank waited for the weights batch k is generated with (version k - s) to arrive, per
    # rollout rank: the barrier schedule's blocking ``sync_weights`` (every rollout rank of the split takes part, from
    # its send to the last ack), the barrier-free schedule's installs (a rank's wait for its background receive to
    # end, plus loading it, before its first generate of the version: the generate's ``install_s``); 0 for the
    # batches of version 0. The retired lockstep loop measured its blocking sync of the version step k made, at the
    # end of step k; on the core step k is reported when its optimizer step is done, before that version travels.
    # ``dynaresize analyze`` shows the same transfers as ``weight_sync`` intervals, labelled by the step whose
    # optimizer step made the version (k - s - 1).
    sync_s: float = 0.0
    tokens_generated: int = 0
    tokens_trained: int = 0


@dataclass
class Job:
    """The run as the schedule sees it. ``state`` and ``last`` are replaced on a restart and a takeover."""

    cfg: Config
    run_dir: Path
    state: JobState
    events: EventLog | None = None  # opened by Coordinator.run()
    last: StepTimes = field(default_factory=StepTimes)  # what the last step measured (the report's figures)
    t_start: float = field(default_factory=time.monotonic)
    elapsed_before: float | None = None  # state.elapsed_s when this process first measured it
    job_id: str = ""  # the run's Redis namespace and fencing identity (dynaresize.rundir.job_id; filled in)

    def __post_init__(self) -> None:
        if not self.job_id:
            from dynaresize.rundir import job_id

            self.job_id = job_id(self.run_dir)

    @property
    def world(self) -> int:
        return self.cfg.cluster.gpus

    @property
    def bound(self) -> int:
        return self.cfg.pipeline.staleness_bound

    def elapsed(self) -> float:
        if self.elapsed_before is None:
            self.elapsed_before = self.state.elapsed_s
        return self.elapsed_before + time.monotonic() - self.t_start

    def trainers(self) -> list[int]:
        return list(range(self.state.n_train))

    def rollouts(self) -> list[int]:
        return [r for r in range(self.state.n_train, self.world) if r not in self.state.lost]

    def alive(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.state.lost]

    def roles(self) -> str:
        return "".join("x" if r in self.state.lost else "T" if r < self.state.n_train else "R" for r in range(self.world))

    def live_steps(self) -> range:
        """The steps whose batches may be queued now: the one in flight and the ``bound`` ahead of it."""
        return range(self.state.step, min(self.state.step + self.bound + 1, self.cfg.run.steps))


@dataclass
class Services:
    """Built once at bootstrap (``dynaresize.job.bootstrap``); ``bus`` is replaced on a restart (a new epoch),
    ``launcher`` whenever ranks are started or taken over."""

    srv: RedisServer
    redis: redis_client.Redis
    bus: CommandBus
    registry: Registry
    queue: RolloutQueue
    task: Task
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    assembler: BatchAssembler
    metrics: Loggers | None
    launcher: Any = None  # dynaresize.job.launcher.LocalLauncher / AttachedRanks, or a Slurm adapter's ranks
    health: Any = None  # dynaresize.control.health.RoundTrips: the coordinator's Redis round trips (None: not measured)
