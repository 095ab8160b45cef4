"""The main job end to end on this machine: real Redis, 4 worker processes, DeepSpeed on CPU, GRPO.

- RL semantics are unchanged by resizing: with the same seed, a run on the barrier schedule whose split changes
  twice (2 -> 1 -> 3 trainers) and a run held static train on the same samples, from the same policy versions,
  with the same batch size and equal losses; the switches' ops are logged, the deferred optimizer stage-in hidden.
- SIGTERM in the middle of a run leaves a run directory that ``--resume`` continues with the same step counter,
  and no sample is lost or trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

B, G = 4, 4
# warm-start 80 steps: with the trained byte-level BPE tokenizer 20 steps leave every reward at 0, and dynamic
# sampling (test_dynamic_sampling_*) then finds no group with unequal rewards
BASE = [
    "run.progress=false", "cluster.gpus=4", "cluster.initial_train=2", f"rollout.prompts_per_step={B}",
    f"rollout.group_size={G}", "rollout.max_tokens=16", "model.tiny.warmstart_steps=80", "run.checkpoint_every=0",
    "redis.heartbeat_s=0.5", "redis.dead_after_heartbeats=8",  # 4 s: a busy 2-core CI box starves heartbeats
]
# The seed of every run whose assertions hold for any seed (here and in the modules that import run()): the
# warm-started model is cached by recipe, seed included (conftest.py's model_cache), so they all share one build
SEED = 7


def run(tmp: Path, cache: str, *overrides: str, resume: Path | None = None, wait: bool = True,
        faults: dict[str, str] | None = None):
    """``dynaresize run``; with ``faults`` (``DYNARESIZE_TEST_*`` variables, see ``tests/support/hooks.py``) its
    ranks start through the test-side entry that applies them (``python -m tests.support.run``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(faults or {}))
    entry = ["tests.support.run"] if faults is not None else ["dynaresize.cli", "run"]
    if resume is not None:
        argv = [sys.executable, "-m", *entry, "--resume", str(resume), *overrides, "--quiet"]
    else:
        argv = [sys.executable, "-m", *entry, "configs/quickstart.yaml", *BASE,
                f"run.output_dir={tmp}", f"model.cache_dir={cache}", *overrides, "--quiet"]
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    if not wait:
        return p
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    return out


def run_dir_of(tmp: Path) -> Path:
    dirs = [d for d in tmp.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def batches(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "batches.jsonl").read_text().splitlines()]


