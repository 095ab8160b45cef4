"""Candidate topologies: every split of ``total`` GPUs in steps of ``unit`` (1 GPU or 1 node), >= 1 unit per role,
that fits in GPU memory (``feasible``: the trainer counts the memory model admits, ``dynaresize.config.memory``;
None where no memory figure is known). Why here: the policy then never predicts, plays or proposes a split whose
ranks would run out of memory, however fast it looks."""

from __future__ import annotations

from typing import Collection

from dynaresize.policy.types import Topology


def candidate_topologies(total: int, unit: int = 1, feasible: Collection[int] | None = None) -> tuple[Topology, ...]:
    if unit < 1 or total % unit or total < 2 * unit:
        raise ValueError(f"cannot split {total} GPUs in units of {unit} with at least one unit per role")
    return tuple(Topology(nt, total - nt) for nt in range(unit, total, unit) if feasible is None or nt in feasible)


def from_cluster(cluster, feasible: Collection[int] | None = None) -> tuple[Topology, ...]:
    """Candidates from a ``cluster`` config section (``gpus``, ``granularity``, ``gpus_per_node``)."""
    unit = cluster.gpus_per_node if cluster.granularity == "node" else 1
    return candidate_topologies(cluster.gpus, unit, feasible)
