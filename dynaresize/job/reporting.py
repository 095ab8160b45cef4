"""What a run tells: each step's record (event log, metrics loggers, ``batches.jsonl``, the progress callback)
and the run's summary (``summary.json``)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from dynaresize import atomic
from dynaresize.job.errors import JobError, OperatorStop
from dynaresize.job.rollout import BuiltBatch
from dynaresize.job.runtime import Job, Services

log = logging.getLogger("dynaresize.job")


@dataclass
class TrainedBatch:
    """A step's training as the coordinator reports it, gathered from the trainers' acks (each a
    :class:`dynaresize.contract.protocol.TrainResult`)."""

    loss: float  # the global loss: the per-rank shares add up to it
    results: list[dict] = field(default_factory=list)  # each trainer's ack result, by rank (loss metrics)


def open_metrics(job: Job):
    from dynaresize.metrics import MissingLoggerError, open_loggers

    try:
        return open_loggers(job.cfg.metrics, job.run_dir, config=job.cfg.model_dump(mode="json"), warn=log.warning)
    except MissingLoggerError as e:
        raise JobError(str(e)) from None


class Reporter:
    def __init__(self, job: Job, svc: Services, on_step: Callable[[dict], None] | None):
        self.job, self.svc, self.on_step = job, svc, on_step

    def report(self, k: int, built: BuiltBatch, trained: TrainedBatch) -> None:
        job, st, last, batch = self.job, self.job.state, self.job.last, built.batch
        self.svc.bus.check_epoch()  # a coordinator that was fenced off while hung writes nothing more to the run
        reward = sum(batch.rewards) / max(1, len(batch.rewards))
        st.rewards[str(k)] = reward
        st.samples += len(batch.keys)
        st.tokens += batch.tokens
        stats = built.stats.as_dict() if built.stats is not None else {}
        mismatch = mismatch_fields(trained.results)
        job.events.emit("step_end", step=k, samples=len(batch.keys), tokens_generated=last.tokens_generated,
                        tokens_trained=batch.tokens, reward_mean=round(reward, 6), loss=round(trained.loss, 8),
                        rollout_s=round(last.rollout_s, 4), train_s=round(last.train_s, 4), sync_s=round(last.sync_s, 4),
                        **{n: (round(v, 6) if isinstance(v, float) else v) for n, v in stats.items() if n != "reward_mean"},
                        **mismatch)
        self._log_metrics(k, built, trained, stats)
        with open(job.run_dir / "batches.jsonl", "a") as f:
            # per sample, in the order of ``keys``: its prompt's and its response's token counts (the what-if's trace:
            # dynaresize.sim.trace replays these lengths through the simulator)
            f.write(json.dumps({"step": k, "keys": batch.keys, "versions": batch.versions, "rewards": batch.rewards,
                                "prompt_tokens": [len(p) for p in batch.prompt_ids],
                                "response_tokens": [len(r) for r in batch.response_ids],
                                "loss": trained.loss, "n_train": st.n_train, "mismatch": mismatch},
                               separators=(",", ":")) + "\n")
        if self.on_step:
            self.on_step({"step": k, "reward": reward, "roles": job.roles(), "switches": len(st.switches),
                          "rollout_s": last.rollout_s, "train_s": last.train_s})

    def _log_metrics(self, k: int, built: BuiltBatch, trained: TrainedBatch, stats: dict) -> None:
        """The step's scalars to every configured logger (``dynaresize.metrics.step_metrics`` names them)."""
        from dynaresize.metrics import step_metrics

        job = self.job
        if self.svc.metrics is not None:
            self.svc.metrics.log(k, step_metrics(built.batch, trained.results, job.last, job.state, n_rollout=len(job.rollouts()),
                                                 max_tokens=job.cfg.rollout.max_tokens, eos_id=self.svc.tokenizer.eos_token_id,
                                                 stats=stats))


def mismatch_fields(results: list[dict]) -> dict[str, float | int]:
    """The step's training-inference mismatch figures as flat event keys (``mismatch_abs_mean``,
    ``mismatch_abs_max``, ``mismatch_k3``, ``mismatch_tokens``, ``mismatch_same_version_*``, ``tis_weight_mean``,
    ``tis_capped_frac``; absent when the trainers reported none), 6 significant digits: on CPU in fp32 they are
    around 1e-7, which a fixed number of decimals would round to 0."""
    from dynaresize.metrics import mismatch_metrics

    out: dict[str, float | int] = {}
    for name, v in mismatch_metrics(results).items():
        key = name.replace("/", "_")
        out[key] = int(v) if key.endswith("tokens") else float(f"{v:.6g}")
    return out


