"""Versioned, chunked weight broadcast over a pre-built group (trainer -> rollout sync, and weights for new trainers).

Protocol (every member calls :func:`broadcast_weights` with the same ``src``, group and bucket size):

1. a header, ``int64[4] = (version, number of tensors, total elements, structure hash)``, from ``src``;
   every receiver checks the count, size and the hash of (name, shape) against its own tensor list and fails
   with a clear :class:`WeightSyncError` on a mismatch;
2. the tensors, concatenated in list order into buckets of about ``bucket_bytes`` (a tensor never straddles
   two buckets; one larger than a bucket travels alone), one ``broadcast`` per bucket.

Receivers hand each bucket's tensors (views of the received bucket) to ``sink``; the default copies them into
their own tensors in place, a vLLM engine passes them to its weight loader instead. The host memory a sync
needs is one bucket, whatever the model size.
"""

from __future__ import annotations

import json
import zlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

Named = Sequence[tuple[str, torch.Tensor]]
Sink = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightSyncError(RuntimeError):
    """The sender's and a receiver's model do not match (count, size or names/shapes)."""


def structure_hash(named: Named) -> int:
    desc = json.dumps([[n, list(t.shape)] for n, t in named], separators=(",", ":")).encode()
    return zlib.crc32(desc)


def buckets(named: Named, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``named`` grouped into buckets of at most ``bucket_bytes`` (a big tensor goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, (_, t) in enumerate(named):
        nb = t.numel() * t.element_size()
        if cur and (size + nb > bucket_bytes or t.dtype != named[cur[0]][1].dtype):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        out.append(cur)
    return out


def _copy_into(named: Named) -> Sink:
    targets = dict(named)

    def sink(items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in items:
                targets[name].copy_(t)

    return sink


def broadcast_weights(
    named: Named,
    src: int,
    group=None,
    bucket_bytes: int = 64 << 20,
    version: int = 0,
    sink: Sink | None = None,
    device: torch.device | str = "cpu",
) -> tuple[int, int]:
    """Broadcast ``named`` from global rank ``src``; returns ``(version, bytes moved)`` on every member.

    On receivers ``named`` gives the expected names, shapes and dtypes (their own model's tensors).
    """

    def move(t: torch.Tensor) -> int:
        dist.broadcast(t, src=src, group=group)
        return t.numel() * t.element_size()

    return _transfer(named, src, move, bucket_bytes, version, sink, device)


def send_weights_p2p(
    named: Named,
    src: int,
    members: list[int],
    bucket_bytes: int = 64 << 20,
    version: int = 0,
    sink: Sink | None = None,
    device: torch.device | str = "cpu",
) -> tuple[int, int]:
    """The same transfer as :func:`broadcast_weights`, point to point from ``src`` to every other rank of
    ``members`` over the world group: for a weight-sync group that lost a member (a rank declared lost), whose
    collectives would wait for the dead rank. Every rank in ``members`` calls it; returns ``(version, bytes)``.

    Slower than a broadcast (the source sends each bucket once per receiver), so it is only the degraded path.
    gloo keeps working pairwise after a peer died (checked on CPU); NCCL p2p on a communicator with a dead member
    is UNVERIFIED.
    """
    peers = [r for r in members if r != src]

    def move(t: torch.Tensor) -> int:
        if dist.get_rank() != src:
            dist.recv(t, src=src)
            return t.numel() * t.element_size()
        for r in peers:
            dist.send(t, dst=r)
        return t.numel() * t.element_size() * len(peers)

    return _transfer(named, src, move, bucket_bytes, version, sink, device)


def bytes_crc(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a tensor's bytes (continued from ``crc``): what a point-to-point receiver checks (a relay forwards
    bytes it received, so a corrupted copy must not spread)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(flat.contiguous().view(torch.uint8).numpy(), crc)


def _transfer(named: Named, src: int, move: Callable[[torch.Tensor], int], bucket_bytes: int, version: int,
              sink: Sink | None, device: torch.device | str, checksum: bool = False) -> tuple[int, int]:
    """A header (version, count, size, structure hash), then the tensors in flat buckets, each moved from ``src``
    to the others by ``move`` (a broadcast, or point-to-point sends); receivers check the header against their own
    tensors and hand each bucket to ``sink``. ``checksum`` (point to point): a trailer with the CRC-32 of every
    bucket's bytes follows; a receiver whose bytes differ refuses the version (:class:`WeightSyncError`) before its
    sink's tensors are used (the sink keeps them in a second buffer)."""
    me = dist.get_rank()
    header = torch.zeros(4, dtype=torch.int64, device=device)
    total = sum(t.numel() for _, t in named)
    if me == src:
        header.copy_(torch.tensor([version, len(named), total, structure_hash(named)], dtype=torch.int64))
    move(header)
    version_in, n, numel, shash = (int(x) for x in header.tolist())
    if me != src and version_in == REFUSED:
        raise WeightSyncError(f"weight sync v{version} from rank {src}: the relay holds no checked copy of it (its own "
                              "receive failed or was refused): planned again from another holder")
    if me != src:
        if n != len(named) or numel != total:
            raise WeightSyncError(
                f"weight sync v{version_in} from rank {src}: sender has {n} tensors / {numel} elements, "
                f"rank {me} expects {len(named)} / {total}"
            )
        if shash != structure_hash(named):
            raise WeightSyncError(f"weight sync v{version_in} from rank {src}: tensor names/shapes differ on rank {me}")
    sink = sink or _copy_into(named)
    moved, crc = 0, 0
    for idx in buckets(named, bucket_bytes):
        dtype = named[idx[0]][1].dtype
        count = sum(named[i][1].numel() for i in idx)
        if me == src:
            flat = torch.cat([named[i][1].detach().reshape(-1).to(device) for i in idx])
        else:
            flat = torch.empty(count, dtype=dtype, device=device)
        moved += move(flat)
        if checksum:
            crc = bytes_crc(flat, crc)
        if me != src:
            items, off = [], 0
            for i in idx:
                name, t = named[i]
                items.append((name, flat[off : off + t.numel()].view(t.shape)))
                off += t.numel()
            sink(items)
    if checksum:
        trailer = torch.tensor([crc if me == src else 0], dtype=torch.int64, device=device)
        move(trailer)
        if me != src and int(trailer.item()) != crc:
            raise WeightSyncError(f"weight sync v{version_in} from rank {src}: the bytes rank {me} received do not match "
                                  f"the sender's checksum (crc32 {crc:#010x}, sent {int(trailer.item()):#010x}): refused")
    return version_in, moved


# ---------------------------------------------------------------------------------------------------------------
# Point to point from trainer dp-rank 0 to one rollout rank: the barrier-free schedule's weight transport


TAG_BASE = 1 << 20  # p2p tags of weight versions: TAG_BASE + version (no other p2p traffic of the world group uses them)


REFUSED = -1  # a header's version when a relay cannot forward a version it was to forward (its receiver is told at once)


def send_refusal(dst: int, version: int, group=None, device: torch.device | str = "cpu") -> None:
    """A relay whose own copy of ``version`` failed tells ``dst`` (whose receive from it is posted) at once, instead
    of leaving it waiting: a header whose version is :data:`REFUSED`."""
    dist.send(torch.tensor([REFUSED, 0, 0, 0], dtype=torch.int64, device=device), dst=dst, group=group,
              tag=version_tag(version))


def version_tag(version: int) -> int:
    """The p2p tag of a version's transfer: two versions on their way to one rank never take each other's messages."""
    return TAG_BASE + int(version)


def send_weights_to(named: Named, dst: int, version: int, bucket_bytes: int = 64 << 20, group=None,
                    device: torch.device | str = "cpu") -> int:
    """Send ``named`` (version ``version``) to global rank ``dst`` alone, point to point over ``group`` (default:
    the world group, pre-built), tagged with the version; the receiver calls :func:`recv_weights_from`. The same
    header and buckets as :func:`broadcast_weights`, then the bytes' checksum. ``dist.get_rank()`` may be any rank
    holding the version: trainer rank 0, or a relay forwarding what it received. Returns the bytes sent (its
    header and checksum trailer not counted)."""
    tag = version_tag(version)

    def move(t: torch.Tensor) -> int:
        dist.send(t, dst=dst, group=group, tag=tag)
        return t.numel() * t.element_size()

    return _transfer(named, dist.get_rank(), move, bucket_bytes, version, None, device, checksum=True)[1]


def recv_weights_from(expected: Named, src: int, version: int, bucket_bytes: int = 64 << 20, group=None,
                      device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], int]:
    """Receive version ``version`` from global rank ``src`` (:func:`send_weights_to`) into FRESH host tensors (a
    second buffer: ``expected``, this rank's own weights, only gives names, shapes and dtypes and is not touched).
    Returns ``(name -> tensor, bytes received)``; a sender whose model or version differs, or bytes whose checksum
    differs from the sender's, is a :class:`WeightSyncError` (the version is refused, never installed or forwarded)."""
    tag = version_tag(version)
    out: dict[str, torch.Tensor] = {}

    def move(t: torch.Tensor) -> int:
        dist.recv(t, src=src, group=group, tag=tag)
        return t.numel() * t.element_size()

    def keep(items: list[tuple[str, torch.Tensor]]) -> None:  # each bucket is a fresh tensor: its views are kept as is
        for name, t in items:
            out[name] = t if t.device.type == "cpu" else t.to("cpu")

    got, moved = _transfer(expected, src, move, bucket_bytes, version, keep, device, checksum=True)
    if got != version:
        raise WeightSyncError(f"weights from rank {src}: expected version {version}, the sender sent {got}")
    return out, moved
