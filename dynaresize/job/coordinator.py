"""The coordinator: the RL schedule, one screen per step, with the expensive transitions as named steps.

One-step-off pipeline with staleness bound ``s`` (``pipeline.staleness_bound``, default 1): while trainers train
on batch ``k`` (producing policy version ``k+1``), rollout ranks already generate batch ``k+s`` with version ``k``.
Then the new weights go to the rollout ranks. Each iteration reads::

    observe  -> what the last step measured (stage times, tokens)
    decide   -> the resizing policy (pure; the simulator runs the very same code)
    switch   -> if the policy asks: ranks change role in place (no process restart, no new communicator)
    generate -> batch k+s, pulled by the rollout ranks from a work queue (dynamic dispatch)
    train    -> batch k on the trainers (GRPO loss, DeepSpeed ZeRO)
    sync     -> version k+1 from the trainers to the rollout ranks

Invariants (tested): batch ``k`` only holds samples of versions ``>= k - s``; every sample is seeded by (seed, step,
prompt, index), so which rank generates it never changes it; a resize in the middle of a rollout neither drops nor
duplicates a sample (the work queue is keyed by sample).

Where a switch happens: trainers -> rollout runs *inside* the step (the mixed step, ``pipeline.mixed_switch``):
the leaving trainers take part in training batch k, then switch and pull what is left of the rollout of batch
k+s, with the weights that batch is generated from (kept before the update), so every sample keeps the version a
static run gives it. Rollout -> trainers runs at the step boundary (the new trainers are needed from the first
forward pass of the next training step). Each switch is a short list of fine-grained operations, each in the
event log with its rank, start, end, bytes and whether it was on the critical path (the optimizer state's
stage-in is deferred to the first optimizer step on the new topology, hidden behind forward and backward).

Stop and resume: SIGINT/SIGTERM ask for a stop; the step in flight finishes, the ranks stage their state under
``checkpoints/``, the coordinator writes ``checkpoints/coordinator.json``, and ``dynaresize run --resume RUN_DIR``
continues with the same step counter. A second signal stops at once (resume then starts from the last checkpoint;
samples already generated stay in the run's Redis and are reused, never generated twice).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dynaresize.config.loader import write_resolved
from dynaresize.config.schema import Config
from dynaresize.events import EventLog, Role, format_ranks
from dynaresize.job.batching import TrainBatch, build_batch, work_items
from dynaresize.job.state import JobState, load_state, policy_from_dict, policy_to_dict, save_state

log = logging.getLogger("dynaresize.job")

LAUNCH_FILE = "launch.json"


class JobError(RuntimeError):
    """The job cannot go on (a rank died, a command failed); the message says which rank and why."""


@dataclass
class StepTimes:
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0
    tokens_generated: int = 0
    tokens_trained: int = 0


@dataclass
class Coordinator:
    cfg: Config
    run_dir: Path
    resume: bool = False
    launcher_factory: Callable[..., Any] | None = None  # (run_dir, world, job_id, device) -> launcher; default local
    on_step: Callable[[dict], None] | None = None  # progress callback (the CLI's progress bar)
    on_redis_ready: Callable[[Any], None] | None = None  # called with the RedisServer once it answers (Slurm rendezvous)
    preemption: Any | None = None  # dynaresize.slurm.preempt.Preemption: USR2 -> checkpoint -> requeue, polled per step
    stop_requested: threading.Event = field(default_factory=threading.Event)

    # ---------------------------------------------------------------------------------------------------------
    # set-up

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.world = self.cfg.cluster.gpus
        self.bound = self.cfg.pipeline.staleness_bound
        self.job_id = self.run_dir.name
        st = load_state(self.run_dir) if self.resume else None
        self.state = st or JobState(n_train=self.cfg.cluster.initial_train)
        self.state.incarnation = _next_incarnation(self.run_dir)  # counts starts, checkpointed or not
        self.group = self.cfg.rollout.group_size
        self.per_step = self.cfg.rollout.prompts_per_step * self.group
        self.last = StepTimes()
        self.t_start = time.monotonic()
        self._items: dict[int, tuple] = {}  # step -> (work items, prompt texts) until its batch is built
        self._results: dict[int, list] = {}  # step -> generated samples, from the end of its rollout to its batch

    def install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, exit. Second: stop now."""

        def handler(signum, frame):
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            log.warning("signal %d: stopping after this step (send it again to stop now)", signum)
            self.stop_requested.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def run(self) -> dict[str, Any]:
        from dynaresize.control.commands import CommandBus
        from dynaresize.control.registry import Registry
        from dynaresize.control.server import RedisServer, connect
        from dynaresize.job.workqueue import RolloutQueue
        from dynaresize.models.store import ensure_model, load_tokenizer
        from dynaresize.policy import ResizePolicy, SwitchCostModel, from_cluster
        from dynaresize.tasks.registry import load_task

        write_resolved(self.cfg, self.run_dir)
        self.events = EventLog(self.run_dir / "events.jsonl")
        if not self.resume:
            self.events.emit(
                "run_start", run_id=self.job_id, source="runtime", world_size=self.world, wall_time=self.events.t0,
                train_ranks=format_ranks(self._trainers()), rollout_ranks=format_ranks(self._rollouts()),
            )
            self.events.emit("topology", step=0, train_ranks=format_ranks(self._trainers()), rollout_ranks=format_ranks(self._rollouts()))
        else:
            self.events.emit("control", what="resume", reason=f"incarnation {self.state.incarnation} from step {self.state.step}")
            self._rewind_batches()
        status = "failed"
        self.launcher = None
        try:
            self.task = load_task(self.cfg.task)
            self.model_dir = ensure_model(self.cfg)
            self.tokenizer = load_tokenizer(self.model_dir)
            self.policy = ResizePolicy(self.cfg.policy, SwitchCostModel(self.cfg.sim.costs, self.cfg.sim.optimizations), from_cluster(self.cfg.cluster))
            self.pstate = policy_from_dict(self.state.policy) or self.policy.initial_state()
            with RedisServer(self.cfg.redis, self.run_dir, supervise=True, on_restart=lambda why: self.events.emit("control", what="redis_restarted", reason=why)) as srv:
                self.redis = connect(srv.endpoint_file, role="coordinator", cfg=self.cfg.redis)
                if self.on_redis_ready is not None:
                    self.on_redis_ready(srv)
                self.bus = CommandBus(self.redis, self.job_id, self.cfg.redis, events=self.events)
                self.registry = Registry(self.redis, self.job_id, self.cfg.redis)
                self.queue = RolloutQueue(self.redis, self.job_id)
                self._write_launch_file()
                if self.preemption is not None:
                    self.preemption.on_checkpoint(self.checkpoint)
                try:
                    self.start_ranks()
                    self.loop()
                    status = "interrupted" if self.state.step < self.cfg.run.steps else "completed"
                    checkpoint = True
                except KeyboardInterrupt:  # a second signal: stop now; resume from the last checkpoint
                    status, checkpoint = "interrupted", False
                except BaseException:  # a rank died or a command failed: the last checkpoint stays the resume point
                    checkpoint = False
                    raise
                finally:
                    self.stop_ranks(checkpoint=checkpoint)
        finally:
            self.events.emit("run_end", status=status, steps=self.state.step)
            self.events.close()
        return self.summary(status)

    def _rewind_batches(self) -> None:
        """Steps trained after the last checkpoint were lost with the processes that trained them (a hard stop):
        they are trained again from the checkpoint, so their old records go, and the log says so."""
        path = self.run_dir / "batches.jsonl"
        if not path.exists():
            return
        keep, dropped = [], []
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the stop
            (keep if step < self.state.step else dropped).append(line if step < self.state.step else step)
        if dropped:
            self.events.emit("control", what="rewind", reason=f"steps {min(dropped)}..{max(dropped)} ran after the last "
                             f"checkpoint (step {self.state.step}) and are trained again")
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        tmp.replace(path)

    def _write_launch_file(self) -> None:
        """What every rank reads at start (local or Slurm): model, split, and where to restore state from."""
        from dynaresize.net import free_port

        launch = {
            "job_id": self.job_id, "model_dir": str(self.model_dir), "world": self.world, "n_train": self.state.n_train,
            "version": self.state.version, "checkpoint": self.state.checkpoint, "incarnation": self.state.incarnation,
            "master_port": free_port("0.0.0.0"),  # for ranks started by srun; local ranks get theirs on the command line
        }
        tmp = self.run_dir / (LAUNCH_FILE + ".tmp")
        tmp.write_text(json.dumps(launch, indent=1))
        tmp.replace(self.run_dir / LAUNCH_FILE)

    def start_ranks(self) -> None:
        from dynaresize.job.launcher import LocalLauncher

        factory = self.launcher_factory or (lambda run_dir, world, job_id, device: LocalLauncher(run_dir, world, job_id, device))
        self.launcher = factory(self.run_dir, self.world, self.job_id, self.cfg.cluster.device)
        self.launcher.start()
        deadline = time.monotonic() + 600
        while len(self.registry.live()) < self.world:
            self._check_ranks_alive()
            if time.monotonic() > deadline:
                raise JobError(f"only {len(self.registry.live())} of {self.world} ranks registered within 600 s")
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            time.sleep(0.2)
        self._call("ping", range(self.world), {})
        ranks = {r: reg.model_dump(mode="json") for r, reg in sorted(self.registry.live().items())}
        (self.run_dir / "ranks.json").write_text(json.dumps(ranks, indent=1))  # who runs where (Slurm identity)
        log.info("%d ranks up", self.world)

    def _check_ranks_alive(self) -> None:
        dead = self.launcher.dead() if hasattr(self.launcher, "dead") else {}
        if dead:
            r, code = next(iter(dead.items()))
            tail = self.launcher.log_tail(r) if hasattr(self.launcher, "log_tail") else ""
            raise JobError(f"rank {r} exited with code {code}; last lines of its log:\n{tail}")

    def stop_ranks(self, checkpoint: bool) -> None:
        if self.launcher is None:
            return
        try:
            if checkpoint and not self.launcher.dead():
                self.checkpoint()
            self.bus.send("shutdown", range(self.world), {})
        except Exception as e:  # the ranks are stopped below either way
            log.warning("could not shut the ranks down cleanly: %s", e)
        self.launcher.stop()

    # ---------------------------------------------------------------------------------------------------------
    # the schedule

    def loop(self) -> None:
        steps = self.cfg.run.steps
        k = self.state.step
        # fill the pipeline: batches k .. k+s-1 (already there after a resume, then this is a no-op)
        for j in range(k, min(k + self.bound, steps)):
            self.generate(j, wait=True)
        while k < steps and not self.stop_requested.is_set():
            t_step = time.monotonic()
            self.events.emit("step_start", step=k)
            decision = self.decide(k)
            mixed = decision is not None and decision.resize and self._mixed_ok(decision)
            if decision is not None and decision.resize and not mixed:
                self.switch(k, decision)
            ahead = k + self.bound
            gen = self.generate(ahead, wait=False) if ahead < steps and self.bound > 0 else None
            if self.bound == 0:
                self.generate(k, wait=True)
            batch = self.make_batch(k)
            train = self.train(k, batch, snapshot=mixed)
            if mixed:
                self.mixed_step(k, decision, gen, train, batch)
            else:
                self.finish(k, gen, train, batch)
            self.sync_weights(k + 1)
            k = self.state.step = k + 1
            self.state.loop_s += time.monotonic() - t_step
            self.state.elapsed_s = self._elapsed()
            self.report(k - 1, batch)
            every = self.cfg.run.checkpoint_every
            if every and k % every == 0 and k < steps:
                self.checkpoint()
            if self.preemption is not None and self.preemption.poll().value != "continue":
                break  # checkpointed by the preemption hook; requeued or stopping

    def observation(self, k: int):
        from dynaresize.policy import Observation, Topology

        return Observation(
            step=k - 1, topology=Topology(self.state.n_train, self.world - self.state.n_train),
            rollout_s=self.last.rollout_s, train_s=self.last.train_s, weight_sync_s=self.last.sync_s,
            tokens_generated=self.last.tokens_generated, tokens_trained=self.last.tokens_trained,
            mixed=getattr(self, "_switched_last", False),
        )

    def decide(self, k: int):
        """Feed the last step's measurements to the policy; ``None`` before anything was measured.

        ``policy.forced_splits`` (tests, experiments) replaces the policy's answer at the steps it names."""
        forced = self.cfg.policy.forced_splits.get(k)
        if forced is not None and forced != self.state.n_train:
            from dynaresize.policy import Action, Decision, Topology

            self._switched_last = False
            d = Decision(Action.RESIZE, Topology(forced, self.world - forced), "forced by policy.forced_splits")
            self.events.emit("decision", step=k, action=d.action.value, reason=d.reason, target_train=forced,
                             target_rollout=self.world - forced)
            return d
        if k == 0 or self.last.train_s <= 0 or not self.cfg.policy.enabled:
            self._switched_last = False
            return None
        self.pstate, d = self.policy.step(self.pstate, self.observation(k))
        self.state.policy = policy_to_dict(self.pstate)
        self._switched_last = False
        self.events.emit(
            "decision", step=k, action=d.action.value, reason=d.reason, imbalance=round(d.imbalance, 4),
            target_train=d.target.n_train, target_rollout=d.target.n_rollout,
            expected_saving_s=round(d.expected_saving_s, 4), cost_s=round(d.critical_cost_s, 4),
        )
        return d

    def _mixed_ok(self, decision) -> bool:
        """A move from training to rollout can happen inside the step (the mixed step) when a rollout runs beside
        training: the leaving trainers train batch k, then join the rollout of batch k+s, with the weights that
        batch is generated from (kept before the update), so the sample-to-version map is the static run's."""
        return self.cfg.pipeline.mixed_switch and self.bound > 0 and decision.target.n_train < self.state.n_train

    def switch(self, k: int, decision, ranks=None, rollout_version: int | None = None, mode: str = "optimized") -> str:
        """Move ranks between roles in place. ``ranks`` get the command now (default: all; ranks outside the old
        and new trainer sets only take note of the new split, so they may get it later)."""
        old, new = self.state.n_train, decision.target.n_train
        sid = f"sw{len(self.state.switches)}-s{k}"
        ranks = list(range(self.world) if ranks is None else ranks)
        self.events.emit(
            "switch_start", switch_id=sid, step=k, from_train=old, from_rollout=self.world - old, to_train=new,
            to_rollout=self.world - new, planned_critical_s=round(decision.critical_cost_s, 4), mode=mode,
        )
        t0 = time.monotonic()
        payload = {"switch_id": sid, "step": k, "from_train": old, "to_train": new}
        if rollout_version is not None:
            payload["rollout_version"] = rollout_version
        self._call("switch_role", ranks, payload)
        critical = time.monotonic() - t0
        moved = range(min(old, new), max(old, new))
        frm, to = (Role.TRAIN, Role.ROLLOUT) if new < old else (Role.ROLLOUT, Role.TRAIN)
        self.events.emit("role_change", step=k, ranks=format_ranks(moved), from_role=frm, to_role=to)
        self.state.n_train = new
        self.events.emit("topology", step=k, train_ranks=format_ranks(self._trainers()), rollout_ranks=format_ranks(self._rollouts()))
        # hidden seconds are not known yet (the optimizer stage-in runs at the next training step): the analysis
        # sums the switch's background ops from the log, and so does summary()
        self.events.emit("switch_end", switch_id=sid, critical_path_s=round(critical, 6))
        self.state.switches.append({"switch_id": sid, "step": k, "from": f"{old}:{self.world - old}", "to": f"{new}:{self.world - new}",
                                    "mode": mode, "critical_path_s": round(critical, 4), "hidden_s": 0.0})
        self._switched_last = True
        log.info("switch %s at step %d: %d -> %d trainers, %.2f s on the critical path", sid, k, old, new, critical)
        return sid

    def mixed_step(self, k: int, decision, gen, train, batch: TrainBatch) -> None:
        """The mixed step: batch k trains on the old trainer set while the rollout of batch k+s runs; then the
        leaving trainers switch and pull what is left of that rollout. Two rollouts (the old pool's and the
        newcomers') and one training pass; the old rollout ranks learn the new split when their rollout is done."""
        old, new = self.state.n_train, decision.target.n_train
        self._await_train(train, batch)
        sid = self.switch(k, decision, ranks=range(old), rollout_version=self.state.version, mode="mixed")
        late = []
        if gen is not None:
            cmd, t0, j, _ = gen
            joined = self.bus.send("generate", range(new, old), cmd.payload)
            late = [(joined, t0, j, list(range(new, old)))]
        self.last.rollout_s = self._await_generate(gen, *late) if gen is not None else 0.0
        self._call("switch_role", range(old, self.world), {"switch_id": sid, "step": k, "from_train": old, "to_train": new})

    def generate(self, j: int, wait: bool):
        """Queue batch ``j`` and let the rollout ranks pull it. Returns (command, send time) or waits for it."""
        items, _ = self._work(j)
        self.queue.publish(j, items)
        for r in range(self.world):  # nothing is in flight for j yet, except claims of an earlier incarnation
            self.queue.release(j, r)
        if self.queue.done(j) >= self.queue.total(j):
            return None
        ro = self.cfg.rollout
        payload = {"step": j, "version": self.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                   "temperature": ro.temperature, "top_p": ro.top_p}
        sent = (self.bus.send("generate", self._rollouts(), payload), time.monotonic(), j, self._rollouts())
        if wait:
            self._await_generate(sent)
            return None
        return sent

    def _await_generate(self, *sent) -> float:
        """Wait for the generate command(s) of one batch (two in a mixed step: the old pool's and the newcomers');
        only when all have acked must every sample be there. Returns the rollout's wall time from the first send."""
        j, t0, acked = sent[0][2], min(x[1] for x in sent), []
        for cmd, _, _, ranks in sent:
            acked += self._await(cmd, ranks, "generate").acks.values()
        if self.queue.done(j) < self.queue.total(j):
            raise JobError(f"generate {j}: {self.queue.total(j) - self.queue.done(j)} samples missing after every rollout rank acked")
        self._results[j] = self.queue.results(j)  # read once: the tokens now, the training batch next step
        self.last.tokens_generated = sum(len(r.response_ids) for r in self._results[j])
        return max(a.acked_at for a in acked) - (time.time() - (time.monotonic() - t0))

    def _work(self, j: int):
        """Batch j's work items and prompt texts, built (prompts sampled, tokenised) once per step."""
        if j not in self._items:
            self._items[j] = work_items(self.task, self.tokenizer, self.cfg.run.seed, j, self.cfg.rollout.prompts_per_step, self.group)
        return self._items[j]

    def make_batch(self, k: int) -> TrainBatch:
        items, texts = self._work(k)
        results = self._results.pop(k, None) or self.queue.results(k)  # not cached after a resume
        batch = build_batch(k, items, results, texts, self.task, self.tokenizer, self.group, self.bound)
        self._items.pop(k, None)
        self.redis.set(self._batch_key(k), batch.to_json(), ex=24 * 3600)
        return batch

    def _batch_key(self, k: int) -> str:
        from dynaresize.control.keys import Keys

        return f"{Keys(self.job_id).ns}:batch:{k}"

    def train(self, k: int, batch: TrainBatch, snapshot: bool = False):
        payload = {"step": k, "batch_key": self._batch_key(k), "n_train": self.state.n_train, "version_after": k + 1,
                   "snapshot": snapshot}
        return self.bus.send("train", self._trainers(), payload), time.monotonic(), self._trainers()

    def _await_train(self, train, batch: TrainBatch) -> None:
        cmd, t0, ranks = train
        res = self._await(cmd, ranks, "train")
        wall0 = time.time() - (time.monotonic() - t0)
        self.last.train_s = max(a.acked_at for a in res.acks.values()) - wall0
        self.last.tokens_trained = batch.tokens
        losses = [float((a.result or {}).get("loss", 0.0)) for a in res.acks.values()]
        self._loss = sum(losses)  # per-rank shares of the global loss add up to it

    def finish(self, k: int, gen, train, batch: TrainBatch) -> None:
        """Wait for the step's training and the overlapping rollout; record what they took."""
        self._await_train(train, batch)
        self.last.rollout_s = self._await_generate(gen) if gen is not None else 0.0

    def sync_weights(self, version: int) -> None:
        t0 = time.monotonic()
        ranks = [0] + self._rollouts()
        self._call("sync_weights", ranks, {"version": version, "n_train": self.state.n_train})
        self.last.sync_s = time.monotonic() - t0
        self.state.version = version

    def checkpoint(self, reason: str = "") -> None:
        tag = f"step-{self.state.step}"
        if self.state.checkpoint == f"checkpoints/{tag}" and (self.run_dir / "checkpoints" / "coordinator.json").exists():
            return  # this step is checkpointed already
        t0 = time.monotonic()
        self._call("stage_state", range(self.world), {"tag": tag})
        self.state.checkpoint = f"checkpoints/{tag}"
        self.state.elapsed_s = self._elapsed()
        save_state(self.run_dir, self.state)
        self.events.emit("stage", step=self.state.step, stage="checkpoint", ranks=format_ranks(range(self.world)),
                         start=self.events.now() - (time.monotonic() - t0), end=self.events.now())

    # ---------------------------------------------------------------------------------------------------------
    # bookkeeping

    def report(self, k: int, batch: TrainBatch) -> None:
        reward = sum(batch.rewards) / max(1, len(batch.rewards))
        self.state.rewards[str(k)] = reward
        self.state.samples += len(batch.keys)
        self.state.tokens += batch.tokens
        self.events.emit("step_end", step=k, samples=len(batch.keys), tokens_generated=self.last.tokens_generated,
                         tokens_trained=batch.tokens, reward_mean=round(reward, 6), loss=round(self._loss, 8),
                         rollout_s=round(self.last.rollout_s, 4), train_s=round(self.last.train_s, 4), sync_s=round(self.last.sync_s, 4))
        with open(self.run_dir / "batches.jsonl", "a") as f:
            f.write(json.dumps({"step": k, "keys": batch.keys, "versions": batch.versions, "rewards": batch.rewards,
                                "loss": self._loss, "n_train": self.state.n_train}, separators=(",", ":")) + "\n")
        if self.on_step:
            self.on_step({"step": k, "reward": reward, "roles": self.roles(), "switches": len(self.state.switches),
                          "rollout_s": self.last.rollout_s, "train_s": self.last.train_s})

    def roles(self) -> str:
        return "T" * self.state.n_train + "R" * (self.world - self.state.n_train)

    def _trainers(self) -> list[int]:
        return list(range(self.state.n_train))

    def _rollouts(self) -> list[int]:
        return list(range(self.state.n_train, self.world))

    def _elapsed(self) -> float:
        prev = getattr(self, "_elapsed_before", None)
        if prev is None:
            prev = self._elapsed_before = self.state.elapsed_s
        return prev + time.monotonic() - self.t_start

    def _call(self, kind: str, ranks, payload: dict):
        """Send a command and wait for every rank's ack, watching the ranks' liveness while waiting."""
        ranks = list(ranks)
        return self._await(self.bus.send(kind, ranks, payload), ranks, kind)

    def _await(self, cmd, ranks, what: str):
        """Wait for acks, checking that no rank process died meanwhile."""
        ranks = list(ranks)
        while True:
            res = self.bus.await_acks(cmd.command_id, ranks, timeout=2.0)
            if not res.missing:
                self._require(res, what, ranks)
                return res
            self._check_ranks_alive()
            dead = self.registry.dead()
            gone = [r for r in res.missing if r in dead]
            if gone:
                raise JobError(f"{what}: rank(s) {format_ranks(gone)} stopped heartbeating")

    def _require(self, res, what: str, ranks) -> None:
        if res.missing:
            raise JobError(f"{what}: no ack from rank(s) {format_ranks(res.missing)}")
        bad = {r: a.error for r, a in res.acks.items() if not a.ok}
        if bad:
            r, err = next(iter(sorted(bad.items())))
            raise JobError(f"{what} failed on rank {r}: {err}")

    def _hidden_by_switch(self) -> dict[str, float]:
        """Seconds of background switch ops per switch, from the event log (the deferred optimizer stage-in is
        logged by the trainers at their first step after the switch, after the switch command was acked)."""
        from dynaresize.events import EventType, ReadStats, read_events

        hidden: dict[str, float] = {}
        for ev in read_events(self.run_dir, ReadStats(), types={EventType.SWITCH_OP}):
            if not ev["critical"]:
                hidden[ev["switch_id"]] = hidden.get(ev["switch_id"], 0.0) + ev["end"] - ev["start"]
        return hidden

    def summary(self, status: str) -> dict[str, Any]:
        hidden = self._hidden_by_switch()
        for sw in self.state.switches:
            sw["hidden_s"] = round(hidden.get(sw["switch_id"], sw.get("hidden_s", 0.0)), 4)
        rewards = self.state.rewards
        steps_done = sorted(int(s) for s in rewards)
        span = max(1e-9, self.state.loop_s)  # the RL loop only: model build, start-up and checkpoints excluded
        out = {
            "status": status,
            "run_dir": str(self.run_dir),
            "steps": self.state.step,
            "samples": self.state.samples,
            "samples_per_s": round(self.state.samples / span, 4),
            "tokens_per_s": round(self.state.tokens / span, 2),
            "loop_s": round(span, 2),
            "elapsed_s": round(self.state.elapsed_s or self._elapsed(), 2),
            "reward_first": rewards[str(steps_done[0])] if steps_done else None,
            "reward_last": rewards[str(steps_done[-1])] if steps_done else None,
            "reward_first3": _mean([rewards[str(s)] for s in steps_done[:3]]),
            "reward_last3": _mean([rewards[str(s)] for s in steps_done[-3:]]),
            "switches": self.state.switches,
            "switch_critical_path_s": round(sum(s["critical_path_s"] for s in self.state.switches), 4),
            "final_split": f"{self.state.n_train}:{self.world - self.state.n_train}",
            "policy": "dynamic" if self.cfg.policy.enabled else "static",
        }
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(self.run_dir / "summary.json")
        return out


def _next_incarnation(run_dir: Path) -> int:
    """1 on a run directory's first start, then 2, 3, ... (kept in ``checkpoints/incarnation``): names this start's
    keys in Redis (e.g. the world group's rendezvous), which outlive a crash in the append-only file."""
    path = run_dir / "checkpoints" / "incarnation"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        n = int(path.read_text().strip()) + 1
    except (OSError, ValueError):
        n = 1
    path.write_text(f"{n}\n")
    return n


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class ExternalRanks:
    """The ranks are started by someone else (``srun`` in a Slurm het job): nothing to start or stop here; a dead
    rank shows up as a missing heartbeat in the registry."""

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
