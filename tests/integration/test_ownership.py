"""Who owns a run (issue 27): real jobs (coordinator, real redis-server, worker processes, DeepSpeed on CPU).

- Two jobs with the same ``run.name``, in two output directories, run directories of the same name (made in the
  same second), on ONE external redis-server: each has its own job id, so its own keys, ranks and epochs; both
  complete and train exactly what a job alone trains (same seed: the same samples, rewards and losses as each
  other). Before, both got the same job id, the first was fenced and the second trained on the first's ranks.
- A second ``--resume`` while the first coordinator is still starting its ranks: the first says who owns the run
  (exit 3), never "resume with", and leaves the run's Redis alone.
- A second coordinator (``--resume``) that restarts the ranks, on both schedules: the first hangs (SIGSTOP), the
  second takes the run over (its ranks restart from the checkpoint), the first comes back and finds its ranks
  gone: it restarts nothing, takes no epoch, says who took over, exits 3; the second completes with every step
  once. (A takeover of the live ranks: ``test_faults.py::test_a_new_coordinator_takes_over_...`` and
  ``test_takeover_core.py``.)
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

from test_faults import assert_nothing_lost, controls, events, find_run_dir, n_batches, wait_for  # noqa: E402
from test_job import BASE, SEED, batches, run  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# A run directory made beforehand with a fixed creation time, so that two parents hold run directories of the same
# name (what two `dynaresize run` of one run.name started in the same second get); then what `dynaresize run` does.
DRIVER = """
import json, logging, sys
from pathlib import Path
from dynaresize.config.loader import load_config
from dynaresize.job.coordinator import Coordinator
from dynaresize.rundir import create_run_dir
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
run_dir = create_run_dir(sys.argv[1], "same", now=0)
s = Coordinator(load_config("configs/quickstart.yaml", sys.argv[2:]), run_dir).run()
print(json.dumps({"status": s["status"], "steps": s["steps"], "run_dir": str(run_dir)}))
sys.exit(0 if s["status"] == "completed" else 1)
"""


@pytest.fixture(autouse=True)
def no_strays(tmp_path):
    yield
    subprocess.run(["pkill", "-CONT", "-f", str(tmp_path)], check=False)
    subprocess.run(["pkill", "-KILL", "-f", str(tmp_path)], check=False)


def test_two_jobs_of_one_name_on_one_redis_keep_their_keys_ranks_and_epochs_apart(tmp_path, model_cache, redis_server):
    from dynaresize.control.server import connect
    from dynaresize.rundir import job_id

    ep = redis_server.endpoint
    url = f"redis://:{ep.password()}@{ep.host}:{ep.port}/0"
    steps = 3
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    procs = []
    for name in ("a", "b"):
        argv = [sys.executable, "-c", DRIVER, str(tmp_path / name), *BASE, "cluster.gpus=3", f"run.steps={steps}",
                f"run.seed={SEED}", "policy.enabled=false", f"model.cache_dir={model_cache}", f"redis.url={url}",
                "run.name=same"]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    dirs = [Path(json.loads(out.strip().splitlines()[-1])["run_dir"]) for out in outs]
    assert dirs[0].name == dirs[1].name and dirs[0] != dirs[1]  # the colliding case
    ids = [job_id(d) for d in dirs]
    assert ids[0] != ids[1] and all(i.startswith(dirs[0].name) for i in ids)
    got = [assert_nothing_lost(d, steps) for d in dirs]
    for a, b in zip(*got):  # the same seed alone twice: the same training (shared ranks gave other rewards)
        assert (a["keys"], a["versions"], a["rewards"]) == (b["keys"], b["versions"], b["rewards"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
    for d, i in zip(dirs, ids):
        assert not controls(d, "fenced") and not controls(d, "refused")
        start = [e for e in events(d) if e.get("type") == "run_start"][0]
        assert start["job_id"] == i
        ranks = json.loads((d / "ranks.json").read_text())
        assert {reg["job_id"] for reg in ranks.values()} == {i}  # its own rank processes
        assert list((d / "checkpoints").glob(f"step-{steps}"))  # its own final checkpoint
    r = connect(url, role="test")
    try:
        for i in ids:  # each job's own epoch, taken once (a fresh start)
            assert int(r.get(f"dr:{i}:epoch")) == 1
    finally:
        r.close()


@pytest.mark.parametrize("schedule", ["barrier", "continuous"])
def test_a_second_coordinator_that_restarts_the_ranks_fences_the_first_for_good(tmp_path, model_cache, schedule):
    """The second coordinator restarts the ranks (on the barrier schedule the resume goes through the test-side
    entry, whose own launcher never attaches), so the first one, continued, has
    its ranks dead under it. Whichever it meets first (its next send, or the lost ranks and so its automatic
    restart or a shrink) it must leave the run alone: no restart, no epoch, no rank fenced, and it says who took
    over. Which path a run takes is timing; each is proved on its own by ``tests/contract/test_commands.py``
    (``test_the_automatic_restart_of_a_fenced_coordinator_...``, ``test_a_fenced_coordinator_fences_no_rank_...``)."""
    steps = 8
    sched = ["pipeline.schedule=continuous", "task.dataset.val_every=0"] if schedule == "continuous" else ["pipeline.schedule=barrier"]
    a = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false",
            "run.checkpoint_every=2", *sched, wait=False)
    rd = wait_for(lambda: find_run_dir(tmp_path), "the ranks to start", a)
    wait_for(lambda: n_batches(rd) >= 3, "step 3", a)
    os.kill(a.pid, signal.SIGSTOP)  # the first coordinator hangs; its ranks and Redis live on
    try:
        b = run(tmp_path, model_cache, resume=rd, wait=False, faults={} if schedule == "barrier" else None)
        wait_for(lambda: len(controls(rd, "resume")) >= 1 and n_batches(rd) >= 5, "the second coordinator to train", b)
    finally:
        os.kill(a.pid, signal.SIGCONT)  # the first comes back: its ranks were replaced by the second's
    out_a, _ = a.communicate(timeout=300)
    assert a.returncode == 3, out_a[-3000:]
    assert "took this run over with `dynaresize run --resume`" in out_a, out_a[-3000:]
    assert "Traceback" not in out_a
    out_b, _ = b.communicate(timeout=900)
    assert b.returncode == 0, out_b[-4000:]
    assert_nothing_lost(rd, steps)
    assert not controls(rd, "restart"), "the fenced coordinator restarted no rank and took no epoch"
    assert not controls(rd, "rank_lost") and not controls(rd, "shrink"), "nor fenced a rank of the second one's"
    ends = [e for e in events(rd) if e.get("type") == "run_end"]
    assert len(ends) == 1 and ends[0]["status"] == "completed"


@pytest.mark.parametrize("wakes", ["once_its_ranks_are_refused", "after_the_second_finished"])
def test_a_second_resume_while_the_first_coordinator_starts_leaves_the_run_to_the_second(tmp_path, model_cache, wakes):
    """The first coordinator hangs (SIGSTOP) while its ranks start; a second ``--resume`` takes the run over and
    starts a newer launch, so the first one's ranks are refused ("it belongs to launch 1") and exit. The first, once
    it goes on, must say that another coordinator owns the run (exit 3) -- not that a rank failed, not "resume
    with" -- and neither shut the run's Redis down nor send anything to its ranks. When it wakes only after the
    second finished the run (and shut the Redis it adopted down), it must not bring that Redis back as if it crashed."""
    steps = 3
    a = run(tmp_path, model_cache, f"run.steps={steps}", f"run.seed={SEED}", "policy.enabled=false", wait=False)

    def starting():
        dirs = [d for d in tmp_path.iterdir() if d.is_dir()] if tmp_path.exists() else []
        return dirs[0] if dirs and (dirs[0] / "launch.json").exists() else None

    rd = wait_for(starting, "the first coordinator to start its ranks", a, timeout=600)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        assert not (rd / "ranks.json").exists(), "the ranks were up before the first coordinator hung"
        b = run(tmp_path, model_cache, resume=rd, wait=False)

        def refused_all() -> bool:  # every rank process of launch 1 was refused (the second began launch 2) and left
            logs = [rd / "logs" / f"rank{r}.log" for r in range(4)]
            return all(f.exists() and "dynaresize worker:" in f.read_text(errors="replace") for f in logs)

        # every launch-1 rank was refused, or the second coordinator finished the run first (under load the first
        # may have been stopped before it forked all its ranks: those never start, and the run does not wait for them)
        deadline = time.monotonic() + 600
        woken = (lambda: b.poll() is not None) if wakes == "after_the_second_finished" else refused_all
        while not (woken() or b.poll() is not None) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert woken() or b.poll() is not None, "neither were the first coordinator's ranks refused nor did the run end"
        # the first goes on now, typically before the second one's ranks are up: it finds its own ranks dead
    finally:
        os.kill(a.pid, signal.SIGCONT)
    out_a, _ = a.communicate(timeout=300)
    assert a.returncode == 3, out_a[-3000:]
    assert "took this run over with `dynaresize run --resume`" in out_a, out_a[-3000:]
    assert "that coordinator owns the run now" in out_a and "could not shut the ranks down" not in out_a, out_a[-3000:]
    assert "resume with" not in out_a and "exited with code" not in out_a and "Traceback" not in out_a, out_a[-3000:]
    out_b, _ = b.communicate(timeout=900)
    assert b.returncode == 0, out_b[-4000:]
    assert_nothing_lost(rd, steps)
    # the run's Redis was not shut down by the fenced one; the server it started ends with its process (parent-death
    # signal) and the owner's watchdog starts it again from its append-only file: every step above, once
    ends = [e for e in events(rd) if e.get("type") == "run_end"]
    assert [e["status"] for e in ends] == ["completed"], "the fenced coordinator logged no end of the run"
    if wakes == "after_the_second_finished":  # the owner shut its Redis down at the end: a stop, never restarted
        assert not controls(rd, "redis_restarted") and "redis-server" not in out_a, out_a[-3000:]
