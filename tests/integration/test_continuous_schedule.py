"""The continuous schedule end to end (``pipeline.schedule: continuous``): real Redis, 4 worker processes, DeepSpeed
on CPU, GRPO, the scheduler core driving the coordinator.

- RL semantics: with the same seed, a continuous run (continuous rollout, streaming training, one resize each way)
  and a static barrier run (``pipeline.schedule: barrier``, policy off) train on the same samples, from the same
  policy versions, with the same rewards and losses within 1e-3; and the continuous run really had no barrier (a batch's generation
  started before the previous batch was complete, training started before its batch was complete).
- Replay: the run's ``schedule.jsonl`` fed to a fresh core gives the same actions.
- Faults: a rollout rank lost while two batches are in flight and a weight version is on its way to it (its
  groups go to the others; nothing is lost or generated twice); a trainer lost (every rank restarts from the
  continuous run's checkpoint and the run finishes with the static run's samples).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from tests.integration.test_job import SEED, batches, run, run_dir_of

pytestmark = pytest.mark.integration

STEPS = 6
# one group per command and per chunk: the most events, and batches of 4 groups overlap and stream
CONTINUOUS = ["pipeline.schedule=continuous", "task.dataset.val_every=0", "pipeline.groups_per_command=1",
              "pipeline.stream_min_groups=1"]


@pytest.fixture(scope="module")
def static_run(tmp_path_factory, model_cache) -> Path:
    parent = tmp_path_factory.mktemp("static")
    # the static barrier run: the baseline every schedule's RL semantics are compared against
    run(parent, model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", "task.dataset.val_every=0",
        "pipeline.schedule=barrier")
    return run_dir_of(parent)


def same_samples(got: list[dict], want: list[dict], loss_rel: float = 1e-3) -> None:
    assert [b["step"] for b in got] == [b["step"] for b in want] == list(range(STEPS))
    for g, w in zip(got, want):
        k = g["step"]
        assert g["keys"] == w["keys"], f"step {k}: other samples"
        assert g["versions"] == w["versions"], f"step {k}: another sample-to-version map"
        assert set(g["versions"]) == {max(0, k - 1)}, f"step {k}: versions {set(g['versions'])}"
        assert g["rewards"] == w["rewards"]
        assert len(g["response_tokens"]) == len(g["keys"]), f"step {k}: per-sample lengths (the what-if's trace)"
        assert (g["response_tokens"], g["prompt_tokens"]) == (w["response_tokens"], w["prompt_tokens"]), f"step {k}"
        assert g["loss"] == pytest.approx(w["loss"], rel=loss_rel, abs=1e-5), f"step {k}"


def schedule(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "schedule.jsonl").read_text().splitlines()]


def test_continuous_schedule_keeps_rl_semantics_and_replays(tmp_path, model_cache, static_run):
    from dynaresize.job.core_io import replay_log

    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.forced_splits={2: 1, 4: 3}", f"run.seed={SEED}",
        "policy.predictor=pipeline", *CONTINUOUS)
    rd = run_dir_of(tmp_path)
    got = batches(rd)
    same_samples(got, batches(static_run))
    n_train = [b["n_train"] for b in got]
    assert 1 in n_train and 3 in n_train, n_train  # one resize each way: 2 -> 1 -> 3
    summary = json.loads((rd / "summary.json").read_text())
    assert [s["from"] + ">" + s["to"] for s in summary["switches"]] == ["2:2>1:3", "1:3>3:1"]

    # no barrier: batch j+1's first group was assigned before batch j's last group was done, and a training chunk
    # of batch k started before batch k was complete
    recs = schedule(rd)
    done: dict[int, int] = {}
    overlap = early_train = False
    for rec in recs:
        ev = rec.get("event") or {}
        if ev.get("type") == "GroupsDone":
            done[ev["batch"]] = done.get(ev["batch"], 0) + len(ev["groups"])
        for a in rec.get("actions", rec.get("start", [])):
            if a["type"] == "Assign" and a["batch"] >= 1 and done.get(a["batch"] - 1, 0) < 4:
                overlap = True
            if a["type"] == "Train" and done.get(a["batch"], 0) < 4:
                early_train = True
    assert overlap, "no batch's generation overlapped the previous batch's tail"
    assert early_train, "no training chunk started before its batch was complete"
    assert sum(1 for r in recs for a in r.get("actions", []) if a["type"] == "Train") > STEPS  # streamed in chunks

    weights_over_the_communicators(rd)
    waited_for_weights_and_calibrates_as_it_ran(rd, {"continuous_rollout": True, "streaming_training": True})
    the_policy_saw_each_batch(rd, recs)

    replayed = replay_log(rd)
    assert len(replayed) > 50
    for what, logged, again in replayed:
        assert logged == again, f"replaying {what}: {logged} != {again}"


def test_the_capacity_predictors_decode_profile_runs_on_the_runtimes_batches(tmp_path, model_cache):
    """``policy.rollout_model: decode`` with the default capacity predictor: the runtime fills each step's batch for it
    (as for the pipeline predictor), the policy learns its profile from the clean steps (after the pipeline's fill,
    batches 0 and 1), and a takeover's replay of the log makes the same decisions."""
    from dynaresize.job.core_io import replay_log

    run(tmp_path, model_cache, f"run.steps={STEPS}", f"run.seed={SEED}", "policy.rollout_model=decode", *CONTINUOUS)
    rd = run_dir_of(tmp_path)
    recs = schedule(rd)
    measured = [r["event"]["observation"] for r in recs if (r.get("event") or {}).get("type") == "StepMeasured"]
    assert all(o["workload"] is not None for o in measured[1:]), measured
    reasons = [a["decision"]["reason"] for r in recs for a in r.get("actions", []) if a["type"] == "Decided"]
    assert reasons[:2] == ["no clean step measured yet"] * 2 and len(reasons) == STEPS - 1, reasons  # the fill
    est = json.loads((rd / "checkpoints" / "coordinator.json").read_text())["policy"]["estimates"]
    assert est["decode"]["groups"] == 4 and est["decode"]["tokens"] > 0 and est["rollout_ratio"] > 0, est
    for what, logged, again in replay_log(rd):
        assert logged == again, f"replaying {what}: {logged} != {again}"
    the_play_check_plays_the_runtimes_batches(rd, recs)


