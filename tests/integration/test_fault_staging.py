"""Fault matrix rows 6 and 7, end to end: real runs (coordinator, real Redis, 3 worker processes, DeepSpeed on
CPU, the tiny model, 4 steps, a checkpoint every 2 steps and one at the end).

- Disk full while staging: ``checkpoints/`` on a real tmpfs that holds one checkpoint but not two. The second
  checkpoint fails on the ranks with ENOSPC; the run completes anyway, the failed tag leaves nothing behind (no
  manifest, no directory), ``coordinator.json`` still names the last good checkpoint, and ``--resume`` (after
  space was freed) continues from it: every step exactly once in ``batches.jsonl``, the same step counter.
- A damaged newest checkpoint (one flipped byte in a chunk; then one truncated chunk and a damaged top-level
  ``coordinator.json``): the resume names the file and chunk in a ``checkpoint_skipped`` event, restores the
  previous intact checkpoint, trains the steps after it again (same samples, same losses: the weights and the
  optimizer state restored are the good ones), every step exactly once.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_job import SEED  # noqa: E402 - tests/integration is on sys.path (rootdir-less)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
B, G, STEPS = 4, 4, 4
BASE = [
    "run.progress=false", "cluster.gpus=3", "cluster.initial_train=2", f"rollout.prompts_per_step={B}",
    f"rollout.group_size={G}", "rollout.max_tokens=16", "model.tiny.warmstart_steps=20", f"run.steps={STEPS}",
    "run.checkpoint_every=2", "redis.heartbeat_s=2", "policy.enabled=false", f"run.seed={SEED}",
]
# A fresh run in a directory made beforehand (so its checkpoints/ can be a mount): what `dynaresize run` does after
# creating the run directory.
DRIVER = """
import json, logging, sys
from pathlib import Path
from dynaresize.config.loader import load_config
from dynaresize.job.coordinator import Coordinator
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
s = Coordinator(load_config("configs/quickstart.yaml", sys.argv[2:]), Path(sys.argv[1])).run()
print(json.dumps({"status": s["status"], "steps": s["steps"], "incomplete": s.get("incomplete")}))
sys.exit(0 if s["status"] == "completed" else 1)
"""


@pytest.fixture
def no_strays(tmp_path):
    """The processes a test started: what a failed test left running (the coordinator's process group, and the
    ranks named in ranks.json, each its own session) is killed by id before the tmpfs is unmounted (request this
    fixture after ``tmpfs``). A pid is killed only while its command line still names the test's directory."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for ranks in tmp_path.rglob("ranks.json"):
        for reg in json.loads(ranks.read_text()).values():
            pid = reg.get("pid")
            try:
                if pid and str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _run(argv: list[str], started: list, expect: int = 0) -> str:
    p = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    started.append(p)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == expect, out[-5000:]
    return out


def _driver(run_dir: Path, cache: str, *overrides: str) -> list[str]:
    return [sys.executable, "-c", DRIVER, str(run_dir), *BASE, f"model.cache_dir={cache}", *overrides]


def fresh_run(run_dir: Path, cache: str, started: list, *overrides: str, expect: int = 0) -> str:
    return _run(_driver(run_dir, cache, *overrides), started, expect)


def resume(run_dir: Path, started: list) -> str:
    return _run([sys.executable, "-m", "dynaresize.cli", "run", "--resume", str(run_dir), "--quiet"], started)


def batches(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "batches.jsonl").read_text().splitlines()]


def controls(run_dir: Path, what: str) -> list[dict]:
    evs = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in evs if e["type"] == "control" and e["what"] == what]


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / "coordinator.json").read_text())


def assert_every_step_once(run_dir: Path, steps: int = STEPS) -> list[dict]:
    got = batches(run_dir)
    assert [b["step"] for b in got] == list(range(steps))  # same counter, no step twice, none missing
    for b in got:
        assert sorted(b["keys"]) == sorted(f"{b['step']}.{p}.{i}" for p in range(B) for i in range(G))
        assert min(b["versions"]) >= b["step"] - 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    return got


