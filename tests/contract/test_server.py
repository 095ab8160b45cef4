"""The embedded redis-server manager against a real redis-server: security, endpoint file, restart."""

from __future__ import annotations

import json
import os
import stat

import pytest
import redis
from pydantic import ValidationError

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import Endpoint, RedisServer, RedisServerError, connect

pytestmark = [pytest.mark.contract, pytest.mark.timeout(60)]


def test_endpoint_file_and_private_password(redis_server):
    ep = json.loads(redis_server.endpoint_file.read_text())
    assert set(ep) >= {"host", "port", "password_file"}
    assert ep["host"] == "127.0.0.1" and ep["port"] == redis_server.port
    pw = os.stat(ep["password_file"])
    assert stat.S_IMODE(pw.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(redis_server.dir / "redis.conf").st_mode) == 0o600
    password = Endpoint.load(redis_server.endpoint_file).password()
    assert password and len(password) >= 32
    cmdline = open(f"/proc/{redis_server.proc.pid}/cmdline", "rb").read()
    assert password.encode() not in cmdline, "the password must never be on the command line"
    c = connect(redis_server.run_dir, role="t")  # a run directory works as a target too
    assert c.ping()
    info = c.config_get("appendonly")
    assert info["appendonly"] in (b"yes", "yes")
    c.close()


def test_wrong_password_refused(redis_server):
    for password in ("not-the-password", None):
        c = connect(f"redis://:{password or ''}@127.0.0.1:{redis_server.port}/0", role="t")
        with pytest.raises(redis.AuthenticationError):  # refused at once: auth errors are not retried
            c.ping()
        c.close()


def test_non_loopback_bind_without_password_refused(tmp_path, redis_binary):
    with pytest.raises(ValidationError, match="require_password must be true"):
        RedisConfig(bind="0.0.0.0", require_password=False)
    forced = RedisConfig.model_construct(**{**RedisConfig().model_dump(), "bind": "0.0.0.0", "require_password": False})
    with pytest.raises(RedisServerError, match="without a password"):
        RedisServer(forced, tmp_path).start()
    assert not (tmp_path / "redis" / "redis.json").exists()


def test_blocking_read_must_be_shorter_than_socket_timeout():
    with pytest.raises(ValidationError, match="block_ms"):
        RedisConfig(block_ms=5000, socket_timeout_s=2.0)


def test_external_url_adopted_without_a_process(redis_server, tmp_path):
    pw = Endpoint.load(redis_server.endpoint_file).password()
    cfg = RedisConfig(url=f"redis://:{pw}@127.0.0.1:{redis_server.port}/0")
    with RedisServer(cfg, tmp_path) as ext:
        assert ext.proc is None and ext.external
        assert stat.S_IMODE(os.stat(tmp_path / "redis" / "password").st_mode) == 0o600
        c = connect(ext.endpoint_file, role="t")
        assert c.ping()
        c.close()
    assert redis_server.client().ping()  # stopping the adopter leaves the external server alone


def test_restart_keeps_port_password_and_data(tmp_path, redis_binary):
    with RedisServer(RedisConfig(server_binary=redis_binary), tmp_path) as srv:
        port, pw = srv.port, Endpoint.load(srv.endpoint_file).password()
        srv.client().set("dr:k", "v")
        srv.restart()
        assert srv.port == port and Endpoint.load(srv.endpoint_file).password() == pw
        assert srv.client().get("dr:k") == b"v"
        proc = srv.proc
    assert proc is None or proc.poll() is not None
    assert srv.proc is None
