"""How worker ranks on other nodes find the coordinator's Redis: a file on shared storage, per job incarnation.

The control plane's :class:`~dynaresize.control.server.RedisServer` writes ``<run_dir>/redis/redis.json``
(host, port, password_file). After a requeue that file still holds the previous incarnation's port until the new
server is up, so the coordinator publishes ``<run_dir>/slurm/rendezvous.json`` = ``{"job_id", "restart_count",
"endpoint_file", "written_at"}`` once its Redis answers, and ranks wait for the one whose job id and restart count
match their own Slurm identity. Written atomically (temp file + rename), read as JSON only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from dynaresize import atomic
from dynaresize.slurm.spec import SLURM_SUBDIR

RENDEZVOUS_FILE = "rendezvous.json"


class RendezvousTimeout(TimeoutError):
    """The coordinator did not publish its endpoint in time (the message names the file and what was seen)."""


class RendezvousFailed(RuntimeError):
    """The coordinator of this job incarnation failed before its Redis was up (the message says why)."""


@dataclass(frozen=True)
class Rendezvous:
    job_id: str
    restart_count: int
    endpoint_file: str | None  # None when error is set
    written_at: float
    error: str | None = None  # the coordinator failed: ranks stop instead of waiting


def path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SLURM_SUBDIR / RENDEZVOUS_FILE


def publish(run_dir: str | Path, job_id: str, restart_count: int, endpoint_file: str | Path | None,
            error: str | None = None) -> Rendezvous:
    """Announce the Redis endpoint of this job incarnation (or, with ``error``, that the coordinator failed)."""
    rv = Rendezvous(job_id, restart_count, str(endpoint_file) if endpoint_file else None, time.time(), error)
    p = path(run_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(p, rv.__dict__)
    return rv


def read(run_dir: str | Path) -> Rendezvous | None:
    try:
        d = json.loads(path(run_dir).read_text())
        return Rendezvous(str(d["job_id"]), int(d["restart_count"]), d.get("endpoint_file"), float(d["written_at"]), d.get("error"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait(run_dir: str | Path, job_id: str, restart_count: int, timeout_s: float = 120.0, poll_s: float = 0.2) -> Rendezvous:
    """Block until the coordinator of (job_id, restart_count) has published its endpoint."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = read(run_dir)
        if last is not None and last.job_id == job_id and last.restart_count == restart_count:
            if last.error:
                raise RendezvousFailed(f"{path(run_dir)}: the coordinator of job {job_id} restart {restart_count} failed: {last.error}")
            return last
        time.sleep(poll_s)
    raise RendezvousTimeout(
        f"{path(run_dir)}: no endpoint for job {job_id} restart {restart_count} within {timeout_s:.0f} s (last seen: {last})"
    )