def test_disk_full_while_staging_keeps_the_last_good_checkpoint(tmp_path, tmpfs, no_strays, model_cache):
    run_dir = tmp_path / "run"
    # one checkpoint of this job is ~15 MB (3 ranks' weights, 2 trainers' ZeRO partitions): 20 MiB holds one
    ck = tmpfs(run_dir / "checkpoints", 20 << 20)
    out = fresh_run(run_dir, model_cache, no_strays, "faults.disk_full_wait_s=0", expect=1)

    failed = controls(run_dir, "checkpoint_failed")
    assert failed, "the second checkpoint should not have fit"
    assert all("step-4 not written" in e["reason"] and "ENOSPC" in e["reason"] and "StagingError" in e["reason"]
               and "resume point stays checkpoints/step-2" in e["reason"] for e in failed), failed
    assert all("a full disk (" in e["reason"] and "free on its filesystem)" in e["reason"] for e in failed), failed
    assert {e["rank"] for e in failed} <= {0, 1, 2}
    assert not (ck / "step-4").exists()  # the failed tag is gone: no manifest, no partial data
    assert sorted(p.relative_to(ck).parts[0] for p in ck.rglob("manifest.json")) == ["step-2"] * 5
    assert not list(ck.rglob("*.tmp"))
    st = state(run_dir)
    assert st["checkpoint"] == "checkpoints/step-2" and st["step"] == 2
    assert [b["step"] for b in batches(run_dir)] == list(range(STEPS))  # the run went on to its end
    # ... but it is not 'completed': its final weights are not on disk, and it says what a resume does
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "incomplete", summary
    why = summary["incomplete"]
    assert why.startswith("the final checkpoint of step 4 (the run's final weights) was not written: step-4: rank "), why
    assert "ENOSPC" in why and "free on its filesystem" in why, why
    assert why.endswith("the last checkpoint is checkpoints/step-2 (step 2): a resume starts there and trains 2 "
                        "step(s) again (steps 2..3)"), why
    assert json.loads(out.strip().splitlines()[-1])["incomplete"] == why
    ends = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if '"run_end"' in l]
    assert [e["status"] for e in ends] == ["incomplete"]

    # the operator frees space; the run resumes from step 2, trains steps 2 and 3 again, checkpoints at its end
    subprocess.run(["mount", "-o", "remount,size=64m", str(ck)], check=True)
    resume(run_dir, no_strays)
    assert_every_step_once(run_dir)
    assert controls(run_dir, "rewind") and "steps 2..3" in controls(run_dir, "rewind")[-1]["reason"]
    st = state(run_dir)
    assert st["checkpoint"] == "checkpoints/step-4" and st["step"] == STEPS
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]  # keep 2


def test_a_final_checkpoint_on_a_full_disk_waits_for_space_and_the_run_completes(tmp_path, tmpfs, no_strays, model_cache):
    """The final checkpoint fails on the full disk; the coordinator waits (faults.disk_full_wait_s); the operator
    frees space (a bigger tmpfs); the checkpoint is taken again and the run completes with its final weights."""
    import time

    run_dir = tmp_path / "run"
    ck = tmpfs(run_dir / "checkpoints", 20 << 20)
    p = subprocess.Popen(_driver(run_dir, model_cache, "faults.disk_full_wait_s=300"), cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    no_strays.append(p)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None:
        if (run_dir / "events.jsonl").exists() and any("step-4 not written" in e["reason"]
                                                       for e in controls(run_dir, "checkpoint_failed")):
            break
        time.sleep(0.2)
    assert p.poll() is None, p.stdout.read()[-4000:]  # waiting for space, not ended
    time.sleep(2)
    assert p.poll() is None, p.stdout.read()[-4000:]
    subprocess.run(["mount", "-o", "remount,size=64m", str(ck)], check=True)  # the operator frees space
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-4000:]
    assert "waiting up to 300 s for space (faults.disk_full_wait_s)" in out, out[-4000:]
    assert state(run_dir)["checkpoint"] == "checkpoints/step-4"
    assert (ck / "step-4" / "coordinator.json").exists()
    assert_every_step_once(run_dir)


