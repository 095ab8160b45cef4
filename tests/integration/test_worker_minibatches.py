"""Mini-batches and PPO epochs on the worker (two trainer processes, DeepSpeed ZeRO-2 on CPU, a real Redis data
plane) against a direct computation: the batch's two groups arrive in reverse order as two chunks; mini-batch 0
(group 0) cannot step before group 0 is in, then both step in the batch's group order, the second pass at the
optimizer step, each update normalised by its own mini-batch's tokens, with the entropy bonus and the LR of the
run's schedule (warmup: the first update at LR 0). The same four updates in plain torch (AdamW, the norm clip) give
the same weights; the updates in arrival order do not."""

from __future__ import annotations

import math
import uuid

import pytest
import torch

from dynaresize.control.server import connect
from dynaresize.worker.local import TINY_MODEL, LocalCluster, tiny_qwen2
from tests.integration.test_worker_streaming import GROUP, _batch, _max_diff
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRAIN = {"lr": 1e-2, "zero_stage": 2, "mini_batches": 2, "epochs": 2, "entropy_coef": 0.01, "lr_warmup_steps": 2,
         "lr_schedule": "cosine", "min_lr_ratio": 0.1}
CONFIG = {"run": {"steps": 2}, "train": TRAIN}


def direct(order: list[int]) -> list[float]:
    """The updates in plain torch: one per mini-batch (a group here), in ``order``, each normalised by its own
    token count, AdamW with the schedule's LR and the gradient-norm clip of 1."""
    from dynaresize.config.schema import Config
    from dynaresize.rl.batch import collate
    from dynaresize.rl.grpo import GrpoLoss
    from dynaresize.rl.lr import LrSchedule

    cfg = Config.model_validate(CONFIG)
    model = tiny_qwen2(TINY_MODEL, 0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.0)
    loss_fn = GrpoLoss.from_config(cfg.train, 1.0, cfg.algorithm)
    sched = LrSchedule.from_config(cfg.train, cfg.run.steps)
    for i, p in enumerate(order):
        tb = _batch(range(p, p + 1))
        batch = collate(tb.prompt_ids, tb.response_ids, 0, tb.logprobs, tb.advantages)
        batch["loss_denominator"] = batch["response_mask"].sum()
        for g in opt.param_groups:
            g["lr"] = sched(i)
        opt.zero_grad()
        loss, _ = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return torch.cat([p.detach().float().reshape(-1) for _, p in model.named_parameters()]).tolist()


def test_mini_batches_and_epochs_step_in_the_batchs_group_order_as_a_direct_computation(tmp_path, redis_server):
    job = f"mini-{uuid.uuid4().hex[:8]}"
    client = connect(redis_server.endpoint_file, role="test")
    keys = [f"dr:{job}:chunk:0:{p}" for p in range(2)]
    for p, key in enumerate(keys):
        client.set(key, _batch(range(p, p + 1)).to_json())
    trainers = [0, 1]
    with LocalCluster(3, 2, tmp_path, global_batch=2 * GROUP, config=CONFIG, hooks=HOOKS,
                      redis=(redis_server.endpoint_file, job)) as c:
        w0 = c.call("weight_values", ranks=[0])[0]["values"]
        chunk = {"step": 0, "n_train": 2, "version": 0, "batch_groups": 2}
        late = c.call("train_chunk", {**chunk, "batch_key": keys[1]}, ranks=trainers)  # group 1 first: held
        assert all(late[r]["loss_sum"] == 0.0 and late[r]["metrics"] == {} for r in trainers), late
        assert c.call("weight_values", ranks=[0])[0]["values"] == w0  # nothing stepped yet
        both = c.call("train_chunk", {**chunk, "batch_key": keys[0]}, ranks=trainers)  # mini-batches 0 and 1 step
        assert all(both[r]["loss_sum"] != 0.0 and both[r]["metrics"]["entropy"] > 0 for r in trainers), both
        assert c.call("weight_values", ranks=[0])[0]["version"] == 0  # the version waits for the RL step's end
        opt = c.call("optimizer_step", {"step": 0, "n_train": 2, "version_after": 1, "denominator": 1.0},
                     ranks=trainers)
        assert opt[0]["version"] == 1 and "grad_norm" in opt[0]["metrics"]
        # the last of the RL step's 4 updates, the run's 4th of 2 x 4: cosine from step 2 (warmup) to 8
        assert opt[0]["metrics"]["lr"] == pytest.approx(TRAIN["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 6))))
        got = c.call("weight_values", ranks=[0])[0]["values"]
    want, wrong = direct([0, 1, 0, 1]), direct([1, 0, 1, 0])
    moved = _max_diff(want, w0)
    assert moved > 1e-3
    assert _max_diff(got, want) < 5e-3 * moved, (_max_diff(got, want), moved)
    assert _max_diff(got, wrong) > 10 * _max_diff(got, want)  # the order is what the test sees