def the_play_check_plays_the_runtimes_batches(rd: Path, recs: list[dict]) -> None:
    """The play check (``policy.play_check``, on by default; rule 9 of the policy) plays the batches the runtime
    logged: the run's policy, fed the run's own observations, keeps their batches (``Estimates.trace``), and a move
    to either end of the splits, checked on them, is played forward (the current split, the proposed one and the
    splits near it) and either let through with a played gain or held with the check's reason; with ``noise_z=0``
    also on a single batch, whose spread is unknown (that once made ``0 x inf`` = NaN)."""
    from dataclasses import replace

    from dynaresize.config.loader import load_config
    from dynaresize.emulation.model import switch_cost_model
    from dynaresize.policy import ResizePolicy, Topology
    from dynaresize.schedule.codec import decode

    cfg = load_config(rd / "config.yaml", ["policy.noise_z=0"])
    assert cfg.policy.play_check and cfg.policy.predictor == "capacity"
    n, t0 = cfg.cluster.gpus, cfg.cluster.initial_train
    policy = ResizePolicy(cfg.policy, switch_cost_model(cfg), [Topology(t, n - t) for t in range(1, n)])
    state = policy.initial_state()
    for r in recs:
        if (r.get("event") or {}).get("type") == "StepMeasured":
            state, _ = policy.step(state, decode(r["event"]["observation"]))
    est = state.estimates
    assert est is not None and len(est.trace) >= 2
    cur = Topology(t0, n - t0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for trace in (est.trace[:1], est.trace):
            for target in (Topology(1, n - 1), Topology(n - 1, 1)):
                got = policy._check_by_play(state, replace(est, trace=trace), cur, target, 10, STEPS)
                if isinstance(got, str):
                    assert got.startswith((f"play check: {target} does not play faster than {cur}",
                                           f"play check: {target} plays faster than {cur} only on a few")), got
                else:
                    to, gain, _, now = got
                    assert to != cur and 0 < gain < now, got
    assert policy.checker.plays >= 2 * (n - 1)  # per trace: the current split and the others near the proposed one



def the_policy_saw_each_batch(rd: Path, recs: list[dict]) -> None:
    """``policy.predictor: pipeline``: each step's observation carries its batch (the pipeline predictor's workload,
    which the replay below feeds the policy again): every generated response's length, group by group, the rollout
    ranks' fitted decode model (also logged as a metric per step) and the training per trained group."""
    fits = {e["step"]: e for e in map(json.loads, (rd / "events.jsonl").read_text().splitlines())
            if e.get("name") == "rollout.iteration_s"}
    trips = {e["step"]: e for e in map(json.loads, (rd / "events.jsonl").read_text().splitlines())
             if e.get("name") == "control.round_trip_s"}
    measured = [r["event"]["observation"] for r in recs if (r.get("event") or {}).get("type") == "StepMeasured"]
    assert len(measured) == STEPS - 1
    # the control plane's latency: the round trips the ranks timed (a rank idle after its ack until the command it
    # caused arrived), their median over the batches of the decode window
    assert trips, "no rank timed a round trip"
    # step 0 may have no batch to play: its window holds batch 0's acks alone, and batches 0 and 1 share version 0,
    # so iterations of batch 0 can go with batch-1 acks and leave fewer than the fit needs (the policy then uses the
    # capacity model for that step); from step 1 on every step has one
    measured = [obs for obs in measured if obs["step"] > 0 or obs["workload"] is not None]
    assert len(measured) >= STEPS - 2
    for obs in measured:
        trip = trips.get(obs["step"])
        assert obs["workload"]["command_latency_s"] == (pytest.approx(trip["value"], abs=1e-6) if trip else 0.0)
        assert trip is None or 0 < trip["value"] < 5.0
    for obs in measured:
        wl, k = obs["workload"], obs["step"]
        assert wl is not None and wl["type"] == "PipelineWorkload", (k, wl)
        lengths = batches(rd)[k]["response_tokens"]
        assert sorted(wl["lengths"]) == sorted(float(x) for x in lengths), k  # the batch's own responses
        assert len(wl["train_s_per_group"]) * wl["group_size"] == len(wl["lengths"]) and sum(wl["train_s_per_group"]) > 0
        f = fits[k]
        assert (wl["iteration_s"], wl["seq_iteration_s"]) == pytest.approx((f["value"], f["seq_iteration_s"]), abs=1e-8)
        assert wl["seq_iteration_s"] + wl["iteration_s"] > 0 and f["iterations"] >= 8  # contract.decode.MIN_ITERATIONS
        # a response of L tokens took L iterations of its rank (each samples one token of every running sequence), all
        # counted in the acks of its batch's window: from step 1 on (batches 0 and 1 share version 0, so a rank may
        # ack a batch-1 command while a batch-0 sequence decodes, and the iterations go with that ack)
        assert k == 0 or f["iterations"] >= max(lengths), (k, f["iterations"], max(lengths))


def waited_for_weights_and_calibrates_as_it_ran(rd: Path, mechanisms: dict[str, bool]) -> None:
    """Each step from 2 on reports the time its batch's rollout ranks waited for the version it was generated with
    (``step_end.sync_s``: batches 0 and 1 are generated with version 0, which no rank waits for); and ``dynaresize
    calibrate`` of the run's log names the schedule the core ran (barrier with these mechanisms, not the retired
    lockstep loop's)."""
    from dynaresize.analysis.calibrate import write_costs
    from dynaresize.analysis.fit import fit_costs
    from dynaresize.analysis.reader import load_run

    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    sync = {e["step"]: e["sync_s"] for e in events if e.get("type") == "step_end"}
    assert sorted(sync) == list(range(STEPS)) and all(sync[k] > 0 for k in range(2, STEPS)), sync
    assert sync[0] == 0.0, sync
    fit = fit_costs(load_run(rd))
    assert fit["schedule"]["schedule"] == "barrier" and fit["schedule"]["mechanisms"] == mechanisms, fit["schedule"]
    sim = yaml.safe_load(write_costs(fit, rd / "analysis" / "costs.yaml").read_text())["sim"]
    assert sim["schedule"] == "barrier" and sim["pipeline"] == mechanisms and "step_gap_s" not in sim, sim


def weights_over_the_communicators(rd: Path) -> None:
    """The default transport (``pipeline.weights_transport: comm``): every version a rollout rank installed came
    from rank 0 point to point over the world group into a second buffer (rank 0 sent exactly what was received,
    without an error), nothing went through the run directory, and no rank created a process group after start-up."""
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    syncs = [e for e in events if e.get("stage") == "weight_sync"]
    recv = sorted((int(e["ranks"]), e["version"]) for e in syncs if e.get("background") and e.get("to") is None)
    sent = sorted((e["to"], e["version"]) for e in syncs if e.get("to") is not None)
    assert recv and all(e.get("transport") == "comm" for e in syncs if e.get("background") or e.get("publish"))
    assert set(recv) <= set(sent) and not any(e.get("error") for e in syncs), (recv, sent)
    installs = {(int(e["ranks"]), e["version"]) for e in syncs if not e.get("background") and not e.get("publish")}
    assert installs and installs <= set(recv), installs - set(recv)
    assert not (rd / "weights").exists() or not any((rd / "weights").iterdir()), "a snapshot went through the run directory"
    created = {e["rank"]: e["value"] for e in events if e.get("name") == "comm/groups_created_after_startup"}
    assert sorted(created) == [0, 1, 2, 3] and set(created.values()) == {0}, created


def test_the_file_fallback_keeps_rl_semantics(tmp_path, model_cache, static_run):
    """``pipeline.weights_transport: file``: the same barrier-free run with versions staged by rank 0 under
    ``<run_dir>/weights/v<k>`` and read by each rollout rank: the static run's samples, versions and rewards."""
    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.forced_splits={2: 1, 4: 3}", f"run.seed={SEED}", *CONTINUOUS,
        "pipeline.weights_transport=file")
    rd = run_dir_of(tmp_path)
    same_samples(batches(rd), batches(static_run))
    assert any((rd / "weights").glob("v*/manifest.json")), "no snapshot in the run directory"
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    syncs = [e for e in events if e.get("stage") == "weight_sync"]
    assert any(e.get("publish") for e in syncs) and any(e.get("background") for e in syncs)
    assert not any(e.get("transport") for e in syncs)


