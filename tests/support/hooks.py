"""The hooks tests give a worker rank (:class:`dynaresize.worker.hooks.Hooks`): the fault matrix and test commands.

Faults (``DYNARESIZE_TEST_KILL_AT="1:switch_role.offload,0:stage_state.weights@step-4"``) make rank 1 SIGKILL
itself right after the offload of a switch, and rank 0 in the middle of staging the checkpoint of step 4 (weights
staged, optimizer state not): ``<rank>:<point>`` fires at the first pass, ``<rank>:<point>@<at>`` only there (a
step, a tag). With ``DYNARESIZE_TEST_KILL_ONCE=<dir>`` each point fires once per run (a marker file in ``<dir>``),
so the restarted rank gets past it. ``DYNARESIZE_TEST_STOP_AT`` (same syntax) SIGSTOPs the rank there instead: a
rank hung in the middle of it. The variables are read here, by the test-side rank entry
(``tests.support.dynaresize_worker``), never by the runtime.

Test commands (sent through :class:`dynaresize.worker.local.LocalCluster` with ``hooks=HOOKS``): inline-batch
variants of generate and train, and inspection of the weights, the optimizer state and the communicators.
"""

from __future__ import annotations

import hashlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynaresize.comm import groups as G
from dynaresize.engines import reshard as R
from dynaresize.engines.protocol import SamplingParams
from dynaresize.engines.trainer_deepspeed import token_nll_loss
from dynaresize.worker.core import Worker, WorkerError
from dynaresize.worker.hooks import Handler, Hooks

HOOKS = "tests.support.hooks:RankHooks.from_env"  # what LocalCluster(hooks=...) resolves in each rank process


def generate_direct(w: Worker, prompts: list[list[int]], seeds: list[int], max_tokens: int = 16,
                    temperature: float = 1.0, top_p: float = 1.0) -> dict[str, Any]:
    """Batch-in/batch-out generation without a work queue."""
    if w.rollout is None:
        raise WorkerError(f"rank {w.rank} is not a rollout rank")
    gens = w.rollout.generate(prompts, seeds, SamplingParams(max_tokens, temperature, top_p))
    return {"token_ids": [g.token_ids for g in gens], "logprobs": [g.logprobs for g in gens], "version": w.version}


def train_direct(w: Worker, input_ids: list[list[int]], n_train: int, version_after: int) -> dict[str, Any]:
    """Train on an inline batch of token ids with the token-NLL loss."""
    return w.train_batch({"input_ids": torch.tensor(input_ids, dtype=torch.long)}, n_train, version_after, token_nll_loss)


def state_digest(w: Worker) -> dict[str, Any]:
    """blake2b of the logical optimizer state of the trainer group (on rank 0) and of this rank's weights."""
    h = hashlib.blake2b(digest_size=16)
    for n, t in w.module.named_parameters():
        h.update(n.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    out: dict[str, Any] = {"weights": h.hexdigest(), "version": w.version, "role": w.role.value,
                           "incoming": sorted(w.incoming), "dtypes": sorted({str(p.dtype) for p in w.module.parameters()})}
    if w.trainer is not None:
        out["optimizer"] = R.state_digest(w.trainer.export_partitions(), w.groups.trainer_group(w.n_train), w._dev)
    return out


def weight_values(w: Worker) -> dict[str, Any]:
    """This rank's weights as one flat list of floats (parameter order): for numeric comparisons across commands."""
    flat = torch.cat([p.detach().float().cpu().reshape(-1) for _, p in w.module.named_parameters()])
    return {"values": flat.tolist(), "version": w.version}


def comm_stats(w: Worker) -> dict[str, Any]:
    return {"created_after_startup": w.groups.created_after_startup(), "created_total": G.group_creations()}


def snapshot_now(w: Worker, chunk_bytes: int | None = None) -> dict[str, Any]:
    """Take the in-memory snapshot an optimizer step takes (faults.snapshot_every) and wait for its exchange
    (``chunk_bytes``: its transfers' size, smaller than staging.chunk_mb allows: several chunks on a tiny model)."""
    if w.trainer is None or w.snaps is None:
        raise WorkerError(f"rank {w.rank} is not a trainer")
    if chunk_bytes is not None:
        w.snaps.chunk_bytes = chunk_bytes
    w._snapshot(w.trainer, w.n_train)
    if w.snaps._thread is not None:
        w.snaps._thread.join()
    return {**w.snaps.held_summary(), "bytes": w.snaps.nbytes(), "errors": w.snaps.errors}


TEST_COMMANDS: dict[str, Handler] = {"generate_direct": generate_direct, "train_direct": train_direct,
                                     "state_digest": state_digest, "weight_values": weight_values,
                                     "comm_stats": comm_stats, "snapshot_now": snapshot_now}


def _points(spec: str | None) -> frozenset[str]:
    return frozenset(p for p in (spec or "").split(",") if p)


@dataclass(frozen=True)
class RankHooks(Hooks):
    kill_at: frozenset[str] = frozenset()
    stop_at: frozenset[str] = frozenset()
    once_dir: Path | None = None

    @classmethod
    def from_env(cls) -> "RankHooks":
        once = os.environ.get("DYNARESIZE_TEST_KILL_ONCE")
        return cls(_points(os.environ.get("DYNARESIZE_TEST_KILL_AT")), _points(os.environ.get("DYNARESIZE_TEST_STOP_AT")),
                   Path(once) if once else None)

    def point(self, rank: int, name: str, at: str = "") -> None:
        here = {f"{rank}:{name}", f"{rank}:{name}@{at}"}
        stop, kill = here & self.stop_at, here & self.kill_at
        if not stop and not kill:
            return
        if self.once_dir is not None:
            marker = self.once_dir / f"rank{rank}-{name}"
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGSTOP if stop else signal.SIGKILL)

    def commands(self) -> dict[str, Handler]:
        return TEST_COMMANDS
