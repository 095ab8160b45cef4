"""Communicator reuse: every process group a role switch can need is created once, at start-up.

Creating a communicator (``init_process_group``, ``new_group``) is collective and slow (seconds on 8 GPUs, minutes
at thousands), and ``new_group`` must be entered by *every* rank of the world in the same order. So a worker
creates, right after the world group and before it loads its model:

- one **trainer group** per candidate trainer set, and
- one **weight-sync group** per candidate topology: the trainers' data-parallel rank 0 plus every rollout rank.

A switch then only *selects* a group (``CommGroups.trainer_group(t)``), it never creates one.

Candidate trainer sets are **nested prefixes**: with ``t`` trainers, ranks ``0..t-1`` train and ``t..N-1`` roll
out, for every ``t`` that is a multiple of the resize unit (one GPU, or one node) between one unit and ``N`` minus
one unit. Nested sets have two useful properties:

- going from ``t`` to ``t'`` trainers moves exactly ``|t - t'|`` ranks, the fewest possible;
- the union of the old and the new trainer set is itself a candidate set (the larger prefix), so the ZeRO
  reshard exchange between old and new trainers runs over a pre-built group too.

Worked example, 4 ranks, unit 1: trainer groups ``{0}``, ``{0,1}``, ``{0,1,2}``; sync groups ``{0,1,2,3}`` (t=1),
``{0,2,3}`` (t=2), ``{0,3}`` (t=3). Six ``new_group`` calls at start-up, none afterwards.

Instrumentation: :func:`group_creations` counts every process group torch creates in this process (it wraps
torch's one internal helper that all of ``init_process_group``, ``new_group`` and their variants go through);
:meth:`CommGroups.created_after_startup` is what the tests assert to be zero after switches.
"""

from __future__ import annotations

import datetime as _dt
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d


class CommError(RuntimeError):
    """A group that does not exist for this topology, or a rank asking for a group it is not a member of."""


# ---------------------------------------------------------------------------------------------------------------
# Pure topology logic


def candidate_trainer_counts(world_size: int, unit: int = 1) -> list[int]:
    """Trainer counts a switch may select: multiples of ``unit`` with at least one unit left for rollout."""
    if world_size < 2:
        raise CommError(f"world_size={world_size}: need at least 2 ranks (one per role)")
    if unit < 1 or world_size % unit:
        raise CommError(f"resize unit {unit} must be >= 1 and divide world_size={world_size}")
    counts = list(range(unit, world_size, unit))
    if not counts:
        raise CommError(f"world_size={world_size} with unit {unit} leaves no valid split")
    return counts


def trainer_ranks(n_train: int) -> tuple[int, ...]:
    """Ranks of the trainer set with ``n_train`` trainers (a prefix)."""
    return tuple(range(n_train))


def rollout_ranks(n_train: int, world_size: int) -> tuple[int, ...]:
    return tuple(range(n_train, world_size))


def sync_ranks(n_train: int, world_size: int) -> tuple[int, ...]:
    """Members of the weight-sync group: the source (trainer dp-rank 0 = global rank 0) and every rollout rank."""
    return (0, *rollout_ranks(n_train, world_size))


def moved_ranks(old_train: int, new_train: int) -> tuple[int, ...]:
    """Ranks whose role changes from ``old_train`` to ``new_train`` trainers (the fewest possible)."""
    lo, hi = sorted((old_train, new_train))
    return tuple(range(lo, hi))


def unit_from_cluster(cluster) -> int:
    """The resize unit from a ``ClusterConfig`` (one GPU, or one node's GPUs)."""
    return cluster.gpus_per_node if cluster.granularity == "node" else 1


# ---------------------------------------------------------------------------------------------------------------
# Instrumentation: count process-group creations in this process

_created = 0
_lock = threading.Lock()
_orig_helper = _c10d._new_process_group_helper


def _counting_helper(*args, **kwargs):
    global _created
    with _lock:
        _created += 1
    return _orig_helper(*args, **kwargs)


