"""Checkpoint files of a run (dynaresize.job.checkpoint_files): verify, choose the resume point, discard, retain.

Checkpoints here are staged with the real Stager, as the worker ranks stage them (weights on every rank, ZeRO
partitions on the trainers, the coordinator's state written last), then damaged on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dynaresize.job import checkpoint_files as C
from dynaresize.job.state import JobState, StateError, save_state
from dynaresize.staging import Stager

pytestmark = pytest.mark.unit

WORLD, N_TRAIN = 3, 1
CHUNK = 4096


def _write(run_dir: Path, step: int, complete: bool = True, top: bool = True, version: int | None = None) -> str:
    """Checkpoint ``step-<step>`` as the coordinator writes it: every rank stages, then the tag's state, then the
    top-level state."""
    tag = f"step-{step}"
    st = Stager(run_dir / "checkpoints" / tag, buffer_mb=1, chunk_mb=1)
    st.chunk = CHUNK
    g = torch.Generator().manual_seed(step)
    v = step if version is None else version
    for r in range(WORLD):
        meta = {"rank": r, "version": v, "n_train": N_TRAIN}
        st.stage(f"rank{r}-weights", {"w": torch.randn(3000, generator=g)}, meta)
        if r < N_TRAIN:
            st.stage(f"rank{r}-optim", {"g0.master": torch.randn(3000, generator=g)}, {**meta, "partitions": []})
    if complete:
        state = JobState(step=step, version=step, n_train=N_TRAIN, checkpoint=f"checkpoints/{tag}", samples=16 * step)
        C.save_tag_state(run_dir, tag, state)
        if top:
            save_state(run_dir, state)
    return tag


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_intact_checkpoint_verifies_and_each_kind_of_damage_is_named(tmp_path):
    tag = _write(tmp_path, 2)
    ck = tmp_path / "checkpoints" / tag
    assert C.verify(tmp_path, tag, WORLD) == []
    assert json.loads((ck / "coordinator.json").read_text())["checkpoint"] == "checkpoints/step-2"

    _flip(ck / "rank1-weights" / "data.bin", CHUNK + 5)  # chunk 1 of rank 1's weights
    os.truncate(ck / "rank0-optim" / "data.bin", 2 * CHUNK + 10)  # chunk 2 of rank 0's optimizer state cut
    probs = C.verify(tmp_path, tag, WORLD)
    assert len(probs) == 2, probs
    assert f"{ck / 'rank0-optim' / 'data.bin'}: chunk 2 " in probs[0] and "truncated" in probs[0]  # rank order
    assert f"{ck / 'rank1-weights' / 'data.bin'}: chunk 1 " in probs[1] and "checksum" in probs[1]

    tag4 = _write(tmp_path, 4)
    ck4 = tmp_path / "checkpoints" / tag4
    (ck4 / "rank2-weights" / "manifest.json").unlink()
    (ck4 / "coordinator.json").write_text('{"state_version": 1, "step": 4,')  # cut mid-write (by hand)
    probs = C.verify(tmp_path, tag4, WORLD)
    assert any(p.startswith(f"{ck4 / 'coordinator.json'}: not valid JSON") for p in probs), probs
    assert any(f"{ck4 / 'rank2-weights' / 'manifest.json'}: no manifest" in p for p in probs), probs
    assert C.verify(tmp_path, tag4, WORLD + 1)[-1].startswith(f"{ck4 / 'rank3-weights'}")  # a rank never staged

    tag6 = _write(tmp_path, 6, complete=False)  # the ranks staged, the coordinator never wrote the state
    assert C.verify(tmp_path, tag6, WORLD) == [f"{tmp_path / 'checkpoints' / tag6 / 'coordinator.json'}: missing "
                                               "(the checkpoint never completed)"]
    # a rank declared lost before the checkpoint staged nothing: not looked for
    import shutil

    tag12 = _write(tmp_path, 12)
    shutil.rmtree(tmp_path / "checkpoints" / tag12 / "rank2-weights")
    assert C.verify(tmp_path, tag12, WORLD)[0].startswith(f"{tmp_path / 'checkpoints' / tag12 / 'rank2-weights'}")
    st12 = json.loads((tmp_path / "checkpoints" / tag12 / "coordinator.json").read_text())
    (tmp_path / "checkpoints" / tag12 / "coordinator.json").write_text(json.dumps({**st12, "lost": [2]}))
    assert C.verify(tmp_path, tag12, WORLD) == []
    tag8 = _write(tmp_path, 8, version=7)  # the ranks hold other weights than the state says
    assert any("weights of policy version 7, the state says 8" in p for p in C.verify(tmp_path, tag8, WORLD))
    assert C.verify(tmp_path, "step-10", WORLD) == [f"{tmp_path / 'checkpoints' / 'step-10'}: checkpoint directory missing"]


def test_resume_takes_the_newest_intact_checkpoint_and_says_what_it_skipped(tmp_path):
    assert C.select_resume(tmp_path, WORLD) is None  # never checkpointed
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    res = C.select_resume(tmp_path, WORLD)
    assert (res.tag, res.state.step, res.skipped, res.state_file_problem) == ("step-4", 4, [], None)

    bad = tmp_path / "checkpoints" / "step-4" / "rank0-optim" / "data.bin"
    _flip(bad, 10)
    res = C.select_resume(tmp_path, WORLD)
    assert res.tag == "step-2" and res.state.step == 2 and res.state.checkpoint == "checkpoints/step-2"
    assert [t for t, _ in res.skipped] == ["step-4"] and f"{bad}: chunk 0 " in res.skipped[0][1]

    _write(tmp_path, 6, complete=False)  # a checkpoint cut short after the ranks staged
    res = C.select_resume(tmp_path, WORLD)
    assert res.tag == "step-2" and [t for t, _ in res.skipped] == ["step-6", "step-4"]
    assert "never completed" in res.skipped[0][1]


def test_a_damaged_top_level_state_falls_back_to_the_tags_own_copies(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    top = tmp_path / "checkpoints" / "coordinator.json"
    top.write_bytes(top.read_bytes()[:40])  # truncated
    res = C.select_resume(tmp_path, WORLD)
    assert res.tag == "step-4" and res.state.step == 4 and res.state.samples == 64
    assert res.state_file_problem.startswith(f"{top}: not valid JSON")

    # the top-level state names a checkpoint that is gone: the newest one there is used, and the gap is reported
    save_state(tmp_path, JobState(step=9, checkpoint="checkpoints/step-9"))
    res = C.select_resume(tmp_path, WORLD)
    assert res.tag == "step-4" and res.skipped == [("step-9", f"{top} names checkpoints/step-9, which does not exist")]


def test_no_intact_checkpoint_is_one_clear_error_and_nothing_is_deleted(tmp_path):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    ck = tmp_path / "checkpoints"
    _flip(ck / "step-2" / "rank2-weights" / "data.bin", 3)
    os.truncate(ck / "step-4" / "rank1-weights" / "data.bin", 100)
    (ck / "coordinator.json").write_text("garbage")
    before = _tree(ck)
    with pytest.raises(StateError) as ei:
        C.select_resume(tmp_path, WORLD)
    msg = str(ei.value)
    assert "step-4: " in msg and f"{ck / 'step-4' / 'rank1-weights' / 'data.bin'}: chunk 0 " in msg
    assert "step-2: " in msg and f"{ck / 'step-2' / 'rank2-weights' / 'data.bin'}: chunk 0 " in msg
    assert f"{ck / 'coordinator.json'}: not valid JSON" in msg and "Nothing was deleted" in msg
    assert _tree(ck) == before
    # the top-level state damaged and no tag directory at all: the same kind of error
    for t in ("step-2", "step-4"):
        C.discard(tmp_path, t)
    with pytest.raises(StateError, match="no checkpoint directory to fall back to. Nothing was deleted"):
        C.select_resume(tmp_path, WORLD)


def test_a_run_directory_of_the_older_layout_still_resumes(tmp_path):
    """Tags without their own coordinator.json: the one the top-level state names is used with that state."""
    _write(tmp_path, 2, complete=False)
    save_state(tmp_path, JobState(step=2, version=2, n_train=N_TRAIN, checkpoint="checkpoints/step-2"))
    res = C.select_resume(tmp_path, WORLD)
    assert res.tag == "step-2" and res.state.step == 2 and res.skipped == []
    assert C.retain(tmp_path, 1) == []  # and it counts as complete: the only one is kept


def test_discard_and_set_aside(tmp_path):
    _write(tmp_path, 2)
    assert C.discard(tmp_path, "step-2") and not (tmp_path / "checkpoints" / "step-2").exists()
    assert not C.discard(tmp_path, "step-2")
    for bad in ("../x", "coordinator.json", "step-2/../../x", ""):
        with pytest.raises(ValueError, match="not a checkpoint tag"):
            C.discard(tmp_path, bad)
    _write(tmp_path, 4)
    first = C.set_aside(tmp_path, "step-4")
    _write(tmp_path, 4)
    second = C.set_aside(tmp_path, "step-4")
    assert (first.name, second.name) == ("step-4.1", "step-4.2") and first.parent.name == "damaged"
    assert (second / "rank0-weights" / "manifest.json").exists() and C.tags(tmp_path) == []


def test_retain_keeps_the_newest_complete_checkpoints(tmp_path):
    for k in (2, 4, 6):
        _write(tmp_path, k)
    _write(tmp_path, 3, complete=False)  # a failed one, older than the resume point
    _write(tmp_path, 8, complete=False)  # newer than the resume point: being written, never touched
    with pytest.raises(ValueError, match="keep=0"):
        C.retain(tmp_path, 0)
    assert C.retain(tmp_path, 2) == ["step-3", "step-2"]
    assert C.tags(tmp_path) == ["step-8", "step-6", "step-4"]
    assert C.retain(tmp_path, 1, current="step-6") == ["step-4"]
    assert C.tags(tmp_path) == ["step-8", "step-6"]

    # the only complete checkpoint is never removed, whatever is newer
    only = tmp_path / "only"
    _write(only, 2)
    _write(only, 4, complete=False)
    assert C.retain(only, 1) == [] and C.tags(only) == ["step-4", "step-2"]
    # nothing complete: nothing removed
    none = tmp_path / "none"
    _write(none, 2, complete=False)
    assert C.retain(none, 1) == [] and C.tags(none) == ["step-2"]


def test_tag_state_on_a_full_disk_fails_cleanly(tmp_path, tmpfs):
    run = tmpfs(tmp_path / "run", 256 << 10)
    _write(run, 2)
    ck = run / "checkpoints"
    with open(ck / "filler", "wb", buffering=0) as f:  # fill what is left
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == 28
    big = JobState(step=2, version=2, n_train=N_TRAIN, checkpoint="checkpoints/step-2",
                   rewards={str(i): 0.5 for i in range(5000)})  # more than a page
    before = (ck / "step-2" / "coordinator.json").read_bytes()
    with pytest.raises(OSError) as ei:
        C.save_tag_state(run, "step-2", big)
    assert ei.value.errno == 28  # ENOSPC
    assert (ck / "step-2" / "coordinator.json").read_bytes() == before  # the old file untouched
    assert not list((ck / "step-2").glob("*.tmp"))  # and no temp file left taking space
    with pytest.raises(OSError):
        save_state(run, big)
    assert not list(ck.glob("*.tmp"))
    assert C.select_resume(run, WORLD).tag == "step-2"


def test_keep_checkpoints_is_validated():
    from dynaresize.config.loader import ConfigError, load_config

    root = Path(__file__).resolve().parents[2]
    assert load_config(root / "configs" / "quickstart.yaml", []).run.keep_checkpoints == 2
    with pytest.raises(ConfigError, match="keep_checkpoints"):
        load_config(root / "configs" / "quickstart.yaml", ["run.keep_checkpoints=0"])


def test_resume_with_no_intact_checkpoint_is_refused_by_the_command(tmp_path, capsys):
    """`dynaresize run --resume` says what is damaged and stops before starting anything (exit 1)."""
    from dynaresize.cli import main
    from dynaresize.config.loader import load_config, write_resolved
    from dynaresize.rundir import write_marker

    root = Path(__file__).resolve().parents[2]
    write_resolved(load_config(root / "configs" / "quickstart.yaml", [f"cluster.gpus={WORLD}", "cluster.initial_train=1"]),
                   tmp_path)
    write_marker(tmp_path)
    _write(tmp_path, 2)
    bad = tmp_path / "checkpoints" / "step-2" / "rank0-weights" / "data.bin"
    _flip(bad, 7)
    before = _tree(tmp_path)
    assert main(["run", "--resume", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"--resume {tmp_path}: no intact checkpoint" in err and f"{bad}: chunk 0 " in err and "Nothing was deleted" in err
    assert _tree(tmp_path) == before  # not even the incarnation counter moved


def test_claim_tag_never_reuses_a_directory_and_names_its_owner(tmp_path):
    assert C.claim_tag(tmp_path, 4, {"epoch": 7}) == "step-4"
    (tmp_path / "checkpoints" / "step-4" / "rank0-weights").mkdir()  # someone is writing into it
    assert C.claim_tag(tmp_path, 4, {"epoch": 8}) == "step-4.2"
    assert C.claim_tag(tmp_path, 4, {"epoch": 8}) == "step-4.3"
    assert (tmp_path / "checkpoints" / "step-4" / "rank0-weights").is_dir(), "the first attempt is left alone"
    owner = json.loads((tmp_path / "checkpoints" / "step-4.2" / C.OWNER_FILE).read_text())
    assert owner["epoch"] == 8 and owner["pid"] == os.getpid()
    assert C.tags(tmp_path) == ["step-4.3", "step-4.2", "step-4"]
    assert C.tag_step("step-4.3") == 4
    for bad in ("step-4.1", "step-4.0", "step-4.x", "step-4.2.1"):
        with pytest.raises(ValueError, match="not a checkpoint tag"):
            C.tag_step(bad)


def _owned_by(run_dir: Path, tag: str, pid: int, host: str | None = None) -> None:
    import socket

    (run_dir / "checkpoints" / tag / C.OWNER_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "epoch": 3}))


def test_an_incomplete_checkpoint_whose_writer_lives_is_left_alone(tmp_path):
    """A coordinator taken over (hung, alive) may still write its checkpoint: retain does not remove it and
    live_writer names it; once that process is gone (or for an older tag without an owner) it is removable."""
    import subprocess
    import sys

    for k in (2, 4, 6):
        _write(tmp_path, k)
    _write(tmp_path, 3, complete=False)
    _write(tmp_path, 5, complete=False)
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _owned_by(tmp_path, "step-3", writer.pid)
        _owned_by(tmp_path, "step-5", writer.pid, host="another-node")
        assert C.live_writer(tmp_path, "step-3") == f"coordinator pid {writer.pid} on {os.uname().nodename} (epoch 3), still alive"
        assert "cannot be checked from this host" in C.live_writer(tmp_path, "step-5")
        assert C.live_writer(tmp_path, "step-4") is None  # complete: nobody writes it any more
        assert C.retain(tmp_path, 1) == ["step-4", "step-2"]
        assert C.tags(tmp_path) == ["step-6", "step-5", "step-3"]
    finally:
        writer.kill()
        writer.wait()
    assert C.live_writer(tmp_path, "step-3") is None  # its process is gone
    assert C.retain(tmp_path, 1) == ["step-3"] and C.tags(tmp_path) == ["step-6", "step-5"]


def test_rank_problems_say_when_what_a_replayed_ack_names_is_gone(tmp_path):
    tag = _write(tmp_path, 2)
    assert C.rank_problems(tmp_path, tag, 0, version=2, n_train=N_TRAIN) == []
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / tag / "rank0-optim")
    (tmp_path / "checkpoints" / tag / "rank1-weights" / "data.bin").unlink()
    [p0] = C.rank_problems(tmp_path, tag, 0, version=2, n_train=N_TRAIN)
    assert str(tmp_path / "checkpoints" / tag / "rank0-optim") in p0
    assert str(tmp_path / "checkpoints" / tag / "rank1-weights") in C.rank_problems(tmp_path, tag, 1, 2, N_TRAIN)[0]
    assert "policy version 2, the state says 3" in C.rank_problems(tmp_path, tag, 2, version=3, n_train=N_TRAIN)[0]


def test_a_resume_leaves_a_checkpoint_another_coordinator_may_be_writing_in_place(tmp_path):
    """The resume point is the newest intact checkpoint; a newer incomplete one whose writer lives is noted and left
    where it is (not set aside), one whose writer is gone is set aside as before."""
    import subprocess
    import sys

    from dynaresize.config.loader import load_config
    from dynaresize.events import ReadStats, read_events
    from dynaresize.job.coordinator import Coordinator

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "quickstart.yaml", [f"cluster.gpus={WORLD}", "cluster.initial_train=1"])
    _write(tmp_path, 2)
    _write(tmp_path, 4, complete=False)
    _write(tmp_path, 6, complete=False)
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _owned_by(tmp_path, "step-6", writer.pid)
        _owned_by(tmp_path, "step-4", 2 ** 22 + 17)  # a pid that is not running
        before = _tree(tmp_path / "checkpoints" / "step-6")
        coord = Coordinator(cfg, tmp_path, resume=True)
        assert coord.state.step == 2 and coord.state.checkpoint == "checkpoints/step-2"
        assert _tree(tmp_path / "checkpoints" / "step-6") == before
        assert not (tmp_path / "checkpoints" / "step-4").exists()
        assert (tmp_path / "checkpoints" / "damaged" / "step-4.1").is_dir()
    finally:
        writer.kill()
        writer.wait()
    notes = [e["reason"] for e in read_events(tmp_path, ReadStats()) if e.get("what") == "checkpoint_skipped"]
    assert any(n.startswith("step-6 skipped: ") and f"left in place: coordinator pid {writer.pid}" in n for n in notes), notes
    assert any(n.startswith("step-4 skipped: ") and "set aside as checkpoints/damaged/step-4.1" in n for n in notes), notes


def test_a_batches_record_cut_by_a_hard_stop_is_named_by_its_line_number(tmp_path):
    from dynaresize.events import EventLog
    from dynaresize.job.checkpointer import rewind_batches

    lines = [json.dumps({"step": k, "keys": []}) for k in range(3)]
    (tmp_path / "batches.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2] + "\n" + '{"step": 3, "ke')
    with EventLog(tmp_path / "events.jsonl") as events:
        rewind_batches(tmp_path, 2, events)
    assert (tmp_path / "batches.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    events = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    reasons = [e["reason"] for e in events if e.get("type") == "control"]
    assert any(r.startswith(f"{tmp_path / 'batches.jsonl'} line 4 is not a complete record") for r in reasons), reasons
    assert any("steps 2..2 ran after the last checkpoint (step 2)" in r for r in reasons), reasons


def test_an_operator_stop_names_its_signal_where_it_ended_and_what_a_resume_does():
    from dynaresize.job.errors import OperatorStop

    done = OperatorStop("SIGTERM", 3, checkpoint="step-4")
    assert done.describe(4, "checkpoints/step-4") == (
        "SIGTERM (an operator's stop) during step 3: step 3 finished, stopped before step 4, checkpoint step-4 "
        "written, ranks shut down; a resume continues at step 4 and trains no step twice")
    cut = OperatorStop("SIGINT", 3, abandoned="checkpoint step-4 abandoned (a second stop signal cut it short)")
    assert cut.describe(4, "checkpoints/step-2").endswith(
        "ranks shut down; checkpoint step-4 abandoned (a second stop signal cut it short); the last checkpoint is "
        "checkpoints/step-2 (step 2): a resume starts there and trains 2 step(s) again (steps 2..3)")
    assert "no checkpoint was written yet: a resume continues at step 0" in OperatorStop("SIGTERM", 0).describe(0, None)
    # a stop between two steps never says "during step 8: stopped before step 8"
    between = OperatorStop("SIGTERM", 8, checkpoint="step-8").describe(8, "checkpoints/step-8")
    assert between.startswith("SIGTERM (an operator's stop) after step 7: stopped before step 8, checkpoint step-8")
    assert "during step 8" not in between
    ahead = OperatorStop("SIGTERM", 5, checkpoint="step-7").describe(7, "checkpoints/step-7")
    assert "during step 5: the steps in flight finished (5..6), stopped before step 7" in ahead


def test_where_a_stop_leaves_the_run_says_the_checkpoint_and_the_steps_trained_again():
    from dynaresize.job.errors import where_stopped

    assert where_stopped(12, None) == ("the run stopped before step 12; no checkpoint was written yet: a resume "
                                       "starts from step 0 and trains 12 step(s) again (steps 0..11)")
    assert where_stopped(12, "checkpoints/step-11.2").endswith("(step 11): a resume starts there and trains 1 step(s) again (step 11)")
    assert where_stopped(12, "checkpoints/step-12").endswith("a resume continues at step 12 and trains no step again")

def test_an_attempts_claim_ends_with_it_and_abandoned_says_why(tmp_path):
    """A checkpoint attempt that ends without being written leaves no claim behind (before, a stale claim was
    reported at the run's end as "abandoned (a second stop signal cut it short)" with no signal sent); a claim left
    in progress is abandoned with the reason: the signal only when one cut it short."""
    from types import SimpleNamespace

    from dynaresize.config.loader import load_config
    from dynaresize.job.checkpointer import Checkpointer
    from dynaresize.job.runtime import Job

    class Events:
        def __init__(self):
            self.got = []

        def emit(self, *a, **kw):
            self.got.append(kw)

    job = Job(load_config("configs/quickstart.yaml", []), tmp_path, JobState(step=4, checkpoint="checkpoints/step-2"))
    job.events = Events()
    cp = Checkpointer(job, SimpleNamespace(launcher=SimpleNamespace(external=False)), None)

    def attempt_that_fails(at):  # claims its directory, then fails without clearing the claim
        cp.in_progress = C.claim_tag(tmp_path, 4, {"epoch": 1})
        cp.last_failure = "step-4: rank 0: StagingError: ... ENOSPC"
        return None

    cp._checkpoint = attempt_that_fails
    assert cp.checkpoint(None) is None
    assert cp.in_progress is None and not (tmp_path / "checkpoints" / "step-4").exists()
    assert cp.abandon_in_progress() is None  # nothing to abandon at the end

    cp.in_progress = C.claim_tag(tmp_path, 4, {"epoch": 1})
    why = cp.abandon_in_progress(by_signal=False)
    assert why == ("checkpoint step-4 abandoned (not completed: step-4: rank 0: StagingError: ... ENOSPC); resume "
                   "point stays checkpoints/step-2") and "signal" not in why
    cp.in_progress = C.claim_tag(tmp_path, 4, {"epoch": 1})
    assert "(a second stop signal cut it short)" in cp.abandon_in_progress(by_signal=True)
