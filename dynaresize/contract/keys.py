"""The per-job key namespace: every key and channel of one job starts with ``dr:<job_id>:``.

Two jobs can therefore share one Redis without seeing each other. One place builds every name, so the protocol's
key layout can be read here in one screen:

=============================  ========  =====================================================================
key                            type      meaning
=============================  ========  =====================================================================
``dr:<job>:epoch``             string    job epoch counter; INCR by each coordinator incarnation (fencing)
``dr:<job>:owner``             hash      who took the current epoch: ``epoch``, ``m`` (JSON: pid, host, run
                                         directory, how: start/resume/restart); written with the INCR
``dr:<job>:live``              zset      rank -> server time (s) of its last heartbeat; dead = too old
``dr:<job>:rank:<r>``          hash      registration of rank r: ``inc`` (incarnation), ``m`` (JSON); PEXPIRE TTL
``dr:<job>:inc:<r>``           string    incarnation counter of rank r (INCR on every register)
``dr:<job>:cmd:<r>``           stream    commands for rank r, field ``m`` = JSON :class:`~.wire.Command`
``dr:<job>:cursor:<r>``        string    id of the last stream entry rank r has finished with (its own cursor)
``dr:<job>:bcast``             stream    job-wide broadcast commands: ``m`` = JSON command, ``r`` = its targets
                                         (rank set); one entry per command whatever the number of targets
``dr:<job>:bcursor:<r>``       string    id of the last broadcast entry for rank r that it has finished with
``dr:<job>:cmdid``             string    id of the last command entry written (a job-wide increasing stream id,
                                         shared by both kinds of streams so that ranks merge them in order)
``dr:<job>:applied:<r>``       hash      command_id -> JSON ack (or a "started" marker): at-most-once apply
``dr:<job>:ack:<command_id>``  stream    acks of one command, field ``m`` = JSON :class:`~.wire.Ack`; EXPIREs
``dr:<job>:wake``              channel   pub/sub wake-up; message = rank-set string of the ranks to wake
``dr:<job>:fenced``            set       ranks the coordinator declared lost: their heartbeats, claims and
                                         results are refused until the next launch of the ranks
``dr:<job>:launch``            string    the ranks' current launch (set by the coordinator before it starts
                                         them, never lowered): a registration of another launch is refused
``dr:<job>:journal``           string    the coordinator's state after its last finished step (JSON; written
                                         only by the current epoch): what a coordinator that takes over reads
``dr:<job>:slow``              hash      rank -> the longest heartbeat round trip (s) it saw since the coordinator
                                         last read it, written only when slower than a heartbeat period
=============================  ========  =====================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "dr"
JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise ValueError(f"job_id={job_id!r}: allowed: 1-64 characters of A-Z a-z 0-9 . _ - (no ':')")
    return job_id


@dataclass(frozen=True, slots=True)
class Keys:
    """Names of one job's keys (see the module docstring)."""

    job_id: str

    def __post_init__(self) -> None:
        check_job_id(self.job_id)

    @property
    def ns(self) -> str:
        return f"{PREFIX}:{self.job_id}"

    @property
    def epoch(self) -> str:
        return f"{self.ns}:epoch"

    @property
    def owner(self) -> str:
        return f"{self.ns}:owner"

    @property
    def live(self) -> str:
        return f"{self.ns}:live"

    @property
    def wake(self) -> str:
        return f"{self.ns}:wake"

    @property
    def fenced(self) -> str:
        return f"{self.ns}:fenced"

    @property
    def launch(self) -> str:
        return f"{self.ns}:launch"

    @property
    def journal(self) -> str:
        return f"{self.ns}:journal"

    @property
    def slow(self) -> str:
        return f"{self.ns}:slow"

    def rank(self, r: int) -> str:
        return f"{self.ns}:rank:{int(r)}"

    def incarnation(self, r: int) -> str:
        return f"{self.ns}:inc:{int(r)}"

    def cmd(self, r: int) -> str:
        return f"{self.ns}:cmd:{int(r)}"

    @property
    def cmd_prefix(self) -> str:
        return f"{self.ns}:cmd:"

    @property
    def broadcast(self) -> str:
        return f"{self.ns}:bcast"

    def broadcast_cursor(self, r: int) -> str:
        return f"{self.ns}:bcursor:{int(r)}"

    @property
    def cmd_last_id(self) -> str:
        return f"{self.ns}:cmdid"

    def cursor(self, r: int) -> str:
        return f"{self.ns}:cursor:{int(r)}"

    def applied(self, r: int) -> str:
        return f"{self.ns}:applied:{int(r)}"

    def ack(self, command_id: str) -> str:
        return f"{self.ns}:ack:{command_id}"