def test_the_barrier_schedule_on_the_core_keeps_rl_semantics_and_its_barrier(tmp_path, model_cache, static_run):
    """``pipeline.schedule: barrier``: the same core with its barrier mechanisms, the static one-step-off baseline.
    Resizing both ways, it trains the static barrier run's samples, versions and rewards; a batch's groups are
    assigned only once the previous batch is complete, training waits for the whole batch, and each version reaches
    the pool in one blocking sync over the pre-built group (no snapshot through the run directory)."""
    from dynaresize.job.core_io import replay_log

    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.forced_splits={2: 1, 4: 3}", f"run.seed={SEED}",
        "pipeline.schedule=barrier", "task.dataset.val_every=0", "pipeline.groups_per_command=1")
    rd = run_dir_of(tmp_path)
    got = batches(rd)
    same_samples(got, batches(static_run))
    n_train = [b["n_train"] for b in got]
    assert 1 in n_train and 3 in n_train, n_train
    recs = schedule(rd)
    assert recs[0]["config"]["mechanisms"]["continuous_rollout"] is False
    done: dict[int, int] = {}
    sends = 0
    for rec in recs:
        ev = rec.get("event") or {}
        if ev.get("type") == "GroupsDone":
            done[ev["batch"]] = done.get(ev["batch"], 0) + len(ev["groups"])
        for a in rec.get("actions", rec.get("start", [])):
            if a["type"] == "Assign" and a["batch"] >= 1:
                assert done.get(a["batch"] - 1, 0) == 4, f"batch {a['batch']} assigned before batch {a['batch'] - 1} was complete"
            if a["type"] == "Train":
                assert done.get(a["batch"], 0) == 4, f"batch {a['batch']} trained before it was complete"
            if a["type"] == "SendWeights":
                assert a["blocking"], a
                sends += 1
    assert sends >= STEPS - 2
    assert not (rd / "weights").exists() or not any((rd / "weights").iterdir()), "a snapshot went through the run directory"
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    syncs = [e for e in events if e.get("stage") == "weight_sync"]
    assert syncs and not any(e.get("background") or e.get("publish") for e in syncs)
    waited_for_weights_and_calibrates_as_it_ran(rd, {"continuous_rollout": False, "streaming_training": False})
    for what, logged, again in replay_log(rd):
        assert logged == again, f"replaying {what}: {logged} != {again}"