def test_a_checkpoint_on_a_full_disk_mid_run_is_waited_out_then_stops_the_run(tmp_path, tmpfs, no_strays, model_cache):
    """A checkpoint at a step boundary fails on the full disk (step 4 of 8; step 2's fits): it is waited out for
    faults.disk_full_wait_s, then the run stops there with one message saying why, where it stopped and what a
    resume trains again -- instead of training on for steps no checkpoint could hold (before: 26 more steps, then
    "checkpoint step-28 abandoned (a second stop signal cut it short)" with no signal sent). Space freed, the
    resume goes on from step 2 to the end."""
    run_dir = tmp_path / "run"
    ck = tmpfs(run_dir / "checkpoints", 20 << 20)
    driver = DRIVER.replace("s = Coordinator(", "from dynaresize.job.errors import JobError\ntry:\n    s = Coordinator(") \
        .replace(".run()\n", ".run()\nexcept JobError as e:\n    print(f'dynaresize run: {e}'); sys.exit(1)\n", 1)
    argv = [sys.executable, "-c", driver, str(run_dir), *BASE, f"model.cache_dir={model_cache}", "run.steps=8",
            "faults.disk_full_wait_s=2"]
    out = _run(argv, no_strays, expect=1)
    assert "waiting up to 2 s for space (faults.disk_full_wait_s)" in out, out[-4000:]
    errors = [l for l in out.splitlines() if l.startswith("dynaresize run:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert errors[0].startswith("dynaresize run: the checkpoint of step 4 failed on a full disk and no space came "
                                "back within faults.disk_full_wait_s (2 s): step-4: rank "), errors[0]
    assert "ENOSPC" in errors[0] and "free on its filesystem" in errors[0], errors[0]
    assert errors[0].endswith("the run stopped before step 4; the last checkpoint is checkpoints/step-2 (step 2): a "
                              "resume starts there and trains 2 step(s) again (steps 2..3); free space first"), errors[0]
    assert "abandoned" not in out and "signal" not in out, out[-4000:]
    assert [b["step"] for b in batches(run_dir)] == [0, 1, 2, 3]  # no step trained past the failed checkpoint
    assert not controls(run_dir, "checkpoint_abandoned") and state(run_dir)["checkpoint"] == "checkpoints/step-2"
    ends = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if '"run_end"' in l]
    assert [e["status"] for e in ends] == ["failed"]

    subprocess.run(["mount", "-o", "remount,size=64m", str(ck)], check=True)  # the operator frees space
    resume(run_dir, no_strays)
    assert_every_step_once(run_dir, 8)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, no_strays, model_cache):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fresh_run(run_dir, model_cache, no_strays)
    ck = run_dir / "checkpoints"
    first = batches(run_dir)
    assert state(run_dir)["checkpoint"] == "checkpoints/step-4"

    # 1) one flipped byte in a chunk of rank 1's weights of the newest checkpoint
    bad = ck / "step-4" / "rank1-weights" / "data.bin"
    _flip_byte(bad, 1000)
    resume(run_dir, no_strays)
    skipped = controls(run_dir, "checkpoint_skipped")
    assert len(skipped) == 1 and f"{bad}: chunk 0 (offset 0" in skipped[0]["reason"], skipped
    assert "checksum" in skipped[0]["reason"] and "resuming from step-2" in skipped[0]["reason"]
    assert "set aside as checkpoints/damaged/step-4.1" in skipped[0]["reason"]
    assert "from step 2" in controls(run_dir, "resume")[-1]["reason"]
    assert "steps 2..3" in controls(run_dir, "rewind")[-1]["reason"]
    again = assert_every_step_once(run_dir)
    for a, b in zip(first, again):  # same samples; the same losses: step 3's needs step 2's optimizer state
        assert a["keys"] == b["keys"] and a["versions"] == b["versions"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5), (a["step"], a["loss"], b["loss"])
    assert (ck / "damaged" / "step-4.1" / "rank1-weights" / "data.bin").exists()  # kept for inspection
    assert state(run_dir)["checkpoint"] == "checkpoints/step-4"  # written anew at the end of the resumed run

    # 2) a truncated chunk of rank 0's optimizer state, and the top-level coordinator.json damaged too
    bad = ck / "step-4" / "rank0-optim" / "data.bin"
    os.truncate(bad, bad.stat().st_size // 2)
    (ck / "coordinator.json").write_text('{"state_version": 1, "st')
    resume(run_dir, no_strays)
    skipped = controls(run_dir, "checkpoint_skipped")[1:]
    reasons = " | ".join(e["reason"] for e in skipped)
    assert len(skipped) == 2, reasons
    assert f"{ck / 'coordinator.json'}: not valid JSON" in reasons and "using the copy in checkpoints/step-2" in reasons
    assert f"{bad}: " in reasons and "truncated" in reasons and "chunk " in reasons
    assert "from step 2" in controls(run_dir, "resume")[-1]["reason"]
    assert_every_step_once(run_dir)
    assert state(run_dir)["checkpoint"] == "checkpoints/step-4"
    assert sorted(p.name for p in (ck / "damaged").iterdir()) == ["step-4.1", "step-4.2"]


@pytest.mark.parametrize("schedule", ["barrier", "continuous"])
def test_redis_on_a_full_disk_is_waited_out_and_the_run_completes(tmp_path, tmpfs, no_strays, model_cache, schedule):
    """The run's redis/ directory on a real 16 MiB tmpfs, filled by a file after step 1: redis-server exits on its
    failed append-only-file write; the watchdog names the full disk and waits (redis.write_wait_s) instead of
    dying; the coordinator and the ranks wait for it; 5 s later the operator frees the space, Redis comes back
    from its append-only file, and the run completes with every step once."""
    import time

    from dynaresize.disk import free_bytes

    run_dir = tmp_path / "run"
    rd = tmpfs(run_dir / "redis", 16 << 20)
    extra = ["pipeline.schedule=continuous", "task.dataset.val_every=0"] if schedule == "continuous" else ["pipeline.schedule=barrier"]
    # twice the steps of the other cases: after step 1 the run must still need Redis when the disk is full (with 4,
    # a loaded machine once finished the run while the filler was being written)
    steps = 2 * STEPS
    p = subprocess.Popen(_driver(run_dir, model_cache, "redis.write_wait_s=120", f"run.steps={steps}", *extra), cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    no_strays.append(p)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None:
        if (run_dir / "batches.jsonl").exists() and len(batches(run_dir)) >= 1:
            break
        time.sleep(0.1)
    assert p.poll() is None, p.stdout.read()[-4000:]
    filler = rd / "filler"
    with open(filler, "wb", buffering=0) as f:  # leave ~32 KiB: the next writes of the append-only file fail
        try:
            f.write(b"\0" * max(0, (free_bytes(rd) or 0) - (32 << 10)))
        except OSError as e:  # Redis appended meanwhile and the write filled the disk (the flake of 2026-12-04)
            if e.errno != errno.ENOSPC:
                raise
    short = (32 << 10) - (free_bytes(rd) or 0)
    if short > 0:  # give back what Redis took meanwhile: ~32 KiB stay free, as intended
        os.truncate(filler, max(0, filler.stat().st_size - short))
    log = rd / "redis.log"
    while time.monotonic() < deadline and p.poll() is None:
        if log.exists() and "Short write while writing to the AOF file" in log.read_text(errors="replace"):
            break
        time.sleep(0.1)
    time.sleep(5)  # the disk stays full a while
    assert p.poll() is None, p.stdout.read()[-4000:]
    filler.unlink()  # the operator frees space
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-5000:]
    assert "disk full (ENOSPC)" in out and "waiting for space to start it again" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert controls(run_dir, "redis_restarted"), "the watchdog brought Redis back"
    assert not controls(run_dir, "restart") and not controls(run_dir, "rank_lost"), "nobody lost: Redis was down"
    assert_every_step_once(run_dir, steps)
