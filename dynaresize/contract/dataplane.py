"""The worker's data plane in a real run: rollout work pulled from, and training batches read from, the run's Redis.

It implements ``dynaresize.worker.core.DataPlane`` over :class:`~dynaresize.contract.workqueue.RolloutQueue` and the
batch keys the coordinator writes (``dr:<job>:batch:<step>``, JSON :class:`~dynaresize.contract.batch.TrainBatch`).
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from dynaresize.contract.batch import TrainBatch
from dynaresize.contract.workqueue import RolloutQueue, SampleResult, WorkItem

log = logging.getLogger("dynaresize.contract.dataplane")


class RedisDataPlane:
    """Every call waits out a Redis outage up to ``outage_s`` (the server restarted by the coordinator's watchdog,
    or by a coordinator that takes over after the old one was killed) instead of failing the command: the client's
    own retries cover a few seconds, a takeover can take longer. Each call is safe to repeat (a claim by its token,
    results by HSETNX, a read)."""

    def __init__(self, client: redis.Redis, job_id: str, outage_s: float = 120.0):
        self.client = client
        self.queue = RolloutQueue(client, job_id)
        self.vqueue = RolloutQueue(client, job_id, name="vq")
        self.outage_s = outage_s

    def _patient(self, fn, *args):
        deadline = time.monotonic() + self.outage_s
        while True:
            try:
                return fn(*args)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("Redis unreachable (%s); retrying for up to %.0f s more", e, deadline - time.monotonic())
                time.sleep(1.0)

    def claim(self, step: int, rank: int, n: int, validation: bool = False) -> list[WorkItem]:
        q = self.vqueue if validation else self.queue
        return self._patient(q.claim, step, rank, n, uuid.uuid4().hex)  # one token: a retry takes nothing new

    def claim_prompts(self, step: int, rank: int, prompts: list[int], validation: bool = False) -> list[WorkItem]:
        q = self.vqueue if validation else self.queue
        return self._patient(q.claim_prompts, step, rank, prompts, uuid.uuid4().hex)  # one token: a retry takes nothing new

    def complete(self, step: int, rank: int, results: list[SampleResult], validation: bool = False) -> int:
        return self._patient((self.vqueue if validation else self.queue).complete, step, rank, results)

    def batch(self, key: str) -> TrainBatch:
        raw = self._patient(self.client.get, key)
        if raw is None:
            raise KeyError(f"training batch {key!r} is not in Redis (expired, or never written)")
        return TrainBatch.from_json(raw)