def hidden_by_switch(run_dir: Path) -> dict[str, float]:
    """Seconds of background switch ops per switch, from the event log (the deferred optimizer stage-in is
    logged by the trainers at their first step after the switch, after the switch command was acked)."""
    from dynaresize.events import EventType, ReadStats, read_events

    hidden: dict[str, float] = {}
    for ev in read_events(run_dir, ReadStats(), types={EventType.SWITCH_OP}):
        if not ev["critical"]:
            hidden[ev["switch_id"]] = hidden.get(ev["switch_id"], 0.0) + ev["end"] - ev["start"]
    return hidden


def summary(job: Job, status: str, stop: OperatorStop | None, incomplete: str | None = None) -> dict[str, Any]:
    """The run's ``summary.json`` (returned too). ``incomplete``: why a run that trained every step is not
    ``completed`` (its final checkpoint did not reach the disk)."""
    st, run_dir = job.state, job.run_dir
    hidden = hidden_by_switch(run_dir)
    for sw in st.switches:
        sw["hidden_s"] = round(hidden.get(sw["switch_id"], sw.get("hidden_s", 0.0)), 4)
    rewards = st.rewards
    steps_done = sorted(int(s) for s in rewards)
    span = max(1e-9, st.loop_s)  # the RL loop only: model build, start-up and checkpoints excluded
    out = {
        "status": status,
        "run_dir": str(run_dir),
        "steps": st.step,
        "samples": st.samples,
        "samples_per_s": round(st.samples / span, 4),
        "tokens_per_s": round(st.tokens / span, 2),
        "loop_s": round(span, 2),
        "elapsed_s": round(st.elapsed_s or job.elapsed(), 2),
        "reward_first": rewards[str(steps_done[0])] if steps_done else None,
        "reward_last": rewards[str(steps_done[-1])] if steps_done else None,
        "reward_first3": _mean([rewards[str(s)] for s in steps_done[:3]]),
        "reward_last3": _mean([rewards[str(s)] for s in steps_done[-3:]]),
        "switches": st.switches,
        "switch_critical_path_s": round(sum(s["critical_path_s"] or 0.0 for s in st.switches), 4),
        "final_split": final_split(job),
        **validation_summary(st.validation),
        "policy": "dynamic" if job.cfg.policy.enabled else "static",
        "rollout_engine": job.cfg.rollout.engine,
    }
    if stop is not None:
        out["operator_stop"] = {**asdict(stop), "text": stop.describe(st.step, st.checkpoint)}
    if incomplete is not None:
        out["incomplete"] = incomplete
    if job.cfg.cluster.device == "emulated":  # the emulation's faithfulness, from the ranks' pacing records
        from dynaresize.emulation.report import emulation_summary

        out["emulation"] = emulation_summary(run_dir)
    try:
        atomic.write_json(run_dir / "summary.json", out, indent=1)
    except OSError as e:  # a full disk: the summary is printed all the same, and says it is not on disk
        from dynaresize.staging import os_error_text

        out["summary_not_written"] = f"{run_dir / 'summary.json'}: {os_error_text(e)}"
        log.warning("%s", out["summary_not_written"])
    return out


def final_split(job: Job) -> str:
    """``trainers:rollout ranks`` at the end, over the live ranks: a rank fenced off (a shrink) is in neither."""
    lost = set(job.state.lost)
    trainers = sum(1 for r in range(job.state.n_train) if r not in lost)
    return f"{trainers}:{len(job.rollouts())}"


def validation_summary(val: dict[str, dict]) -> dict[str, Any]:
    """First and last validation pass (by policy version) for the summary; empty when none ran."""
    if not val:
        return {}
    first, last = val[min(val, key=int)], val[max(val, key=int)]
    return {"val_reward_first": first["reward_mean"], "val_reward_last": last["reward_mean"],
            "val_pass_at_k_first": first["pass_at_k"], "val_pass_at_k_last": last["pass_at_k"], "val_k": last["k"],
            "val_versions": [first["version"], last["version"]]}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
