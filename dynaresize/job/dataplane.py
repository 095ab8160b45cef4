"""The worker's data plane in a real run: rollout work pulled from, and training batches read from, the run's Redis.

It implements ``dynaresize.worker.core.DataPlane`` over :class:`~dynaresize.job.workqueue.RolloutQueue` and the
batch keys the coordinator writes (``dr:<job>:batch:<step>``, JSON :class:`~dynaresize.job.batching.TrainBatch`).
"""

from __future__ import annotations

import redis

from dynaresize.job.batching import TrainBatch
from dynaresize.job.workqueue import RolloutQueue, SampleResult, WorkItem


class RedisDataPlane:
    def __init__(self, client: redis.Redis, job_id: str):
        self.client = client
        self.queue = RolloutQueue(client, job_id)

    def claim(self, step: int, rank: int, n: int) -> list[WorkItem]:
        return self.queue.claim(step, rank, n)

    def complete(self, step: int, rank: int, results: list[SampleResult]) -> int:
        return self.queue.complete(step, rank, results)

    def batch(self, key: str) -> TrainBatch:
        raw = self.client.get(key)
        if raw is None:
            raise KeyError(f"training batch {key!r} is not in Redis (expired, or never written)")
        return TrainBatch.from_json(raw)
