"""What ``dynaresize run --resume RUN_DIR [key=value ...]`` may change, decided before anything is written.

A resume continues the run in its directory from its newest intact checkpoint. Overrides given with it are checked
against the run's own ``config.yaml`` first: a refused resume names the reason and leaves every file of the run as it
was (no incarnation counted, no event logged, no ``run_end``), so the run can be resumed the right way afterwards.

What may change, and why only that: the checkpoint's weights and optimizer state, the samples already generated in
the run's Redis and the schedule logged in ``schedule.jsonl`` were all made under the run's config; a key that
changes *what* is computed (the seed, the model, the data, the loss, the split of ranks) would train the rest of the
run on a different recipe than its start, silently. Keys that only change how the job reports, checkpoints, waits or
recovers are free (:data:`CHANGEABLE`), and ``run.steps`` may change as long as steps are left to train:

- an interrupted run (its checkpoint before its last step): ``run.steps`` larger than the checkpoint's step (a
  smaller one than before shortens the run);
- a completed run (its final checkpoint at its last step): ``run.steps`` larger than the steps it trained extends
  it: the extended run continues from the final checkpoint (docs/FAULTS.md "Extending a completed run" says what it
  trains, and the one difference from a run of that length in one go).

While the run's ranks still live (its coordinator was killed), a resume takes them over and continues the schedule
they run, as logged: nothing may change then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynaresize.config.schema import Config

# dotted key or section prefix -> why a resume may change it
CHANGEABLE: dict[str, str] = {
    "run.steps": "the run's length (checked against the checkpoint below)",
    "run.progress": "the terminal's progress bar",
    "run.checkpoint_every": "when checkpoints are taken",
    "run.keep_checkpoints": "how many checkpoints are kept",
    "metrics.": "where the figures are logged",
    "faults.": "what the job does when a rank is lost or the disk is full",
    "slurm.": "how the job is submitted",
    "sim.": "the simulator (not the job)",
    "staging.": "how rank state is written to disk (the same bytes)",
    "redis.heartbeat_s": "liveness timing",
    "redis.dead_after_heartbeats": "liveness timing",
    "redis.start_timeout_s": "liveness timing",
    "redis.start_grace_s": "liveness timing",
    "redis.socket_timeout_s": "liveness timing",
    "redis.connect_timeout_s": "liveness timing",
    "redis.health_check_s": "liveness timing",
    "redis.restart_attempts": "how the run's Redis is restarted",
    "redis.restart_backoff_s": "how the run's Redis is restarted",
    "redis.write_wait_s": "liveness timing",
    "redis.password_file": "where the external Redis's password is read (the same server, the same data)",
}


class ResumeRefused(ValueError):
    """The resume asked for cannot be done; the message says why and what would work. Nothing was written."""


@dataclass(frozen=True)
class ResumePlan:
    """What the resume does: from the checkpoint at ``step`` (0: none, from the start) to ``steps``."""

    step: int
    steps_before: int  # run.steps in the run's config.yaml
    steps: int  # run.steps now
    changed: dict[str, tuple[Any, Any]]  # dotted key -> (the run's value, the value given)

    @property
    def extends(self) -> bool:
        """A completed run trains more steps (its final checkpoint is the resume point)."""
        return self.step >= self.steps_before and self.steps > self.steps_before


def flat(cfg: Any, pre: str = "") -> dict[str, Any]:
    """Every setting of the config by dotted key (a section's settings under its name; a dict value is one setting)."""
    from pydantic import BaseModel

    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        v = getattr(cfg, name)
        if isinstance(v, BaseModel):
            out.update(flat(v, f"{pre}{name}."))
        else:
            out[pre + name] = v
    return out


def changed_keys(before: Config, now: Config) -> dict[str, tuple[Any, Any]]:
    a, b = flat(before), flat(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def changeable(key: str) -> bool:
    return any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE)


def plan_resume(run_dir: Path, before: Config, now: Config, live_ranks: dict[int, int] | None = None) -> ResumePlan:
    """The resume of ``run_dir`` from config ``before`` (its ``config.yaml``) with the overrides that gave ``now``;
    ``live_ranks``: the run's rank processes still alive (rank -> pid). Reads the checkpoints, writes nothing.
    Raises :class:`ResumeRefused`."""
    from dynaresize.job import checkpoint_files as ckpt

    changed = changed_keys(before, now)
    fixed = [k for k in changed if not changeable(k)]
    if fixed:
        what = "; ".join(f"{k}: the run's {changed[k][0]!r}, given {changed[k][1]!r}" for k in fixed)
        raise ResumeRefused(
            f"{'this key' if len(fixed) == 1 else 'these keys'} cannot change on a resume ({what}): the checkpoint, the "
            f"samples already generated and the logged schedule were made with the run's value, so the rest of the run "
            f"would train on another recipe than its start. Keys a resume may change: "
            f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in CHANGEABLE)}. To train with the new "
            f"value, start a new run")
    if changed and live_ranks:
        raise ResumeRefused(
            f"the run's ranks are still running (rank(s) {', '.join(map(str, sorted(live_ranks)))}, pids "
            f"{', '.join(map(str, (live_ranks[r] for r in sorted(live_ranks))))}): a resume takes them over and "
            f"continues the schedule they run as logged, so nothing may change ({', '.join(changed)} given). Resume "
            f"without overrides, or once the run has stopped")
    try:
        res = ckpt.select_resume(run_dir, now.cluster.gpus)  # looks only: the resume itself reports and repairs
    except ValueError:  # no intact checkpoint: the resume says what is damaged (StateError), as before
        res = None
    step = res.state.step if res is not None else 0
    tag = f"checkpoints/{res.tag}" if res is not None and res.tag else "no checkpoint"
    old, new = before.run.steps, now.run.steps
    if new <= step:
        if step >= old and new == old:
            raise ResumeRefused(
                f"the run completed its {old} steps ({tag} holds its final weights): there is nothing to resume. To "
                f"train it further, give the new length: dynaresize run --resume {run_dir} run.steps=N with N > {old} "
                f"(it continues from {tag})")
        raise ResumeRefused(
            f"run.steps={new} leaves nothing to train: the run's newest checkpoint ({tag}) is at step {step}, and a "
            f"resume trains from there up to run.steps; give run.steps larger than {step}")
    return ResumePlan(step, old, new, changed)
