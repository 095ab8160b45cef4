"""Rollout work: a batch's work items (prompts sampled and tokenised once per step), the dynamic-sampling rounds added
to the run's queue, the generate payload, and the reward failures the rollout ranks reported."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dynaresize.contract.batch import TrainBatch
from dynaresize.job.batching import reward_errors, work_items
from dynaresize.job.errors import JobError
from dynaresize.job.runtime import Job, Services

log = logging.getLogger("dynaresize.job")


@dataclass
class BuiltBatch:
    batch: TrainBatch
    stats: Any  # dynaresize.job.filtering.BatchStats (reward shaping, dynamic sampling)


class RolloutWork:
    def __init__(self, job: Job, svc: Services):
        self.job, self.svc = job, svc
        self.items: dict[int, tuple] = {}  # step -> (work items, prompt texts) until its batch is built
        self.shown_prompt = False  # the first prompt as the model gets it is in the event log
        self.reward_seen: dict[int, dict[str, str | None]] = {}  # step -> sample key -> its reward error (None: ok)
        self.reward_warned: dict[int, int] = {}  # step -> samples judged when its failures were last warned about

    def forget(self) -> None:
        """A restart from a checkpoint: nothing generated or planned since is kept here."""
        self.items.clear()
        self.reward_seen.clear()
        self.reward_warned.clear()
        self.svc.assembler.forget()

    def payload(self, j: int, **extra) -> dict:
        """A ``generate`` command's payload; with ``validation=True`` the validation pass's sampling
        (``task.dataset.val_temperature``, ``val_top_p``: :func:`validation_sampling`)."""
        ro = self.job.cfg.rollout
        temperature, top_p = (validation_sampling(self.job.cfg) if extra.get("validation")
                              else (ro.temperature, ro.top_p))
        return {"step": j, "version": self.job.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                "temperature": temperature, "top_p": top_p, "top_k": ro.top_k, **extra}

    def add_round(self, j: int, round_: int, prompts: int) -> None:
        """Dynamic sampling: extra round ``round_`` of batch ``j`` (``prompts`` more prompts, the next indices), in
        this coordinator's plan and in the run's queue (once: a round already queued adds nothing there)."""
        items, texts = self.work(j)
        a = self.svc.assembler
        if len(texts) != a.need + (round_ - 1) * a.round_prompts:
            return  # planned already (a replay of the rounds from the stored samples)
        cfg = self.job.cfg
        more, more_texts = work_items(self.svc.task, self.svc.tokenizer, cfg.run.seed, j, prompts, cfg.rollout.group_size,
                                      first=len(texts), stride=self.stride())
        self.items[j] = (items + more, texts + more_texts)
        self.svc.queue.extend(j, round_, more)

    def replay_rounds(self, j: int) -> None:
        """Dynamic sampling after a resume: the rounds batch ``j`` had, planned again from its stored samples (every
        one of them is in the run's Redis); nothing is generated."""
        a, q = self.svc.assembler, self.svc.queue
        while a.filtering:
            items, texts = self.work(j)
            n = a.next_round(j, items, texts, q.results(j))
            if not n:
                return
            self.add_round(j, a.rounds_of(len(texts)) + 1, n)

    def stride(self) -> int:
        """Prompts a step may use at most: the step's own, plus every extra round dynamic sampling may add. A dataset
        task's step ``k`` reads records ``k * stride ..``, so no round ever takes a record of another step."""
        a = self.svc.assembler
        return self.job.cfg.rollout.prompts_per_step + (a.max_rounds * a.round_prompts if a.filtering else 0)

    def work(self, j: int):
        """Batch j's work items and prompt texts, built (prompts sampled, tokenised) once per step."""
        cfg, tok = self.job.cfg, self.svc.tokenizer
        if j not in self.items:
            self.items[j] = work_items(self.svc.task, tok, cfg.run.seed, j, cfg.rollout.prompts_per_step,
                                       cfg.rollout.group_size, stride=self.stride())
            if j == self.job.state.step and not self.shown_prompt:  # what the model is really given
                self.shown_prompt = True
                first = self.items[j][0][0]
                self.job.events.emit("control", what="prompt_rendered", reason=tok.decode(first.prompt_ids),
                                     key=first.key, tokens=len(first.prompt_ids))
        return self.items[j]

    def check_rewards(self, k, results) -> None:
        """Reward failures the rollout ranks reported for groups of batch ``k`` as they complete: each one an event
        naming the sample (its score is 0), one warning per batch once all its planned samples are in. The run stops
        (``JobError``) at the first failure with ``reward.on_error: fail``, and once more than
        ``reward.max_error_fraction`` of the batch's planned samples failed: a broken reward (e.g. one called with
        the wrong arguments) must not train the policy on zeros."""
        rc = self.job.cfg.reward
        seen = self.reward_seen.setdefault(k, {})
        fresh = [r for r in results if r.key not in seen]
        for r in fresh:
            seen[r.key] = r.extra.get("reward_error") or None
        for j in [j for j in self.reward_seen if j not in self.items and j != k]:  # batches built already
            self.reward_seen.pop(j)
            self.reward_warned.pop(j, None)
        errors = reward_errors(fresh)
        for err in errors[:20]:
            self.job.events.emit("control", what="reward_error", reason=err, step=k)
        failed = [e for e in seen.values() if e]
        if not failed:
            return
        if rc.on_error == "fail":
            raise JobError(f"reward failed ({len(failed)} sample(s) of batch {k}; reward.on_error=fail): {failed[0]}")
        planned = max(len(self.work(k)[0]), len(seen))
        if len(failed) > rc.max_error_fraction * planned:
            raise JobError(
                f"batch {k}: the reward failed on {len(failed)} of its {planned} samples ({len(failed) / planned:.0%} > "
                f"reward.max_error_fraction={rc.max_error_fraction:g}); stopped instead of training on zeros. First "
                f"failure: {failed[0]}")
        if len(seen) >= planned and self.reward_warned.get(k) != len(seen):
            self.reward_warned[k] = len(seen)
            log.warning("batch %s: %d of %d reward(s) failed and scored 0, e.g. %s", k, len(failed), len(seen), failed[0])


def batch_key(job_id: str, k: int) -> str:
    from dynaresize.contract.keys import Keys

    return f"{Keys(job_id).ns}:batch:{k}"


def validation_sampling(cfg) -> tuple[float, float]:
    """``(temperature, top_p)`` of a validation pass: ``task.dataset.val_temperature`` (null: rollout.temperature;
    0: greedy) and ``val_top_p`` (null: rollout.top_p). verl's ``actor_rollout_ref.rollout.val_kwargs``
    (``temperature``, ``top_p``; ``do_sample: false`` is temperature 0 here). ``rollout.top_k`` applies to both."""
    ds, ro = cfg.task.dataset, cfg.rollout
    return (ro.temperature if ds.val_temperature is None else float(ds.val_temperature),
            ro.top_p if ds.val_top_p is None else float(ds.val_top_p))
