"""Staging faults on a real, small tmpfs: a full disk is one clear error, leaves no partial snapshot and no
manifest, and the stager stays usable; a truncated or bit-flipped chunk is named by verify and by load."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from dynaresize.staging import Stager, StagingError, read_manifest, verify_snapshot

pytestmark = pytest.mark.unit

CHUNK = 64 << 10


def _stager(root, writers: int = 2, zero_copy: bool = True, fsync: bool = False) -> Stager:
    st = Stager(root, buffer_mb=1, chunk_mb=1, writer_threads=writers, zero_copy_host=zero_copy, fsync=fsync)
    st.chunk = CHUNK  # many chunks in flight through a pool of three
    st.buffers = [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(3)]
    return st


def _state(mb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * (1 << 20)) // 4
    return {"a": torch.randn(n // 2, generator=g), "tail": torch.randn(n - n // 2 + 7, generator=g),
            "half": torch.randn(1001, generator=g).to(torch.bfloat16)}


def _stage_bounded(st: Stager, name: str, tensors) -> BaseException | None:
    """Run stage() on a thread: a deadlocked pool would hang here, so a join timeout turns it into a failure."""
    out: list[BaseException | None] = [None]

    def go():
        try:
            st.stage(name, tensors)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out[0] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(120)
    assert not th.is_alive(), "stage() did not return: the buffer pool or a writer thread is stuck"
    return out[0]


def _used(root) -> int:
    s = os.statvfs(root)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


@pytest.mark.parametrize("writers,zero_copy,fsync", [(2, True, False), (1, False, True), (3, True, True)])
def test_disk_full_is_a_clear_error_and_leaves_nothing(tmp_path, tmpfs, writers, zero_copy, fsync):
    root = tmpfs(tmp_path / "scratch", 1 << 20)
    st = _stager(root, writers, zero_copy, fsync)
    st.stage("kept", _state(0.1, seed=1))  # an earlier good snapshot must survive the failure next to it
    used_before = _used(root)
    threads_before = threading.active_count()

    err = _stage_bounded(st, "big", _state(3))
    assert isinstance(err, StagingError), repr(err)
    msg = str(err)
    assert "ENOSPC" in msg and str(root / "big") in msg and "No space left on device" in msg
    assert isinstance(err.__cause__, OSError)
    assert not (root / "big").exists()  # the partial snapshot is gone: no data, no manifest, no temp manifest
    assert sorted(os.listdir(root)) == ["kept"]
    assert _used(root) == used_before  # the space of the partial data is given back
    assert threading.active_count() == threads_before  # writer threads joined, none leaked

    # the stager is still usable: same pool, same threads count, a snapshot that fits round-trips
    small = _state(0.3, seed=2)
    st.stage("small", small)
    out, _ = st.load("small")
    assert all(torch.equal(out[k], small[k]) for k in small)
    assert threading.active_count() == threads_before
    kept, _ = st.load("kept")
    assert torch.equal(kept["a"], _state(0.1, seed=1)["a"])


def test_full_disk_at_the_manifest_leaves_no_manifest(tmp_path, tmpfs):
    """The data fits to the byte, the manifest does not: the snapshot does not exist afterwards."""
    root = tmpfs(tmp_path / "exact", 16 * 4096)
    st = _stager(root)
    err = _stage_bounded(st, "fits", {"x": torch.ones(16 * 4096 // 4)})  # exactly the tmpfs' 16 pages
    assert isinstance(err, StagingError) and "ENOSPC" in str(err), repr(err)
    assert "manifest" in str(err)  # the file that could not be written is named
    assert not (root / "fits").exists() and os.listdir(root) == []
    with pytest.raises(StagingError, match="no manifest"):
        read_manifest(root / "fits")
    st.stage("fits", {"x": torch.ones(1000)})  # smaller: fits with its manifest
    assert read_manifest(root / "fits")["total_bytes"] == 4000


def test_failed_restage_removes_the_old_snapshot_of_that_name(tmp_path, tmpfs):
    root = tmpfs(tmp_path / "re", 1 << 20)
    st = _stager(root)
    st.stage("s", _state(0.2))
    err = _stage_bounded(st, "s", _state(2))
    assert isinstance(err, StagingError) and "ENOSPC" in str(err)
    # the old manifest described other bytes: the name is simply absent now, never half old, half new
    assert not (root / "s").exists()


def _staged(root, name="snap"):
    st = _stager(root)
    src = _state(0.5)
    st.stage(name, src)
    return st, src, root / name / "data.bin"


def test_truncated_chunk_is_named_by_verify_and_load(tmp_path, tmpfs):
    root = tmpfs(tmp_path / "t", 4 << 20)
    st, src, data = _staged(root)
    size = data.stat().st_size
    cut = 5 * CHUNK + 100  # inside chunk 5
    os.truncate(data, cut)
    with pytest.raises(StagingError, match=rf"{data}: chunk 5 \(offset {5 * CHUNK}\) truncated"):
        st.verify("snap")
    with pytest.raises(StagingError, match=rf"{data}: chunk 5 \(offset {5 * CHUNK}\) truncated"):
        verify_snapshot(root / "snap")
    with pytest.raises(StagingError, match=rf"{data}: truncated: {cut} bytes, manifest says {size} \(chunk 5 "):
        st.load("snap")
    dest = {k: torch.zeros_like(t) for k, t in src.items()}
    with pytest.raises(StagingError, match="chunk 5"):
        st.load("snap", dest)
    assert all(int(t.count_nonzero()) == 0 for t in dest.values())  # verified first: nothing loaded


def test_bit_flipped_chunk_is_named_by_verify_and_load(tmp_path, tmpfs):
    root = tmpfs(tmp_path / "f", 4 << 20)
    st, src, data = _staged(root)
    with open(data, "r+b") as f:
        f.seek(2 * CHUNK + 4321)
        b = f.read(1)
        f.seek(2 * CHUNK + 4321)
        f.write(bytes([b[0] ^ 0x10]))
    pattern = rf"{data}: chunk 2 \(offset {2 * CHUNK}, {CHUNK} bytes\) fails its \w+ checksum: corrupted"
    with pytest.raises(StagingError, match=pattern):
        st.verify("snap")
    with pytest.raises(StagingError, match=pattern):
        verify_snapshot(root / "snap")
    with pytest.raises(StagingError, match=pattern):
        st.load("snap")


def test_damaged_chunk_table_is_caught_in_the_manifest(tmp_path):
    st, _, _ = _staged(tmp_path)
    man_path = tmp_path / "snap" / "manifest.json"
    import json

    man = json.loads(man_path.read_text())
    man["chunks"][3]["length"] = 1 << 40  # one damaged number: would allocate 1 TiB if trusted
    man_path.write_text(json.dumps(man))
    with pytest.raises(StagingError, match=r"manifest.json: chunk 3 has offset \d+ and length 1099511627776"):
        verify_snapshot(tmp_path / "snap")
    man["chunks"][3]["length"] = CHUNK
    man["total_bytes"] += 1
    man_path.write_text(json.dumps(man))
    with pytest.raises(StagingError, match="total_bytes .* but the chunks cover"):
        st.load("snap")


def test_a_full_disk_error_without_a_file_name_still_says_the_space_left(tmp_path):
    """A write to an open file raises ENOSPC without a file name: the free space is read where the snapshot goes."""
    import errno as _errno

    from dynaresize.staging.store import os_error_text

    e = OSError(_errno.ENOSPC, "No space left on device")
    assert "free on its filesystem" not in os_error_text(e)
    text = os_error_text(e, tmp_path / "step-4" / "rank0-weights")  # not there any more: its nearest folder counts
    assert text.startswith("ENOSPC (No space left on device), a full disk (") and "free on its filesystem)" in text