def wait_for_batches(parent: Path, p, n: int = 2, timeout_s: float = 400, poll_s: float = 0.2) -> Path:
    """The run directory under ``parent`` once its ``batches.jsonl`` holds ``n`` steps (the job must stay alive)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dirs = [d for d in parent.iterdir() if d.is_dir()] if parent.exists() else []
        if dirs and (dirs[0] / "batches.jsonl").exists() and len((dirs[0] / "batches.jsonl").read_text().splitlines()) >= n:
            return dirs[0]
        assert p.poll() is None, p.stdout.read()[-4000:]
        time.sleep(poll_s)
    raise AssertionError(f"the run never reached step {n}")


def test_resizing_keeps_rl_semantics(tmp_path, model_cache):
    """Resizing on the barrier schedule, its switch ops and the deferred optimizer stage-in (the barrier-free
    schedule's resizing against the same static run: tests/integration/test_continuous_schedule.py)."""
    # a forced split lands at the next batch boundary its switch can take (one batch later when the trainers already
    # hold that batch's chunk), and the policy is not asked while a switch is in flight: two steps apart
    steps = 6
    run(tmp_path / "dyn", model_cache, f"run.steps={steps}", "policy.forced_splits={2: 1, 4: 3}", f"run.seed={SEED}",
        "switching.optimizations.deferred_optimizer=true", "pipeline.schedule=barrier")  # the workers defer, the policy plans so
    run(tmp_path / "static", model_cache, f"run.steps={steps}", "policy.enabled=false", f"run.seed={SEED}",
        "pipeline.schedule=barrier")
    dyn_dir, st_dir = run_dir_of(tmp_path / "dyn"), run_dir_of(tmp_path / "static")
    dyn, st = batches(dyn_dir), batches(st_dir)
    assert [b["step"] for b in dyn] == [b["step"] for b in st] == list(range(steps))
    n_train = [b["n_train"] for b in dyn]
    assert n_train[:2] == [2, 2] and 1 in n_train and n_train[-1] == 3 and {b["n_train"] for b in st} == {2}, n_train
    for d, s in zip(dyn, st):
        k = d["step"]
        assert len(d["keys"]) == len(s["keys"]) == B * G  # same global batch size
        assert d["keys"] == s["keys"]  # same samples, in the same order
        assert d["versions"] == s["versions"]  # same sample -> policy version map
        assert min(d["versions"]) >= k - 1  # staleness bound 1 enforced
        assert d["rewards"] == s["rewards"]
        assert d["loss"] == pytest.approx(s["loss"], rel=1e-3, abs=1e-5)
        # per-sample lengths (the what-if's trace), in the order of keys: the same samples have the same lengths
        assert len(d["response_tokens"]) == len(d["prompt_tokens"]) == B * G
        assert d["response_tokens"] == s["response_tokens"] and d["prompt_tokens"] == s["prompt_tokens"]
    ends = [json.loads(l) for l in (dyn_dir / "events.jsonl").read_text().splitlines() if '"step_end"' in l]
    assert [sum(b["response_tokens"]) for b in dyn] == [e["tokens_trained"] for e in sorted(ends, key=lambda e: e["step"])]
    summary = json.loads((dyn_dir / "summary.json").read_text())
    assert summary["steps"] == steps and len(summary["switches"]) == 2
    assert {"steps", "samples_per_s", "reward_first", "reward_last", "switches", "switch_critical_path_s"} <= set(summary)
    ops = [json.loads(l) for l in (dyn_dir / "events.jsonl").read_text().splitlines() if '"switch_op"' in l]
    assert {"comm_select", "engine_build", "optimizer_reshard"} <= {o["op"] for o in ops}
    assert any(not o["critical"] for o in ops)  # the deferred optimizer stage-in is hidden behind training
    # each switch at a training-batch boundary; the second's optimizer stage-in runs behind the next training
    assert [s.get("mode", "") for s in summary["switches"]] == ["optimized", "optimized"]
    assert summary["switches"][-1]["hidden_s"] > 0
    stages = [json.loads(l) for l in (dyn_dir / "events.jsonl").read_text().splitlines() if '"type":"stage"' in l]
    seen = {(e["stage"], e["ranks"]) for e in stages}
    # every rank logged busy intervals in both roles it held: rank 1 trained, then rolled out, then trained
    assert {("train", "1"), ("rollout", "1"), ("rollout", "3"), ("weight_sync", "3")} <= seen


def test_sigterm_then_resume_loses_and_duplicates_nothing(tmp_path, model_cache):
    steps = 7
    p = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", wait=False)
    rd = wait_for_batches(tmp_path, p)
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out[-4000:]
    state = json.loads((rd / "checkpoints" / "coordinator.json").read_text())
    done = len(batches(rd))
    assert 2 <= state["step"] == done < steps
    assert (rd / state["checkpoint"]).is_dir()

    run(tmp_path, model_cache, resume=rd)
    got = batches(rd)
    assert [b["step"] for b in got] == list(range(steps))  # same counter, no step twice, none missing
    for b in got:
        assert sorted(b["keys"]) == sorted(f"{b['step']}.{p}.{i}" for p in range(B) for i in range(G))
        assert min(b["versions"]) >= b["step"] - 1
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    events = (rd / "events.jsonl").read_text()
    assert '"what":"resume"' in events


def test_a_dead_rank_fails_the_job_clearly_and_the_run_resumes(tmp_path, model_cache):
    p = run(tmp_path, model_cache, "run.steps=60", "run.checkpoint_every=2", f"run.seed={SEED}", "faults.shrink=false",
            "faults.max_restarts=0", wait=False)  # the fail-fast path; tests/integration/test_faults.py: the others
    deadline = time.monotonic() + 400
    state = None
    while time.monotonic() < deadline:
        dirs = [d for d in tmp_path.iterdir() if d.is_dir()] if tmp_path.exists() else []
        state = dirs[0] / "checkpoints" / "coordinator.json" if dirs else None
        if state is not None and state.exists() and json.loads(state.read_text())["step"] >= 2:
            break
        assert p.poll() is None, p.stdout.read()[-4000:]
        time.sleep(0.2)
    rd = state.parent.parent
    victim = json.loads((rd / "ranks.json").read_text())["3"]["pid"]
    os.kill(victim, signal.SIGKILL)
    out, _ = p.communicate(timeout=120)  # noticed within seconds, not after a command timeout
    assert p.returncode == 1, out[-4000:]
    assert "rank(s) 3 lost" in out and ("process exited" in out or "no heartbeat" in out), out[-2000:]
    assert f"dynaresize run --resume {rd}" in out
    ck = json.loads(state.read_text())["step"]
    run(tmp_path, model_cache, f"run.steps={ck + 2}", resume=rd)
    got = [b["step"] for b in batches(rd)]
    assert got == list(range(ck + 2))  # the steps after the last checkpoint are trained again, once


DAPO = ["task.params={partial_credit: false}",  # a binary reward: many groups are all 0 or all 1 and get dropped
        "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2",
        "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=4",
        "train.clip_eps_high=0.28", "train.kl_coef=0.01"]


DAPO_STEPS, DAPO_SEED = 6, 11  # the seed matters: its batches must drop groups (asserted below)


@pytest.fixture(scope="module")
def dapo_static(tmp_path_factory, model_cache) -> Path:
    """The static DAPO run both dynamic-sampling tests compare with (one launch for the two)."""
    parent = tmp_path_factory.mktemp("dapo-static")
    run(parent, model_cache, f"run.steps={DAPO_STEPS}", "policy.enabled=false", f"run.seed={DAPO_SEED}", *DAPO,
        "pipeline.schedule=barrier")  # the static one-step-off baseline, on the scheduler core
    return run_dir_of(parent)


def test_dynamic_sampling_keeps_the_same_groups_when_resized(tmp_path, model_cache, dapo_static):
    """DAPO dynamic sampling (with overlong shaping, clip-higher and KL to the reference on): a barrier-free run (the
    default schedule) resized twice and the static barrier run with the same seed generate the same extra rounds, keep
    the same groups (by prompt order), and train on the same samples; the metrics reach TensorBoard. 5 steps: the
    forced splits, and no step after them in which the policy (on, to keep them) may resize by itself."""
    steps = DAPO_STEPS - 1
    run(tmp_path / "dyn", model_cache, f"run.steps={steps}", "policy.forced_splits={1: 1, 3: 3}", f"run.seed={DAPO_SEED}",
        "metrics.tensorboard=true", *DAPO)
    dyn_dir, st_dir = run_dir_of(tmp_path / "dyn"), dapo_static
    dyn, st = batches(dyn_dir), batches(st_dir)[:steps]  # run.steps changes no earlier step
    n_train = [b["n_train"] for b in dyn]
    assert 1 in n_train and 3 in n_train and {b["n_train"] for b in st} == {2}, n_train
    for d, s in zip(dyn, st, strict=True):
        assert len(d["keys"]) == B * G and d["keys"] == s["keys"] and d["versions"] == s["versions"]
        assert d["rewards"] == s["rewards"]
        assert d["loss"] == pytest.approx(s["loss"], rel=1e-3, abs=1e-5)
        # per-sample lengths (the what-if's trace), in the order of keys: the same samples have the same lengths
        assert len(d["response_tokens"]) == len(d["prompt_tokens"]) == B * G
        assert d["response_tokens"] == s["response_tokens"] and d["prompt_tokens"] == s["prompt_tokens"]
    ends = {e["step"]: e for e in map(json.loads, (dyn_dir / "events.jsonl").read_text().splitlines()) if e["type"] == "step_end"}
    st_ends = {e["step"]: e for e in map(json.loads, (st_dir / "events.jsonl").read_text().splitlines()) if e["type"] == "step_end"}
    counts = ("groups_generated", "groups_dropped", "groups_kept", "groups_filler", "rounds")
    assert [[ends[k][c] for c in counts] for k in range(steps)] == [[st_ends[k][c] for c in counts] for k in range(steps)]
    assert any(ends[k]["groups_dropped"] > 0 and ends[k]["rounds"] > 0 for k in ends), ends  # the filter did work
    for b in dyn:  # each step's trained groups: whole groups, in prompt order; groups of extra rounds among them
        prompts = [int(key.split(".")[1]) for key in b["keys"]]
        assert prompts == sorted(prompts) and all(prompts.count(p) == G for p in set(prompts))
        e = ends[b["step"]]
        assert max(prompts) < e["groups_generated"] and e["groups_kept"] + e["groups_filler"] == B
    assert any(int(key.split(".")[1]) >= B for b in dyn for key in b["keys"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dyn_dir / "tensorboard"))
    acc.Reload()
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert [s for s, _ in tb["reward/mean"]] == list(range(steps))
    assert [v for _, v in tb["reward/mean"]] == pytest.approx([sum(b["rewards"]) / len(b["rewards"]) for b in dyn], abs=1e-6)
    assert [v for _, v in tb["roles/n_train"]] == [b["n_train"] for b in dyn]
    assert all(v > 0 for _, v in tb["loss/kl"][1:])  # the KL to the reference grows once the policy moved
    assert {"dynamic_sampling/groups_dropped", "response/length_mean", "throughput/tokens_per_s", "switches/count"} <= set(tb)


def test_dynamic_sampling_resumes_without_generating_twice(tmp_path, model_cache, dapo_static):
    """SIGTERM mid-run with dynamic sampling on, then --resume: the extra rounds are replayed from the stored
    samples (nothing generated twice) and every step trains on the groups an uninterrupted run trains on."""
    steps, seed = DAPO_STEPS, DAPO_SEED
    p = run(tmp_path / "cut", model_cache, f"run.steps={steps}", f"run.seed={seed}", "policy.enabled=false", *DAPO, wait=False)
    rd = wait_for_batches(tmp_path / "cut", p)
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out[-4000:]
    run(tmp_path / "cut", model_cache, resume=rd)
    ref, cut = batches(dapo_static), batches(rd)
    assert [b["step"] for b in cut] == list(range(steps))
    assert [b["keys"] for b in cut] == [b["keys"] for b in ref]
    for d in (dapo_static, rd):
        events = [json.loads(l) for l in (d / "events.jsonl").read_text().splitlines()]
        generated = sum(e.get("samples", 0) for e in events if e["type"] == "stage" and e["stage"] == "rollout")
        planned = sum(e["groups_generated"] for e in events if e["type"] == "step_end") * G
        assert generated == planned, d  # every sample of every round generated exactly once


def test_dynamic_sampling_that_cannot_fill_a_batch_fails_clearly(tmp_path, model_cache):
    """Near-greedy sampling makes most groups' responses (and rewards) equal: with on_unfilled=fail the job stops
    at the first batch with one message saying what was found, after generating at most max_rounds extra rounds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-m", "dynaresize.cli", "run", "configs/quickstart.yaml", *BASE, f"run.output_dir={tmp_path}",
            f"model.cache_dir={model_cache}", "run.steps=2", f"run.seed={SEED}", "rollout.temperature=0.01",
            "cluster.gpus=2", "cluster.initial_train=1",  # the check is the coordinator's: two ranks start faster than four
            "algorithm.dynamic_sampling.enabled=true",
            "algorithm.dynamic_sampling.max_rounds=1", "algorithm.dynamic_sampling.on_unfilled=fail", "--quiet"]
    p = subprocess.run(argv, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    import re

    found = re.search(rf"dynaresize run: batch 0: dynamic sampling found ([0-{B - 1}]) of {B} groups with unequal rewards "
                      rf"in {2 * B} prompts \(1 extra rounds", p.stderr)
    assert found, p.stderr[-1500:]  # near-greedy: (almost) every group's responses are the same
    assert "Traceback" not in p.stderr and "on_unfilled=pad" in p.stderr