_c10d._new_process_group_helper = _counting_helper


def group_creations() -> int:
    """How many process groups (world included) torch has created in this process so far."""
    return _created


# ---------------------------------------------------------------------------------------------------------------
# The pre-built groups of one worker process


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_world(
    rank: int, world_size: int, master_addr: str, master_port: int, device: str = "cpu", timeout_s: float = 600.0,
    local_rank: int | None = None,
) -> None:
    """Create the world process group once (TCP rendezvous; gloo on CPU, NCCL on GPUs)."""
    if dist.is_initialized():
        raise CommError("the world process group already exists in this process (it is created once)")
    local = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    # DeepSpeed reads these (it refuses to start without LOCAL_RANK when not started by its own launcher).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    kwargs = {}
    if device == "cuda":
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)  # eager NCCL init: the communicator exists now
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
        **kwargs,
    )


@dataclass
class CommGroups:
    """All groups a switch may select, created in one deterministic order on every rank."""

    world_size: int
    rank: int
    unit: int
    device: str = "cpu"
    _trainer: dict[int, object] = field(default_factory=dict)
    _sync: dict[int, object] = field(default_factory=dict)
    _created_at_startup: int = 0

    @classmethod
    def build(cls, unit: int = 1, device: str = "cpu", warmup: bool = True) -> "CommGroups":
        """Create every candidate group (collective: every rank of the world calls this, in the same order)."""
        if not dist.is_initialized():
            raise CommError("init_world() must run before CommGroups.build()")
        self = cls(world_size=dist.get_world_size(), rank=dist.get_rank(), unit=unit, device=device)
        for t in candidate_trainer_counts(self.world_size, unit):
            self._trainer[t] = dist.new_group(list(trainer_ranks(t)))
        for t in candidate_trainer_counts(self.world_size, unit):
            self._sync[t] = dist.new_group(list(sync_ranks(t, self.world_size)))
        if warmup:
            self._warmup()
        self._created_at_startup = group_creations()
        return self

    def _warmup(self) -> None:
        """One tiny collective per group this rank belongs to, in the global order (no deadlock: a consistent
        order is like ordered locking). On NCCL this makes the communicators exist now, not at the first switch."""
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        x = torch.zeros(1, device=dev)
        for t, g in list(self._trainer.items()) + list(self._sync.items()):
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.all_reduce(x, group=g)
        dist.barrier()

    # -- selection (a switch calls only these) --------------------------------------------------------------

    @property
    def world(self):
        return dist.group.WORLD

    def trainer_counts(self) -> list[int]:
        return sorted(self._trainer)

    def trainer_group(self, n_train: int):
        """The pre-built group of the ``n_train`` trainers (only members may use it)."""
        self._check(n_train)
        if self.rank not in trainer_ranks(n_train):
            raise CommError(f"rank {self.rank} is not a trainer with {n_train} trainers (trainers: 0-{n_train - 1})")
        return self._trainer[n_train]

    def sync_group(self, n_train: int):
        """The pre-built weight-sync group for ``n_train`` trainers: global rank 0 plus every rollout rank."""
        self._check(n_train)
        if self.rank not in sync_ranks(n_train, self.world_size):
            raise CommError(f"rank {self.rank} is not in the weight-sync group for {n_train} trainers")
        return self._sync[n_train]

    def union_group(self, old_train: int, new_train: int):
        """The group of old and new trainers together: the larger prefix (a candidate set by construction)."""
        return self.trainer_group(max(old_train, new_train))

    def created_after_startup(self) -> int:
        """Process groups created since :meth:`build` returned (a switch must keep this at zero)."""
        return group_creations() - self._created_at_startup

    def _check(self, n_train: int) -> None:
        if n_train not in self._trainer:
            raise CommError(
                f"no pre-built group for {n_train} trainers; candidates: {self.trainer_counts()} "
                f"(world {self.world_size}, unit {self.unit})"
            )
