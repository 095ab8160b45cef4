"""The worker side of the barrier-free schedule with four real worker processes (gloo, DeepSpeed on CPU) and a real
Redis data plane: streamed training (``train_chunk`` x2 + ``optimizer_step``) equals one whole-batch ``train``; rank
0 publishes the new weights, a rollout rank fetches them in the background and the ``generate`` that asks for that
version installs them (weights equal to the trainer's, bit for bit) and generates exactly the prompts it was given;
a version never fetched, or a snapshot that is not there, is a clear error."""

from __future__ import annotations

import uuid

import pytest
import torch

from dynaresize.contract.batch import TrainBatch
from dynaresize.contract.workqueue import RolloutQueue, WorkItem
from dynaresize.control.server import connect
from dynaresize.events import read_events
from dynaresize.metrics import mismatch_metrics
from dynaresize.rl.mismatch import reduce_stats
from dynaresize.worker.local import LocalCluster, LocalWorkerError
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GROUP = 4  # GRPO group size: the batch is 2 groups, one chunk per group


def _batch(groups: range, seed: int = 3) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "logprobs", "advantages", "rewards", "versions", "keys")}
    for p in range(2):  # both groups are drawn always, so a chunk holds the same samples as the whole batch
        prompt = torch.randint(3, 48, (3 + p,), generator=g).tolist()
        for i in range(GROUP):
            n = int(torch.randint(2, 9, (1,), generator=g))  # responses of different lengths: the token norm matters
            resp = torch.randint(3, 48, (n,), generator=g).tolist()
            lp = (-3.0 + 0.1 * torch.randn(n, generator=g)).tolist()
            adv, rew = float(torch.randn(1, generator=g)), float(i % 2)
            if p in groups:
                for k, v in zip(rows, (prompt, resp, lp, adv, rew, 0, f"0.{p}.{i}")):
                    rows[k].append(v)
    return TrainBatch(step=0, **rows)


