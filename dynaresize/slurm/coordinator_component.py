"""Het component 0 of a Slurm job: the coordinator and the run's Redis (``dynaresize.slurm.entry coordinator``)."""

from __future__ import annotations

import json

from dynaresize.job.coordinator import Coordinator


class ExternalRanks:
    """The ranks are started by someone else (``srun`` in a Slurm het job): nothing to start or stop here; a dead
    rank shows up as a missing heartbeat in the registry."""

    external = True  # srun's processes: they may still write after this coordinator stopped waiting for them

    def __init__(self, run_dir, world, job_id, device):
        self.world = world

    def start(self) -> None:
        pass

    def dead(self) -> dict[int, int]:
        return {}

    def stop(self, grace_s: float = 0.0) -> None:
        pass


def run_coordinator(ctx) -> int:
    """Slurm entry of het component 0 (``dynaresize.slurm.entry coordinator``): the coordinator and the run's Redis;
    the worker ranks are component 1, started by ``srun``, and find Redis through the rendezvous file."""
    from dynaresize.slurm import rendezvous

    ident = ctx.identity
    job, restart = (ident.job_id, ident.restart_count) if ident else ("local", 0)
    coord = Coordinator(
        ctx.cfg, ctx.run_dir, resume=ctx.resume, launcher_factory=ExternalRanks, preemption=ctx.preemption,
        on_redis_ready=lambda srv: rendezvous.publish(ctx.run_dir, job, restart, srv.endpoint_file),
    )
    coord.install_signal_handlers()
    summary = coord.run()
    print(json.dumps({k: summary[k] for k in ("status", "steps", "samples_per_s", "reward_first", "reward_last")}), flush=True)
    return 0 if summary["status"] in ("completed", "interrupted") else 1
