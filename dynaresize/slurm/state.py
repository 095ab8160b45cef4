"""Job state of a heterogeneous job, read from ``squeue`` / ``scontrol`` text (pure parsing and aggregation).

Without slurmdbd ``sacct`` fails, so state comes from the controller, which lists a het job as one line per
component: ``12+0`` (the leader, component 0) and ``12+1``. :func:`leader_of` maps every spelling back to the
leader id ``12``, which is what ``scancel``, ``scontrol requeue`` and the user see. :func:`aggregate` folds the
component states into one :class:`SlurmJobState` of the whole job. A finished job leaves the controller after
``MinJobAge``; then the state is :attr:`SlurmJobState.GONE` unless accounting (``sacct``) knows better.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

SQUEUE_FORMAT = "%i|%T|%r|%N"  # id | state | reason | nodes
_ID = re.compile(r"^(?P<leader>\d+)(?:\+(?P<offset>\d+))?(?:_\S+)?$")


class SlurmJobState(str, enum.Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    REQUEUED = "REQUEUED"
    SUSPENDED = "SUSPENDED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    GONE = "GONE"  # no longer known to the controller (finished more than MinJobAge ago; no accounting)
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> "SlurmJobState":
        word = text.strip().split(" ")[0].upper()  # sacct writes 'CANCELLED by 0'
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def finished(self) -> bool:
        return self not in _ACTIVE and self != SlurmJobState.UNKNOWN


_ACTIVE = {SlurmJobState.PENDING, SlurmJobState.CONFIGURING, SlurmJobState.RUNNING, SlurmJobState.COMPLETING, SlurmJobState.REQUEUED, SlurmJobState.SUSPENDED}
# Which component state speaks for the whole job: the most advanced activity, else the worst ending.
_ACTIVE_ORDER = [SlurmJobState.RUNNING, SlurmJobState.COMPLETING, SlurmJobState.CONFIGURING, SlurmJobState.SUSPENDED, SlurmJobState.REQUEUED, SlurmJobState.PENDING]
_END_ORDER = [
    SlurmJobState.NODE_FAIL, SlurmJobState.BOOT_FAIL, SlurmJobState.OUT_OF_MEMORY, SlurmJobState.FAILED, SlurmJobState.TIMEOUT,
    SlurmJobState.DEADLINE, SlurmJobState.PREEMPTED, SlurmJobState.CANCELLED, SlurmJobState.COMPLETED, SlurmJobState.GONE,
]


def leader_of(job_id: str) -> str:
    """``'12+1'`` -> ``'12'``; ``'12'`` -> ``'12'``. Raises ValueError naming the text when it is not a job id."""
    m = _ID.match(job_id.strip())
    if not m:
        raise ValueError(f"not a Slurm job id: {job_id!r} (expected N, N+K or N_K)")
    return m.group("leader")


def offset_of(job_id: str) -> int:
    """Het-group offset of a component id (``'12+1'`` -> 1); a plain id is component 0."""
    m = _ID.match(job_id.strip())
    if not m:
        raise ValueError(f"not a Slurm job id: {job_id!r} (expected N, N+K or N_K)")
    return int(m.group("offset") or 0)


@dataclass(frozen=True)
class ComponentState:
    job_id: str  # as Slurm prints it: '12+1'
    state: SlurmJobState
    reason: str = ""
    nodes: str = ""


@dataclass(frozen=True)
class HetJobStatus:
    leader: str
    state: SlurmJobState
    components: tuple[ComponentState, ...]

    def describe(self) -> str:
        parts = [f"{c.job_id}:{c.state.value}" + (f"({c.reason})" if c.reason and c.reason != "None" else "") for c in self.components]
        return f"{self.leader} {self.state.value} [{' '.join(parts)}]"


def aggregate(states: list[SlurmJobState]) -> SlurmJobState:
    """One state for a job from its components' states (an empty list is UNKNOWN)."""
    if not states:
        return SlurmJobState.UNKNOWN
    for s in _ACTIVE_ORDER:
        if s in states:
            return s
    for s in _END_ORDER:
        if s in states:
            return s
    return SlurmJobState.UNKNOWN


def parse_squeue(text: str) -> dict[str, HetJobStatus]:
    """Parse ``squeue -h -t all -o '%i|%T|%r|%N'`` output into one status per leader id (bad lines are skipped)."""
    comps: dict[str, list[ComponentState]] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 2:
            continue
        try:
            leader = leader_of(fields[0])
        except ValueError:
            continue
        comps.setdefault(leader, []).append(
            ComponentState(fields[0].strip(), SlurmJobState.parse(fields[1]), fields[2].strip() if len(fields) > 2 else "",
                           fields[3].strip() if len(fields) > 3 else "")
        )
    return {
        leader: HetJobStatus(leader, aggregate([c.state for c in cs]), tuple(sorted(cs, key=lambda c: offset_of(c.job_id))))
        for leader, cs in comps.items()
    }


def parse_sacct(text: str) -> dict[str, HetJobStatus]:
    """Parse ``sacct -X -n -P -o JobID,State`` output (only present with slurmdbd) like :func:`parse_squeue`."""
    return parse_squeue("\n".join(line for line in text.splitlines() if "." not in line.split("|")[0]))


def parse_scontrol(text: str) -> dict[str, HetJobStatus]:
    """Parse ``scontrol show job -o N`` (one line per component: ``JobId=13 HetJobId=12 HetJobOffset=1 ... JobState=X``)."""
    rows = []
    for line in text.splitlines():
        kv = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "JobId" not in kv or "JobState" not in kv:
            continue
        jid = f"{kv['HetJobId']}+{kv.get('HetJobOffset', '0')}" if kv.get("HetJobId") else kv["JobId"]
        rows.append(f"{jid}|{kv['JobState']}|{kv.get('Reason', '')}|{kv.get('NodeList', '')}")
    return parse_squeue("\n".join(rows))


def parse_preempt_time(text: str) -> str | None:
    """``PreemptTime`` of a job from ``scontrol show job -o N`` text, or None when Slurm has not preempted it.

    Slurm 22.05 sets it on every component of a het job the moment a higher-priority job selects it for preemption
    (the job stays RUNNING for the partition's ``GraceTime``); a job that is cancelled or timed out keeps
    ``PreemptTime=None``. A requeue clears the field."""
    for line in text.splitlines():
        for tok in line.split():
            if tok.startswith("PreemptTime="):
                value = tok.split("=", 1)[1]
                if value and value not in ("None", "Unknown", "(null)", "N/A"):
                    return value
    return None
