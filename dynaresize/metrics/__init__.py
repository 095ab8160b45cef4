"""One metric-logger interface for the run's scalars, with a JSONL, a TensorBoard and a W&B (offline) backend.

The coordinator calls ``log(step, {name: value})`` once per RL step and ``close()`` at the end; names are
``group/name`` (``reward/mean``, ``loss/kl``, ``response/length_mean``, ``throughput/tokens_per_s``,
``roles/n_train``, ``switches/count``, ``dynamic_sampling/groups_dropped``, ``mismatch/abs_mean``, ``mismatch/k3``
...; ``step_metrics`` builds them).

- JSONL (always): ``<run_dir>/metrics.jsonl``, one ``{"step": k, "metrics": {...}}`` per step.

A validation pass (a dataset task with ``val_files``) is logged with ``log_validation(version, {...})``: names
``val/reward_mean``, ``val/pass_at_k``, ``val/reward_errors``, against the policy version it scored (the optimizer
steps taken before it), which is not the training step being logged when it ends. JSONL: a line
``{"step": version, "validation": true, "metrics": {...}}``; TensorBoard: the scalars at step ``version``; W&B:
the scalars with ``val/version`` as their x-axis (``define_metric``), logged at the current training step (W&B
drops a step older than one it has).
- TensorBoard (``metrics.tensorboard: true``): event files under ``<run_dir>/tensorboard/``, written with
  ``torch.utils.tensorboard`` (needs the ``tensorboard`` package: ``pip install 'dynaresize[metrics]'``), or
  ``tensorboardX`` when only that is installed. ``tensorboard --logdir RUN_DIR/tensorboard`` shows them.
- Weights & Biases (``metrics.wandb.enabled: true``): always offline (``WANDB_MODE=offline``; nothing goes to the
  network), files under ``<run_dir>/wandb/``; upload later with ``wandb sync RUN_DIR/wandb/offline-run-*``.

A backend asked for whose package is missing is a :class:`MissingLoggerError` before the run starts, naming the
config key and the install command. Only this package imports tensorboard or wandb.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"


class MissingLoggerError(RuntimeError):
    """A logger was asked for in the config but its package is not installed."""


class MetricsLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_validation(self, version: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


class JsonlLogger:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE
        self._f = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": int(step), "metrics": _finite(metrics)}, separators=(",", ":")) + "\n")
        self._f.flush()

    def log_validation(self, version: int, metrics: dict[str, float]) -> None:
        line = {"step": int(version), "validation": True, "metrics": _finite(metrics)}
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    except ImportError:
        raise MissingLoggerError(
            "metrics.tensorboard is true but neither the 'tensorboard' nor the 'tensorboardX' package is installed: "
            "pip install 'dynaresize[metrics]' (or tensorboard==2.21.0), or set metrics.tensorboard=false"
        ) from None


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "tensorboard"
        self._w = _summary_writer_class()(log_dir=str(self.dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in _finite(metrics).items():
            self._w.add_scalar(name, value, int(step))
        self._w.flush()

    def log_validation(self, version: int, metrics: dict[str, float]) -> None:
        self.log(version, metrics)

    def close(self) -> None:
        self._w.close()


class WandbLogger:
    def __init__(self, run_dir: Path, cfg, config: dict | None = None):
        os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the user's environment says
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:
            raise MissingLoggerError(
                "metrics.wandb.enabled is true but the 'wandb' package is not installed: "
                "pip install 'dynaresize[wandb]' (or wandb==0.30.0), or set metrics.wandb.enabled=false"
            ) from None
        run_dir = Path(run_dir)
        self._run = wandb.init(mode="offline", dir=str(run_dir), project=cfg.project, name=cfg.name or run_dir.name,
                               tags=list(cfg.tags) or None, config=config, reinit=True)
        self._run.define_metric("val/version")
        self._run.define_metric("val/*", step_metric="val/version")
        self._step = 0  # the newest training step logged: W&B refuses an older one

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._step = max(self._step, int(step))
        self._run.log(_finite(metrics), step=int(step))

    def log_validation(self, version: int, metrics: dict[str, float]) -> None:
        self._run.log({**_finite(metrics), "val/version": int(version)}, step=self._step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # waits for W&B's service process to write the run's records out


class Loggers:
    """Every configured backend behind the one interface; a backend that fails while the run goes on is closed
    and reported once (metrics are never worth a failed run)."""

    def __init__(self, backends: list[Any], warn=None):
        self.backends = backends
        self._warn = warn or (lambda msg: None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._each("log", step, metrics)

    def log_validation(self, version: int, metrics: dict[str, float]) -> None:
        """A validation pass's scalars (``val/...``) against the policy version it scored."""
        self._each("log_validation", version, metrics)

    def _each(self, method: str, *args) -> None:
        for b in list(self.backends):
            try:
                getattr(b, method)(*args)
            except Exception as e:  # noqa: BLE001 - a logger's failure must not stop training
                self._warn(f"metrics logger {type(b).__name__} failed ({e}); it is switched off for this run")
                self.backends.remove(b)

    def close(self) -> None:
        for b in self.backends:
            try:
                b.close()
            except Exception as e:  # noqa: BLE001
                self._warn(f"metrics logger {type(b).__name__} failed to close: {e}")
        self.backends = []


