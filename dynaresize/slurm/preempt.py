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

Site preemption (``PreemptMode=REQUEUE`` with a ``GraceTime``; seen on Slurm 22.05 with
``PreemptType=preempt/partition_prio``, ``preempt/qos`` is expected to signal the same way): the moment a higher-priority job selects ours, slurmstepd sends SIGCONT +
SIGTERM to EVERY process of every step of every component (not to the batch shell; no USR2 unless the site sets
``PreemptParameters=send_user_signal``), the job stays RUNNING with ``PreemptTime`` set, and only when the grace
time is over do the batch shell and the tasks get SIGTERM, then SIGKILL, and Slurm requeues the job. A job that
ends by itself within the grace time is NOT requeued (it completes), so the coordinator requeues itself, like on
USR2. With ``install(watch_term=True)`` the coordinator blocks SIGTERM too (Redis, its child, must survive it to
serve the checkpoint) and the watcher asks the controller whether the job was preempted
(:func:`dynaresize.slurm.adapter.preempt_time`): if so it records a preemption request (checkpoint + requeue at the
next safe point; not bounded by ``max_requeues``: Slurm would requeue the job anyway); any other SIGTERM (scancel,
time limit without ``--signal``) is handed to the main thread's own SIGTERM handler (the coordinator's: stop after
the step). Worker ranks keep serving through a SIGTERM (:class:`TermDeferral`) until the coordinator has
checkpointed them and sent ``shutdown``, its Redis is gone, or a timeout.

Hook for the main job::

    pre = ctx.preemption
    pre.on_checkpoint(lambda reason: job.checkpoint(reason))   # must be complete when it returns
    while not done:
        run_step()
        if pre.poll() is not PreemptAction.CONTINUE:
            break                                              # requeued (the job is being killed) or stopping
"""

from __future__ import annotations

import _thread
import enum
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("dynaresize.slurm.preempt")

CheckpointFn = Callable[[str], None]


class PreemptAction(str, enum.Enum):
    CONTINUE = "continue"  # no signal: keep going
    REQUEUED = "requeued"  # checkpointed and requeued: exit now (Slurm kills the job shortly)
    STOP = "stop"  # checkpointed, requeue not allowed (limit reached or disabled): finish cleanly


@dataclass(frozen=True)
class PreemptDecision:
    action: PreemptAction
    reason: str


def decide(signalled: bool, requeue_enabled: bool, restart_count: int, max_requeues: int, preempted: bool = False) -> PreemptDecision:
    """Pure: what to do at a safe point. ``preempted``: the signal was Slurm's preemption (its SIGTERM with the job's
    ``PreemptTime`` set), which Slurm itself would follow with a requeue, so ``max_requeues`` does not bound it."""
    if not signalled:
        return PreemptDecision(PreemptAction.CONTINUE, "no signal")
    if not requeue_enabled:
        return PreemptDecision(PreemptAction.STOP, "signal received; slurm.requeue is off")
    if preempted:
        return PreemptDecision(PreemptAction.REQUEUED, f"preempted by Slurm; requeue now (restart {restart_count + 1}; preemptions are not counted against slurm.max_requeues)")
    if restart_count >= max_requeues:
        return PreemptDecision(PreemptAction.STOP, f"signal received; already requeued {restart_count} times (slurm.max_requeues={max_requeues})")
    return PreemptDecision(PreemptAction.REQUEUED, f"signal received; requeue {restart_count + 1} of at most {max_requeues}")


class Preemption:
    """Records Slurm's warning signal and turns it into checkpoint + requeue at the caller's safe point."""

    def __init__(self, leader_job_id: str | None, restart_count: int, requeue_enabled: bool, max_requeues: int,
                 requeue_fn: Callable[[str], None] | None = None, signum: int = signal.SIGUSR2,
                 is_preempted: Callable[[], str | None] | None = None):
        self.leader = leader_job_id
        self.restart_count = restart_count
        self.requeue_enabled = requeue_enabled and leader_job_id is not None
        self.max_requeues = max_requeues
        self.requeue_fn = requeue_fn
        self.signum = signum
        self.is_preempted = is_preempted  # the job's PreemptTime (None: not preempted); see install(watch_term=True)
        self.preempted: str | None = None  # PreemptTime once a SIGTERM was found to be Slurm's preemption
        self._watched: set[int] = {signum}
        self._callbacks: list[CheckpointFn] = []
        self._event = threading.Event()
        self.signalled_at: float | None = None
        self.handled: PreemptDecision | None = None

    def install(self, watch_term: bool = False) -> "Preemption":
        """Block the signal in this process (call it before starting threads or children) and watch for it.

        ``watch_term``: block and watch SIGTERM too; a SIGTERM while Slurm has the job preempted becomes a
        preemption request, any other goes to the main thread's Python SIGTERM handler (a default one that exits
        with 143 through ``SystemExit`` is installed when there is none). Must be called from the main thread.
        Children started afterwards inherit the blocked signals."""
        self._watched = {self.signum} | ({signal.SIGTERM} if watch_term else set())
        self._old_handler = signal.signal(self.signum, self._on_signal)
        self._old_term = None
        if watch_term and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self._watched)
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
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)

    def _watch(self) -> None:
        while not self._stop.is_set():
            info = signal.sigtimedwait(self._watched, 0.2)
            if info is None:
                continue
            if info.si_signo == signal.SIGTERM:
                self._on_term()
            else:
                log.warning("preemption: signal %d received", info.si_signo)
                self._on_signal(info.si_signo, None)

    def _on_term(self) -> None:
        """A SIGTERM: Slurm's preemption (checkpoint + requeue at the next safe point) or a stop for the main thread."""
        when = None
        if self.is_preempted is not None and self.handled is None:
            try:
                when = self.is_preempted()
            except Exception as e:  # a controller that does not answer: treat it as a plain stop
                log.warning("preemption: could not ask Slurm whether the job was preempted: %s", e)
        if when:
            log.warning("preemption: SIGTERM, and Slurm preempted the job at %s: checkpoint and requeue at the next "
                        "safe point (ranks keep serving until then)", when)
            self.trigger(preempted=when)
            return
        log.warning("SIGTERM (not a preemption: scancel, time limit or an operator): passed to the main thread's handler")
        # runs the handler at the main thread's next bytecode; it does not cut a blocking call short (the signal
        # stays blocked there), and the coordinator's waits are short (acks: 2 s)
        _thread.interrupt_main(signal.SIGTERM)

    def _on_signal(self, signum, frame) -> None:  # only records: safe anywhere
        self.signalled_at = time.time()
        self._event.set()

    def trigger(self, preempted: str | None = None) -> None:
        """Act as if the signal arrived (tests, or a coordinator that decides to yield its allocation);
        ``preempted``: Slurm's PreemptTime, when the request is Slurm's preemption."""
        if preempted:
            self.preempted = preempted
        self._on_signal(self.signum, None)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def on_checkpoint(self, fn: CheckpointFn) -> None:
        """Register a checkpoint callback; called with a reason string, in registration order."""
        self._callbacks.append(fn)

    def poll(self) -> PreemptAction:
        """Call at a safe point. Idempotent: after handling it keeps answering the same action."""
        if self.handled is not None:
            return self.handled.action
        d = decide(self.requested, self.requeue_enabled, self.restart_count, self.max_requeues, bool(self.preempted))
        if d.action is PreemptAction.CONTINUE:
            return d.action
        log.warning("preemption: %s", d.reason)
        for fn in self._callbacks:
            fn(d.reason)
        if d.action is PreemptAction.REQUEUED:
            assert self.leader is not None and self.requeue_fn is not None
            try:
                self.requeue_fn(self.leader)
            except Exception as e:  # never crash the coordinator over a failed requeue: stop cleanly instead
                log.error("preemption: requeue of job %s failed: %s; stopping after the checkpoint", self.leader, e)
                d = PreemptDecision(PreemptAction.STOP, f"requeue failed: {e}")
        self.handled = d
        return d.action


