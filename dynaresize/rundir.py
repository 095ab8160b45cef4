"""Run directories: ``<parent>/<run.name>-<YYYYmmdd-HHMMSS>/``, created atomically (a name collision gets ``.2``,
``.3``, ...), so two runs started in the same second never share one. Used by ``run``, ``demo`` and ``submit``.

Each one holds a marker written at creation, ``.dynaresize-run.json`` (run id, dynaresize version, creation
time): ``dynaresize run --resume DIR`` accepts only a directory that has it (:func:`require_run_dir`), so a resume
never writes into a folder the project did not create (a user's own config folder, a home directory). Run
directories made before the marker existed are recognised by their event log, whose first record is the
``run_start`` of a run named like the directory.

The marker also holds the run's **job id** (:func:`job_id`): the namespace of its keys in Redis (``dr:<job id>:``),
its ranks' registrations and its coordinators' epochs. It is the directory's name plus a random suffix drawn when
the directory is created, so two runs with the same ``run.name`` started in the same second in two output
directories, on one shared Redis, never share a key, a rank or a fencing epoch; a directory without one (made by
an older version, or by a test) gets the name plus a digest of its absolute path. Only ``--resume`` of the same
directory reaches the same job again.

A run directory is created with mode 0700 (its owner only): it lives on storage that a cluster shares between
users, and holds the run's logs, prompts, rewards and weights; its secrets (the Redis password) are in 0600 files
besides. Not 0750: on many clusters every user's primary group is one shared group (``users``), so group access
would be everyone's. Share a finished run on purpose (``chmod -R g+rX``), not by default.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from pathlib import Path

from dynaresize import atomic

MARKER = ".dynaresize-run.json"


class RunDirError(ValueError):
    """Not a run directory dynaresize created; the message names the directory and what is missing."""


def create_run_dir(parent: str | Path, name: str, now: float | None = None) -> Path:
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    base = parent / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    run_dir, n = base, 1
    while True:
        try:
            run_dir.mkdir(mode=0o700)
            break
        except FileExistsError:
            n += 1
            run_dir = base.with_name(f"{base.name}.{n}")
    run_dir.chmod(0o700)  # mkdir's mode is narrowed by the umask, never widened: exact here
    write_marker(run_dir)
    return run_dir


def write_marker(run_dir: Path) -> Path:
    from dynaresize import __version__

    path = Path(run_dir) / MARKER
    name = Path(run_dir).name
    return atomic.write_json(path, {"run_id": name, "job_id": _job_id(name, secrets.token_hex(4)),
                                    "dynaresize": __version__, "created": time.time()})


def _job_id(name: str, suffix: str) -> str:
    """``<name>-<suffix>`` within the key namespace's rules (1-64 of ``A-Za-z0-9._-``)."""
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:55]}-{suffix}"


def job_id(run_dir: str | Path) -> str:
    """The run's job id: the one its marker holds, else the directory's name plus a digest of its absolute path
    (never the name alone: two output directories can hold runs of the same name and second)."""
    run_dir = Path(run_dir)
    try:
        info = json.loads((run_dir / MARKER).read_text())
        jid = info.get("job_id") if isinstance(info, dict) else None
        if isinstance(jid, str) and re.fullmatch(r"[A-Za-z0-9._-]{1,64}", jid):
            return jid
    except (OSError, ValueError):
        pass
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return _job_id(run_dir.name, digest)


def _legacy_run(run_dir: Path) -> bool:
    """A run directory from before the marker: its event log opens with the run_start of a run of this name."""
    try:
        with open(run_dir / "events.jsonl") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("type") == "run_start" and first.get("run_id") == run_dir.name


def require_run_dir(path: str | Path) -> Path:
    """``path`` if it is a run directory dynaresize created (its marker, or a legacy run's event log) holding a
    resolved ``config.yaml``; else :class:`RunDirError` saying what is missing. Reads only, writes nothing."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such directory")
    marker = run_dir / MARKER
    if marker.exists():
        try:
            info = json.loads(marker.read_text())
            if not isinstance(info, dict) or not info.get("run_id"):
                raise ValueError("no run_id")
        except (OSError, ValueError) as e:
            raise RunDirError(f"{marker}: unreadable run marker ({e}); this directory was not left as dynaresize "
                              f"wrote it, so nothing is written into it") from None
    elif not _legacy_run(run_dir):
        raise RunDirError(f"{run_dir}: not a run directory created by dynaresize (no {MARKER} marker, no event log "
                          f"of a run named {run_dir.name!r}); nothing was written into it. Start a new run with "
                          f"`dynaresize run CONFIG` (a config file goes there, not after --resume)")
    if not (run_dir / "config.yaml").is_file():
        raise RunDirError(f"{run_dir}: a run directory without its resolved config.yaml; nothing was written into it")
    return run_dir
