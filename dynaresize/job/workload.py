"""A finished batch as the resize policy's pipeline predictor replays it, from what the runtime measured.

The simulator fills ``Observation.workload`` from the batch it simulated; the runtime fills it here from the batch it
ran (``policy.predictor: pipeline``, docs/simulator.md "A predictor of the barrier-free pipeline"):

- the response lengths, group by group: every generated group of the batch (with dynamic sampling, the dropped
  ones too: they were decoded), from the samples' tokens;
- the decode model: the rollout ranks' timed iterations (their generate acks' sums; the coordinator passes the
  last few batches', ``training.DECODE_WINDOW``), fitted
  (:func:`~dynaresize.contract.decode.fit_decode`: fixed seconds per iteration, seconds per active sequence, prefill
  seconds per admitted sequence), with the configured KV slots per rank;
- the training: the trainers' compute for the batch's chunks (the slowest trainer of each) on ``n_train`` trainers,
  as seconds on one GPU (times ``n_train`` and the policy's data-parallel efficiency), shared among the trained
  groups by their response tokens; the optimizer step's seconds;
- the pipeline's settings: staleness, what a rank asks for at a time (``pipeline.groups_per_command``), the least
  chunk of streaming training, the training queue.

- the control plane: its latency per command, the median round trip the ranks timed over the same batches
  (``Ack.reply_s``: a rank that acked a command and waited idle until the command it caused arrived; of a command to
  several ranks the least, its last acker's), the trainers' where there are any, else the rollout ranks'
  (``training.Training.workload``; 0 when none was timed).

Not in the play: gradient helpers (a simulator-only mechanism).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from dynaresize.contract.decode import DecodeFit, DecodeSums, fit_decode
from dynaresize.policy.predictor import efficiency
from dynaresize.policy.types import PipelineWorkload
from dynaresize.schedule import SchedulerConfig


def batch_workload(cfg, core_cfg: SchedulerConfig, samples: Iterable, trained_prompts: set[int], decode: DecodeSums,
                   chunk_s: float, n_train: int, step_s: float, sync_s: float,
                   command_latency_s: float = 0.0) -> tuple[PipelineWorkload | None, DecodeFit | None]:
    """The batch's workload for the pipeline predictor, and the decode fit it rests on. ``samples``: every generated
    sample of the batch (``SampleResult``); ``trained_prompts``: the groups its chunks trained;
    ``command_latency_s``: the control plane's measured round trip. No workload (None) without a decode fit (too few
    timed iterations), a complete group or training time."""
    fit = fit_decode(decode)
    G = cfg.rollout.group_size
    by_prompt: dict[int, dict[int, int]] = defaultdict(dict)
    for r in samples:
        by_prompt[r.prompt][r.index] = len(r.response_ids)
    groups = [(p, [got[i] for i in range(G)]) for p, got in sorted(by_prompt.items()) if all(i in got for i in range(G))]
    if fit is None or not groups or chunk_s <= 0 or n_train < 1:
        return None, fit
    tokens = [sum(lens) if p in trained_prompts else 0 for p, lens in groups]
    one_gpu_s = chunk_s * n_train * efficiency(n_train, cfg.policy.train_scaling_per_doubling)
    total = sum(tokens)
    if total <= 0:
        return None, fit
    wl = PipelineWorkload(
        lengths=tuple(float(x) for _, lens in groups for x in lens), group_size=G, kv_slots=cfg.rollout.kv_slots,
        iteration_s=fit.iteration_s, seq_iteration_s=fit.seq_iteration_s, prefill_s_per_group=fit.prefill_s_per_seq * G,
        train_s_per_group=tuple(one_gpu_s * x / total for x in tokens), step_overhead_s=step_s, sync_s=sync_s,
        command_latency_s=command_latency_s, staleness=core_cfg.staleness, claim_groups=cfg.pipeline.groups_per_command,
        stream_min_groups=core_cfg.stream_min_groups, train_queue=core_cfg.train_queue)
    return wl, fit
