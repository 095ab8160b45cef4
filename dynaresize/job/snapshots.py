"""The coordinator's side of the in-memory snapshots (``faults.snapshot_every``; the ranks' side is
:mod:`dynaresize.worker.snapshot`): its own step state at each snapshot step, and on a lost trainer the snapshot
written out as a checkpoint of that step, so the restart (:meth:`dynaresize.job.recovery.Recovery.restart`) goes
on from it instead of the last disk checkpoint.

At each snapshot step (``version % snapshot_every == 0``, right after the optimizer step that made it) the
coordinator keeps a copy of its :class:`JobState` (what a disk checkpoint writes for it: step, version, samples,
rewards, switches, the policy state, ...); the trainers take theirs at the same optimizer step. On a trainer loss
:meth:`Snapshots.materialise`:

1. asks every surviving trainer what it holds (``snapshot_held``), bounded by :data:`ANSWER_S`;
2. picks the newest step held whole (:func:`plan`, pure): every trainer's partition on a survivor (its own copy
   or its ring peer's) and the weights (rank 0's, or its peer's copy), newer than the last disk checkpoint, and
   the coordinator's state of that step; and waits (bounded, while the live rollout ranks still complete samples of
   them) for the batches a resume at that step trains first to be generated (they are in the run's Redis; a resume
   at step k needs batches k .. k+s-1, as after a drain); when they are not, the snapshot before it (the ranks keep
   the two newest) if its batches are: a loss early in a step, before its batch was all handed out, costs one step
   more;
3. claims ``checkpoints/step-<k>`` and has the holders write it (``materialize_snapshot``: the layout and files
   ``stage_state`` writes), then writes the tag's ``coordinator.json`` and the top-level one, as a checkpoint does.

The restart then resumes from the newest intact checkpoint, which is this one: one restore path. The files are
written to the run directory (the restore reads files), once, at the loss; no step writes a checkpoint to disk.
Anything short of that (snapshots off, a single trainer, both copies of a partition lost, a switch since the
snapshot, a survivor that does not answer, a batch not generated) leaves today's disk-checkpoint restart, and the
reason is said in the restart's line and event.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dynaresize.job import checkpoint_files as ckpt
from dynaresize.job.runtime import Job, Services
from dynaresize.job.state import JobState, save_state
from dynaresize.job.transport import Phase, Transport

log = logging.getLogger("dynaresize.job")

ANSWER_S = 30.0  # how long the survivors have to answer (their stream may hold a command failing on the lost peer)
GENERATED_S = 60.0  # how long the batches a resume trains first may take to finish generating on the live ranks
STALLED_S = 10.0  # ... and how long without a new sample before the rest is taken as never handed out
KEEP = 3  # coordinator states kept (the ranks' newest complete snapshot may be one behind the newest taken)


@dataclass(frozen=True)
class Plan:
    """Who writes what of the snapshot of ``step``: rank -> (partitions of ranks, weights files of ranks)."""

    step: int
    writes: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)


def plan(held: dict[int, dict], lost: set[int], states: dict[int, dict], checkpoint_step: int, world: int,
         skip: frozenset[int] = frozenset()) -> Plan | str:
    """The newest snapshot step that can be written whole, or why none can (pure).

    ``held``: survivor rank -> its ``snapshot_held`` answer (``own``/``held``: lists of ``{rank, step, n_train,
    weights}``); ``lost``: the ranks lost now; ``states``: step -> the coordinator's state then (``asdict(JobState)``);
    ``checkpoint_step``: the last disk checkpoint's step (a snapshot must be newer); ``skip``: steps ruled out
    already (their batches were not generated)."""
    if not states:
        return "the coordinator kept no snapshot state yet"
    copies: dict[tuple[int, int], int] = {}  # (trainer, step) -> a survivor holding it
    weights: dict[int, int] = {}  # step -> a survivor holding the weights
    for r, ans in sorted(held.items()):
        for s in [*(ans.get("own") or []), *(ans.get("held") or [])]:
            if s:
                copies.setdefault((int(s["rank"]), int(s["step"])), r)
                if s.get("weights"):
                    weights.setdefault(int(s["step"]), r)
    why = []
    for step in sorted(states, reverse=True):
        if step in skip:
            continue
        st = states[step]
        if step <= checkpoint_step:
            why.append(f"step {step} is not newer than the disk checkpoint (step {checkpoint_step})")
            break
        n = int(st["n_train"])
        missing = [t for t in range(n) if (t, step) not in copies]
        if len(missing) == n:
            why.append(f"step {step}: the survivors hold none of its copies (a switch since drops them)")
            continue
        if missing:
            both = [t for t in missing if t in lost and (t + 1) % n in lost]  # the ring peer holds t's copy
            why.append(f"step {step}: no surviving copy of trainer rank(s) {', '.join(map(str, missing))}"
                       + (" (the rank and the peer holding its copy were both lost)" if both else
                          " (its copy was not complete)"))
            continue
        if step not in weights:
            why.append(f"step {step}: no surviving copy of the weights")
            continue
        writes: dict[int, tuple[list[int], list[int]]] = {}
        for t in range(n):
            writes.setdefault(copies[(t, step)], ([], []))[0].append(t)
        gone = set(st.get("lost") or [])
        writes.setdefault(weights[step], ([], []))[1].extend(r for r in range(world) if r not in gone)
        return Plan(step, writes)
    return "; ".join(why) or "no snapshot is complete"


class Snapshots:
    def __init__(self, job: Job, svc: Services, tx: Transport):
        self.job, self.svc, self.tx = job, svc, tx
        self.states: dict[int, dict] = {}  # snapshot step -> the coordinator's state then (JSON-safe copy)

    @property
    def every(self) -> int:
        return int(self.job.cfg.faults.snapshot_every)

    def kept(self, step: int) -> None:
        """The optimizer step before ``step`` is done (``job.state`` is that step's): keep the state when the
        trainers take a snapshot there."""
        if not self.every or step % self.every or step >= self.job.cfg.run.steps:
            return
        self.states[step] = json.loads(json.dumps(asdict(self.job.state)))
        for old in sorted(self.states)[:-KEEP]:
            del self.states[old]

    def forget(self) -> None:
        """A restart: the ranks' snapshots go with their processes."""
        self.states.clear()

    def materialise(self, lost: list[int], attempt: int) -> tuple[JobState | None, str]:
        """Write the newest whole snapshot as a checkpoint of its step. Returns (its state, the line saying so), or
        (None, why the snapshot could not be used)."""
        job, cfg = self.job, self.job.cfg
        if not self.every:
            return None, "faults.snapshot_every is 0 (snapshots off)"
        st = job.state
        if st.n_train < 2:
            return None, "a single trainer has no peer to hold its snapshot"
        disk = _checkpoint_step(st.checkpoint)
        survivors = [r for r in range(st.n_train) if r not in set(lost) | set(st.lost)]
        at = Phase(f"snap{attempt}")
        held, why = self._ask(at, "snapshot_held", survivors, {})
        if held is None:
            return None, why
        answers = {r: a.result or {} for r, a in held.items()}
        skip: set[int] = set()
        notes: list[str] = []
        while True:  # the newest whole snapshot whose first batches are generated (an older one: one step more)
            p = plan(answers, set(lost), self.states, disk if disk is not None else -1, job.world, frozenset(skip))
            if isinstance(p, str):
                return None, "; ".join(notes + [p])
            gen = self._generated(p.step, wait=not skip)
            if gen is None:
                break
            skip.add(p.step)
            notes.append(gen)
        tag = ckpt.claim_tag(job.run_dir, p.step, {"epoch": self.svc.bus.epoch, "job_id": job.job_id,
                                                   "incarnation": st.incarnation, "snapshot": True})
        ranks = sorted(p.writes)
        # one command, the same payload to every writer would not do: each gets its own (the ids differ by payload)
        sent = {r: self.tx.send(at, "materialize_snapshot", [r], {"tag": tag, "step": p.step, "optim": p.writes[r][0],
                                                                   "weights": p.writes[r][1]}) for r in ranks}
        for r, s in sent.items():
            _, why = self._await(s.cmd.command_id, [r], "materialize_snapshot")
            if why is not None:
                _discard(job.run_dir, tag)
                return None, why
        state = JobState(**self.states[p.step])
        state.checkpoint = f"checkpoints/{tag}"
        state.run_steps = cfg.run.steps
        ckpt.save_tag_state(job.run_dir, tag, state)
        save_state(job.run_dir, state)
        what = ", ".join(f"{'trainer' if r < st.n_train else 'rollout'} rank {r}" for r in sorted(lost))
        again = st.step - p.step
        line = (f"{what} lost at step {st.step}: going on from the in-memory snapshot of step {p.step} "
                f"({again} step{'' if again == 1 else 's'} retrained; the last disk checkpoint was "
                f"{'step ' + str(disk) if disk is not None else 'none'}), written as checkpoints/{tag}")
        return state, line

    def _ask(self, at: Phase, kind: str, ranks: list[int], payload: dict):
        sent = self.tx.send(at, kind, ranks, payload)
        return self._await(sent.cmd.command_id, ranks, kind)

    def _await(self, cid: str, ranks: list[int], kind: str):
        """The acks of every rank of ``ranks`` (bounded by :data:`ANSWER_S`), or (None, why not)."""
        deadline = time.monotonic() + ANSWER_S
        acks: dict = {}
        while True:
            res = self.svc.bus.await_acks(cid, ranks, timeout=1.0)
            acks.update(res.acks)
            if not res.missing:
                break
            if time.monotonic() > deadline:
                return None, (f"rank(s) {', '.join(map(str, res.missing))} did not answer {kind} within {ANSWER_S:g} s "
                              "(busy in a collective with the lost rank?)")
        bad = {r: a.error for r, a in acks.items() if not a.ok}
        if bad:
            r, err = sorted(bad.items())[0]
            return None, f"{kind} failed on rank {r}: {err}"
        return acks, None

    def _generated(self, k: int, wait: bool) -> str | None:
        """Whether batches k .. k+s-1 are generated (a resume at step k trains them first); with ``wait``, while the
        live rollout ranks still complete samples of them (the commands they hold), up to :data:`GENERATED_S`, and
        no longer than :data:`STALLED_S` without a new one (the rest was never handed out). None when they are,
        else why not."""
        q, cfg = self.svc.queue, self.job.cfg
        last = min(k + cfg.pipeline.staleness_bound, cfg.run.steps)
        t0 = time.monotonic()
        seen, moved = -1, t0
        while True:
            short = [(j, q.done(j), q.total(j)) for j in range(k, last) if not q.done(j) >= q.total(j) > 0]
            if not short:
                return None
            now = time.monotonic()
            done = sum(d for _, d, _ in short)
            if done != seen:
                seen, moved = done, now
            if not wait or now - t0 > GENERATED_S or now - moved > STALLED_S or any(t == 0 for _, _, t in short):
                j, d, total = short[0]
                return (f"batch {j}, which a resume at step {k} trains first, was not generated ({d} of {total} "
                        f"samples in the run's Redis{f' after {now - t0:.0f} s' if wait else ''})")
            time.sleep(0.2)


def _checkpoint_step(checkpoint: str | None) -> int | None:
    if not checkpoint:
        return None
    try:
        return ckpt.tag_step(Path(checkpoint).name)
    except ValueError:
        return None


def _discard(run_dir: Path, tag: str) -> None:
    try:
        ckpt.discard(run_dir, tag)
    except OSError as e:
        log.warning("could not remove the unfinished snapshot checkpoint %s: %s", tag, e)
