"""Staging: round trip, bounded pool, manifest-last, and corruption/truncation are caught, never loaded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dynaresize.staging import Prefetch, Stager, StagingError, read_manifest

pytestmark = pytest.mark.unit


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 257, generator=g),
        "step": torch.tensor(7.0),
        "ids": torch.randint(0, 1 << 40, (1000,), generator=g),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0),
    }


@pytest.mark.parametrize("zero_copy", [True, False])
def test_round_trip_is_bit_exact_across_chunk_boundaries(tmp_path, zero_copy):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1, zero_copy_host=zero_copy)
    st.chunk = 4096  # many chunks, tensors straddle them
    st.buffers = [torch.empty(st.chunk, dtype=torch.uint8) for _ in range(3)]
    src = _state()
    res = st.stage("snap", src, meta={"version": 3, "layout": [1, 2]})
    assert res.chunks > 10 and res.bytes == sum(t.numel() * t.element_size() for t in src.values())
    out, meta = st.load("snap")
    assert meta == {"version": 3, "layout": [1, 2]}
    for k, t in src.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k], t), k
    into = {k: torch.empty_like(t) for k, t in src.items()}
    out2, _ = Prefetch(st, "snap", into).result()
    assert all(out2[k] is into[k] and torch.equal(into[k], src[k]) for k in src)


def test_manifest_is_json_and_written_last(tmp_path):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1)
    st.stage("s", _state())
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert man["checksum"] in ("xxh3", "crc32") and {t["name"] for t in man["tensors"]} == set(_state())
    assert not list((tmp_path / "s").glob("*.tmp"))
    # re-staging removes the old manifest before touching data: a failed re-stage leaves no manifest
    (tmp_path / "s" / "data.bin").chmod(0o400)
    if os.geteuid() != 0:
        with pytest.raises(StagingError, match="EACCES"):
            st.stage("s", _state(1))
        with pytest.raises(StagingError, match="no manifest"):
            read_manifest(tmp_path / "s")


@pytest.mark.parametrize("algo", ["crc32", "blake2b", pytest.param("xxh3", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("xxhash") is None, reason="xxhash not installed"))])
def test_corrupted_chunk_is_caught_and_named(tmp_path, algo):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1, checksum=algo)
    st.chunk = 8192
    st.buffers = [torch.empty(st.chunk, dtype=torch.uint8) for _ in range(2)]
    src = _state()
    st.stage("c", src)
    data = tmp_path / "c" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[3 * 8192 + 17] ^= 0x01  # one bit in chunk 3
    data.write_bytes(bytes(raw))
    dest = {k: torch.zeros_like(t) for k, t in src.items()}
    with pytest.raises(StagingError, match=r"data\.bin: chunk 3 .*checksum"):
        st.load("c", dest)  # verify-first: nothing loaded at all
    assert all(int(t.count_nonzero()) == 0 for t in dest.values())
    with pytest.raises(StagingError, match=r"data\.bin: chunk 3 .*checksum"):
        st.load("c", dest, verify_first=False)  # streaming: chunks 0-2 loaded, the bad one never
    # nothing of the bad chunk reached the destination: bytes from chunk 3 on are still zero
    w = dest["w"].view(-1).view(torch.uint8)
    assert torch.equal(w[: 3 * 8192], src["w"].view(-1).view(torch.uint8)[: 3 * 8192])
    assert int(w[3 * 8192 :].count_nonzero()) == 0


def test_truncated_or_missing_data_is_reported(tmp_path):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1)
    st.stage("t", _state())
    data = tmp_path / "t" / "data.bin"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 10)
    with pytest.raises(StagingError, match="truncated"):
        st.load("t")
    data.unlink()
    with pytest.raises(StagingError, match="data file missing"):
        st.load("t")
    with pytest.raises(StagingError, match="no manifest"):
        st.load("never-written")


def test_destination_mismatch_and_bad_manifest(tmp_path):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1)
    st.stage("m", {"a": torch.ones(4)})
    with pytest.raises(StagingError, match="'a' is torch.float32\\[4\\]"):
        st.load("m", {"a": torch.ones(5)})
    (tmp_path / "m" / "manifest.json").write_text("{not json")
    with pytest.raises(StagingError, match="not valid JSON"):
        st.load("m")


def test_pool_bounds_buffers(tmp_path):
    st = Stager(tmp_path, buffer_mb=4, chunk_mb=1)
    assert len(st.buffers) == 4 and st.buffer_bytes == 4 << 20
    assert Stager(tmp_path, buffer_mb=1, chunk_mb=8).buffer_bytes == 1 << 20  # chunk never exceeds the buffer


def test_bad_snapshot_leaves_live_tensors_untouched(tmp_path):
    st = Stager(tmp_path, buffer_mb=1, chunk_mb=1)
    st.chunk = 4096
    src = _state()
    st.stage("v", src)
    data = tmp_path / "v" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # last chunk
    data.write_bytes(bytes(raw))
    live = {k: torch.full_like(t, 3) for k, t in src.items()}
    with pytest.raises(StagingError, match="checksum"):
        st.load("v", live)  # verify_first by default with live destinations
    assert all(bool((t == 3).all()) for t in live.values())
