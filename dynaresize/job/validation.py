"""Validation (a dataset task with ``val_files``): held-out prompts, scored like training samples, never trained on.
Which passes are due and their queue here; the scheduler core hands a pass out as versioned work (docs/schedule.md)."""

from __future__ import annotations

import json
import logging

from dynaresize.job.batching import reward_errors
from dynaresize.job.runtime import Job, Services

log = logging.getLogger("dynaresize.job")


class Validation:
    def __init__(self, job: Job, svc: Services):
        self.job, self.svc = job, svc

    def due(self, version: int) -> bool:
        task, cfg = self.svc.task, self.job.cfg
        every = cfg.task.dataset.val_every
        samples = task.val_samples() if callable(getattr(task, "val_samples", None)) else []
        return (bool(samples) and every > 0 and str(version) not in self.job.state.validation
                and (version % every == 0 or version == cfg.run.steps))

    def passes(self, first: int) -> tuple[tuple[int, int], ...]:
        """The validation passes of versions ``first`` .. ``run.steps`` still to run: (version, prompts), the
        scheduler core's ``SchedulerConfig.validations`` (one group per validation prompt)."""
        if self.job.cfg.task.dataset.val_every <= 0:
            return ()
        n = len(self.svc.task.val_samples()) if callable(getattr(self.svc.task, "val_samples", None)) else 0
        return tuple((v, n) for v in range(first, self.job.cfg.run.steps + 1) if n and self.due(v))

    def queue(self):
        from dynaresize.contract.workqueue import RolloutQueue

        return RolloutQueue(self.svc.redis, self.job.job_id, name="vq")

    def publish(self, version: int) -> int:
        """Queue the pass of ``version`` (once: a published pass keeps its claims and results); its item count."""
        from dynaresize.job.batching import val_items

        ds = self.job.cfg.task.dataset
        items = val_items(self.svc.task.val_samples(), self.svc.tokenizer, self.job.cfg.run.seed, version, ds.val_samples)
        self.queue().publish(version, items)
        return len(items)

    def record(self, version: int, seconds: float) -> None:
        """The pass of ``version`` is generated: its mean reward and pass@k to the state, the events, the metric
        loggers and ``validation.jsonl``."""
        job, ds = self.job, self.job.cfg.task.dataset
        vq = self.queue()
        results = vq.results(version)
        total = vq.total(version)
        if len(results) < total or not results:
            log.warning("validation at version %d: %d of %d samples generated; not recorded", version, len(results), total)
            return
        rewards = [float(r.extra.get("reward", 0.0)) for r in results]
        rec = {"version": version, "step": version, **pass_figures(rewards, ds.val_samples),
               "reward_errors": len(reward_errors(results)), "seconds": round(seconds, 3)}
        job.state.validation[str(version)] = rec
        for name in ("reward_mean", "pass_at_k"):
            job.events.emit("metric", name=f"val_{name}", value=rec[name], step=version, k=ds.val_samples)
        if self.svc.metrics is not None:  # metrics.jsonl, TensorBoard, W&B (dynaresize.metrics: log_validation)
            self.svc.metrics.log_validation(version, {"val/reward_mean": rec["reward_mean"],
                                                      "val/pass_at_k": rec["pass_at_k"],
                                                      "val/reward_errors": rec["reward_errors"]})
        with open(job.run_dir / "validation.jsonl", "a") as f:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        vq.clear(version)
        if rec["reward_errors"]:  # on the console (validation.jsonl has the count too): a reward failing here is seen
            log.warning("validation at version %d: %d of %d reward(s) failed and scored 0, e.g. %s", version,
                        rec["reward_errors"], len(results), reward_errors(results)[0])
        log.info("validation at version %d: mean reward %.3f, pass@%d %.3f (%d prompts, %.1f s)", version,
                 rec["reward_mean"], ds.val_samples, rec["pass_at_k"], rec["prompts"], rec["seconds"])


def pass_figures(rewards: list[float], k: int) -> dict[str, float | int]:
    """Mean reward and pass@k of ``k`` responses a prompt (``rewards`` prompt by prompt, in response order; a
    response with reward >= 1 passes): what a validation pass records and ``dynaresize eval`` reports."""
    per_prompt = [rewards[p * k:(p + 1) * k] for p in range(len(rewards) // k)]
    return {"prompts": len(per_prompt), "k": k, "reward_mean": round(sum(rewards) / len(rewards), 6),
            "pass_at_k": round(sum(max(g) >= 1.0 for g in per_prompt) / len(per_prompt), 6)}
