"""Training a batch on the trainers, and the new weights from the trainers to the rollout ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dynaresize.contract.batch import TrainBatch
from dynaresize.job.rollout import batch_key
from dynaresize.job.runtime import Job
from dynaresize.job.transport import InFlight, Phase, Transport


@dataclass
class TrainResult:
    loss: float  # the global loss: the per-rank shares add up to it
    results: list[dict] = field(default_factory=list)  # each trainer's ack result, by rank (loss metrics)


class Training:
    def __init__(self, job: Job, tx: Transport):
        self.job, self.tx = job, tx

    def start(self, at: Phase, k: int, batch: TrainBatch, snapshot: bool = False) -> InFlight:
        st = self.job.state
        payload = {"step": k, "batch_key": batch_key(self.job.job_id, k), "n_train": st.n_train, "version_after": k + 1,
                   "snapshot": snapshot}
        return self.tx.send(at, "train", self.job.trainers(), payload, step=k)

    def wait(self, train: InFlight, batch: TrainBatch) -> TrainResult:
        res = self.tx.wait(train.cmd, train.ranks, "train")
        self.job.last.train_s = max(a.acked_at for a in res.acks.values()) - train.wall_sent_at()
        self.job.last.tokens_trained = batch.tokens
        losses = [float((a.result or {}).get("loss", 0.0)) for a in res.acks.values()]
        return TrainResult(sum(losses), [a.result or {} for _, a in sorted(res.acks.items())])

    def sync_weights(self, at: Phase, version: int) -> None:
        t0 = time.monotonic()
        st = self.job.state
        ranks = [0] + self.job.rollouts()
        self.tx.call(at, "sync_weights", ranks, {"version": version, "n_train": st.n_train, "lost": st.lost})
        self.job.last.sync_s = time.monotonic() - t0
        st.version = version
