"""A loopback TCP proxy in front of a real redis-server that fails or delays chosen Redis calls (tests only).

The clients under test connect to the proxy with the project's own client (``dynaresize.control.server.connect`` on
:meth:`FaultProxy.endpoint_file`), so redis-py's retries, timeouts and pipelines run exactly as in a real run.
The proxy parses the RESP requests of each connection into **calls**: one command, or one ``MULTI ... EXEC`` block
(one transaction). Each call gets a number (one counter over all connections) and the plan decides what happens:

============  ==========================================================================================
action        what the client sees (what the server did)
============  ==========================================================================================
``pass``      the real reply
``delay``     the real reply, ``delay_s`` later (the call waits before it reaches the server)
``stall``     the call reaches the server ``stall_s`` later, after the client's socket timeout: the client
              gives up (timeout, retried by redis-py) and the call may still run, after or during its retry
``drop``      the connection breaks before the call reaches the server (nothing executed)
``lose``      the call runs on the server, then the connection breaks before the reply (executed, reply lost)
``oom``       ``-OOM ...`` (what ``maxmemory`` does to a write; a read passes); nothing executed
``misconf``   ``-MISCONF ...`` (a failed background save with ``stop-writes-on-bgsave-error``); a read passes
``readonly``  ``-READONLY ...`` (a read-only replica); a read passes
``restart``   the redis-server is restarted (``on_restart``) before the call, whose connection then breaks
============  ==========================================================================================

:meth:`FaultProxy.hold` stalls the whole server for a while, as a slow disk, a fork or a network hiccup does: every
call, connection set-up included, that arrives before the hold ends waits for its end, then reaches the server
(a client whose socket timeout passed meanwhile has given up and retries; its retry waits too).

Inside a transaction a refused write gets the error at queue time and ``EXEC`` answers ``-EXECABORT``, as Redis
does. Connection set-up (AUTH, HELLO, CLIENT, SELECT), health-check PINGs and pub/sub connections are never faulted
(a pub/sub connection is piped through as raw bytes once it subscribes).

Calls are served one at a time per connection (a client waits for its replies anyway), which keeps replies in
order without buffering them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ACTIONS = ("pass", "delay", "stall", "drop", "lose", "oom", "misconf", "readonly", "restart")
REFUSALS = {
    "oom": b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
    "misconf": b"-MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. "
               b"Commands that may modify the data set are disabled.\r\n",
    "readonly": b"-READONLY You can't write against a read only replica.\r\n",
}
SETUP = {b"AUTH", b"HELLO", b"CLIENT", b"SELECT", b"PING", b"QUIT", b"RESET"}
WRITES = {b"SET", b"HSET", b"HSETNX", b"HDEL", b"DEL", b"INCR", b"INCRBY", b"EXPIRE", b"PEXPIRE", b"XADD", b"XTRIM",
          b"XDEL", b"ZADD", b"ZREM", b"SADD", b"SREM", b"RPUSH", b"LPUSH", b"LPOP", b"RPOP", b"EVAL", b"EVALSHA",
          b"FCALL", b"SETEX", b"PSETEX", b"MSET", b"HINCRBY", b"RENAME", b"UNLINK", b"FLUSHDB", b"FLUSHALL"}


class _Closed(Exception):
    pass


class _Reader:
    """Buffered RESP reader over a socket: whole requests (arrays of bulk strings) and whole RESP2/RESP3 replies."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise _Closed()
        self.buf += data

    def _line(self, pos: int) -> tuple[bytes, int]:
        while True:
            i = self.buf.find(b"\r\n", pos)
            if i >= 0:
                return self.buf[pos:i], i + 2
            self._fill()

    def _need(self, end: int) -> None:
        while len(self.buf) < end:
            self._fill()

    def _value(self, pos: int) -> int:
        """End offset of the RESP value that starts at ``pos`` (reads more as needed)."""
        self._need(pos + 1)
        t = self.buf[pos:pos + 1]
        line, nxt = self._line(pos + 1)
        if t in b"$=!":  # bulk string, verbatim string, bulk error
            n = int(line)
            if n < 0:
                return nxt
            self._need(nxt + n + 2)
            return nxt + n + 2
        if t in b"*~>%|":  # array, set, push, map (2n values), attribute (2n values, then the value itself)
            n = int(line)
            if n < 0:
                return nxt
            n = 2 * n if t in b"%|" else n
            for _ in range(n):
                nxt = self._value(nxt)
            return self._value(nxt) if t == b"|" else nxt
        return nxt  # + - : _ , # ( : one line

    def take(self) -> bytes:
        end = self._value(0)
        raw, self.buf = self.buf[:end], self.buf[end:]
        return raw

    def request(self) -> tuple[bytes, list[bytes]]:
        """One command: its raw bytes and its arguments."""
        raw = self.take()
        args, pos = [], 0
        line_end = raw.find(b"\r\n")
        n, pos = int(raw[1:line_end]), line_end + 2
        for _ in range(n):
            e = raw.find(b"\r\n", pos)
            size = int(raw[pos + 1:e])
            args.append(raw[e + 2:e + 2 + size])
            pos = e + 2 + size + 2
        return raw, args


