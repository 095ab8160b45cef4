"""Weights over the communicators (``pipeline.weights_transport: comm``) with four real worker processes (gloo,
DeepSpeed on CPU) and a real Redis data plane: rank 0 keeps a copy of the new version at its optimizer step and
sends it point to point over the world group built at start-up to each rollout rank whose ``fetch_weights`` posted
a receive (``push_weights``; or before it, the fetch marked ``pushed``); the rollout rank receives it into a second buffer while it holds the old version, and
the ``generate`` that asks for it installs it: bit-identical to the trainer's. A rank that installed a newer version
receives an older one again on request; nothing goes through the weights directory; no process group is created
after start-up. The file fallback is tests/integration/test_worker_streaming.py."""

from __future__ import annotations

import uuid

import pytest

from dynaresize.control.server import connect
from dynaresize.events import read_events
from dynaresize.worker.local import LocalCluster, LocalWorkerError
from tests.integration.test_worker_streaming import GROUP, _batch
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_versions_reach_rollout_ranks_over_the_world_group_into_a_second_buffer(tmp_path, redis_server):
    job = f"wcomm-{uuid.uuid4().hex[:8]}"
    client = connect(redis_server.endpoint_file, role="test")
    keys = {"c0": f"dr:{job}:chunk:0:0", "c1": f"dr:{job}:chunk:0:1"}
    client.set(keys["c0"], _batch(range(0, 1)).to_json())
    client.set(keys["c1"], _batch(range(1, 2)).to_json())
    weights_dir, events = tmp_path / "weights", tmp_path / "events.jsonl"
    gen = {"step": 1, "pull_batch": 3, "max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "prompts": []}
    trainers, rollouts = [0, 1], [2, 3]

    def step(version_after: int, key: str) -> None:
        ch = c.call("train_chunk", {"step": version_after - 1, "batch_key": key, "n_train": 2,
                                    "version": version_after - 1}, ranks=trainers)
        opt = c.call("optimizer_step", {"step": version_after - 1, "n_train": 2, "version_after": version_after,
                                        "denominator": float(ch[0]["tokens"]), "publish": True, "transport": "comm",
                                        "keep_from": version_after - 1}, ranks=trainers)
        assert opt[0]["published_bytes"] > 0 and opt[1]["published_bytes"] == 0  # rank 0 keeps one copy

    with LocalCluster(4, 2, tmp_path, global_batch=2 * GROUP, config={"train": {"lr": 1e-2}}, events=events,
                      hooks=HOOKS, redis=(redis_server.endpoint_file, job), weights_dir=weights_dir) as c:
        v0 = c.call("state_digest", ranks=[2])[2]["weights"]
        step(1, keys["c0"])
        v1 = c.call("state_digest", ranks=trainers)[0]["weights"]
        assert v1 != v0

        # the receive is posted in the background: the rank still holds (and would decode with) version 0
        fetched = c.call("fetch_weights", {"version": 1, "transport": "comm"}, ranks=rollouts)
        assert all(f == {"version": 1, "started": True} for f in fetched.values())
        assert c.call("fetch_weights", {"version": 1, "transport": "comm"}, ranks=[2])[2]["started"] is False
        dig = c.call("state_digest", ranks=rollouts)
        assert all(d["weights"] == v0 and d["version"] == 0 and d["incoming"] == [1] for d in dig.values())
        assert c.call("push_weights", {"version": 1, "ranks": rollouts}, ranks=[0])[0] == {"version": 1, "ranks": rollouts}
        c.call("generate", {**gen, "version": 1}, ranks=rollouts)  # installs: no prompts, only the new version
        dig = c.call("state_digest", ranks=rollouts)
        assert all(d["weights"] == v1 and d["version"] == 1 and d["incoming"] == [] for d in dig.values())

        # version 2 to rank 2; then version 1 again (a lost rank's groups of batch 1 handed to it)
        step(2, keys["c1"])
        v2 = c.call("state_digest", ranks=trainers)[0]["weights"]
        assert c.call("fetch_weights", {"version": 2, "transport": "comm"}, ranks=[2])[2]["started"] is True
        c.call("push_weights", {"version": 2, "ranks": [2]}, ranks=[0])
        c.call("generate", {**gen, "version": 2}, ranks=[2])
        assert c.call("state_digest", ranks=[2])[2]["weights"] == v2
        with pytest.raises(LocalWorkerError, match="holds policy version 2, generate asks for 1"):
            c.call("generate", {**gen, "version": 1}, ranks=[2])  # nothing in the weights directory to read again
        again = c.call("fetch_weights", {"version": 1, "transport": "comm", "again": True}, ranks=[2])[2]
        assert again["started"] is True
        c.call("push_weights", {"version": 1, "ranks": [2]}, ranks=[0])
        c.call("generate", {**gen, "version": 1}, ranks=[2])
        d = c.call("state_digest", ranks=[2])[2]
        assert (d["weights"], d["version"]) == (v1, 1)

        # the coordinator's order for a new version: rank 0 told first (ahead of its next training command), the
        # fetch marked pushed; pushed to a rank that holds it already, the rank still posts the one receive (dropped)
        c.call("push_weights", {"version": 2, "ranks": [3]}, ranks=[0])
        assert c.call("fetch_weights", {"version": 2, "transport": "comm", "pushed": True}, ranks=[3])[3]["started"] is True
        c.call("generate", {**gen, "version": 2}, ranks=[3])
        assert c.call("state_digest", ranks=[3])[3]["weights"] == v2
        c.call("push_weights", {"version": 2, "ranks": [3]}, ranks=[0])
        assert c.call("fetch_weights", {"version": 2, "transport": "comm", "pushed": True}, ranks=[3])[3]["started"] is False
        assert c.call("state_digest", ranks=[3])[3]["incoming"] == []
        # rank 0 sends to a rank in order: without that receive, this send would wait behind the one above for ever
        assert c.call("fetch_weights", {"version": 1, "transport": "comm", "again": True}, ranks=[3])[3]["started"] is True
        c.call("push_weights", {"version": 1, "ranks": [3]}, ranks=[0])
        c.call("generate", {**gen, "version": 1}, ranks=[3])
        assert c.call("state_digest", ranks=[3])[3]["weights"] == v1

        # what rank 0 refuses: a version it kept no copy of (nor holds), a push from another rank
        with pytest.raises(LocalWorkerError, match=r"holds no copy of version 5 to send \(held: 1, 2\)"):
            c.call("push_weights", {"version": 5, "ranks": [3]}, ranks=[0])
        with pytest.raises(LocalWorkerError, match=r"trainer rank 0 and rollout ranks \(relays\) send weights"):
            c.call("push_weights", {"version": 2, "ranks": [3]}, ranks=[1])
        stats = c.call("comm_stats")
        assert all(s["created_after_startup"] == 0 for s in stats.values()), stats
    client.close()

    assert not weights_dir.exists() or not any(weights_dir.iterdir()), "a version went through the weights directory"
    stages = [e for e in read_events(events) if e.type.value == "stage" and e["stage"] == "weight_sync"]
    recv = sorted((e["ranks"], e["version"]) for e in stages if e.get("background") and e.get("to") is None)
    assert recv == [("2", 1), ("2", 1), ("2", 2), ("3", 1), ("3", 1), ("3", 2)]  # a dropped receive is not logged
    assert all(e.get("transport") == "comm" and e["bytes"] > 0 for e in stages if e.get("background"))
    sends = sorted((e["to"], e["version"]) for e in stages if e.get("to") is not None)
    assert sends == [(2, 1), (2, 1), (2, 2), (3, 1), (3, 1), (3, 2), (3, 2)] and all(e["ranks"] == "0" and e.get("error") is None
                                                             for e in stages if e.get("to") is not None)


def test_a_relay_forwards_what_it_received_from_its_second_buffer(tmp_path, redis_server):
    """``pipeline.weights_relay``: rank 2 receives version 1 from rank 0 and forwards it from its second buffer to
    rank 3 (its push queued before its own receive ended: it sends once that is checked); both install rank 0's
    bytes, rank 0 sent the version once, no process group was created."""
    job = f"wrelay-{uuid.uuid4().hex[:8]}"
    client = connect(redis_server.endpoint_file, role="test")
    key = f"dr:{job}:chunk:0:0"
    client.set(key, _batch(range(0, 1)).to_json())
    events = tmp_path / "events.jsonl"
    gen = {"step": 1, "pull_batch": 3, "max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "prompts": []}
    trainers = [0, 1]
    with LocalCluster(4, 2, tmp_path, global_batch=2 * GROUP, config={"train": {"lr": 1e-2}}, events=events,
                      hooks=HOOKS, redis=(redis_server.endpoint_file, job), weights_dir=tmp_path / "weights") as c:
        ch = c.call("train_chunk", {"step": 0, "batch_key": key, "n_train": 2, "version": 0}, ranks=trainers)
        c.call("optimizer_step", {"step": 0, "n_train": 2, "version_after": 1, "denominator": float(ch[0]["tokens"]),
                                  "publish": True, "transport": "comm", "keep_from": 0}, ranks=trainers)
        v1 = c.call("state_digest", ranks=trainers)[0]["weights"]
        comm = {"version": 1, "transport": "comm", "pushed": True}
        # the coordinator's order: rank 0's push first, then each fetch naming its sender, a relay's push after its fetch
        c.call("push_weights", {"version": 1, "ranks": [2], "one_at_a_time": True}, ranks=[0])
        assert c.call("fetch_weights", {**comm, "src": 0, "forward": True}, ranks=[2])[2]["started"] is True
        c.call("push_weights", {"version": 1, "ranks": [3], "one_at_a_time": True}, ranks=[2])
        assert c.call("fetch_weights", {**comm, "src": 2, "forward": True}, ranks=[3])[3]["started"] is True
        c.call("generate", {**gen, "version": 1}, ranks=[2, 3])
        dig = c.call("state_digest", ranks=[2, 3])
        assert all(d["weights"] == v1 and d["version"] == 1 for d in dig.values())

        stats = c.call("comm_stats")
        assert all(s["created_after_startup"] == 0 for s in stats.values()), stats
    client.close()
    stages = [e for e in read_events(events) if e.type.value == "stage" and e["stage"] == "weight_sync"]
    sends = sorted((e["ranks"], e["to"], e["version"]) for e in stages if e.get("to") is not None)
    assert sends == [("0", 2, 1), ("2", 3, 1)]  # rank 0 sent version 1 once; rank 2 forwarded it
