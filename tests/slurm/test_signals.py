"""Signals and faults of the Slurm layer without a cluster: real signals to real processes, a real redis-server.

What Slurm 22.05 does on preemption (PreemptMode=REQUEUE, GraceTime) was recorded on the local cluster (see
docs/slurm.md): SIGTERM to every process of every step at once, the job stays RUNNING with ``PreemptTime`` set.
These tests check our side: the coordinator tells that SIGTERM from a cancel's and keeps its children alive, a
worker rank survives it until the coordinator is done, and lost ranks requeue the job a bounded number of times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dynaresize.slurm import rendezvous
from dynaresize.slurm.entry import RELAUNCH_FILE, _relaunches, coordinator_gone, decide_relaunch
from dynaresize.slurm.preempt import TERM_EXIT_CODE, PreemptAction, Preemption, decide
from dynaresize.slurm.state import parse_preempt_time

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]

# `scontrol show job -o 180` of a het job, shortened: selected for preemption (grace time running), then cancelled
PREEMPTED = (
    "JobId=180 HetJobId=180 HetJobOffset=0 JobName=het3.sbatch JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
    "PreemptEligibleTime=2026-11-30T04:20:43 PreemptTime=2026-11-30T04:20:46 Partition=cpu NodeList=cpu1\n"
    "JobId=181 HetJobId=180 HetJobOffset=1 JobName=het3.sbatch JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
    "PreemptEligibleTime=2026-11-30T04:20:43 PreemptTime=2026-11-30T04:20:46 Partition=gpu NodeList=gpu1\n"
)
CANCELLED = PREEMPTED.replace("JobState=RUNNING", "JobState=COMPLETING").replace("PreemptTime=2026-11-30T04:20:46", "PreemptTime=None")


def test_preempt_time_tells_preemption_from_cancel() -> None:
    assert parse_preempt_time(PREEMPTED) == "2026-11-30T04:20:46"
    assert parse_preempt_time(CANCELLED) is None  # PreemptEligibleTime is not PreemptTime
    assert parse_preempt_time("") is None


def test_preemption_requeues_beyond_max_requeues_but_not_when_requeue_is_off() -> None:
    assert decide(True, True, 5, 2, preempted=True).action is PreemptAction.REQUEUED  # Slurm would requeue it anyway
    assert decide(True, True, 2, 2, preempted=False).action is PreemptAction.STOP  # the time-limit warning stays bounded
    assert decide(True, False, 0, 2, preempted=True).action is PreemptAction.STOP


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_coordinator_sigterm_preempted_or_not() -> None:
    """Real SIGTERMs to a fresh process: with the job preempted it becomes checkpoint + requeue (past max_requeues)
    and a child started after install() (like redis-server) survives it; otherwise it reaches the main thread's
    own handler (the coordinator's: stop after the step).

    A fresh interpreter, as the coordinator entry is: threads that other tests left in the pytest process were
    started before install() blocked SIGTERM, so the kernel could hand a process-directed SIGTERM to one of them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    code = "import test_signals; test_signals._coordinator_sigterm_preempted_or_not(); print('ok')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def _coordinator_sigterm_preempted_or_not() -> None:
    assert threading.current_thread() is threading.main_thread()
    preempted: list[str | None] = ["2026-11-30T04:20:46"]
    calls: list[str] = []
    handled: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda s, f: handled.append(s))
    pre = Preemption("42", 3, True, 1, requeue_fn=lambda leader: calls.append(f"requeue {leader}"),
                     is_preempted=lambda: preempted[0])
    pre.on_checkpoint(lambda reason: calls.append(f"checkpoint: {reason}"))
    pre.install(watch_term=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        child.send_signal(signal.SIGTERM)
        _wait(lambda: pre.requested, 10, "the preemption request")
        assert pre.preempted == "2026-11-30T04:20:46" and handled == []
        time.sleep(0.3)
        assert child.poll() is None, "a child of the coordinator died of SIGTERM (Redis would)"
        assert pre.poll() is PreemptAction.REQUEUED
        assert calls[0].startswith("checkpoint: preempted by Slurm") and calls[1] == "requeue 42"
        preempted[0] = None  # scancel: PreemptTime=None
        pre.handled = None
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(lambda: handled, 10, "the main thread's SIGTERM handler")
        assert handled == [signal.SIGTERM]
    finally:
        child.kill()
        child.wait()
        pre.uninstall()
        signal.signal(signal.SIGTERM, old)
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "proc.py"
    p.write_text(textwrap.dedent(body))
    return p


def _start(script: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_coordinator_without_its_own_handler_exits_143_through_finally(tmp_path: Path) -> None:
    """The probe entry installs no SIGTERM handler: a plain SIGTERM still ends it, through ``finally`` (where the
    embedded Redis is stopped), with the conventional 143."""
    script = _script(tmp_path, """
        import sys, time
        from dynaresize.slurm.preempt import Preemption
        Preemption("7", 0, True, 1, requeue_fn=print, is_preempted=lambda: None).install(watch_term=True)
        try:
            print("ready", flush=True)
            for _ in range(600):  # the coordinator's waits are short (acks: 2 s): the handler runs between them
                time.sleep(0.1)
        finally:
            print("finally ran", flush=True)
    """)
    p = _start(script)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == TERM_EXIT_CODE and "finally ran" in out, out


WORKER = """
    import sys, time
    from pathlib import Path
    from dynaresize.slurm.preempt import TermDeferral
    flag, shutdown = Path(sys.argv[1]), Path(sys.argv[2])
    TermDeferral(float(sys.argv[3]), coordinator_gone=flag.exists, poll_s=0.1).install()
    print("ready", flush=True)
    while not shutdown.exists():  # a rank applying commands until `shutdown`
        time.sleep(0.05)
    print("shutdown applied", flush=True)
"""


def test_worker_serves_through_sigterm_until_shutdown(tmp_path: Path) -> None:
    p = _start(_script(tmp_path, WORKER), str(tmp_path / "gone"), str(tmp_path / "shutdown"), "60")
    p.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert p.poll() is None, "the rank died of SIGTERM before the coordinator's shutdown"
    (tmp_path / "shutdown").touch()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and "shutdown applied" in out and "keeps serving until the coordinator's shutdown" in out, out


def test_worker_exits_after_sigterm_when_the_coordinator_is_gone(tmp_path: Path) -> None:
    p = _start(_script(tmp_path, WORKER), str(tmp_path / "gone"), str(tmp_path / "shutdown"), "60")
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None
    (tmp_path / "gone").touch()
    t0 = time.monotonic()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == TERM_EXIT_CODE and time.monotonic() - t0 < 10, out
    assert "coordinator's Redis is gone" in out and "shutdown applied" not in out


def test_worker_exits_at_the_timeout_after_sigterm(tmp_path: Path) -> None:
    p = _start(_script(tmp_path, WORKER), str(tmp_path / "gone"), str(tmp_path / "shutdown"), "1")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == TERM_EXIT_CODE and 0.9 < time.monotonic() - t0 < 20, out
    assert "no shutdown from the coordinator within 1 s" in out


def test_coordinator_gone_asks_the_real_redis(redis_server, tmp_path: Path) -> None:
    from dynaresize.net import free_port

    gone = coordinator_gone(tmp_path, "7", 1)
    assert gone() is False  # nothing published yet: unknown is not gone
    rendezvous.publish(tmp_path, "7", 0, redis_server.endpoint_file)
    assert gone() is False  # the previous incarnation's endpoint says nothing about this one
    rendezvous.publish(tmp_path, "7", 1, redis_server.endpoint_file)
    assert gone() is False  # answers
    dead = tmp_path / "dead.json"
    dead.write_text(json.dumps({"host": "127.0.0.1", "port": free_port("127.0.0.1"), "password_file": None}))
    rendezvous.publish(tmp_path, "7", 1, dead)
    assert gone() is True  # refuses connections
    rendezvous.publish(tmp_path, "7", 1, None, error="RuntimeError: boom")
    assert gone() is True


def test_relaunches_are_bounded_and_their_record_is_checked(tmp_path: Path) -> None:
    assert decide_relaunch(0, 2, True).action is PreemptAction.REQUEUED
    assert "requeue 2 of at most 2" in decide_relaunch(1, 2, True).reason
    assert decide_relaunch(2, 2, True).action is PreemptAction.STOP
    assert decide_relaunch(0, 2, False).action is PreemptAction.STOP
    assert _relaunches(tmp_path) == []
    rec = tmp_path / "slurm" / RELAUNCH_FILE
    rec.parent.mkdir()
    rec.write_text('{"relaunches": [{"job_id": "7"}]}')
    assert len(_relaunches(tmp_path)) == 1
    rec.write_text("[1, 2]")
    with pytest.raises(RuntimeError, match=f"{rec}.*want"):
        _relaunches(tmp_path)
    rec.write_text("{not json")
    with pytest.raises(RuntimeError, match=f"{rec}: unreadable"):
        _relaunches(tmp_path)
