"""ZeRO-1/2 reshard when the number of trainers changes: a pure copy of overlapping ranges, over a pre-built group.

DeepSpeed lays each parameter group out as one logical flat vector of length ``L`` (independent of the trainer
count) and gives trainer ``r`` of ``dp`` the slice ``[r*ps, (r+1)*ps)`` (the tail beyond ``L`` is zero padding).
Moving from ``dp_old`` to ``dp_new`` trainers is therefore: for every pair (old rank ``s``, new rank ``d``), copy
the intersection of their valid ranges. :func:`plan` computes those copies (pure); :func:`exchange` runs them as
point-to-point messages over the *union* group (old plus new trainers, a pre-built candidate group, see
``dynaresize.comm.groups``) straight into the receiver's new partition buffers, so no rank ever holds more than
its old and its new partition, and nothing is pickled.

Worked example: ``L = 10``, 2 -> 3 trainers. Old ``ps = 6`` ([0,6) and [6,10)+2 pad), new ``ps = 4``
([0,4), [4,8), [8,10)+2 pad). Plan: (s0 -> d0, [0,4)), (s0 -> d1, [4,6)), (s1 -> d1, [6,8)), (s1 -> d2, [8,10)).

Exactness: the copy moves fp32 master, ``exp_avg`` and ``exp_avg_sq`` unchanged and the step counter from rank
0, so the logical state after a reshard is ``torch.equal`` to the state before (asserted by the tests through
:func:`state_digest`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynaresize.engines.trainer_deepspeed import Partition, PartitionLayout

FIELDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Copy:
    group: int  # parameter group
    src: int  # old dp rank (== global rank: trainer sets are prefixes)
    dst: int  # new dp rank
    start: int  # global [start, end) in the logical flat vector
    end: int


def plan(length: int, old_dp: int, old_ps: int, new_dp: int, new_ps: int, group: int = 0) -> list[Copy]:
    """Every (old rank, new rank) range copy that moves one parameter group from ``old_dp`` to ``new_dp``."""
    copies = []
    for s in range(old_dp):
        s0, s1 = s * old_ps, min((s + 1) * old_ps, length)
        for d in range(new_dp):
            d0, d1 = d * new_ps, min((d + 1) * new_ps, length)
            a, b = max(s0, d0), min(s1, d1)
            if a < b:
                copies.append(Copy(group, s, d, a, b))
    return copies


def layout_header(layouts_old: list[PartitionLayout] | None, layouts_new: list[PartitionLayout] | None, step: float) -> torch.Tensor:
    """Rank 0's description of both layouts, broadcast so that leaving trainers know where to send."""
    rows = [[lo.length, lo.size, ln.size] for lo, ln in zip(layouts_old or [], layouts_new or [])]
    return torch.tensor([[len(rows), 0, 0], *rows, [int(step), 0, 0]], dtype=torch.int64)


def exchange(
    old: list[Partition] | None,
    new_layouts: list[PartitionLayout] | None,
    old_dp: int,
    new_dp: int,
    group,
    n_groups: int,
    device: torch.device | str = "cpu",
) -> tuple[list[Partition] | None, int]:
    """Run the reshard on every member of the union group. ``old``: this rank's partitions if it was a trainer;
    ``new_layouts``: its new layouts if it is one now. Returns (this rank's new partitions or None, bytes sent)."""
    me = dist.get_rank()
    # 1. rank 0 (a trainer before and after, trainer sets are prefixes) tells everyone the sizes and the step
    hdr = torch.zeros(n_groups + 2, 3, dtype=torch.int64, device=device)
    if me == 0:
        if old is None or new_layouts is None:
            raise RuntimeError("rank 0 must be a trainer before and after a reshard")
        hdr.copy_(layout_header([p.layout for p in old], new_layouts, old[0].step if old else 0))
    dist.broadcast(hdr, src=0, group=group)
    hdr = hdr.cpu()
    if int(hdr[0, 0]) != n_groups:
        raise RuntimeError(f"reshard: rank 0 has {int(hdr[0, 0])} parameter groups, rank {me} has {n_groups}")
    step = float(hdr[-1, 0])
    copies: list[Copy] = []
    for g in range(n_groups):
        length, old_ps, new_ps = (int(x) for x in hdr[g + 1])
        copies += plan(length, old_dp, old_ps, new_dp, new_ps, g)
    # 2. receive buffers for my new partitions
    mine: list[Partition] | None = None
    if new_layouts is not None:
        mine = [
            Partition(lay, *(torch.zeros(lay.size, dtype=torch.float32, device=device) for _ in FIELDS), step=step)
            for lay in new_layouts
        ]
    # 3. point-to-point copies in one global order (isend/irecv, then wait all: no ordering deadlock)
    reqs, sent = [], 0
    for tag, c in enumerate(copies):
        i_send = old is not None and old[0].layout.dp_rank == c.src
        i_recv = mine is not None and mine[0].layout.dp_rank == c.dst
        if not (i_send or i_recv):
            continue
        for k, fld in enumerate(FIELDS):
            if i_send:
                sp = old[c.group]
                src_view = getattr(sp, fld).narrow(0, c.start - sp.layout.start, c.end - c.start)
            if i_recv:
                dp_ = mine[c.group]
                dst_view = getattr(dp_, fld).narrow(0, c.start - dp_.layout.start, c.end - c.start)
            if i_send and i_recv:
                dst_view.copy_(src_view)
            elif i_send:
                reqs.append(dist.isend(src_view.contiguous().to(device), dst=c.dst, group=group, tag=tag * 3 + k))
                sent += src_view.numel() * 4
            else:
                reqs.append(dist.irecv(dst_view, src=c.src, group=group, tag=tag * 3 + k))  # into the new partition
    for r in reqs:
        r.wait()
    return mine, sent


def state_digest(parts: list[Partition], group, device: torch.device | str = "cpu") -> dict[str, str] | None:
    """Hashes of the *logical* (unpartitioned) optimizer state of a trainer group, computed on dp rank 0.

    Every trainer sends the valid part of its partitions to dp rank 0, which concatenates and hashes them; equal
    digests before and after a reshard mean the state is bit-identical. Returns None on other ranks.
    """
    me_dp = parts[0].layout.dp_rank
    dp = parts[0].layout.dp
    out: dict[str, hashlib._Hash] = {f: hashlib.blake2b(digest_size=16) for f in FIELDS}
    for p in parts:
        for fld in FIELDS:
            for s in range(dp):
                start = s * p.layout.size
                valid = max(0, min(p.layout.size, p.layout.length - start))
                if me_dp == 0:
                    if s == 0:
                        buf = getattr(p, fld)[:valid].contiguous()
                    else:
                        buf = torch.empty(valid, dtype=torch.float32, device=device)
                        if valid:
                            dist.recv(buf, src=s, group=group)
                    out[fld].update(buf.cpu().numpy().tobytes())
                elif s == me_dp and valid:
                    dist.send(getattr(p, fld)[:valid].contiguous().to(device), dst=0, group=group)
    if me_dp != 0:
        return None
    res = {f: h.hexdigest() for f, h in out.items()}
    res["step"] = str(parts[0].step)
    res["length"] = str(sum(p.layout.length for p in parts))
    return res
