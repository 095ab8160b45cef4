"""dynaresize.atomic: a write replaces the whole file or nothing, and leaves no temp file behind."""

from __future__ import annotations

import json
import os

import pytest

from dynaresize import atomic

pytestmark = pytest.mark.unit


def test_writes_replace_the_file_whole(tmp_path):
    p = tmp_path / "state.json"
    atomic.write_json(p, {"step": 1}, indent=1)
    assert json.loads(p.read_text()) == {"step": 1}
    atomic.write_text(p, "two\n")
    assert p.read_text() == "two\n"
    atomic.write_bytes(p, b"\x00\x01", fsync=False)
    assert p.read_bytes() == b"\x00\x01"
    with atomic.open_atomic(p) as f:
        f.write(b"streamed ")
        f.write(b"in parts")
    assert p.read_bytes() == b"streamed in parts"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]


def test_an_exception_while_writing_leaves_the_old_content_and_no_temp_file(tmp_path):
    p = tmp_path / "launch.json"
    p.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic.open_atomic(p) as f:
            f.write(b"half of the new conte")
            assert len(list(tmp_path.glob("*.tmp"))) == 1  # the new content goes elsewhere until it is complete
            raise RuntimeError("disk on fire")
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["launch.json"]
    with pytest.raises(TypeError):
        atomic.write_json(p, {"not json": object()})
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["launch.json"]


def test_a_missing_directory_is_an_error_not_a_stray_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic.write_text(tmp_path / "no" / "such" / "file", "x")
    assert list(tmp_path.iterdir()) == []


def test_mode_is_exact_and_the_default_follows_the_umask(tmp_path):
    secret = atomic.write_text(tmp_path / "password", "pw\n", mode=0o600)
    assert secret.stat().st_mode & 0o777 == 0o600
    atomic.write_text(secret, "pw2\n", mode=0o644)  # replaced: the new file's mode, not the old one's
    assert secret.stat().st_mode & 0o777 == 0o644
    old = os.umask(0o027)
    try:
        plain = atomic.write_text(tmp_path / "plain", "x")
    finally:
        os.umask(old)
    assert plain.stat().st_mode & 0o777 == 0o640
