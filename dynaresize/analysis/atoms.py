"""Atoms: the coarsest partition of ranks such that every rank set in a log contains an atom whole or not at all.

Why: every busy interval and every topology in the log names a rank set, so two ranks of one atom have exactly the
same activity and roles for the whole run. Per-rank quantities (busy union, idle time, role time) are therefore
computed once per atom and multiplied by its size: a 4096-GPU run with a few rank sets has a few dozen atoms.
Atoms are also the lanes of the timeline and the tracks of a grouped Perfetto trace ("ranks with identical
activity collapse into one band").

Built without expanding any rank set: the range boundaries of all sets cut ``[0, world)`` into blocks, blocks
with the same membership row are merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynaresize.events import format_ranks


@dataclass(frozen=True)
class Atom:
    blocks: tuple[tuple[int, int], ...]  # inclusive rank ranges
    size: int

    @property
    def first(self) -> int:
        return self.blocks[0][0]

    def label(self, width: int = 24) -> str:
        text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.blocks)
        if len(text) > width:
            text = text[: width - 3] + "..."
        return text

    def ranks(self) -> list[int]:
        return [r for a, b in self.blocks for r in range(a, b + 1)]


def _ranges(text: str) -> list[tuple[int, int]]:
    out = []
    if not text:
        return out
    for part in text.split(","):
        a, sep, b = part.partition("-")
        out.append((int(a), int(b) if sep else int(a)))
    return out


def build_atoms(ranksets: list[str], world: int) -> tuple[list[Atom], np.ndarray]:
    """Return the atoms and a boolean membership matrix ``member[atom, rankset_id]``.

    Ranks in no rank set at all form one atom too (they are idle for the whole run), so the atoms always cover
    ``range(world)``.
    """
    parsed = [_ranges(s) for s in ranksets]
    cuts = {0, world}
    for rs in parsed:
        for a, b in rs:
            cuts.add(a)
            cuts.add(b + 1)
    bounds = np.array(sorted(c for c in cuts if 0 <= c <= world), dtype=np.int64)
    nblocks = len(bounds) - 1
    member = np.zeros((nblocks, max(len(ranksets), 1)), dtype=bool)
    for j, rs in enumerate(parsed):
        for a, b in rs:
            i0 = int(np.searchsorted(bounds, a))
            i1 = int(np.searchsorted(bounds, min(b + 1, world)))
            member[i0:i1, j] = True
    if nblocks == 0:
        return [], np.zeros((0, len(ranksets)), dtype=bool)
    rows, inverse = np.unique(member, axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    groups: dict[int, list[tuple[int, int]]] = {}
    for blk in range(nblocks):
        lo, hi = int(bounds[blk]), int(bounds[blk + 1]) - 1
        g = groups.setdefault(int(inverse[blk]), [])
        if g and g[-1][1] + 1 == lo:  # contiguous with the previous block of this atom
            g[-1] = (g[-1][0], hi)
        else:
            g.append((lo, hi))
    order = sorted(groups, key=lambda k: groups[k][0][0])
    atoms = [Atom(tuple(groups[k]), sum(b - a + 1 for a, b in groups[k])) for k in order]
    return atoms, rows[order][:, : len(ranksets)]


def atom_ranks_text(atoms: list[Atom]) -> str:
    return format_ranks(r for a in atoms for r in a.ranks())
