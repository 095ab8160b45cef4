"""A Redis that stalls is not a dead rank (issue 47, item 1), on the coordinator's real liveness check
(``Transport.check_alive``) with ranks heartbeating through a delaying proxy (``faultproxy.FaultProxy.hold``) in front
of a real redis-server: a stall longer than the heartbeat deadline and than the socket timeout declares nobody lost
and is announced once, with the coordinator's measure and the ranks' own; a rank that dies during a stall is seen once Redis answers; a stall past
``redis.write_wait_s`` stops with one message naming Redis."""

from __future__ import annotations

import logging
import time

import pytest

from dynaresize.config.loader import load_config
from dynaresize.control.health import RoundTrips, stall_grace_s
from dynaresize.control.registry import Heartbeater, Registry
from dynaresize.control.server import connect
from dynaresize.job.errors import JobError, RanksLost
from dynaresize.job.runtime import Job, Services
from dynaresize.job.state import JobState
from dynaresize.job.transport import Transport

from conftest import make_registration
from faultproxy import FaultProxy

pytestmark = [pytest.mark.contract, pytest.mark.timeout(120)]

# a 1 s heartbeat deadline and a 2 s socket timeout: the stalls below outlast both
FAST = ["redis.heartbeat_s=0.2", "redis.dead_after_heartbeats=5", "redis.socket_timeout_s=2", "redis.block_ms=100",
        "redis.connect_timeout_s=2", "redis.retries=8"]


class Harness:
    def __init__(self, redis_server, tmp_path, *overrides: str):
        self.proxy = FaultProxy(redis_server.endpoint_file, tmp_path / "proxy").__enter__()
        self.job = Job(load_config("configs/quickstart.yaml", [*FAST, *overrides]), tmp_path, JobState(n_train=2))
        self.rc = self.job.cfg.redis
        self.health = RoundTrips(slow_after_s=self.rc.heartbeat_s)
        coord = connect(self.proxy.endpoint_file, role="coordinator", cfg=self.rc, round_trips=self.health)
        self.clients = [coord]
        svc = Services(srv=None, redis=coord, bus=None, registry=Registry(coord, self.job.job_id, self.rc), queue=None,
                       task=None, model_dir=tmp_path, tokenizer=None, assembler=None, metrics=None, health=self.health)
        self.tx = Transport(self.job, svc)
        self.ranks = {}
        for r in range(3):
            c = connect(self.proxy.endpoint_file, role=f"rank{r}", cfg=self.rc)
            self.clients.append(c)
            self.ranks[r] = Heartbeater(Registry(c, self.job.job_id, self.rc), make_registration(self.job.job_id, r))
            self.ranks[r].start()

    def watch(self, seconds: float) -> tuple[BaseException | None, float]:
        """The coordinator's liveness check in a loop (as while it waits on acks) until it raises or ``seconds``
        pass: what it raised (None) and when (monotonic)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.tx.check_alive(sorted(self.ranks), "test")
            except (RanksLost, JobError) as e:
                return e, time.monotonic()
            time.sleep(0.1)
        return None, time.monotonic()

    def close(self):
        for hb in self.ranks.values():
            hb._stop.set()
        self.proxy.close()
        for c in self.clients:
            c.close()


@pytest.fixture
def harness(redis_server, tmp_path):
    made = []

    def make(*overrides: str) -> Harness:
        made.append(Harness(redis_server, tmp_path / str(len(made)), *overrides))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_a_stall_longer_than_the_deadline_and_the_socket_timeout_loses_no_rank_and_is_announced_once(harness, caplog):
    h = harness()
    assert h.watch(1.0)[0] is None  # healthy
    caplog.set_level(logging.WARNING, logger="dynaresize.job")
    h.proxy.hold(4.0)  # 4x the heartbeat deadline, 2x the socket timeout
    got, _ = h.watch(4.0 + stall_grace_s(h.rc) + h.rc.dead_after_s + 2.0)
    assert got is None, f"a Redis stall was taken for {got}"
    lines = [r.getMessage() for r in caplog.records if "Redis replies took" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("; ranks waited; no rank lost"), lines
    took = float(lines[0].split("took ")[1].split(" s")[0])
    assert 3.0 <= took <= 8.0, lines  # the measured delay
    theirs = float(lines[0].split("the ranks' heartbeats up to ")[1].split(" s")[0])  # the ranks report theirs
    assert 3.0 <= theirs <= 8.0, lines


def test_a_rank_that_dies_during_a_stall_is_seen_once_redis_answers(harness):
    h = harness()
    assert h.watch(1.0)[0] is None
    h.proxy.hold(3.0)
    held_until = h.proxy.held_until
    h.ranks[2]._stop.set()  # dies (no deregistration): its beat in flight, if any, is its last
    got, at = h.watch(3.0 + stall_grace_s(h.rc) + h.rc.dead_after_s + 10.0)
    assert isinstance(got, RanksLost) and set(got.ranks) == {2}, got
    assert held_until <= at <= held_until + stall_grace_s(h.rc) + h.rc.dead_after_s + 3.0, (at - held_until)
    assert "while Redis was slow or unreachable, not counted" in str(got), got


def test_a_stall_past_write_wait_stops_with_one_message_naming_redis(harness):
    h = harness("redis.write_wait_s=2")
    assert h.watch(1.0)[0] is None
    h.proxy.hold(4.0)
    got, _ = h.watch(10.0)
    assert isinstance(got, JobError) and not isinstance(got, RanksLost), got
    text = str(got)
    assert text.startswith("Redis replies took ") and "longer than redis.write_wait_s (2 s)" in text, text
    assert "not a rank" in text and "check Redis first" in text, text
