"""A coordinator takeover of a live run on the scheduler core (``dynaresize run --resume`` while the ranks live):
the coordinator is SIGKILLed with two batches in flight (its redis-server dies with it; the ranks ride the outage
out), then ``--resume`` starts Redis again from its append-only file, replays the segment of ``schedule.jsonl``
from the ranks' stored acks, sends the commands in flight again under their ids and goes on. Checked against the
static barrier run with the same seed: the same rank processes all along (no restart), every command applied once
(each training chunk and optimizer step ran once on rank 0), no step
trained twice, the same sample keys, versions and rewards, losses within 1e-3."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from test_continuous_schedule import CONTINUOUS, STEPS, same_samples, schedule, static_run  # noqa: F401 - the fixture
from test_faults import controls, events, find_run_dir, n_batches, no_strays, pid_of, wait_for  # noqa: F401 - a fixture
from test_job import SEED, batches, run

pytestmark = pytest.mark.integration


def in_flight(run_dir: Path) -> set[int]:
    """Batches the schedule had handed work of and not yet stepped (from ``schedule.jsonl``)."""
    started, stepped = set(), set()
    for rec in schedule_lines(run_dir):
        for a in rec.get("actions", rec.get("start", [])):
            if a["type"] in ("Assign", "Train"):
                started.add(a["batch"])
        ev = rec.get("event") or {}
        if ev.get("type") == "OptimizerStepDone":
            stepped.add(ev["batch"])
    return started - stepped


def schedule_lines(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "schedule.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def train_stages(run_dir: Path, rank: int) -> Counter:
    """How many training stages (each training chunk and each optimizer step it applied) ``rank`` logged per step:
    a command answered from its stored ack runs nothing and logs nothing."""
    return Counter(e["step"] for e in events(run_dir) if e.get("type") == "stage" and e.get("stage") == "train"
                   and e.get("ranks") == str(rank))


@pytest.mark.parametrize("schedule_name", ["barrier_free", "barrier"])
def test_a_killed_coordinator_on_the_core_is_taken_over_without_restarting_a_rank(tmp_path, model_cache, static_run,
                                                                                   schedule_name):
    from dynaresize.job.core_io import replay_log

    extra = CONTINUOUS if schedule_name == "barrier_free" else ["pipeline.schedule=barrier", "task.dataset.val_every=0",
                                                                "pipeline.groups_per_command=1"]
    a = run(tmp_path, model_cache, f"run.steps={STEPS}", f"run.seed={SEED}", "policy.forced_splits={2: 1, 4: 3}",
            *extra, "run.checkpoint_every=0", wait=False)
    rd = wait_for(lambda: find_run_dir(tmp_path), "the ranks to start", a)

    def paused_with_two_in_flight() -> bool:
        """The coordinator's session paused (SIGSTOP) with two batches in flight: the condition seen is the one it
        is killed in (it could step a batch between a check and the kill), else resumed to try again."""
        wait_for(lambda: n_batches(rd) >= 2 and len(in_flight(rd)) >= 2, "two batches in flight after step 2", a)
        os.killpg(a.pid, signal.SIGSTOP)
        if len(in_flight(rd)) >= 2:
            return True
        os.killpg(a.pid, signal.SIGCONT)
        return False

    wait_for(paused_with_two_in_flight, "the coordinator paused with two batches in flight", a)
    pids = {r: pid_of(rd, r) for r in range(4)}
    os.killpg(a.pid, signal.SIGKILL)  # the coordinator's own session (and its redis-server): the ranks live on
    a.communicate(timeout=60)
    assert len(in_flight(rd)) >= 2, in_flight(rd)
    out = run(tmp_path, model_cache, resume=rd)
    assert "Traceback" not in out
    got = batches(rd)
    same_samples(got, batches(static_run))  # every step once: no step retrained, nothing dropped
    assert {r: pid_of(rd, r) for r in range(4)} == pids, "the same rank processes finished the run"
    for r in range(4):
        assert (rd / "logs" / f"rank{r}.log").read_text(errors="replace").count(" ready: ") == 1, r
    assert len(controls(rd, "attach")) == 1 and len(controls(rd, "takeover")) == 1, controls(rd, "takeover")
    assert not controls(rd, "restart") and not controls(rd, "interrupted")
    # at most once: on rank 0 (it trains every batch) each training chunk and each optimizer step ran once
    chunks = Counter(x["batch"] for rec in schedule_lines(rd) for x in rec.get("actions", rec.get("start", []))
                     if x["type"] == "Train")
    assert train_stages(rd, 0) == Counter({k: chunks[k] + 1 for k in range(STEPS)})
    for what, logged, again in replay_log(rd):
        assert logged == again, f"replaying {what}: {logged} != {again}"