@dataclass
class Plan:
    """What to do with call number ``n``: ``fixed`` first, else ``random_rate`` of the calls get a random action
    (from ``actions``) drawn from ``rng``; ``next_of[name]`` queues actions for the next calls of one command
    (``MULTI`` for a transaction); ``delay_s`` for ``delay``."""

    fixed: dict[int, str] = field(default_factory=dict)
    next_of: dict[str, list[str]] = field(default_factory=dict)  # command name -> actions for its next calls
    random_rate: float = 0.0
    actions: tuple[str, ...] = ("drop", "lose", "oom", "misconf", "readonly", "delay")
    rng: object = None  # random.Random
    delay_s: float = 0.05
    stall_s: float = 1.2

    def decide(self, n: int, name: str = "") -> str:
        if n in self.fixed:
            return self.fixed[n]
        queued = self.next_of.get(name)
        if queued:
            return queued.pop(0)
        if self.random_rate and self.rng is not None and self.rng.random() < self.random_rate:
            return self.rng.choice(self.actions)
        return "pass"


class FaultProxy:
    """``with FaultProxy(upstream_endpoint_file, workdir, plan) as proxy: connect(proxy.endpoint_file, ...)``."""

    def __init__(self, upstream_endpoint_file: Path, workdir: Path, plan: Plan | None = None,
                 on_restart: Callable[[], None] | None = None):
        ep = json.loads(Path(upstream_endpoint_file).read_text())
        self.upstream = (ep["host"], int(ep["port"]))
        self.plan = plan or Plan()
        self.on_restart = on_restart
        self.calls = 0
        self.seen: Counter[str] = Counter()  # action -> calls it was applied to (faults that really happened)
        self.log: list[tuple[int, str, str]] = []  # (call number, action, command) of every fault
        self.held_until = 0.0  # monotonic time: calls arriving before it wait until then (hold())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(64)
        self.port = self._listen.getsockname()[1]
        workdir.mkdir(parents=True, exist_ok=True)
        self.endpoint_file = workdir / "proxy.json"
        self.endpoint_file.write_text(json.dumps(ep | {"host": "127.0.0.1", "port": self.port}))
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hold(self, seconds: float) -> None:
        """Stall every call (set-up included) that arrives in the next ``seconds`` until they have passed."""
        self.held_until = time.monotonic() + seconds

    def _wait_hold(self) -> None:
        wait = self.held_until - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def close(self) -> None:
        self._stop.set()
        try:
            self._listen.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    # -- plumbing -------------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._listen.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), name="fault-proxy-conn", daemon=True).start()

    def _next(self, name: bytes, first: bytes) -> tuple[int, str]:
        with self._lock:
            self.calls += 1
            n = self.calls
            action = self.plan.decide(n, first.decode(errors="replace"))
            if action != "pass":
                self.seen[action] += 1
                self.log.append((n, action, name.decode(errors="replace")))
            return n, action

    def _serve(self, client: socket.socket) -> None:
        try:
            up = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _close(client)
            return
        up.settimeout(None)
        with self._lock:
            self._conns += [client, up]
        cr, ur = _Reader(client), _Reader(up)
        try:
            while not self._stop.is_set():
                raw, args = cr.request()
                self._wait_hold()
                name = args[0].upper() if args else b""
                if name in (b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"):
                    up.sendall(raw + cr.buf)
                    _pipe(client, up, ur.buf)
                    return
                unit = [(raw, args)]
                if name == b"MULTI":
                    while unit[-1][1][0].upper() not in (b"EXEC", b"DISCARD"):
                        unit.append(cr.request())
                if name in SETUP:
                    self._forward(client, up, ur, unit)
                    continue
                n, action = self._next(b" ".join(a[1][0].upper() for a in unit[:3]), name)
                if action in REFUSALS and any(a[1][0].upper() in WRITES for a in unit):
                    client.sendall(_refused(unit, REFUSALS[action]))
                    continue
                if action == "delay":
                    time.sleep(self.plan.delay_s)
                elif action == "stall":
                    time.sleep(self.plan.stall_s)
                elif action == "drop":
                    return
                elif action == "restart":
                    if self.on_restart is not None:
                        self.on_restart()
                    return
                elif action == "lose":
                    for r, _ in unit:
                        up.sendall(r)
                    for _ in unit:
                        ur.take()
                    return
                self._forward(client, up, ur, unit)
        except (_Closed, OSError, ValueError):
            pass
        finally:
            _close(client)
            _close(up)

    @staticmethod
    def _forward(client: socket.socket, up: socket.socket, ur: _Reader, unit) -> None:
        up.sendall(b"".join(r for r, _ in unit))
        client.sendall(b"".join(ur.take() for _ in unit))


def _refused(unit, error: bytes) -> bytes:
    """Replies of a call refused as Redis refuses it (a transaction: errors at queue time, then EXECABORT)."""
    if unit[0][1][0].upper() != b"MULTI":
        return error
    out = [b"+OK\r\n"]
    for _, args in unit[1:-1]:
        out.append(error if args[0].upper() in WRITES else b"+QUEUED\r\n")
    out.append(b"-EXECABORT Transaction discarded because of previous errors.\r\n")
    return b"".join(out)


def _pipe(client: socket.socket, up: socket.socket, pending: bytes) -> None:
    """Raw bytes both ways until either side closes (pub/sub: the server pushes when it likes)."""
    if pending:
        client.sendall(pending)

    def one_way(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            _close(a)
            _close(b)

    t = threading.Thread(target=one_way, args=(up, client), daemon=True)
    t.start()
    one_way(client, up)
    t.join(timeout=5)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
