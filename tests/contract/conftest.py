"""Helpers of the control-plane contract tests: a fast config, a fresh job id per test, client factories."""

from __future__ import annotations

import os
import uuid

import pytest

from dynaresize.control.config import RedisConfig
from dynaresize.control.server import RedisServer, connect
from dynaresize.control.wire import RankState, Registration

FAST = dict(heartbeat_s=0.1, dead_after_heartbeats=2, socket_timeout_s=2.0, connect_timeout_s=1.0, block_ms=100, retries=3)


@pytest.fixture
def cfg(redis_server: RedisServer) -> RedisConfig:
    return redis_server.cfg.model_copy(update=FAST)


@pytest.fixture
def job_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(redis_server, cfg):
    """Factory of fresh clients (each its own connection pool), closed at the end of the test."""
    made = []

    def make(role: str = "test"):
        c = connect(redis_server.endpoint_file, role=role, cfg=cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def registration():
    """Factory: a valid registration of (job_id, rank) with extra fields from keywords."""
    return make_registration


def make_registration(job_id: str, rank: int, **kw) -> Registration:
    # ready ranks (a starting one, ``state=RankState.STARTING``, gets ``start_grace_s`` before it is reported dead)
    fields = dict(host="testhost", device="cpu", staging_dir="/tmp/stage", pid=os.getpid(), state=RankState.IDLE) | kw
    return Registration(job_id=job_id, rank=rank, **fields)
