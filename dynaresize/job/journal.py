"""The takeover journal: the state after the last finished step, in Redis, written only while this coordinator's
epoch is the job's; a coordinator started with ``--resume`` while the run's ranks still live takes them over from it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

from dynaresize.control.commands import FencedError
from dynaresize.contract.keys import Keys
from dynaresize.job.planner import Planner
from dynaresize.job.ranks import LAUNCH_FILE, leftover_ranks
from dynaresize.job.runtime import Job, Services, StepTimes
from dynaresize.job.state import JobState

log = logging.getLogger("dynaresize.job")

_JOURNAL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


class Journal:
    def __init__(self, job: Job, svc: Services):
        self.job, self.svc = job, svc
        self.script = svc.redis.register_script(_JOURNAL)

    def write(self) -> None:
        """The state after the last finished step, in Redis, written only while this coordinator's epoch is the
        job's (one Lua script): what a coordinator that takes over continues from (:meth:`attach`)."""
        job, bus = self.job, self.svc.bus
        data = {"state": asdict(job.state), "last": asdict(job.last)}
        keys = Keys(job.job_id)
        if not int(self.script(keys=[keys.epoch, keys.journal], args=[bus.epoch, json.dumps(data)])):
            bus.check_epoch()
            raise FencedError(f"job {job.job_id}: journal not written (epoch {bus.epoch} is not the job's)")

    def attach(self, planner: Planner, own_launcher: bool) -> bool:
        """``--resume`` while the ranks of the run are still alive (the coordinator was killed or hung, its ranks
        were not; its Redis either still answers and was adopted, or died with it and was started again on the same
        port from its append-only file): take the ranks over as they are, from the journal, instead of restarting
        them from the last checkpoint. The new epoch (taken already) fences off the old coordinator; the schedule
        replays its ``schedule.jsonl`` segment (:mod:`dynaresize.job.takeover`), which must be of this launch, and
        sends the commands in flight again with the same ids, so what the ranks already applied is answered from
        their stored acks (``batches.jsonl`` is rewound once the replay is over, not here).
        ``own_launcher``: the ranks are started by a launcher of the caller's (Slurm), never taken over."""
        from dynaresize.job.launcher import AttachedRanks

        job, svc, cfg = self.job, self.svc, self.job.cfg
        raw = svc.redis.get(Keys(job.job_id).journal)
        if raw is None:
            return False
        try:
            j = json.loads(raw)
            st = JobState(**j["state"])
            launch = json.loads((job.run_dir / LAUNCH_FILE).read_text())
        except (ValueError, TypeError, KeyError, OSError) as e:
            log.warning("journal or launch file unreadable (%s): resuming from the checkpoint", e)
            return False
        want = [r for r in range(job.world) if r not in st.lost]
        leftovers = leftover_ranks(job.run_dir)
        if own_launcher or set(leftovers) != set(want):
            # only local ranks whose processes are seen alive are taken over; a Slurm requeue starts every rank
            # anew (and right after a Redis restart stale heartbeats still look fresh, so they prove nothing)
            return False
        # ranks whose registration expired while Redis was down (it dies with a killed coordinator and comes back
        # with this one) register again within a heartbeat or two: give them the heartbeat deadline and some
        deadline = time.monotonic() + (cfg.redis.heartbeat_s * cfg.redis.dead_after_heartbeats + 10 if leftovers else 0)
        while True:
            live = svc.registry.live()
            if all(r in live for r in want) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if launch.get("incarnation") != st.incarnation or any(r not in live for r in want):
            return False  # run() stops what is left of that launch
        from dynaresize.job.takeover import last_segment

        seg = last_segment(job.run_dir)
        if seg is None or seg.header.get("incarnation") != st.incarnation:
            log.warning("schedule.jsonl has no segment of launch %d with its start state: resuming from the "
                        "checkpoint", st.incarnation)
            return False
        st.elapsed_s, st.loop_s = max(st.elapsed_s, job.state.elapsed_s), max(st.loop_s, job.state.loop_s)
        job.state = st
        job.last = StepTimes(**j.get("last", {}))
        planner.reset()
        svc.launcher = AttachedRanks(job.run_dir, {r: live[r] for r in want})
        epoch = svc.bus.epoch
        job.events.emit("control", what="attach", reason=f"took over {len(want)} live rank(s) of launch {st.incarnation} "
                        f"at step {st.step} with epoch {epoch}; the schedule is replayed from schedule.jsonl and the "
                        "commands in flight sent again, applied commands answered from their acks",
                        epoch=epoch)
        log.warning("attached to %d live ranks at step %d (epoch %d)", len(want), st.step, epoch)
        return True
