"""The checkpoint manager: when to checkpoint (``due``), and how a checkpoint is taken, checked and given up;
plus what a start reads back (the resume state, the incarnation counter, the batches trained after the checkpoint).
The files themselves (tags, verification, retention) are :mod:`dynaresize.job.checkpoint_files`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from dynaresize import atomic
from dynaresize.events import EventLog, format_ranks
from dynaresize.job import checkpoint_files as ckpt
from dynaresize.disk import SpaceWatch, describe, is_disk_full
from dynaresize.job.errors import JobError, RanksLost, resume_plan
from dynaresize.job.runtime import Job, Services
from dynaresize.job.state import JobState, save_state
from dynaresize.job.transport import Phase, Transport

log = logging.getLogger("dynaresize.job")


class Checkpointer:
    def __init__(self, job: Job, svc: Services, tx: Transport):
        self.job, self.svc, self.tx = job, svc, tx
        self.in_progress: str | None = None  # the checkpoint directory claimed and not complete yet
        self.last_failure: str | None = None  # why the last checkpoint attempt failed (None: it did not)
        self.disk_full = False  # the last attempt failed on a full disk (ENOSPC/EDQUOT)

    def due(self, step: int) -> bool:
        """Whether the step boundary before ``step`` takes a checkpoint (``run.checkpoint_every``; the end of the
        run has its own, taken when the ranks stop)."""
        every = self.job.cfg.run.checkpoint_every
        return bool(every) and step % every == 0 and step < self.job.cfg.run.steps

    def checkpoint(self, at: Phase, reason: str = "") -> str | None:
        """Every rank stages its state under ``checkpoints/<tag>/``, then the coordinator writes the tag's own
        state, then the top-level ``coordinator.json``, then old checkpoints beyond ``run.keep_checkpoints`` go.
        Returns the tag written (None: not written). The tag is a directory this coordinator claimed for the attempt
        (``step-<k>``, or ``step-<k>.<n>`` when the name is taken: a checkpoint another coordinator may still be
        writing is never deleted or reused). A replayed ack of ``stage_state`` is trusted only when what it names is
        there and intact; otherwise the ranks stage again into a new directory (a new command id: applied, not
        answered from the stored ack). A staging failure on a rank (a full disk: its ack carries the StagingError)
        or a failed state write is not fatal: a ``checkpoint_failed`` event, the partial tag removed, the previous
        checkpoint stays the resume point, the run goes on. A lost rank (dead, silent) is handled as before.
        Whatever ends an attempt, its claim ends with it (:attr:`in_progress` only names a checkpoint a second stop
        signal is cutting short): a failed attempt's directory is removed, one cut by an error is left incomplete
        (a resume sets it aside)."""
        before = self.in_progress
        try:
            tag = self._checkpoint(at)
        except KeyboardInterrupt:
            raise  # a second stop signal in the middle of it: the shutdown abandons it (abandon_in_progress)
        except BaseException:
            if self.in_progress != before:
                self.in_progress = None
            raise
        if tag is None and self.in_progress not in (None, before):
            stale, self.in_progress = self.in_progress, None
            log.warning("checkpoint %s: its attempt ended without being written (%s); removed", stale,
                        self.last_failure or "no reason recorded")
            try:
                ckpt.discard(self.job.run_dir, stale)
            except OSError as e:
                log.warning("could not remove the failed checkpoint %s: %s", stale, e)
        return tag

    def _checkpoint(self, at: Phase) -> str | None:
        job, run_dir = self.job, self.job.run_dir
        step = job.state.step
        self.last_failure, self.disk_full = None, False
        done = Path(job.state.checkpoint).name if job.state.checkpoint else None
        if done and ckpt.tag_step(done) == step and (run_dir / "checkpoints" / "coordinator.json").exists():
            return done  # this step is checkpointed already
        t0 = time.monotonic()
        ranks = job.alive()
        for attempt in (1, 2):
            tag = self._claim(step)
            staged = self._stage_into(at, tag, ranks) if tag is not None else None
            if staged is None:
                return None
            untrusted = self._untrusted_replays(tag, staged)
            if not untrusted:
                break
            again = "; the ranks stage again into a new directory" if attempt == 1 else ""
            self.failed(tag, {r: why + again for r, why in untrusted.items()})
        else:
            return None
        previous = job.state.checkpoint
        job.state.checkpoint = f"checkpoints/{tag}"
        job.state.elapsed_s = job.elapsed()
        job.state.run_steps = job.cfg.run.steps  # the batches this launch generated (an extended run's resume reads it)
        self.svc.bus.check_epoch()
        try:
            ckpt.save_tag_state(run_dir, tag, job.state)
            save_state(run_dir, job.state)
        except OSError as e:
            from dynaresize.staging import os_error_text

            job.state.checkpoint = previous
            self.failed(tag, {None: f"writing the coordinator state: {os_error_text(e)}"})
            return None
        self.in_progress = None
        try:
            removed = ckpt.retain(run_dir, job.cfg.run.keep_checkpoints, current=tag)
            if removed:
                log.info("checkpoint %s written; removed older checkpoints %s", tag, ", ".join(removed))
        except OSError as e:  # the new checkpoint is in place; an old one left behind only takes space
            log.warning("checkpoint %s written, but removing older ones failed: %s", tag, e)
        job.events.emit("stage", step=job.state.step, stage="checkpoint", ranks=format_ranks(range(job.world)),
                        start=job.events.now() - (time.monotonic() - t0), end=job.events.now())
        return tag

    def final(self, at: Phase) -> str | None:
        """The run's last checkpoint, which holds its final weights. One that failed on a full disk is waited out:
        once space comes back on ``checkpoints/`` it is taken again, for up to ``faults.disk_full_wait_s``; past it
        the run ends ``incomplete`` (:meth:`unsaved`)."""
        return self._waited_out(at, "the final checkpoint")

    def periodic(self, at: Phase) -> str | None:
        """A checkpoint at a step boundary (``run.checkpoint_every``; the ranks are drained there). One that failed
        on a full disk is waited out like the final one; a disk still full past ``faults.disk_full_wait_s`` stops
        the run (JobError: the reason, where it stopped, what a resume trains again): training on with no checkpoint
        writable only adds steps a crash would lose, while the disk fills further. Any other failure (row 6 of
        docs/FAULTS.md: an I/O error on one rank) leaves the previous checkpoint the resume point and the run goes on."""
        from dynaresize.job.errors import where_stopped

        step = self.job.state.step
        tag = self._waited_out(at, f"the checkpoint of step {step}")
        if tag is None and self.disk_full:
            st, wait_s = self.job.state, self.job.cfg.faults.disk_full_wait_s
            waited = f"no space came back within faults.disk_full_wait_s ({wait_s:g} s)" if wait_s else \
                "faults.disk_full_wait_s is 0"
            raise JobError(f"the checkpoint of step {step} failed on a full disk and {waited}: {self.last_failure}; the "
                           f"run stops instead of training on with no checkpoint it can write; "
                           f"{where_stopped(st.step, st.checkpoint)}; free space first")
        return tag

    def _waited_out(self, at: Phase, what: str) -> str | None:
        tag = self.checkpoint(at)
        wait_s = self.job.cfg.faults.disk_full_wait_s
        deadline = time.monotonic() + wait_s
        while tag is None and self.disk_full and time.monotonic() < deadline:
            where = self.job.run_dir / "checkpoints"
            watch = SpaceWatch(where)
            log.warning("%s failed on a full disk (%s): waiting up to %.0f s for space (faults.disk_full_wait_s), "
                        "then it is taken again", what, describe(where), wait_s)
            while not watch.back() and time.monotonic() < deadline:
                time.sleep(0.5)
            if not watch.back():
                break
            tag = self.checkpoint(at)
        return tag

    def unsaved(self) -> str | None:
        """Why the run's end is not on disk: its last checkpoint (the final weights) is not of the step the run
        reached, with the reason it failed; None when it is."""
        st = self.job.state
        try:
            at = ckpt.tag_step(Path(st.checkpoint).name) if st.checkpoint else None
        except ValueError:
            at = None
        if at == st.step:
            return None
        why = self.last_failure or "it was not taken"
        return (f"the final checkpoint of step {st.step} (the run's final weights) was not written: {why}; "
                f"{resume_plan(st.step, st.checkpoint)}")

    def _claim(self, step: int) -> str | None:
        """A fresh checkpoint directory for this attempt, owned by this coordinator (``checkpoint_files.claim_tag``)."""
        try:
            self.in_progress = ckpt.claim_tag(self.job.run_dir, step, {"epoch": self.svc.bus.epoch, "job_id": self.job.job_id,
                                                                       "incarnation": self.job.state.incarnation})
        except OSError as e:
            from dynaresize.staging import os_error_text

            self.failed(f"step-{step}", {None: f"creating its directory: {os_error_text(e)}"}, discard=False)
            return None
        return self.in_progress

    def _stage_into(self, at: Phase, tag: str, ranks: list[int]):
        """Every live rank stages its state into ``tag``: their acks, or None when a rank's staging failed
        (handled: logged, the tag removed)."""
        sent = self.tx.send(at, "stage_state", ranks, {"tag": tag})
        try:
            return self.tx.wait(sent.cmd, ranks, "stage_state")
        except RanksLost:
            self.in_progress = None  # left incomplete (a resume sets it aside): not a stop's abandoned checkpoint
            raise  # a rank died or went silent: handled as before (restart, or the job fails)
        except JobError:
            failed = self.tx.failures(sent, "StagingError")  # a rank's StagingError (a full disk), with its text
            if not failed:
                self.in_progress = None
                raise  # a rank failed for another reason than staging: as before
            self.failed(tag, failed)
            return None

    def _untrusted_replays(self, tag: str, staged) -> dict[int, str]:
        """Ranks whose ``stage_state`` ack was replayed (the stored result of an earlier application of the same
        command, e.g. the one a coordinator taken over from sent) while what it names is gone or damaged."""
        st = self.job.state
        out = {}
        for r, ack in sorted(staged.acks.items()):
            if not ack.replayed:
                continue
            problems = ckpt.rank_problems(self.job.run_dir, tag, r, st.version, st.n_train)
            if problems:
                out[r] = (f"rank {r}'s stage_state ack was replayed (the stored result of its first application; "
                          f"nothing was staged again), but what it names is gone or damaged: {problems[0]}; not trusted")
        return out

    def failed(self, tag: str, failures: dict[int | None, str], discard: bool = True) -> None:
        """Log why checkpoint ``tag`` was not written; remove it when it is this coordinator's (``discard``)."""
        keep = self.job.state.checkpoint or "none (a resume starts from scratch)"
        first = sorted(failures.items(), key=lambda x: -1 if x[0] is None else x[0])[0]
        self.last_failure = f"{tag}: {'' if first[0] is None else f'rank {first[0]}: '}{first[1]}"
        self.disk_full = self.disk_full or any(is_disk_full(err) for err in failures.values())
        for r, err in sorted(failures.items(), key=lambda x: -1 if x[0] is None else x[0]):
            reason = f"{tag} not written: {err}; resume point stays {keep}"
            log.warning("checkpoint %s failed%s: %s", tag, "" if r is None else f" on rank {r}", reason)
            try:
                self.job.events.emit("control", what="checkpoint_failed", reason=reason, **({} if r is None else {"rank": r}))
            except OSError as e:  # the run directory's disk may be the full one: the warning above still says it
                log.warning("could not log checkpoint_failed: %s", e)
        if not discard:
            return
        if self.in_progress == tag:
            self.in_progress = None
        try:
            ckpt.discard(self.job.run_dir, tag)
        except OSError as e:
            log.warning("could not remove the failed checkpoint %s: %s", tag, e)

    def abandon_in_progress(self, by_signal: bool = False) -> str | None:
        """A checkpoint left in progress at the end (``by_signal``: a second stop signal cut it short; else the
        attempt ended some other way, its reason in :attr:`last_failure`): logged, and its reason returned (None:
        none was in progress); its directory (claimed by this coordinator, so no one else writes it) is removed once
        local ranks have exited; ranks started by srun may still write it, so it stays (incomplete: never resumed
        from; retain removes it later)."""
        tag, self.in_progress = self.in_progress, None
        if tag is None:
            return None
        why = "a second stop signal cut it short" if by_signal else f"not completed: {self.last_failure or 'its attempt ended early'}"
        reason = f"checkpoint {tag} abandoned ({why}); resume point stays {self.job.state.checkpoint or 'none'}"
        log.warning("%s", reason)
        self.job.events.emit("control", what="checkpoint_abandoned", reason=reason)
        if not self.svc.launcher.external:
            try:
                ckpt.discard(self.job.run_dir, tag)
            except OSError as e:
                log.warning("could not remove the abandoned checkpoint %s: %s", tag, e)
        return reason


