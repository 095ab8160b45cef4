"""Four real worker processes (gloo, DeepSpeed on CPU): role switches both ways in one run, weight sync bit for
bit, optimizer state bit-exact across trainer-count changes, staging restore, corrupted chunks caught, and no
communicator created after start-up."""

from __future__ import annotations

import pytest
import torch

from dynaresize.events import read_events
from dynaresize.worker.local import LocalCluster, LocalWorkerError
from tests.support.hooks import HOOKS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _ids(seed: int, n: int = 12, length: int = 16) -> list[list[int]]:
    return torch.randint(3, 48, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _train(c, n_train, version_after, seed=1):
    return c.call("train_direct", {"input_ids": _ids(seed), "n_train": n_train, "version_after": version_after},
                  ranks=range(n_train))


def _opt_digest(c, n_train):
    return c.call("state_digest", ranks=range(n_train))[0]["optimizer"]


def test_roles_switch_both_ways_state_stays_exact(tmp_path):
    events = tmp_path / "events.jsonl"
    with LocalCluster(4, 2, tmp_path, global_batch=12, config={"train": {"lr": 1e-2, "zero_stage": 1}}, events=events, hooks=HOOKS) as c:
        _train(c, 2, 1)
        _train(c, 2, 2, seed=2)
        before = _opt_digest(c, 2)
        assert before["step"] == "2.0"

        # weight sync: every rollout rank equals the trainer bit for bit
        sync = c.call("sync_weights", {"version": 2, "n_train": 2})
        assert sync[2]["version"] == sync[3]["version"] == 2 and sync[2]["bytes"] > 0
        dig = c.call("state_digest")
        assert len({d["weights"] for d in dig.values()}) == 1

        # rollout rank 2 becomes a trainer (2 -> 3): optimizer state unchanged, bit for bit
        sw = c.call("switch_role", {"switch_id": "grow", "step": 2, "from_train": 2, "to_train": 3})
        assert [sw[r]["role"] for r in range(4)] == ["train", "train", "train", "rollout"]
        assert sw[3]["ops"] == []  # not involved: keeps rolling out
        assert {o["op"] for o in sw[2]["ops"]} >= {"comm_select", "engine_build", "optimizer_reshard"}
        assert _opt_digest(c, 3) == before
        _train(c, 3, 3)

        # trainers 1 and 2 become rollout ranks (3 -> 1); a stale rank refuses to generate until synced
        after3 = _opt_digest(c, 3)
        sw = c.call("switch_role", {"switch_id": "shrink", "step": 3, "from_train": 3, "to_train": 1})
        assert [sw[r]["role"] for r in range(4)] == ["train", "rollout", "rollout", "rollout"]
        assert _opt_digest(c, 1) == after3
        with pytest.raises(LocalWorkerError, match="holds policy version 2"):
            c.call("generate", {"step": 0, "version": 3, "pull_batch": 2, "max_tokens": 4, "temperature": 1.0, "top_p": 1.0}, ranks=[3])
        c.call("sync_weights", {"version": 3, "n_train": 1})
        dig = c.call("state_digest")
        assert len({d["weights"] for d in dig.values()}) == 1 and {d["version"] for d in dig.values()} == {3}

        # same prompts and seeds give the same samples on every rollout rank
        gen = c.call("generate_direct", {"prompts": [[1, 5, 6], [1, 7]], "seeds": [5, 6], "max_tokens": 12}, ranks=[1, 2, 3])
        assert gen[1]["token_ids"] == gen[2]["token_ids"] == gen[3]["token_ids"]
        assert all(lp <= 0 for row in gen[1]["logprobs"] for lp in row)

        # staging: stage, train, restore (optimizer state deferred to the first step), train again: identical
        staged = c.call("stage_state", {"tag": "a"})
        assert len(staged[0]["manifests"]) == 2 and len(staged[1]["manifests"]) == 1
        d_staged = _opt_digest(c, 1)
        _train(c, 1, 4, seed=7)
        d_after = _opt_digest(c, 1)
        c.call("restore_state", {"tag": "a"})
        assert _opt_digest(c, 1) == d_staged  # reading the digest installs the deferred state
        c.call("restore_state", {"tag": "a"}, ranks=[0])
        _train(c, 1, 4, seed=7)  # deferred install at the first step, inside this train command
        assert _opt_digest(c, 1) == d_after

        # a corrupted chunk is caught and named; the weights are left untouched
        w_before = c.call("state_digest", ranks=[2])[2]["weights"]
        data = tmp_path / "staging" / "a-rank2-weights" / "data.bin"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        with pytest.raises(LocalWorkerError, match=r"a-rank2-weights/data\.bin: chunk \d+ .*checksum"):
            c.call("restore_state", {"tag": "a"}, ranks=[2])
        assert c.call("state_digest", ranks=[2])[2]["weights"] == w_before  # and the worker is still alive

        # communicator reuse: no process group created after start-up, on any rank
        stats = c.call("comm_stats")
        assert all(s["created_after_startup"] == 0 for s in stats.values())

    ops = [e for e in read_events(events) if e.type.value == "switch_op"]
    assert {e["switch_id"] for e in ops} >= {"grow", "shrink"}
    assert any(e["op"] == "optimizer_stage_in" and e["critical"] is False for e in ops)
    assert all(e["end"] >= e["start"] for e in ops)
