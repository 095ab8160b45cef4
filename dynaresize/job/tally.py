"""What each batch measured in the runtime's schedule, from its first generate command to its optimizer step: the
rollout ranks' busy seconds, tokens and timed decode iterations, the trainers' seconds and loss sums, the seconds
rollout ranks waited for the version a batch is generated with, and the dead time of its commands. The step's report
(``batches.jsonl``) and the resize policy's observation are made of these (:mod:`dynaresize.job.training`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaresize.contract.decode import DecodeSums
from dynaresize.job.flight import Sent
from dynaresize.job.runtime import Job


@dataclass
class Tally:
    """What one batch measured, from its first generate command to its optimizer step."""

    gen_busy_s: float = 0.0
    tokens_generated: int = 0
    tokens: int = 0  # response tokens of the chunks built: the token normaliser
    samples: int = 0  # sequences of the chunks built: the sequence normaliser
    chunks: int = 0
    train_s: float = 0.0  # the trainers' compute: chunks and the step (the slowest rank of each)
    sync_s: float = 0.0  # rollout-rank seconds waiting for the version it is generated with (StepTimes.sync_s)
    loss_sum: dict[int, float] = field(default_factory=dict)  # trainer -> its summed loss over the chunks
    chunk_stats: dict[int, list] = field(default_factory=dict)  # trainer -> its chunks' mismatch/TIS sums
    results: list = field(default_factory=list)  # the samples of the chunks built (read once from Redis)
    mixed: bool = False  # a switch ran while this batch was generated or trained
    decode: DecodeSums = field(default_factory=DecodeSums)  # the rollout ranks' timed iterations (its generate acks)
    # the dead time of its commands (Ack.reply_s less the command's busy_s: the round trip and the command's handling
    # outside its work; the least over a command's ranks, the one that acked last), of its training commands
    # (train_chunk, optimizer_step) and of its generates
    train_replies: list[float] = field(default_factory=list)
    gen_replies: list[float] = field(default_factory=list)


class Tallies:
    """The batches' tallies, by batch."""

    def __init__(self, job: Job, staleness: int):
        self.job, self.staleness = job, staleness
        self.by_batch: dict[int, Tally] = {}

    def of(self, j: int) -> Tally:
        return self.by_batch.setdefault(j, Tally())

    def pop(self, k: int) -> Tally:
        return self.by_batch.pop(k, Tally())

    def replied(self, sent: Sent, res: dict[int, dict]) -> None:
        """The dead time a command costs: from the ack it answers to its own, less its work (Ack.reply_s - busy_s)."""
        replies = [max(0.0, a.reply_s - float(res[r].get("busy_s", 0.0))) for r, a in sent.acks.items()
                   if getattr(a, "reply_s", None) is not None]
        if replies and sent.batch is not None and sent.kind in ("train_chunk", "optimizer_step", "generate"):
            t = self.of(sent.batch)
            (t.gen_replies if sent.kind == "generate" else t.train_replies).append(min(replies))

    def generated(self, sent: Sent, res: dict, replaying: bool) -> None:
        """A generate's ack: its busy seconds, tokens, decode sums and install wait."""
        t = self.of(sent.batch)
        t.gen_busy_s += float(res.get("busy_s", 0.0))
        t.tokens_generated += int(res.get("tokens", 0))
        self.add_decode(t, sent.rank, res.get("decode"), replaying)
        self.waited_for(sent.version, float(res.get("install_s", 0.0)))

    def trained(self, batch: int, res: dict[int, dict]) -> None:
        """A train_chunk's acks: the slowest trainer's seconds, each trainer's loss sum and figures."""
        t = self.of(batch)
        t.train_s += max(float(x.get("busy_s", 0.0)) for x in res.values())
        for r, x in res.items():
            t.loss_sum[r] = t.loss_sum.get(r, 0.0) + float(x.get("loss_sum", 0.0))
            if x.get("metrics"):  # (a chunk held for its mini-batch trained nothing yet: no figures)
                t.chunk_stats.setdefault(r, []).append(x["metrics"])

    def switched(self) -> None:
        """A switch ran: every batch in flight is mixed (its figures are no step of one split)."""
        for t in self.by_batch.values():
            t.mixed = True

    def add_decode(self, t: Tally, rank: int, sums, replaying: bool) -> None:
        """A generate ack's decode sums (``GenerateResult.decode``) added to its batch's; a malformed one is left out
        of the fit, with a control event saying which rank sent what (the samples it acked are kept)."""
        if sums is None:
            return
        try:
            t.decode.merge(DecodeSums.from_wire(sums))
        except ValueError as e:
            if not replaying:
                self.job.events.emit("control", what="decode_sums_ignored", reason=f"rank {rank}: {e}")

    def waited_for(self, version: int | None, seconds: float) -> None:
        """Rollout-rank seconds spent waiting for ``version`` to arrive (an install before a generate, a blocking
        sync): the batch generated with it (``version + s``) reports them, per rollout rank, as its ``sync_s``."""
        j = (version or 0) + self.staleness
        if seconds > 0 and self.job.state.step <= j < self.job.cfg.run.steps:
            self.of(j).sync_s += seconds
