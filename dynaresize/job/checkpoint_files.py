"""Checkpoints of a run on disk: which are complete and intact, which one a resume starts from, which to keep.

Pure file logic (no Redis, no ranks). Layout under ``<run_dir>/checkpoints/``::

    coordinator.json        the coordinator state of the resume point (written after the tag's own copy)
    step-<k>/               one checkpoint, taken when step k is the next step to train
      owner.json            who writes it (coordinator pid, host, epoch), written when the directory is claimed
      rank<r>-weights/      every rank's weights: manifest.json + data.bin (dynaresize.staging, per-chunk checksums)
      rank<r>-optim/        trainers only (ranks 0..n_train-1): their ZeRO partitions
      coordinator.json      the coordinator state of this checkpoint, written last: it marks the tag complete
    step-<k>.<n>/           a later attempt at step k's checkpoint (the name step-<k> was taken): same layout
    damaged/step-<k>.<n>/   tags a resume found damaged, set aside (kept for inspection, never deleted here)

A checkpoint is *complete* when its own ``coordinator.json`` is readable (it is written only after every rank
acknowledged staging its state), and *intact* when, in addition, every rank's snapshot has its manifest and every
chunk its length and checksum (:func:`verify`, streamed through one chunk-sized buffer). A resume starts from the
newest intact checkpoint (:func:`select_resume`), whatever the top-level ``coordinator.json`` says or whether it
is readable at all; :func:`retain` keeps the newest ``run.keep_checkpoints`` complete ones.

Takeover safety: a coordinator claims a fresh directory for each attempt (:func:`claim_tag`, an exclusive mkdir),
so it never deletes or reuses the files of a checkpoint another coordinator (one it took over from, hung but
alive) may still be writing; :func:`live_writer` says when an incomplete tag's owner may still write it, and then
:func:`retain` and a resume leave it alone. :func:`rank_problems` checks what one rank staged (a replayed ack of
``stage_state`` is trusted only when the files it names are there and intact).

Run directories written before tags had their own ``coordinator.json``: the tag the top-level file names counts
as complete, with the top-level state as its state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from dynaresize import atomic
from dynaresize.job.state import STATE_FILE, JobState, StateError, read_state, write_state
from dynaresize.staging import StagingError, verify_snapshot

CHECKPOINTS = "checkpoints"
DAMAGED = "damaged"
OWNER_FILE = "owner.json"
_TAG = re.compile(r"^step-(\d+)(?:\.([2-9]|[1-9]\d+))?$")


@dataclass(frozen=True)
class Resume:
    """Where a resumed run starts: the state of checkpoint ``tag``, and the newer tags passed over, with why."""

    state: JobState
    tag: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (tag, what is damaged), newest first
    state_file_problem: str | None = None  # the top-level coordinator.json was unreadable (the tag's copy was used)


def tag_step(tag: str) -> int:
    """``step-12`` -> 12; anything else is not a checkpoint tag (ValueError naming it)."""
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a checkpoint tag (expected step-<k> or step-<k>.<n>)")
    return int(m.group(1))


def _tag_key(tag: str) -> tuple[int, int]:
    """Order of tags: by step, then by attempt (``step-4`` < ``step-4.2`` < ``step-5``)."""
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a checkpoint tag (expected step-<k> or step-<k>.<n>)")
    return int(m.group(1)), int(m.group(2) or 1)


def tags(run_dir: str | Path) -> list[str]:
    """The checkpoint tags present under ``<run_dir>/checkpoints``, newest (highest step) first."""
    ck = Path(run_dir) / CHECKPOINTS
    try:
        names = [p.name for p in ck.iterdir() if p.is_dir() and _TAG.match(p.name)]
    except FileNotFoundError:
        return []
    return sorted(names, key=_tag_key, reverse=True)


def claim_tag(run_dir: str | Path, step: int, owner: dict) -> str:
    """A fresh directory for an attempt at step ``step``'s checkpoint, created by this call alone (an exclusive
    mkdir): ``step-<k>``, or ``step-<k>.<n>`` when an earlier attempt holds the name (an abandoned or failed one, or
    one another coordinator may still be writing). Never reuses, empties or deletes an existing directory.
    ``owner`` (coordinator pid, host, epoch) goes to its ``owner.json`` (:func:`live_writer`)."""
    ck = Path(run_dir) / CHECKPOINTS
    ck.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        tag = f"step-{step}" if n == 1 else f"step-{step}.{n}"
        try:
            (ck / tag).mkdir()
        except FileExistsError:
            n += 1
            continue
        atomic.write_json(ck / tag / OWNER_FILE, {"host": socket.gethostname(), "pid": os.getpid(), **owner})
        return tag


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not reaped) writes nothing
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def live_writer(run_dir: str | Path, tag: str) -> str | None:
    """Who may still be writing checkpoint ``tag``: a text naming its owner (``owner.json``) when the tag is
    incomplete and that coordinator is another process alive on this host, or runs on another host (which cannot
    be checked from here); None when nobody can (complete, no owner file: an older layout, or its process is gone,
    or it is this process)."""
    d = Path(run_dir) / CHECKPOINTS / tag
    if (d / STATE_FILE).exists():
        return None
    try:
        owner = json.loads((d / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    who = f"coordinator pid {pid} on {host}" + (f" (epoch {owner['epoch']})" if "epoch" in owner else "")
    if host != socket.gethostname():
        return f"{who}, which cannot be checked from this host"
    if pid == os.getpid() or not _pid_alive(pid):
        return None
    return f"{who}, still alive"


def save_tag_state(run_dir: str | Path, tag: str, state: JobState) -> Path:
    """The coordinator state of checkpoint ``tag`` at ``checkpoints/<tag>/coordinator.json`` (atomic, fsynced).
    Written after every rank has staged its state: its presence marks the checkpoint complete."""
    tag_step(tag)
    d = Path(run_dir) / CHECKPOINTS / tag
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such checkpoint directory (the ranks stage into it first)")
    return write_state(d / STATE_FILE, state)


def verify(run_dir: str | Path, tag: str, world: int, state: JobState | None = None) -> list[str]:
    """Problems of checkpoint ``tag`` for ``world`` ranks (empty: intact). Reads every chunk of every snapshot once
    (bounded memory: one chunk at a time) and checks the tag's state against what the ranks staged. Ranks the
    state lists as lost staged nothing and are not looked for.

    ``state`` stands in for a missing ``<tag>/coordinator.json`` (an older run directory's top-level state)."""
    tag_step(tag)
    d = Path(run_dir) / CHECKPOINTS / tag
    if not d.is_dir():
        return [f"{d}: checkpoint directory missing"]
    problems: list[str] = []
    if state is None:
        try:
            state = read_state(d / STATE_FILE)
        except StateError as e:
            if not (d / STATE_FILE).exists():
                problems.append(f"{d / STATE_FILE}: missing (the checkpoint never completed)")
            else:
                problems.append(str(e))
    if state is not None:
        if state.checkpoint != f"{CHECKPOINTS}/{tag}":
            problems.append(f"{d / STATE_FILE}: names checkpoint {state.checkpoint!r}, not {CHECKPOINTS}/{tag}")
        if state.step != tag_step(tag):
            problems.append(f"{d / STATE_FILE}: step {state.step}, the tag says {tag_step(tag)}")
    lost = set(state.lost) if state is not None else set()
    for r in range(world):
        if r in lost:
            continue  # declared lost before this checkpoint: it staged nothing (it restarts from rank 0's weights)
        problems += rank_problems(run_dir, tag, r, state.version if state is not None else None,
                                  state.n_train if state is not None else None)
    return problems


def rank_problems(run_dir: str | Path, tag: str, rank: int, version: int | None = None,
                  n_train: int | None = None) -> list[str]:
    """Problems of what ``rank`` staged into checkpoint ``tag`` (empty: its weights, and on a trainer its
    optimizer state, are there and intact, and staged by that rank at ``version`` when given)."""
    d = Path(run_dir) / CHECKPOINTS / tag
    problems: list[str] = []
    snap = d / f"rank{rank}-weights"
    try:
        meta = verify_snapshot(snap)["meta"]
    except StagingError as e:
        problems.append(str(e))
        meta = {}
    if meta and meta.get("rank") != rank:
        problems.append(f"{snap}: staged by rank {meta.get('rank')!r}, not rank {rank}")
    if meta and version is not None and meta.get("version") != version:
        problems.append(f"{snap}: weights of policy version {meta.get('version')!r}, the state says {version}")
    n_train = n_train if n_train is not None else meta.get("n_train")
    optim = d / f"rank{rank}-optim"
    if (isinstance(n_train, int) and rank < n_train) or optim.exists():
        try:
            verify_snapshot(optim)
        except StagingError as e:
            problems.append(str(e))
    return problems


def select_resume(run_dir: str | Path, world: int) -> Resume | None:
    """The newest checkpoint that verifies, falling back through older ones; ``None`` when the run never
    checkpointed. The top-level ``coordinator.json`` unreadable: the tags' own copies are used. Checkpoints exist
    but none is intact: :class:`StateError` saying what is damaged in each, and that nothing was deleted."""
    ck = Path(run_dir) / CHECKPOINTS
    top_path = ck / STATE_FILE
    top: JobState | None = None
    top_problem: str | None = None
    if top_path.exists():
        try:
            top = read_state(top_path)
        except StateError as e:
            top_problem = str(e)
    top_tag = Path(top.checkpoint).name if top is not None and top.checkpoint else None
    found = tags(run_dir)
    skipped: list[tuple[str, str]] = []
    if top_tag is not None and top_tag not in found:
        skipped.append((top_tag, f"{top_path} names {top.checkpoint}, which does not exist"))
    if not found and not skipped:
        if top_problem is not None:
            raise StateError(f"{top_problem}; there is no checkpoint directory to fall back to. Nothing was deleted.")
        return None if top is None else Resume(top, None, [], None)  # a state without a checkpoint: start from it
    for tag in found:
        legacy = top if tag == top_tag and not (ck / tag / STATE_FILE).exists() else None
        problems = verify(run_dir, tag, world, state=legacy)
        if not problems:
            return Resume(legacy or read_state(ck / tag / STATE_FILE), tag, skipped, top_problem)
        skipped.append((tag, "; ".join(problems)))
    what = "; ".join(f"{t}: {why}" for t, why in skipped)
    if top_problem is not None:
        what += f"; {top_problem}"
    raise StateError(f"no intact checkpoint to resume {run_dir} from ({what}). Nothing was deleted: restore or move "
                     f"away the damaged directories under {ck}, or start a new run.")


def discard(run_dir: str | Path, tag: str) -> bool:
    """Remove checkpoint ``tag`` (a failed or partial one); False when it was not there. Its state file goes first,
    so a removal cut short leaves an incomplete tag, never one that looks complete."""
    tag_step(tag)
    d = Path(run_dir) / CHECKPOINTS / tag
    if not d.exists():
        return False
    (d / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(d)
    return True


def set_aside(run_dir: str | Path, tag: str) -> Path:
    """Move a damaged checkpoint to ``checkpoints/damaged/<tag>.<n>`` (same file system: a rename, no space
    needed): out of every later choice, still there to inspect. Returns where it went."""
    tag_step(tag)
    ck = Path(run_dir) / CHECKPOINTS
    (ck / DAMAGED).mkdir(exist_ok=True)
    n = 1
    while True:
        dest = ck / DAMAGED / f"{tag}.{n}"
        try:
            os.rename(ck / tag, dest)  # fails with EEXIST/ENOTEMPTY on a taken name (no check-then-act race)
            return dest
        except OSError as e:
            if not dest.exists():
                raise
            n += 1
            if n > 10000:
                raise OSError(f"{ck / DAMAGED}: no free name for {tag}") from e


def retain(run_dir: str | Path, keep: int, current: str | None = None) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints up to ``current`` (default: the one the top-level state names,
    else the newest complete one); remove older ones and incomplete tags older than ``current``. Never removes
    ``current``, the tag the top-level state names, a tag newer than ``current`` (being written, or not ours to
    judge), an incomplete tag another coordinator may still be writing (:func:`live_writer`), or anything when no
    complete checkpoint exists. Returns the removed tags."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep={keep!r}: must be an integer >= 1 (run.keep_checkpoints)")
    ck = Path(run_dir) / CHECKPOINTS
    try:
        top = read_state(ck / STATE_FILE)
        top_tag = Path(top.checkpoint).name if top.checkpoint else None
    except StateError:
        top_tag = None
    found = tags(run_dir)

    def complete(t: str) -> bool:
        if (ck / t / STATE_FILE).exists():
            try:
                read_state(ck / t / STATE_FILE)
                return True
            except StateError:
                return False
        return t == top_tag  # an older run directory: only the top-level file holds that tag's state

    good = [t for t in found if complete(t)]
    if current is None:
        current = top_tag if top_tag in good else (good[0] if good else None)
    if current is None or not good:
        return []
    kept = set([t for t in good if _tag_key(t) <= _tag_key(current)][:keep]) | {current}
    if top_tag is not None:
        kept.add(top_tag)
    removed = []
    for t in found:
        if t in kept or _tag_key(t) > _tag_key(current):
            continue
        if not complete(t) and live_writer(run_dir, t) is not None:
            continue  # another coordinator may still be writing it: not ours to remove
        if discard(run_dir, t):
            removed.append(t)
    return removed
