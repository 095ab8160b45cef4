"""ZeRO-1/2 optimizer state (fp32, and fp32 master and moments under bf16 training) is bit-exact across 2 -> 4 -> 2 trainers (four processes, DeepSpeed on CPU), installed at
once (``switching.optimizations.deferred_optimizer=false``; test_worker_switch.py covers the deferred install)."""

from __future__ import annotations

import pytest
import torch

from dynaresize.engines.reshard import plan
from dynaresize.events import read_events
from dynaresize.worker.local import TINY_MODEL, LocalCluster
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_plan_covers_every_element_once():
    for length, old_dp, new_dp in [(10, 2, 3), (85696, 2, 4), (7, 4, 1), (12, 3, 3)]:
        def ps(dp):
            pad = 2 * dp
            return ((length + pad - 1) // pad * pad) // dp
        cover = torch.zeros(length, dtype=torch.int64)
        for c in plan(length, old_dp, ps(old_dp), new_dp, ps(new_dp)):
            cover[c.start:c.end] += 1
        assert bool((cover == 1).all()), (length, old_dp, new_dp)


@pytest.mark.parametrize("stage,dtype", [(2, "float32"), (1, "bfloat16"), (2, "bfloat16")])
def test_zero_reshard_is_bit_exact(tmp_path, stage, dtype):
    # bf16 (train.precision auto on a bfloat16 model): the fp32 master and moments still move bit for bit, on the
    # ZeRO optimizer that engines/precision.py's settings keep for both stages
    ids = torch.randint(3, 48, (12, 16), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = {"train": {"lr": 5e-3, "zero_stage": stage}, "cluster": {"gpus": 5, "initial_train": 2},
           "switching": {"optimizations": {"deferred_optimizer": False}}}
    events = tmp_path / "events.jsonl"
    model = {**TINY_MODEL, "dtype": dtype}
    with LocalCluster(5, 2, tmp_path, global_batch=12, config=cfg, events=events, hooks=HOOKS, model=model) as c:
        for v in (1, 2):
            c.call("train_direct", {"input_ids": ids, "n_train": 2, "version_after": v}, ranks=[0, 1])
        d2 = c.call("state_digest", ranks=[0, 1])[0]["optimizer"]
        c.call("switch_role", {"switch_id": "up", "step": 2, "from_train": 2, "to_train": 4})
        d4 = c.call("state_digest", ranks=range(4))[0]["optimizer"]
        assert d4 == d2
        c.call("train_direct", {"input_ids": ids, "n_train": 4, "version_after": 3}, ranks=range(4))
        d4b = c.call("state_digest", ranks=range(4))[0]["optimizer"]
        assert d4b["step"] == "3.0" and d4b["master"] != d2["master"]
        c.call("switch_role", {"switch_id": "down", "step": 3, "from_train": 4, "to_train": 2})
        assert c.call("state_digest", ranks=[0, 1])[0]["optimizer"] == d4b
        # every rank, trainer or (ranks 2-4) rollout, holds the weights in the model's dtype
        assert all(s["dtypes"] == [f"torch.{dtype}"] for s in c.call("state_digest").values())
        assert all(s["created_after_startup"] == 0 for s in c.call("comm_stats").values())
    ops = [e["op"] for e in read_events(events) if e.type.value == "switch_op"]
    assert "optimizer_reshard" in ops and "optimizer_stage_in" not in ops  # not deferred: no install inside a step


def test_candidate_sets_are_nested_prefixes_and_unions_are_candidates():
    from dynaresize.comm.groups import CommError, candidate_trainer_counts, moved_ranks, sync_ranks, trainer_ranks

    assert candidate_trainer_counts(4) == [1, 2, 3]
    assert candidate_trainer_counts(8, unit=4) == [4]
    assert candidate_trainer_counts(12, unit=4) == [4, 8]
    with pytest.raises(CommError, match="unit 3 must be >= 1 and divide world_size=4"):
        candidate_trainer_counts(4, unit=3)
    with pytest.raises(CommError, match="at least 2 ranks"):
        candidate_trainer_counts(1)
    counts = candidate_trainer_counts(6)
    for a in counts:
        for b in counts:
            assert set(trainer_ranks(a)) | set(trainer_ranks(b)) == set(trainer_ranks(max(a, b)))
            assert len(moved_ranks(a, b)) == abs(a - b)
    assert sync_ranks(2, 4) == (0, 2, 3)
