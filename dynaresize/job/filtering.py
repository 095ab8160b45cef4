"""From a step's generated groups to its training batch: reward shaping and DAPO dynamic sampling in the runtime.

Why it exists: dynamic sampling (arXiv 2503.14476, section 3.2; ``dynaresize.rl.dapo``) decides *which* samples
a batch trains on, and that decision must not depend on *when* or *where* samples were generated, or a resized
run would train on other groups than a static one. So everything here is a function of the step's prompts
(deterministic from ``run.seed``) and their samples (seeded per sample key), never of arrival order:

1. round 0 is the step's ``B = prompts_per_step`` prompts (indices ``0..B-1``), generated as without filtering;
2. once all of a round's samples are in, every group is scored; if fewer than ``B`` groups are informative (their
   rewards not all equal), round ``r`` adds ``round_prompts`` prompts with the next indices
   (``B + (r-1) * round_prompts ...``), keys ``step.prompt.index`` like any other sample, queued under the same
   step; at most ``max_rounds`` extra rounds;
3. the batch holds the first ``B`` informative groups **by prompt index**; with fewer after the last round,
   ``on_unfilled=pad`` adds the earliest dropped groups (advantage 0) to keep ``B`` groups, ``fail`` stops the
   job with a message saying how many groups were found.

The plan of step 2 is replayed from the stored samples after a resume (``RolloutQueue.extend`` adds a round at
most once), so a resumed step generates nothing twice. Extra rounds are sent when the coordinator collects the
rollout (in the pipelined loop: after the step's training was awaited, before the weight sync), so they use the
policy version round 0 used; unlike round 0 they do not overlap training (they add to the step's time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaresize.contract.batch import TrainBatch
from dynaresize.contract.workqueue import SampleResult, WorkItem
from dynaresize.job.batching import build_batch, ordered_samples, score_samples
from dynaresize.rl.dapo import GroupSelection, OverlongShaping, kept_count, next_round_prompts, select_groups


class UnfilledBatchError(RuntimeError):
    """Dynamic sampling found too few informative groups after its last round and ``on_unfilled`` is ``fail``."""


@dataclass(frozen=True)
class BatchStats:
    """What one step's batch assembly saw (logged per step: events, metrics, batches.jsonl)."""

    score_mean: float  # mean task score of the trained samples (before shaping)
    reward_mean: float  # mean reward the advantages came from (after shaping)
    overlong_penalty_mean: float  # mean overlong penalty of the trained samples (0 when shaping is off)
    # dynamic sampling only (None when it is off):
    groups_generated: int | None = None  # prompt groups generated for the step (all rounds)
    groups_dropped: int | None = None  # groups looked at and dropped (all rewards equal)
    groups_kept: int | None = None  # informative groups trained on
    groups_filler: int | None = None  # dropped groups trained on to keep the batch size (on_unfilled=pad)
    rounds: int | None = None  # extra generation rounds (0: the first generation was enough)

    def as_dict(self) -> dict[str, float]:
        """The fields that apply (what the step_end event and the metric loggers get)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class BatchAssembler:
    """Scores groups, plans extra rounds and selects the batch's groups (pure: no Redis, no clock)."""

    task: object
    tokenizer: object
    need: int  # prompts_per_step
    group: int  # group_size
    bound: int  # staleness bound
    advantage: str = "grpo"  # algorithm.advantage (dynaresize.rl.grpo.advantages)
    overlong: OverlongShaping | None = None
    filtering: bool = False
    max_rounds: int = 0
    round_prompts: int = 0
    pad: bool = True
    _scores: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)  # step -> key -> (score, reward)

    @classmethod
    def from_config(cls, cfg, task, tokenizer) -> "BatchAssembler":
        ds = cfg.algorithm.dynamic_sampling
        return cls(task, tokenizer, cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.pipeline.staleness_bound,
                   advantage=cfg.algorithm.advantage, overlong=OverlongShaping.from_config(cfg),
                   filtering=ds.enabled, max_rounds=ds.max_rounds,
                   round_prompts=ds.round_prompts or cfg.rollout.prompts_per_step, pad=ds.on_unfilled == "pad")

    def forget(self) -> None:
        """Drop cached scores (a restart may generate a step's samples again)."""
        self._scores.clear()

    def rounds_of(self, prompts: int) -> int:
        """Extra rounds behind a step that has ``prompts`` prompts."""
        return max(0, prompts - self.need) // max(1, self.round_prompts)

    def _score(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> dict[str, tuple[float, float]]:
        cache = self._scores.setdefault(step, {})
        todo = [it for it in items if it.key not in cache]
        if todo:
            ordered = ordered_samples(step, todo, samples)
            scores, rewards = score_samples(todo, ordered, texts, self.task, self.tokenizer, self.overlong)
            cache.update({it.key: (s, r) for it, s, r in zip(todo, scores, rewards)})
        return cache

    def group_rewards(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> list[list[float]]:
        """Rewards per prompt index (``[p][i]``), for every prompt of ``items``."""
        scored = self._score(step, items, texts, samples)
        out: list[list[float]] = [[] for _ in range(len(texts))]
        for it in items:
            out[it.prompt].append(scored[it.key][1])
        return out

    def next_round(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> int:
        """Prompts the next extra round adds (0: none), once every sample of ``items`` is in ``samples``."""
        if not self.filtering:
            return 0
        kept = kept_count(self.group_rewards(step, items, texts, samples))
        return next_round_prompts(kept, self.need, self.rounds_of(len(texts)), self.max_rounds, self.round_prompts)

    def select(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> GroupSelection:
        if not self.filtering:
            return GroupSelection(tuple(range(len(texts))), (), (), ())
        sel = select_groups(self.group_rewards(step, items, texts, samples), self.need, pad=self.pad)
        if len(sel.trained) < self.need:
            raise UnfilledBatchError(
                f"batch {step}: dynamic sampling found {len(sel.kept)} of {self.need} groups with unequal rewards in "
                f"{len(texts)} prompts ({self.rounds_of(len(texts))} extra rounds = algorithm.dynamic_sampling.max_rounds); "
                "raise max_rounds or round_prompts, or set algorithm.dynamic_sampling.on_unfilled=pad"
            )
        return sel

    def judge(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult],
              prompts: list[int]) -> tuple[bool, ...]:
        """Whether each of ``prompts`` (groups whose samples are all in ``samples``) carries a signal: its rewards
        (after shaping) differ. The scheduler core selects the batch's groups from these, in prompt order."""
        from dynaresize.rl.dapo import informative

        rewards = self.group_rewards(step, items, texts, samples)
        return tuple(informative(rewards[p]) for p in prompts)

    def build_groups(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> TrainBatch:
        """A chunk of ``step``'s batch: exactly the groups of ``items`` (selected already), in prompt order, with the
        advantages the whole batch gives them (a group's advantages are its own)."""
        trained = sorted(items, key=lambda it: (it.prompt, it.index))
        scored = self._score(step, trained, texts, samples)
        return build_batch(step, trained, samples, texts, self.task, self.tokenizer, self.group, self.bound,
                           self.advantage, scored={it.key: scored[it.key][1] for it in trained})

    def build(self, step: int, items: list[WorkItem], texts: list[str], samples: list[SampleResult]) -> tuple[TrainBatch, BatchStats]:
        """The training batch of ``step`` (the selected groups, in prompt order) and what was seen."""
        sel = self.select(step, items, texts, samples)
        chosen = set(sel.trained)
        trained = [it for it in items if it.prompt in chosen]
        trained.sort(key=lambda it: (it.prompt, it.index))
        scored = self._score(step, trained, texts, samples)
        batch = build_batch(step, trained, samples, texts, self.task, self.tokenizer, self.group, self.bound,
                            self.advantage, scored={k: scored[k][1] for k in (it.key for it in trained)})
        scores = [scored[it.key][0] for it in trained]
        n = max(1, len(trained))
        counts = dict(groups_generated=len(texts), groups_dropped=len(sel.dropped), groups_kept=len(sel.kept),
                      groups_filler=len(sel.filler), rounds=self.rounds_of(len(texts))) if self.filtering else {}
        stats = BatchStats(score_mean=sum(scores) / n, reward_mean=sum(batch.rewards) / n,
                           overlong_penalty_mean=sum(r - s for r, s in zip(batch.rewards, scores)) / n, **counts)
        self._scores.pop(step, None)
        return batch, stats
