"""Small network helpers shared by the Redis manager, the local launcher and the test cluster."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # the lowest port free_port hands out below the ephemeral range
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux: where outgoing connections take their ports


def ephemeral_low(path: Path = _RANGE) -> int | None:
    """The lowest port of the kernel's ephemeral range (Linux), or None where it cannot be read."""
    try:
        lo = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return lo if lo > 0 else None


def _binds(fam: int, host: str, port: int) -> bool:
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (IPv4 or IPv6 literal); the caller binds it soon after.

    Drawn below the kernel's ephemeral range where it can tell (Linux): a port bound only seconds later (rank 0's
    rendezvous, once its process has started) could otherwise be taken meanwhile by an outgoing connection, whose
    port comes from the same range as ``bind(0)``'s (a two-job test once saw rank 0 fail with EADDRINUSE); else, or
    if no port there binds, any free port."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo = ephemeral_low()
    if lo is not None and lo > LOWEST + 1000:
        pick = random.SystemRandom()
        for _ in range(64):
            port = pick.randrange(LOWEST, lo)
            if _binds(fam, host, port):
                return port
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
