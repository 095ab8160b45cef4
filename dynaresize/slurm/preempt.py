"""Time-out and preemption: Slurm's warning signal -> checkpoint -> requeue by leader id -> resume.

Slurm sends USR2 ``slurm.signal_before_s`` seconds before the time limit (``--signal=B:USR2@s``; the batch shell
forwards it to the coordinator's srun, see :mod:`dynaresize.slurm.sbatch`). slurmstepd then signals EVERY process of
the coordinator's step, the embedded redis-server included, whose default action for USR2 is to die (seen on the
local cluster). So :meth:`Preemption.install` BLOCKS USR2 in the coordinator (children inherit the mask across
fork and exec, so Redis and any helper never see it) and a thread takes it with ``sigtimedwait``; a Python handler
stays installed as a fallback. Doing real work at signal time is unsafe anyway, so only the request is recorded; the
coordinator's loop calls :meth:`Preemption.poll` at a safe point (between steps). ``poll`` then runs the
checkpoint callbacks that the main job registered (ranks flush staged state, the coordinator writes its
checkpoint into the run directory) and requeues the whole het job with ``scontrol requeue <leader>``. The
requeued job starts again with the same job id and run directory (``SLURM_RESTART_COUNT`` + 1) and resumes from
the checkpoint. After ``slurm.max_requeues`` requeues it only checkpoints and asks the loop to stop.

Hook for the main job::

    pre = ctx.preemption
    pre.on_checkpoint(lambda reason: job.checkpoint(reason))   # must be complete when it returns
    while not done:
        run_step()
        if pre.poll() is not Action.CONTINUE:
            break                                              # requeued (the job is being killed) or stopping
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("dynaresize.slurm.preempt")

CheckpointFn = Callable[[str], None]


class Action(str, enum.Enum):
    CONTINUE = "continue"  # no signal: keep going
    REQUEUED = "requeued"  # checkpointed and requeued: exit now (Slurm kills the job shortly)
    STOP = "stop"  # checkpointed, requeue not allowed (limit reached or disabled): finish cleanly


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(signalled: bool, requeue_enabled: bool, restart_count: int, max_requeues: int) -> Decision:
    """Pure: what to do at a safe point."""
    if not signalled:
        return Decision(Action.CONTINUE, "no signal")
    if not requeue_enabled:
        return Decision(Action.STOP, "signal received; slurm.requeue is off")
    if restart_count >= max_requeues:
        return Decision(Action.STOP, f"signal received; already requeued {restart_count} times (slurm.max_requeues={max_requeues})")
    return Decision(Action.REQUEUED, f"signal received; requeue {restart_count + 1} of at most {max_requeues}")


class Preemption:
    """Records Slurm's warning signal and turns it into checkpoint + requeue at the caller's safe point."""

    def __init__(self, leader_job_id: str | None, restart_count: int, requeue_enabled: bool, max_requeues: int,
                 requeue_fn: Callable[[str], None] | None = None, signum: int = signal.SIGUSR2):
        self.leader = leader_job_id
        self.restart_count = restart_count
        self.requeue_enabled = requeue_enabled and leader_job_id is not None
        self.max_requeues = max_requeues
        self.requeue_fn = requeue_fn
        self.signum = signum
        self._callbacks: list[CheckpointFn] = []
        self._event = threading.Event()
        self.signalled_at: float | None = None
        self.handled: Decision | None = None

    def install(self) -> "Preemption":
        """Block the signal in this process (call it before starting threads or children) and watch for it.

        Must be called from the main thread. Children started afterwards inherit the blocked signal.
        """
        self._old_handler = signal.signal(self.signum, self._on_signal)
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="slurm-preemption", daemon=True)
        self._watcher.start()
        return self

    def uninstall(self) -> None:
        """Undo :meth:`install` (tests)."""
        if getattr(self, "_watcher", None) is None:
            return
        self._stop.set()
        self._watcher.join(timeout=2)
        self._watcher = None
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
        signal.signal(self.signum, self._old_handler)

    def _watch(self) -> None:
        while not self._stop.is_set():
            if signal.sigtimedwait({self.signum}, 0.2) is not None:
                log.warning("preemption: signal %d received", self.signum)
                self._on_signal(self.signum, None)

    def _on_signal(self, signum, frame) -> None:  # only records: safe anywhere
        self.signalled_at = time.time()
        self._event.set()

    def trigger(self) -> None:
        """Act as if the signal arrived (tests, or a coordinator that decides to yield its allocation)."""
        self._on_signal(self.signum, None)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def on_checkpoint(self, fn: CheckpointFn) -> None:
        """Register a checkpoint callback; called with a reason string, in registration order."""
        self._callbacks.append(fn)

    def poll(self) -> Action:
        """Call at a safe point. Idempotent: after handling it keeps answering the same action."""
        if self.handled is not None:
            return self.handled.action
        d = decide(self.requested, self.requeue_enabled, self.restart_count, self.max_requeues)
        if d.action is Action.CONTINUE:
            return d.action
        log.warning("preemption: %s", d.reason)
        for fn in self._callbacks:
            fn(d.reason)
        if d.action is Action.REQUEUED:
            assert self.leader is not None and self.requeue_fn is not None
            try:
                self.requeue_fn(self.leader)
            except Exception as e:  # never crash the coordinator over a failed requeue: stop cleanly instead
                log.error("preemption: requeue of job %s failed: %s; stopping after the checkpoint", self.leader, e)
                d = Decision(Action.STOP, f"requeue failed: {e}")
        self.handled = d
        return d.action
