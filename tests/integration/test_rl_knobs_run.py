"""verl's RL knobs in a whole run (real Redis, 4 worker processes, DeepSpeed on CPU): mini-batches and PPO epochs,
the entropy bonus, an LR warmup and cosine schedule, the RLOO advantage and top-k sampling, all at once.

- RL semantics: the default schedule (continuous rollout, streaming training: each mini-batch steps as soon as its
  groups are in) with a resize each way trains the static barrier run's samples, from the same policy versions,
  with the same rewards and losses within 1e-3 (the same knobs on both).
- Streaming: each chunk steps exactly the mini-batches its groups complete, in the batch's group order.
- The LR of each RL step's last update equals the schedule computed directly (dynaresize.rl.lr), across the switches.
- The entropy metric is reported every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_continuous_schedule import CONTINUOUS, same_samples
from tests.integration.test_job import SEED, batches, run, run_dir_of

pytestmark = pytest.mark.integration

STEPS = 6
KNOBS = ["train.mini_batches=2", "train.epochs=2", "train.entropy_coef=0.01", "train.lr_warmup_steps=3",
         "train.lr_schedule=cosine", "train.min_lr_ratio=0.1", "algorithm.advantage=rloo", "rollout.top_k=20",
         f"run.steps={STEPS}", f"run.seed={SEED}", "task.dataset.val_every=0"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l)["metrics"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mini_batches_epochs_and_schedule_keep_rl_semantics_with_resizing_and_streaming(tmp_path, model_cache):
    from dynaresize.rl.lr import LrSchedule

    run(tmp_path / "static", model_cache, "policy.enabled=false", "pipeline.schedule=barrier", *KNOBS)
    run(tmp_path / "dyn", model_cache, "policy.forced_splits={2: 1, 4: 3}", *CONTINUOUS, *KNOBS)
    st, dyn = run_dir_of(tmp_path / "static"), run_dir_of(tmp_path / "dyn")
    got = batches(dyn)
    same_samples(got, batches(st))
    n_train = [b["n_train"] for b in got]
    assert 1 in n_train and 3 in n_train, n_train

    # streaming: each chunk steps exactly the first-pass mini-batches its groups complete (in the batch's group
    # order, whatever the arrival order), as the schedule handed the chunks out; every one within the chunks
    from tests.integration.test_continuous_schedule import schedule

    def complete(have: set[int]) -> int:  # mini-batches 0 .. m-1 (groups 2m, 2m + 1) all in: m
        m = 0
        while m < 2 and {2 * m, 2 * m + 1} <= have:
            m += 1
        return m

    want: dict[int, list[int]] = {}
    seen: dict[int, set[int]] = {}
    for rec in schedule(dyn):
        for a in rec.get("actions", rec.get("start", [])):
            if a["type"] == "Train":
                have = seen.setdefault(a["batch"], set())
                before = complete(have)
                have.update(a["groups"])
                want.setdefault(a["batch"], []).append(complete(have) - before)
    events = [json.loads(l) for l in (dyn / "events.jsonl").read_text().splitlines()]
    stepped: dict[int, list[int]] = {}
    for e in events:
        if e.get("stage") == "train" and e.get("chunk") and e.get("ranks") == "0":
            stepped.setdefault(e["step"], []).append(int(e["mini_batches"]))
    assert stepped == want, (stepped, want)
    assert all(sum(per) == 2 for per in stepped.values()), stepped

    # the LR of every step's last update: the schedule over the run's 6 x 2 x 2 optimizer steps, across the switches
    from dynaresize.config.loader import load_config

    sched = LrSchedule.from_config(load_config(dyn / "config.yaml").train, STEPS)
    assert sched.total_steps == STEPS * 4
    for name, rd in (("static", st), ("dynamic", dyn)):
        m = metrics(rd)
        assert [x["train/lr"] for x in m] == pytest.approx([sched(4 * k + 3) for k in range(STEPS)], rel=1e-6), name
        assert all(x["loss/entropy"] > 0 for x in m), name


def test_mini_batches_with_dynamic_sampling_step_at_the_batch_end_as_the_barrier_run(tmp_path, model_cache):
    """Dynamic sampling selects the batch's groups (prompt indices beyond B - 1 too), so the order is known only at
    the batch's end: every update runs at the optimizer step, over the kept groups in prompt order. Resized and
    streamed, the run trains the barrier run's kept groups with its losses (DAPO's options all on)."""
    from tests.integration.test_job import DAPO, DAPO_SEED

    steps = 4
    knobs = ["train.mini_batches=2", "train.epochs=2", f"run.steps={steps}", f"run.seed={DAPO_SEED}",
             "task.dataset.val_every=0", *DAPO]
    run(tmp_path / "static", model_cache, "policy.enabled=false", "pipeline.schedule=barrier", *knobs)
    run(tmp_path / "dyn", model_cache, "policy.forced_splits={1: 1, 3: 3}", *CONTINUOUS, *knobs)
    st, dyn = batches(run_dir_of(tmp_path / "static")), batches(run_dir_of(tmp_path / "dyn"))
    assert [b["step"] for b in dyn] == [b["step"] for b in st] == list(range(steps))
    assert any(int(k.split(".")[1]) >= 4 for b in st for k in b["keys"]), "no batch kept a group of an extra round"
    for g, w in zip(dyn, st):
        assert (g["keys"], g["versions"], g["rewards"]) == (w["keys"], w["versions"], w["rewards"]), g["step"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-3, abs=1e-5), g["step"]
    assert 1 in [b["n_train"] for b in dyn]
    events = [json.loads(l) for l in (run_dir_of(tmp_path / "dyn") / "events.jsonl").read_text().splitlines()]
    assert all(e.get("mini_batches") == 0 for e in events if e.get("stage") == "train" and e.get("chunk"))