def _max_diff(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


def test_streamed_training_publishes_weights_that_a_rollout_rank_fetches_and_installs(tmp_path, redis_server):
    job = f"stream-{uuid.uuid4().hex[:8]}"
    client = connect(redis_server.endpoint_file, role="test")
    keys = {"whole": f"dr:{job}:batch:0", "c0": f"dr:{job}:chunk:0:0", "c1": f"dr:{job}:chunk:0:1"}
    client.set(keys["whole"], _batch(range(2)).to_json())
    client.set(keys["c0"], _batch(range(0, 1)).to_json())
    client.set(keys["c1"], _batch(range(1, 2)).to_json())
    queue = RolloutQueue(client, job)
    queue.publish(1, [WorkItem(1, p, i, [1, 5 + p, 9], seed=100 * p + i) for p in range(3) for i in range(2)])
    weights_dir, events = tmp_path / "weights", tmp_path / "events.jsonl"
    gen = {"step": 1, "pull_batch": 3, "max_tokens": 6, "temperature": 1.0, "top_p": 1.0}
    trainers = [0, 1]
    with LocalCluster(4, 2, tmp_path, global_batch=2 * GROUP, config={"train": {"lr": 1e-2, "zero_stage": 2}},
                      events=events, hooks=HOOKS, redis=(redis_server.endpoint_file, job), weights_dir=weights_dir) as c:
        w0 = c.call("weight_values", ranks=[0])[0]["values"]
        rollout_v0 = c.call("state_digest", ranks=[2])[2]["weights"]

        # (a) one whole-batch step, then the same step streamed from the same state (restored, optimizer included)
        c.call("stage_state", {"tag": "init"}, ranks=trainers)
        whole = c.call("train", {"step": 0, "batch_key": keys["whole"], "n_train": 2, "version_after": 1}, ranks=trainers)
        w_whole = c.call("weight_values", ranks=[0])[0]["values"]
        c.call("restore_state", {"tag": "init"}, ranks=trainers)  # version 0 again; optimizer state installed at the step
        with pytest.raises(LocalWorkerError, match="at version 0; the chunk trains from version 1"):
            c.call("train_chunk", {"step": 0, "batch_key": keys["c0"], "n_train": 2, "version": 1}, ranks=trainers)
        with pytest.raises(LocalWorkerError, match="trains with 2 trainers, the command says 3"):
            c.call("train_chunk", {"step": 0, "batch_key": keys["c0"], "n_train": 3, "version": 0}, ranks=trainers)
        chunks = [c.call("train_chunk", {"step": 0, "batch_key": keys[k], "n_train": 2, "version": 0}, ranks=trainers)
                  for k in ("c0", "c1")]
        assert [ch[0]["samples"] for ch in chunks] == [GROUP, GROUP] and all(ch[0]["version"] == 0 for ch in chunks)
        tokens = sum(ch[0]["tokens"] for ch in chunks)
        assert tokens == whole[0]["tokens"]  # the chunks' tokens add up to the batch's: the token normaliser
        assert all(ch[r]["loss_sum"] != 0.0 for ch in chunks for r in trainers)
        # the same rollout/trainer mismatch figures either way: the whole batch's per-trainer sums, and each
        # trainer's chunks reduced as the continuous schedule reduces them (job.training), then over the trainers
        fig_whole = mismatch_metrics([whole[r] for r in trainers])
        fig_stream = mismatch_metrics([{"metrics": reduce_stats([ch[r]["metrics"] for ch in chunks])} for r in trainers])
        assert fig_whole["mismatch/tokens"] == fig_stream["mismatch/tokens"] == tokens
        assert fig_whole["mismatch/same_version_tokens"] == tokens  # every sample of version 0, trained from 0
        assert fig_whole["mismatch/abs_mean"] > 0.1  # the batch's made-up logprobs are far from the model's
        assert set(fig_stream) == set(fig_whole)
        for name, v in fig_whole.items():
            assert fig_stream[name] == pytest.approx(v, rel=1e-6), name
        with pytest.raises(LocalWorkerError, match="at version 0; the update would make it 2"):
            c.call("optimizer_step", {"step": 0, "n_train": 2, "version_after": 2, "denominator": float(tokens)}, ranks=trainers)
        opt = c.call("optimizer_step", {"step": 0, "n_train": 2, "version_after": 1, "denominator": float(tokens),
                                        "publish": True}, ranks=trainers)
        assert opt[0]["version"] == opt[1]["version"] == 1 and "grad_norm" in opt[0]["metrics"]
        assert opt[0]["published_bytes"] > 0 and opt[1]["published_bytes"] == 0  # rank 0 publishes, once
        assert (weights_dir / "v1" / "manifest.json").is_file()
        w_stream = c.call("weight_values", ranks=[0])[0]["values"]
        moved = _max_diff(w_whole, w0)
        assert moved > 1e-3
        # Adam divides each gradient by its own running RMS, so an element whose gradient is near zero turns the float
        # summation difference of chunked vs whole-batch gradients into a visible update difference: seen 1.1e-3 x moved
        assert _max_diff(w_stream, w_whole) < 5e-3 * moved

        # (c) a version this rank never fetched: refused, nothing claimed
        with pytest.raises(LocalWorkerError, match="holds policy version 0, generate asks for 1"):
            c.call("generate", {**gen, "version": 1, "prompts": [0, 2]}, ranks=[2])
        assert queue.pending(1) == 6
        with pytest.raises(LocalWorkerError, match="only a rollout rank fetches weights"):
            c.call("fetch_weights", {"version": 1}, ranks=[0])

        # (b) fetch in the background, then the generate of version 1 installs it and does exactly its prompts
        assert c.call("fetch_weights", {"version": 1}, ranks=[2])[2] == {"version": 1, "started": True}
        assert c.call("fetch_weights", {"version": 1}, ranks=[2])[2] == {"version": 1, "started": False}
        g = c.call("generate", {**gen, "version": 1, "prompts": [2, 0]}, ranks=[2])[2]
        assert g["samples"] == 4 and g["version"] == 1 and g["prompts"] == [2, 0]
        done = queue.results(1)
        assert [(s.prompt, s.index) for s in done] == [(0, 0), (0, 1), (2, 0), (2, 1)] and queue.pending(1) == 2
        assert {(s.version, s.rank) for s in done} == {(1, 2)}
        # no prompts: only the install (what a rank needs before a checkpoint of the new version)
        c.call("fetch_weights", {"version": 1}, ranks=[3])
        g3 = c.call("generate", {**gen, "version": 1, "prompts": []}, ranks=[3])[3]
        assert (g3["samples"], g3["version"], g3["prompts"]) == (0, 1, []) and queue.pending(1) == 2
        dig = c.call("state_digest")  # every rank: the trainers' optimizer digest is collective
        assert dig[2]["weights"] == dig[3]["weights"] == dig[0]["weights"] != rollout_v0 and dig[2]["version"] == 1
        assert dig[2]["incoming"] == []
        assert c.call("fetch_weights", {"version": 1}, ranks=[2])[2]["started"] is False  # held now

        # (c) snapshots that are not there: the fetch starts, the install says which version and path failed
        assert c.call("fetch_weights", {"version": 7}, ranks=[2])[2]["started"] is True
        assert c.call("fetch_weights", {"version": 8}, ranks=[2])[2]["started"] is True
        with pytest.raises(LocalWorkerError, match=r"already holds 2 fetched versions \(7, 8\), at most 2"):
            c.call("fetch_weights", {"version": 9}, ranks=[2])
        # the scheduler dropped version 7 (no batch needs it): its buffer is freed for 9, 8 stays
        assert c.call("fetch_weights", {"version": 9, "keep": [8, 9]}, ranks=[2])[2]["started"] is True
        assert c.call("state_digest", ranks=[2])[2]["incoming"] == [8, 9]
        with pytest.raises(LocalWorkerError, match=r"already holds 2 fetched versions \(8, 9\), at most 2"):
            c.call("fetch_weights", {"version": 10, "keep": [8, 9, 10]}, ranks=[2])
        c.call("fetch_weights", {"version": 7, "keep": [7, 8]}, ranks=[2])  # 9 dropped, 7 read again
        with pytest.raises(LocalWorkerError, match=r"version 7 \(.*v7\) cannot be installed: .*no manifest"):
            c.call("generate", {**gen, "version": 7, "prompts": [1]}, ranks=[2])
        assert c.call("state_digest", ranks=[2])[2]["incoming"] == [8]
        assert queue.pending(1) == 2
        # the pull loop still takes what is left, with the installed version
        g = c.call("generate", {**gen, "version": 1}, ranks=[2])[2]
        assert g["samples"] == 2 and "prompts" not in g and queue.pending(1) == 0

        # a rank that becomes a trainer drops its fetched versions; a whole-batch train while chunks wait is refused
        c.call("switch_role", {"switch_id": "grow", "step": 1, "from_train": 2, "to_train": 3})
        assert c.call("state_digest")[2]["incoming"] == []
        c.call("train_chunk", {"step": 1, "batch_key": keys["c0"], "n_train": 3, "version": 1}, ranks=[0, 1, 2])
        with pytest.raises(LocalWorkerError, match="streamed chunks wait"):
            c.call("train", {"step": 1, "batch_key": keys["whole"], "n_train": 3, "version_after": 2}, ranks=[0, 1, 2])
    client.close()

    ev = list(read_events(events))
    stages = [e for e in ev if e.type.value == "stage"]
    chunk_ev = [e for e in stages if e["stage"] == "train" and e.get("chunk")]
    assert sorted(e["ranks"] for e in chunk_ev) == ["0", "0", "0", "1", "1", "1", "2"]
    assert sorted(e["ranks"] for e in stages if e["stage"] == "train" and e.get("optimizer_step")) == ["0", "1"]
    sync = [e for e in stages if e["stage"] == "weight_sync" and e["ranks"] == "2"]
    read = [e for e in sync if e.get("background")]
    assert len(read) == 1 and read[0]["version"] == 1 and read[0]["bytes"] > 0  # the failed reads are not intervals
    assert [e["version"] for e in sync if not e.get("background")] == [1]  # the install
    assert any(e["stage"] == "weight_sync" and e.get("publish") and e["ranks"] == "0" for e in stages)
    stage_in = [e for e in ev if e.type.value == "switch_op" and e["op"] == "optimizer_stage_in"]
    assert sorted(e["ranks"] for e in stage_in if e["switch_id"] == "init") == ["0", "1"]  # inside optimizer_step
