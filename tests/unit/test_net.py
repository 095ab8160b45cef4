"""free_port (dynaresize/net.py): a port below the kernel's ephemeral range, so that one bound seconds later (rank 0's
rendezvous) is not taken meanwhile by an outgoing connection's port."""

from __future__ import annotations

import socket

import pytest

from dynaresize import net

pytestmark = pytest.mark.unit


def test_the_ephemeral_range_is_read_and_garbage_is_none(tmp_path):
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert net.ephemeral_low(f) == 32768
    f.write_text("not a range\n")
    assert net.ephemeral_low(f) is None
    assert net.ephemeral_low(tmp_path / "missing") is None


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    lo = net.ephemeral_low()
    if lo is None or lo <= net.LOWEST + 1000:
        pytest.skip("no ephemeral range to stay below on this machine")
    ports = {net.free_port() for _ in range(20)}
    assert all(net.LOWEST <= p < lo for p in ports)
    assert len(ports) > 1  # drawn, not a fixed port that every job would collide on
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_without_a_range_any_free_port(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_low", lambda path=None: None)
    p = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_a_port_taken_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]  # free again once closed
        draws = iter([taken, taken, spare])

        class Picker:  # the draw: the taken port twice, then a free one
            def randrange(self, lo, hi):
                return next(draws)

        monkeypatch.setattr(net.random, "SystemRandom", Picker)
        monkeypatch.setattr(net, "ephemeral_low", lambda path=None: 65535)
        monkeypatch.setattr(net, "LOWEST", 1024)
        assert net.free_port() == spare
