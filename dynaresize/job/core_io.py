"""What the coordinator gives the scheduler core and keeps of it: the core's configuration from the run's, the
resize policy it consults (``policy.forced_splits`` first), ``schedule.jsonl`` (every event fed to the core and the
actions it returned) and the replay of that log through a fresh core (:func:`replay_log`).

Used by the continuous schedule (:mod:`dynaresize.job.core_driver`) and by anyone who studies a run afterwards::

    from dynaresize.job.core_io import replay_log
    assert all(logged == again for _, logged, again in replay_log("runs/quickstart-..."))
"""

from __future__ import annotations

import json
from dataclasses import replace

from dynaresize.config.schema import Config
from dynaresize.job.runtime import Job
from dynaresize.job.state import policy_from_dict, policy_to_dict
from dynaresize.policy import Topology
from dynaresize.policy.types import Decision, Observation, PolicyState, ResizeAction
from dynaresize.schedule import DynamicSampling, Mechanisms, PipelineScheduler, SchedulerConfig
from dynaresize.schedule.codec import encode


def scheduler_config(cfg: Config, n_train: int, resume_step: int, validations: tuple[tuple[int, int], ...] = (),
                     resumed: tuple[tuple[int, tuple[int, ...]], ...] = (), generated: int | None = None) -> SchedulerConfig:
    """The core's configuration for this run (what ``schedule.jsonl`` records, and a replay rebuilds)."""
    pl = cfg.pipeline
    return SchedulerConfig(
        n_ranks=cfg.cluster.gpus, n_train=n_train, groups=(cfg.rollout.prompts_per_step,) * cfg.run.steps,
        staleness=pl.staleness_bound, mechanisms=mechanisms(cfg),
        stream_min_groups=pl.stream_min_groups, train_queue=pl.train_queue, collective_switch=True, resume_step=resume_step, validations=validations,
        sampling=sampling(cfg), resumed=resumed, generated=generated,
    )


def mechanisms(cfg: Config) -> Mechanisms:
    """The core's mechanisms for ``pipeline.schedule``: ``barrier`` turns every barrier-free one off (the static
    one-step-off pipeline, the baseline), ``barrier_free`` runs continuous rollout and (``streaming_training``)
    streaming training. Resizing is on in both (the policy decides; ``policy.enabled: false`` holds the split)."""
    pl = cfg.pipeline
    if pl.schedule == "barrier":
        return Mechanisms(continuous_rollout=False, streaming_training=False, resize=True)
    return Mechanisms(continuous_rollout=True, streaming_training=pl.streaming_training, resize=True)


def sampling(cfg: Config) -> DynamicSampling | None:
    """DAPO dynamic sampling as the core runs it (``algorithm.dynamic_sampling``), or None when it is off."""
    ds = cfg.algorithm.dynamic_sampling
    if not ds.enabled:
        return None
    need = cfg.rollout.prompts_per_step
    return DynamicSampling(need=need, round_groups=ds.round_prompts or need, max_rounds=ds.max_rounds,
                           pad=ds.on_unfilled == "pad")


class PlannedPolicy:
    """The resize policy the core consults: ``policy.forced_splits`` (tests, experiments) at the steps it names, else
    the planner's :class:`~dynaresize.policy.ResizePolicy` (when ``policy.enabled``), else hold. The core asks after
    ``T_k`` (``obs.step == k``); a forced split at step ``k + 1`` answers it (the split that trains batch
    ``k + 1``), or the first question after it when none came then (a switch was in flight: it is late, not lost);
    ``PolicyState.forced_step`` remembers the last one that came due. Pure, like the policy it wraps."""

    def __init__(self, policy, forced: dict[int, int], enabled: bool):
        self.policy, self.forced, self.enabled = policy, dict(forced), enabled

    def initial_state(self) -> PolicyState:
        return self.policy.initial_state()

    def step(self, state: PolicyState, obs: Observation) -> tuple[PolicyState, Decision]:
        # the newest forced split due by the next step and not applied yet: one due while a switch was in flight (the
        # core asks no policy then) is applied at the first step after it, not dropped
        due = [k for k in self.forced if state.forced_step < k <= obs.step + 1]
        if due:
            k = max(due)
            n, state = self.forced[k], replace(state, forced_step=k)
            if n != obs.topology.n_train and 1 <= n < obs.topology.total:
                late = f" (due at step {k})" if k < obs.step + 1 else ""
                return state, Decision(ResizeAction.RESIZE, Topology(n, obs.topology.total - n),
                                       "forced by policy.forced_splits" + late)
        if not self.enabled or obs.train_s <= 0:
            return state, Decision(ResizeAction.HOLD, obs.topology, "policy disabled" if not self.enabled else "nothing measured")
        return self.policy.step(state, obs)


class ScheduleLog:
    """``schedule.jsonl``: the core's configuration, then every event fed and the actions returned."""

    def __init__(self, path, cfg: SchedulerConfig, incarnation: int, policy_state: PolicyState | None,
                 state: dict | None = None, header: bool = True):
        """``state``: the job state the segment starts from (what a takeover of the live ranks replays from);
        ``header``: False for a takeover, which goes on with the segment it replayed."""
        self.f = open(path, "a", buffering=1)
        if header:
            self.write({"config": encode(cfg), "incarnation": incarnation,
                        "policy_state": policy_to_dict(policy_state) if policy_state is not None else None,
                        "state": state})

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.f.close()


# --- replay -------------------------------------------------------------------------------------------------------
def replay_log(run_dir) -> list[tuple[str, list, list]]:
    """Feed the events of a run's ``schedule.jsonl`` to a fresh core (one per start of the schedule: a restart or a
    resume begins a new segment at its config line), with the run's own resize policy re-planned over the live ranks
    where the run did; returns (what, logged actions, replayed actions) for every start and event, encoded."""
    from pathlib import Path

    from dynaresize.config.loader import load_config
    from dynaresize.job.planner import Planner
    from dynaresize.job.state import JobState
    from dynaresize.schedule.codec import decode

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")

    def policy(lost: list[int]) -> PlannedPolicy:
        planner = Planner(Job(cfg, run_dir, JobState(n_train=cfg.cluster.initial_train, lost=list(lost))))
        return PlannedPolicy(planner.policy, cfg.policy.forced_splits, cfg.policy.enabled)

    out: list[tuple[str, list, list]] = []
    core = planned = None
    for line in (run_dir / "schedule.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "config" in rec:
            planned = policy([])
            core = PipelineScheduler(decode(rec["config"]), planned)
            core.policy_state = policy_from_dict(rec.get("policy_state")) or core.policy_state
        elif "start" in rec:
            out.append(("start", rec["start"], encode(core.start())))
        elif "lost" in rec:
            planned.policy = policy(rec["lost"]).policy
        elif "event" in rec:
            ev = decode(rec["event"])
            out.append((type(ev).__name__, rec["actions"], encode(core.handle(ev))))
    return out