TERM_EXIT_CODE = 128 + signal.SIGTERM


def _exit_on_term(signum, frame) -> None:
    """SIGTERM's default action for a process that watches SIGTERM on a thread: leave through ``SystemExit`` (so
    ``finally`` blocks stop the embedded Redis instead of leaving it behind)."""
    raise SystemExit(TERM_EXIT_CODE)


class TermDeferral:
    """A worker rank under Slurm does not die of the first SIGTERM.

    On preemption Slurm sends SIGTERM to every rank at the same moment as to the coordinator, which still has to
    finish the step and checkpoint every rank's state; a rank that died of the signal would make that checkpoint
    impossible (the job would go back to an older one). So the first SIGTERM only starts a watchdog: the rank keeps
    applying commands and ends normally at the coordinator's ``shutdown``. The watchdog ends the process (exit 143)
    when ``coordinator_gone()`` answers True twice in a row (its Redis refuses connections: no shutdown will come)
    or ``timeout_s`` after the signal. SIGKILL (end of the grace time, ``KillWait`` after scancel) ends it anyway.
    A Python handler, not a blocked signal: children of the rank keep the default action (a blocked mask would be
    inherited, and a child outliving its parent escapes Slurm's process tracking)."""

    def __init__(self, timeout_s: float, coordinator_gone: Callable[[], bool] | None = None,
                 exit_fn: Callable[[int], None] = os._exit, poll_s: float = 0.5):
        self.timeout_s = timeout_s
        self.coordinator_gone = coordinator_gone
        self.exit_fn = exit_fn
        self.poll_s = poll_s
        self.received_at: float | None = None
        self.exit_reason: str | None = None

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> "TermDeferral":
        """Call from the main thread. ``signals``: the stop signals deferred (a local run's ranks defer SIGINT too:
        an operator's ``pkill -INT`` reaches every process of the job at once, like SIGTERM)."""
        self._old = {s: signal.signal(s, self._on_term) for s in signals}
        return self

    def uninstall(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def _on_term(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received_at is not None:
            log.warning("%s again: still serving until the coordinator's shutdown", name)
            return
        self.received_at = time.monotonic()
        log.warning("%s: this rank keeps serving until the coordinator's shutdown (it checkpoints first on a "
                    "stop or a preemption); it exits after %.0f s, or sooner if the coordinator's Redis goes away",
                    name, self.timeout_s)
        threading.Thread(target=self._watch, name="sigterm-watchdog", daemon=True).start()

    def _watch(self) -> None:
        assert self.received_at is not None
        deadline = self.received_at + self.timeout_s
        misses = 0
        while True:
            time.sleep(self.poll_s)
            if time.monotonic() >= deadline:
                self.exit_reason = f"no shutdown from the coordinator within {self.timeout_s:.0f} s of the stop signal"
                break
            if self.coordinator_gone is not None:
                try:
                    gone = self.coordinator_gone()
                except Exception as e:  # noqa: BLE001 - unknown is not gone
                    log.debug("coordinator liveness check failed: %s", e)
                    gone = False
                misses = misses + 1 if gone else 0
                if misses >= 2:
                    self.exit_reason = "the coordinator's Redis is gone after the stop signal: no shutdown will come"
                    break
        log.error("exiting: %s", self.exit_reason)
        for h in logging.getLogger().handlers:
            try:
                h.flush()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        self.exit_fn(TERM_EXIT_CODE)