def test_a_rollout_rank_lost_with_two_batches_in_flight_and_weights_on_the_way(tmp_path, model_cache, static_run):
    # rank 3 dies as version 2 starts to reach it in the background: batch 1 is training, batch 2 generating
    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS,
        faults={"DYNARESIZE_TEST_KILL_AT": "3:fetch_weights.started@v2"})
    rd = run_dir_of(tmp_path)
    same_samples(batches(rd), batches(static_run))
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    assert any(e.get("what") == "rank_lost" and e.get("rank") == 3 for e in events)
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["status"] == "completed"


def test_the_relay_keeps_rl_semantics_and_forwards_from_rollout_ranks(tmp_path, model_cache, static_run):
    """``pipeline.weights_relay: 1`` (a chain: every version a second rollout rank asks for comes from the first):
    the static barrier run's samples, versions, rewards and losses; some versions went from a rollout rank to
    another (a relay), rank 0 sent each version at most once per fetch round, no process group was created."""
    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS,
        "pipeline.weights_relay=1")
    rd = run_dir_of(tmp_path)
    same_samples(batches(rd), batches(static_run))
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    sends = [e for e in events if e.get("stage") == "weight_sync" and e.get("to") is not None]
    relayed = [(e["ranks"], e["to"], e["version"]) for e in sends if e["ranks"] != "0"]
    assert relayed, sorted((e["ranks"], e["to"], e["version"]) for e in sends)
    assert not any(e.get("error") for e in sends)
    created = {e["rank"]: e["value"] for e in events if e.get("name") == "comm/groups_created_after_startup"}
    assert set(created.values()) == {0}, created