def check_available(cfg) -> None:
    """Raise :class:`MissingLoggerError` now (before any rank starts) if a configured backend cannot load."""
    import importlib.util

    if cfg.tensorboard and not (importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")):
        _summary_writer_class()
    if cfg.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise MissingLoggerError(
            "metrics.wandb.enabled is true but the 'wandb' package is not installed: "
            "pip install 'dynaresize[wandb]' (or wandb==0.30.0), or set metrics.wandb.enabled=false"
        )


def open_loggers(cfg, run_dir: Path, config: dict | None = None, warn=None) -> Loggers:
    """The run's loggers from a ``MetricsConfig``: JSONL always, TensorBoard and W&B when enabled."""
    backends: list[Any] = [JsonlLogger(run_dir)]
    try:
        if cfg.tensorboard:
            backends.append(TensorBoardLogger(run_dir))
        if cfg.wandb.enabled:
            backends.append(WandbLogger(run_dir, cfg.wandb, config))
    except BaseException:
        for b in backends:
            b.close()
        raise
    return Loggers(backends, warn)


# a trainer's per-token loss figures, each a mean over its tokens: weighted by tokens when parts are combined
# (``entropy``: the policy's mean token entropy on the trained tokens, reported whatever train.entropy_coef)
LOSS_MEANS = ("kl", "clip_frac", "ratio_mean", "entropy")


def trainer_metrics(results: list[dict]) -> dict[str, float]:
    """The step's loss metrics from the trainers' acks: ``loss`` is the sum of the ranks' shares of the global
    loss; KL, clip fraction and ratio are token-weighted means of the ranks' local means; grad norm: the largest."""
    out: dict[str, float] = {}
    if not results:
        return out
    out["loss/loss"] = sum(float(r.get("loss", 0.0)) for r in results)
    ms = [r.get("metrics") or {} for r in results]
    tokens = [float(m.get("tokens", 0.0)) for m in ms]
    total = sum(tokens)
    for key in LOSS_MEANS:
        if total > 0 and all(key in m for m in ms):
            out[f"loss/{key}"] = sum(float(m[key]) * t for m, t in zip(ms, tokens)) / total
    norms = [float(m["grad_norm"]) for m in ms if "grad_norm" in m]
    if norms:
        out["loss/grad_norm"] = max(norms)
    lrs = [float(m["lr"]) for m in ms if "lr" in m]  # the LR of the step's last update (dynaresize.rl.lr)
    if lrs:
        out["train/lr"] = max(lrs)
    out.update(mismatch_metrics(results))
    return out


def chunk_loss_means(parts: list[dict]) -> dict[str, float]:
    """One trainer's loss metrics over the chunks of a batch (the streamed path): KL, clip fraction and ratio as
    token-weighted means of the chunks' local means, and the tokens summed; what a whole-batch ``train`` reports."""
    tokens = [float(p.get("tokens", 0.0)) for p in parts]
    total = sum(tokens)
    if total <= 0:
        return {}
    out = {"tokens": total}
    for key in LOSS_MEANS:
        if all(key in p for p in parts):
            out[key] = sum(float(p[key]) * t for p, t in zip(parts, tokens)) / total
    return out


def mismatch_metrics(results: list[dict]) -> dict[str, float]:
    """The training-inference mismatch of the step from the trainers' acks (``dynaresize.rl.mismatch``): each
    trainer's sums over the tokens it trained, added (and maxima maxed) over the trainers, then divided:
    ``mismatch/abs_mean``, ``mismatch/abs_max``, ``mismatch/k3``, ``mismatch/tokens``, the same over the samples of
    the trainer's own version (``mismatch/same_version_*``), and ``tis/weight_mean``, ``tis/capped_frac`` with TIS."""
    from dynaresize.rl.mismatch import figures, reduce_stats

    return figures(reduce_stats([r.get("metrics") or {} for r in results])) if results else {}


def response_metrics(response_ids: list[list[int]], max_tokens: int, eos_id: int | None) -> dict[str, float]:
    """Response-length metrics of a batch: mean, min, max, and the fraction cut at ``max_tokens`` without EOS."""
    lengths = [len(r) for r in response_ids]
    if not lengths:
        return {}
    cut = sum(1 for r in response_ids if len(r) >= max_tokens and (eos_id is None or not r or r[-1] != eos_id))
    return {"response/length_mean": sum(lengths) / len(lengths), "response/length_min": float(min(lengths)),
            "response/length_max": float(max(lengths)), "response/truncated_frac": cut / len(lengths)}


def step_metrics(batch, train_results: list[dict], last, state, n_rollout: int, max_tokens: int, eos_id: int | None,
                 stats: dict[str, float]) -> dict[str, float]:
    """Every scalar of one RL step: ``batch`` (a TrainBatch), the trainers' ack results, the coordinator's
    ``StepTimes`` and ``JobState``, and the batch assembly's stats (reward shaping, dynamic sampling)."""
    step_s = max(1e-9, last.rollout_s + last.train_s + last.sync_s)
    loop_s = max(1e-9, state.loop_s)
    m = {
        "reward/mean": sum(batch.rewards) / max(1, len(batch.rewards)),
        **trainer_metrics(train_results),
        **response_metrics(batch.response_ids, max_tokens, eos_id),
        "time/rollout_s": last.rollout_s, "time/train_s": last.train_s, "time/sync_s": last.sync_s,
        "throughput/tokens_generated": float(last.tokens_generated), "throughput/tokens_trained": float(batch.tokens),
        "throughput/samples_per_s": state.samples / loop_s, "throughput/tokens_per_s": state.tokens / loop_s,
        "throughput/step_tokens_per_s": batch.tokens / step_s,
        "roles/n_train": float(state.n_train), "roles/n_rollout": float(n_rollout), "roles/n_lost": float(len(state.lost)),
        "switches/count": float(len(state.switches)), "policy/version": float(state.version),
    }
    for name in ("score_mean", "overlong_penalty_mean"):
        if name in stats:
            m[f"reward/{name}"] = float(stats[name])
    for name in ("groups_generated", "groups_dropped", "groups_kept", "groups_filler", "rounds"):
        if name in stats:
            m[f"dynamic_sampling/{name}"] = float(stats[name])
    return m
