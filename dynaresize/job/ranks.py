"""The rank processes' lifecycle: start a launch (the launch file, the launcher, everyone registered and
answering), what is left of an earlier launch, and the final checkpoint and shutdown."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import redis

from dynaresize import atomic
from dynaresize.job.checkpointer import Checkpointer
from dynaresize.job.errors import JobError, OperatorStop
from dynaresize.job.planner import Planner
from dynaresize.job.runtime import Job, Services
from dynaresize.job.transport import Phase, Transport

log = logging.getLogger("dynaresize.job")

LAUNCH_FILE = "launch.json"


class Ranks:
    def __init__(self, job: Job, svc: Services, tx: Transport, planner: Planner,
                 launcher_factory: Callable[..., Any] | None, stop_requested: threading.Event):
        self.job, self.svc, self.tx, self.planner = job, svc, tx, planner
        self.launcher_factory = launcher_factory  # (run_dir, world, job_id, device) -> launcher; default local
        self.stop_requested = stop_requested
        self.stopping = False  # shut_down runs: a second signal only cuts a checkpoint in progress short

    def start(self, at: Phase) -> None:
        from dynaresize.events import format_ranks
        from dynaresize.job.launcher import LocalLauncher

        job, svc, world = self.job, self.svc, self.job.world
        # a coordinator another one took the run over from while it started (a second --resume): it writes no
        # launch, puts back no claim of the other's (FencedError: it says who owns the run)
        svc.bus.check_epoch()
        # a new launch: every rank slot is usable again, and processes of an earlier launch are refused
        svc.registry.begin_launch(job.state.incarnation, world)
        if job.state.lost:  # new processes in every slot (a restart, a resume, a requeue): nobody is lost any more
            log.info("a new launch: rank(s) %s lost earlier are started again", format_ranks(job.state.lost))
            job.state.lost = []
            self.planner.rebuild()
        for r in range(world):  # heartbeats of an earlier launch's processes must not count as this one's
            svc.registry.forget(r)
        # claims are bound to the launch that made them: every claim of an earlier launch's processes is void, of
        # every step (the continuous schedule runs ahead of the checkpoint), training batches and validation alike
        from dynaresize.contract.workqueue import RolloutQueue

        back = svc.queue.release_all() + RolloutQueue(svc.redis, job.job_id, name="vq").release_all()
        if back:
            job.events.emit("control", what="reclaimed", reason=f"{back} sample(s) claimed by processes of an earlier "
                            f"launch put back for launch {job.state.incarnation}")
        write_launch_file(job, svc.model_dir)
        factory = self.launcher_factory or (lambda run_dir, world, job_id, device: LocalLauncher(
            run_dir, world, job_id, device, zygote=job.cfg.cluster.fork_ranks))
        svc.launcher = factory(job.run_dir, world, job.job_id, job.cfg.cluster.device)
        svc.launcher.start()
        deadline = time.monotonic() + 600
        while len(svc.registry.live()) < world:
            self.check_alive()
            if time.monotonic() > deadline:
                raise JobError(f"only {len(svc.registry.live())} of {world} ranks registered within 600 s")
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            time.sleep(0.2)
        self.tx.call(at, "ping", range(world), {})
        ranks = {r: reg.model_dump(mode="json") for r, reg in sorted(svc.registry.live().items())}
        atomic.write_json(job.run_dir / "ranks.json", ranks, indent=1)  # who runs where (Slurm identity)
        log.info("%d ranks up", world)

    def check_alive(self) -> None:
        launcher = self.svc.launcher
        dead = launcher.dead() if hasattr(launcher, "dead") else {}
        if dead:
            # its ranks were refused because another coordinator took the run over and began a newer launch (a
            # second --resume while this one started): that one owns the run; this one is fenced (FencedError), it
            # neither reports a failure of the run nor touches its Redis
            self.svc.bus.check_epoch()
            r, code = next(iter(dead.items()))
            tail = launcher.log_tail(r) if hasattr(launcher, "log_tail") else ""
            raise JobError(f"rank {r} exited with code {code}; last lines of its log:\n{tail}")

    def stop_superseded(self) -> None:
        """A fenced coordinator's own rank processes of a launch the job has left behind (another coordinator began a
        newer one): they can never serve the run, so they are stopped. Ranks it took over, or that a newer
        coordinator took over from it (the same launch), are left alone."""
        from dynaresize.job.launcher import LocalLauncher

        launcher, job = self.svc.launcher, self.job
        if not isinstance(launcher, LocalLauncher):  # started by srun, or ranks this coordinator took over
            return
        try:
            superseded = self.svc.registry.launch() > job.state.incarnation
        except redis.RedisError:
            return
        if superseded:
            launcher.stop(grace_s=0.0)

    def shut_down(self, at: Phase, checkpoint: bool, checkpointer: Checkpointer, stop: OperatorStop | None) -> None:
        """The end of a run: the final checkpoint (``checkpoint``, when no rank of the launch is dead), then
        ``shutdown`` to every live rank, then the launcher stops them. A second signal during the checkpoint
        abandons it (the ranks finish what they are staging, then take the shutdown; the directory goes once they
        have exited). ``stop``: the operator's stop, told how it ended."""
        launcher, job = self.svc.launcher, self.job
        if launcher is None:
            return
        self.stopping = True
        self.tx.check_redis(final=True)  # a Redis stall not announced yet (the last steps'): announced now
        told: list[int] = []  # the ranks sent the shutdown
        cut = False  # a second stop signal cut the final checkpoint short
        try:
            if checkpoint and not (set(launcher.dead()) - set(job.state.lost)):
                try:
                    tag = checkpointer.final(at)  # the final weights: a full disk is waited out
                    if stop is not None and tag is not None:
                        stop.checkpoint = tag
                except KeyboardInterrupt:
                    cut = True
                self.svc.bus.send("shutdown", job.alive(), {})
                told = job.alive()
            elif not self.tx.writes_refused:  # else it would wait for Redis once more: just stop them
                self.svc.bus.send("shutdown", job.alive(), {})
                told = job.alive()
        except Exception as e:  # the ranks are stopped below either way
            why = self.svc.srv.failure if isinstance(e, redis.ConnectionError) else None
            log.warning("could not shut the ranks down cleanly: %s", why or e)
            if stop is not None and not stop.checkpoint:
                stop.abandoned = f"the stop's checkpoint could not be taken ({why or e})"
        launcher.stop()
        if told and launcher.external:
            self._await_departures(told)
        abandoned = checkpointer.abandon_in_progress(by_signal=cut)
        if stop is not None and abandoned is not None:
            stop.abandoned = abandoned
        if stop is not None:
            text = stop.describe(job.state.step, job.state.checkpoint)
            log.warning("%s", text)
            job.events.emit("control", what="operator_stop", reason=text)

    def _await_departures(self, ranks: list[int]) -> None:
        """Ranks started by someone else (``srun``): nobody here waits for their processes, and the coordinator
        stops Redis next. Their last act in Redis is to deregister: wait for that, at most the heartbeat deadline,
        so that they leave cleanly instead of retrying against a server that is gone (redis-py's backoff, ~5 s,
        then a warning in each rank's log) while the Slurm job waits for them."""
        deadline = time.monotonic() + self.job.cfg.redis.dead_after_s
        try:
            while set(ranks) & set(self.svc.registry.live()) and time.monotonic() < deadline:
                time.sleep(0.05)
        except redis.RedisError as e:
            log.warning("could not see the ranks deregister: %s", e)