def test_a_relay_lost_mid_forward_its_receiver_gets_the_version_from_another_holder(tmp_path, model_cache, static_run):
    """A rollout rank dies as it is asked to forward version 2 (the one that relays it, whichever asked first): the
    coordinator plans its receiver again from another holder (rank 0), nothing is lost, the run finishes with the
    static run's samples."""
    run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS,
        "pipeline.weights_relay=1",
        faults={"DYNARESIZE_TEST_KILL_AT": "2:push_weights.relay@v2,3:push_weights.relay@v2"})
    rd = run_dir_of(tmp_path)
    same_samples(batches(rd), batches(static_run))
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    lost = [e["rank"] for e in events if e.get("what") == "rank_lost"]
    assert len(lost) == 1 and lost[0] in (2, 3), lost
    other = 5 - lost[0]
    sends = {(e["ranks"], e["to"], e["version"]) for e in events if e.get("stage") == "weight_sync" and e.get("to") is not None}
    assert (str(lost[0]), other, 2) not in sends and ("0", other, 2) in sends, sorted(sends)  # from another holder
    assert json.loads((rd / "summary.json").read_text())["status"] == "completed"


def test_a_lost_trainer_restarts_every_rank_from_the_continuous_checkpoint(tmp_path, model_cache, static_run):
    once = tmp_path / "once"
    once.mkdir()
    run(tmp_path / "run", model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS,
        "run.checkpoint_every=2", "faults.snapshot_every=0",  # the disk path (the snapshot's: the test below)
        faults={"DYNARESIZE_TEST_KILL_AT": "1:train_chunk.accumulated@step-3", "DYNARESIZE_TEST_KILL_ONCE": str(once)})
    rd = run_dir_of(tmp_path / "run")
    same_samples(batches(rd), batches(static_run))
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e.get("what") == "restart"]
    assert len(restarts) == 1 and "step 2" in restarts[0]["reason"], restarts
    assert not [e for e in events if e.get("what", "").startswith("snapshot_")]