def next_incarnation(run_dir: Path) -> int:
    """1 on a run directory's first start, then 2, 3, ... (kept in ``checkpoints/incarnation``): names this start's
    keys in Redis (e.g. the world group's rendezvous), which outlive a crash in the append-only file."""
    path = run_dir / "checkpoints" / "incarnation"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        n = int(path.read_text().strip()) + 1
    except (OSError, ValueError):
        n = 1
    atomic.write_text(path, f"{n}\n")
    return n


def resume_state(run_dir: Path, world: int) -> JobState | None:
    """The state a resume starts from: the newest checkpoint that verifies (``checkpoint_files.select_resume``).
    Newer tags found damaged are logged (``control`` what=checkpoint_skipped, naming the file) and set aside
    under ``checkpoints/damaged/``; a damaged or stale top-level ``coordinator.json`` is rewritten from the
    chosen tag's own copy. None intact: StateError (nothing deleted)."""
    res = ckpt.select_resume(run_dir, world)
    if res is None:
        return None
    notes: list[str] = []
    if res.state_file_problem is not None:
        notes.append(f"{res.state_file_problem}; using the copy in checkpoints/{res.tag}")
    for tag, why in res.skipped:
        where = ""
        writer = ckpt.live_writer(run_dir, tag) if (run_dir / "checkpoints" / tag).is_dir() else None
        if writer is not None:  # a coordinator this one takes over from may still be writing it: not touched
            where = f"; left in place: {writer} may still be writing it"
        elif (run_dir / "checkpoints" / tag).is_dir():
            try:
                where = f"; set aside as {ckpt.set_aside(run_dir, tag).relative_to(run_dir)}"
            except OSError as e:
                where = f"; could not set it aside: {e}"
        notes.append(f"{tag} skipped: {why}{where}; resuming from {res.tag}")
    for note in notes:
        log.warning("resume: %s", note)
    if notes:
        with EventLog(run_dir / "events.jsonl") as ev:  # before run() opens the log: these precede 'resume'
            for note in notes:
                ev.emit("control", what="checkpoint_skipped", reason=note)
    top = run_dir / "checkpoints" / "coordinator.json"
    if res.tag is not None and (res.state_file_problem is not None or res.skipped or not top.exists()):
        try:
            save_state(run_dir, res.state)  # the resume point of record is the chosen, intact one
        except OSError as e:
            log.warning("resume: could not rewrite %s: %s (the checkpoint tags are used next time too)", top, e)
    return res.state


def rewind_batches(run_dir: Path, step: int, events: EventLog) -> None:
    """Steps trained after the last checkpoint (``step``: the checkpoint's) were lost with the processes that
    trained them (a hard stop): they are trained again from the checkpoint, so their old records go, and the log
    says so."""
    path = run_dir / "batches.jsonl"
    if not path.exists():
        return
    keep, dropped = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rec_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # a line cut by a hard stop: named, dropped
            reason = f"{path} line {n} is not a complete record (cut by a hard stop?): dropped ({line[:60]!r})"
            log.warning("resume: %s", reason)
            events.emit("control", what="damaged_record", reason=reason)
            continue
        (keep if rec_step < step else dropped).append(line if rec_step < step else rec_step)
    if dropped:
        events.emit("control", what="rewind", reason=f"steps {min(dropped)}..{max(dropped)} ran after the last "
                    f"checkpoint (step {step}) and are trained again")
    atomic.write_text(path, "".join(l + "\n" for l in keep))