def write_launch_file(job: Job, model_dir: Path) -> None:
    """What every rank reads at start (local or Slurm): model, split, and where to restore state from."""
    from dynaresize.net import free_port

    st = job.state
    launch = {
        "job_id": job.job_id, "model_dir": str(model_dir), "world": job.world, "n_train": st.n_train,
        "version": st.version, "checkpoint": st.checkpoint, "incarnation": st.incarnation,
        "master_port": free_port("0.0.0.0"),  # for ranks started by srun; local ranks get theirs on the command line
    }
    atomic.write_json(job.run_dir / LAUNCH_FILE, launch, indent=1)


def leftover_ranks(run_dir: Path) -> dict[int, int]:
    """Rank processes of this run's last launch still alive on this host (from ``ranks.json``; a pid counts
    only while its command line still names this run, so a recycled pid is never taken)."""
    import socket

    from dynaresize.control.server import pid_alive

    try:
        ranks = json.loads((run_dir / "ranks.json").read_text())
    except (OSError, ValueError):
        return {}
    here, out = socket.gethostname(), {}
    for r, info in ranks.items():
        pid = info.get("pid") if isinstance(info, dict) else None
        if not pid or info.get("host") != here or not pid_alive(pid):
            continue
        try:
            cmdline = open(f"/proc/{int(pid)}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "dynaresize" in cmdline and run_dir.name in cmdline:  # --run-dir may be relative or absolute
            out[int(r)] = int(pid)
    return out


def kill_leftovers(run_dir: Path) -> None:
    """An incomplete earlier launch cannot be used: what is left of it is killed before the restart."""
    for r, pid in leftover_ranks(run_dir).items():
        log.warning("rank %d (pid %d) of the earlier launch is still alive: killed before the restart", r, pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
