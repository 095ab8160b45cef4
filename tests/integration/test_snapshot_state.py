"""In-memory snapshots (``faults.snapshot_every``, :mod:`dynaresize.worker.snapshot`) on three real worker processes
(gloo, DeepSpeed ZeRO-1 on CPU): what a surviving peer writes for a lost trainer is, bit for bit, what a disk
checkpoint of the same step holds; and the ring rule puts every copy on another rank (pure)."""

from __future__ import annotations

import pytest
import torch

from dynaresize.staging import Stager
from dynaresize.worker.local import LocalCluster
from dynaresize.worker.snapshot import peer_of, source_of
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _train(c, version_after: int, seed: int) -> None:
    ids = torch.randint(3, 48, (12, 16), generator=torch.Generator().manual_seed(seed)).tolist()
    c.call("train_direct", {"input_ids": ids, "n_train": 2, "version_after": version_after}, ranks=[0, 1])


def _same(stager: Stager, a: str, b: str) -> None:
    ta, ma = stager.load(a)
    tb, mb = stager.load(b)
    assert ma == mb, (a, b)
    assert list(ta) == list(tb), (a, b)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), (a, name)


def test_a_lost_trainers_partition_written_by_its_peer_is_its_disk_checkpoint_bit_for_bit(tmp_path):
    cfg = {"train": {"lr": 1e-2, "zero_stage": 1}, "faults": {"snapshot_every": 1}}
    with LocalCluster(3, 2, tmp_path, global_batch=12, config=cfg, hooks=HOOKS) as c:
        _train(c, 1, seed=1)
        # in 64 KiB chunks: several per snapshot, rank 0's (with the weights) more than rank 1's
        c.call("snapshot_now", {"chunk_bytes": 64 << 10}, ranks=[0, 1])  # step 1 ...
        _train(c, 2, seed=2)
        held = c.call("snapshot_now", ranks=[0, 1])  # ... and step 2: the two newest are kept
        assert [x["step"] for x in held[0]["own"]] == [1, 2] and [x["step"] for x in held[1]["held"]] == [1, 2]
        assert held[0]["own"][-1] == {"rank": 0, "step": 2, "n_train": 2, "weights": True}
        assert held[0]["held"][-1] == {"rank": 1, "step": 2, "n_train": 2, "weights": False}
        assert held[1]["held"][-1] == {"rank": 0, "step": 2, "n_train": 2, "weights": True}  # rank 0's copy, weights too
        c.call("stage_state", {"tag": "disk"}, ranks=[0, 1])  # the disk checkpoint of the same step
        _train(c, 3, seed=3)  # the live state moves on: the snapshot must not
        held = c.call("snapshot_now", ranks=[0, 1])  # step 3: step 1's goes when step 3's starts
        assert [x["step"] for x in held[1]["own"]] == [2, 3] and [x["step"] for x in held[1]["held"]] == [2, 3]
        # rank 0 lost: rank 1 writes rank 0's partition and both ranks' weights from what it holds
        out = c.call("materialize_snapshot", {"tag": "snap", "step": 2, "optim": [0, 1], "weights": [0, 1]}, ranks=[1])
        assert out[1]["bytes"] > 4 * (64 << 10) and len(out[1]["manifests"]) == 4
        with pytest.raises(Exception, match="holds no snapshot of rank 0 at step 1"):  # gone: never written stale
            c.call("materialize_snapshot", {"tag": "x", "step": 1, "optim": [0], "weights": []}, ranks=[1])
    stager = Stager(tmp_path / "staging")
    for r in (0, 1):
        for what in ("optim", "weights"):
            _same(stager, f"disk-rank{r}-{what}", f"snap-rank{r}-{what}")


def test_the_ring_puts_every_copy_on_another_rank():
    for n in range(2, 9):
        assert sorted(peer_of(r, n) for r in range(n)) == list(range(n))  # every rank holds exactly one copy
        for r in range(n):
            assert peer_of(r, n) != r and source_of(peer_of(r, n), n) == r
    assert peer_of(0, 1) is None and peer_of(3, 2) is None  # a single trainer, a rollout rank: no peer
