"""Exactness of the point-to-point weight transport (dynaresize/comm/weights.py, transport.py) over real gloo
processes: a receiver refuses bytes whose checksum differs from the sender's; a relay whose own copy was refused
tells its receiver at once (no hang), and that receiver then gets the version from another holder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynaresize.comm import weights as W
from dynaresize.comm.transport import CommFetch, WeightSender


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(64, 32, generator=g)), ("b", torch.randn(1000, generator=g))]


def _send_corrupt(named, dst: int, version: int) -> None:
    """What a broken link would deliver: the same header and checksum, one bucket's byte flipped on the way."""
    tag = W.version_tag(version)

    def move(t: torch.Tensor) -> int:
        out = t
        if t.numel() > 8:  # a bucket (not the header or trailer)
            out = t.clone()
            out.view(torch.uint8)[3] ^= 0xFF
        dist.send(out, dst=dst, tag=tag)
        return t.numel() * t.element_size()

    W._transfer(named, dist.get_rank(), move, 1 << 20, version, None, "cpu", checksum=True)


def _world(rank: int, d: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=rank, world_size=3)
    good, mine = _named(1), _named(2 + rank)
    out: dict = {}
    if rank == 0:
        _send_corrupt(good, 1, 1)  # rank 1 (the relay) gets a corrupted copy of version 1
        W.send_weights_to(good, 2, 1)  # and rank 2 then gets it from rank 0, the other holder
    elif rank == 1:
        fetch = CommFetch(mine, 0, 1, 1 << 20, "cpu")
        sender = WeightSender(1 << 20, "cpu")
        sender.relay(1, fetch, [n for n, _ in mine], replan_s=0.5)
        sender.push(1, [2], one_at_a_time=True)
        try:
            fetch.result()
        except W.WeightSyncError as e:
            out["relay"] = str(e)
        while not sender.sent:
            pass
        out["send"] = sender.take_sent()[0].get("error", "")
    else:
        try:
            W.recv_weights_from(mine, 1, 1)
        except W.WeightSyncError as e:
            out["from_relay"] = str(e)
        got, _ = W.recv_weights_from(mine, 0, 1)
        out["again_equal"] = all(torch.equal(got[n], t) for n, t in good)
    Path(d, f"r{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_corrupted_copy_is_refused_and_the_relay_tells_its_receiver(tmp_path):
    mp.spawn(_world, args=(str(tmp_path),), nprocs=3, join=True)
    r1 = json.loads((tmp_path / "r1.json").read_text())
    r2 = json.loads((tmp_path / "r2.json").read_text())
    assert "do not match the sender's checksum" in r1["relay"] and "refused" in r1["relay"]
    assert "WeightSyncError" in r1["send"]  # the relay forwarded nothing it had not checked
    assert "holds no checked copy" in r2["from_relay"]
    assert r2["again_equal"] is True


def test_the_checksum_covers_every_byte():
    t = torch.arange(100, dtype=torch.float32)
    u = t.clone()
    u.view(torch.uint8)[7] ^= 1
    assert W.bytes_crc(t) != W.bytes_crc(u)
    assert W.bytes_crc(t[50:], W.bytes_crc(t[:50])) == W.bytes_crc(t)