def test_a_lost_trainer_goes_on_from_the_in_memory_snapshot_with_the_static_runs_training(tmp_path, model_cache,
                                                                                           static_run):
    """faults.snapshot_every=1 with no disk checkpoint before the end (run.checkpoint_every=50): a trainer killed in
    the middle of step 4 costs at most one step, and the run trains what the static run trains (keys, versions,
    rewards, losses within 1e-3). FAULTS row 33."""
    once = tmp_path / "once"
    once.mkdir()
    run(tmp_path / "run", model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS,
        "run.checkpoint_every=50", "faults.snapshot_every=1",
        faults={"DYNARESIZE_TEST_KILL_AT": "1:train_chunk.accumulated@step-4", "DYNARESIZE_TEST_KILL_ONCE": str(once)})
    rd = run_dir_of(tmp_path / "run")
    same_samples(batches(rd), batches(static_run))
    events = [json.loads(l) for l in (rd / "events.jsonl").read_text().splitlines()]
    used = [e for e in events if e.get("what") == "snapshot_restore"]
    assert len(used) == 1 and not [e for e in events if e.get("what") == "snapshot_unused"], used
    assert used[0]["step"] >= 3, used  # killed in step 4: at most snapshot_every (1) finished step trained again
    assert "trainer rank 1 lost at step 4: going on from the in-memory snapshot of step" in used[0]["reason"]
    assert "the last disk checkpoint was none" in used[0]["reason"]
    restarts = [e for e in events if e.get("what") == "restart"]
    assert len(restarts) == 1 and f"(step {used[0]['step']})" in restarts[0]["reason"], restarts
    rewinds = [e for e in events if e.get("what") == "rewind"]
    assert all(f"steps {used[0]['step']}.." in e["reason"] for e in rewinds), rewinds


def test_sigterm_drains_checkpoints_and_the_resume_goes_on_with_the_static_runs_samples(tmp_path, model_cache, static_run):
    """An operator's stop of a continuous run: the step in flight finishes, the coordinator drains to the state of a
    step boundary of the static run, the ranks stage it; ``--resume`` starts the core there and ends with the static run's
    samples, versions and losses, no step trained twice."""
    import os
    import signal

    from tests.integration.test_job import wait_for_batches

    p = run(tmp_path, model_cache, f"run.steps={STEPS}", "policy.enabled=false", f"run.seed={SEED}", *CONTINUOUS, wait=False)
    rd = wait_for_batches(tmp_path, p)
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 130, out[-4000:]
    state = json.loads((rd / "checkpoints" / "coordinator.json").read_text())
    assert 2 <= state["step"] == len(batches(rd)) < STEPS
    run(tmp_path, model_cache, resume=rd)
    same_samples(batches(rd), batches(static_run))
    assert json.loads((rd / "summary.json").read_text())["status"] == "completed"
    assert sum(1 for r in schedule(rd) if "config" in r) == 2  # the core started twice: at 0, then at the checkpoint
