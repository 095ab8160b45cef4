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
samples already generated stay in the run's Redis and are reused, never generated twice); during the final
checkpoint it abandons that checkpoint (the ranks are still shut down cleanly). An operator's stop reaches EVERY
process of the job at once (``pkill``, ``kill`` of the process list): the ranks defer it until the coordinator's
``shutdown`` (like under Slurm), the embedded redis-server is started with both signals blocked (it serves the
stop's checkpoint; it is SHUTDOWN at the end), and nothing is restarted while the run stops.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis

from dynaresize.config.loader import write_resolved
from dynaresize.config.schema import Config
from dynaresize.contract.batch import TrainBatch
from dynaresize.control.commands import FencedError
from dynaresize.control.server import RedisRefusesWrites
from dynaresize.events import EventLog, Role, format_ranks
from dynaresize.job.batching import reward_errors, work_items
from dynaresize.job.filtering import BatchAssembler, UnfilledBatchError
from dynaresize.job.state import JobState, policy_from_dict, policy_to_dict, save_state

log = logging.getLogger("dynaresize.job")

LAUNCH_FILE = "launch.json"


_JOURNAL = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


class JobError(RuntimeError):
    """The job cannot go on (a rank died, a command failed); the message says which rank and why."""


class RanksLost(JobError):
    """Ranks died (process exited) or went silent (no heartbeat within the deadline) while a command waited on them."""

    def __init__(self, ranks, what: str, why: str):
        self.ranks = sorted(ranks)
        self.what = what
        self.why = why
        super().__init__(f"{what}: rank(s) {format_ranks(self.ranks)} lost ({why})")


@dataclass
class OperatorStop:
    """An operator's stop (the first SIGTERM/SIGINT) and how it ended: for the event log, the summary, the CLI."""

    signal: str  # SIGTERM or SIGINT
    at_step: int  # the step in flight when it arrived
    checkpoint: str | None = None  # the checkpoint the stop wrote (tag)
    abandoned: str | None = None  # why the checkpoint in progress was abandoned (a second signal)

    def describe(self, step: int, resume_point: str | None) -> str:
        """One line: the stop, where the run ended (``step``: the next step to train) and what a resume does."""
        head = f"{self.signal} (an operator's stop) during step {self.at_step}: stopped before step {step}"
        if self.checkpoint:
            return (f"{head}, checkpoint {self.checkpoint} written, ranks shut down; a resume continues at step {step} "
                    f"and trains no step twice")
        why = self.abandoned or "no checkpoint could be taken"
        return f"{head}, ranks shut down; {why}; a resume starts from {resume_point or 'the start'} (the steps after it are trained again)"


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
        st = self._resume_state() if self.resume else None
        self.state = st or JobState(n_train=self.cfg.cluster.initial_train)
        self.state.incarnation = _next_incarnation(self.run_dir)  # counts starts, checkpointed or not
        self.group = self.cfg.rollout.group_size
        self.per_step = self.cfg.rollout.prompts_per_step * self.group
        self.last = StepTimes()
        self.t_start = time.monotonic()
        self._items: dict[int, tuple] = {}  # step -> (work items, prompt texts) until its batch is built
        self._results: dict[int, list] = {}  # step -> generated samples, from the end of its rollout to its batch
        self._filled: set[int] = set()  # steps whose dynamic-sampling rounds are all generated (dynaresize.job.filtering)
        self._stats = None  # BatchStats of the last batch (reward shaping, dynamic sampling)
        self._train_results: list[dict] = []  # the trainers' ack results of the last step (loss metrics)
        self.restarts = 0  # automatic restarts of the ranks in this process (faults.max_restarts)
        self._ctx, self._seq = "start", {}  # where in the schedule commands are sent from (their ids, see _send)
        self.operator_stop: OperatorStop | None = None  # set by the first SIGTERM/SIGINT
        self._final = False  # stop_ranks runs: a second signal only cuts a checkpoint in progress short
        self._ckpt_tag: str | None = None  # the checkpoint directory claimed and not complete yet

    def install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish the step, checkpoint, exit. Second: stop now (while the ranks are being shut
        down: abandon the checkpoint in progress, if any, and go on shutting them down)."""

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if not self.stop_requested.is_set():
                self.operator_stop = OperatorStop(name, self.state.step)
                log.warning("%s: an operator's stop: the step in flight finishes, then every rank is checkpointed and "
                            "shut down (send it again to stop sooner)", name)
                self.stop_requested.set()
                return
            if self._final and self._ckpt_tag is None:
                log.warning("%s again: already shutting the ranks down", name)
                return
            log.warning("%s again: stopping now%s", name, " (the checkpoint in progress is abandoned)" if self._ckpt_tag else "")
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def run(self) -> dict[str, Any]:
        from dynaresize.control.commands import CommandBus
        from dynaresize.control.registry import Registry
        from dynaresize.control.server import RedisServer, connect
        from dynaresize.contract.workqueue import RolloutQueue
        from dynaresize.models.store import ensure_model, load_tokenizer
        from dynaresize.rewards import load_reward
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
        status = "failed"
        fenced = False
        self.launcher = None
        self.metrics = None
        try:
            self.metrics = self._open_metrics()
            self.task = load_task(self.cfg.task)
            if callable(getattr(self.task, "check_run", None)):
                self.task.check_run(self.cfg.run.steps, self.cfg.rollout.prompts_per_step)
            load_reward(self.cfg, self.task)  # an import path that does not resolve fails here, before any rank starts
            self.model_dir = ensure_model(self.cfg)
            self.tokenizer = load_tokenizer(self.model_dir)
            self._check_prompts()
            self.assembler = BatchAssembler.from_config(self.cfg, self.task, self.tokenizer)
            self._build_policy()
            self.pstate = policy_from_dict(self.state.policy) or self.policy.initial_state()
            with _shielded(RedisServer(self.cfg.redis, self.run_dir, supervise=True,  # a crash comes back (AOF)
                                       on_restart=lambda why: self.events.emit("control", what="redis_restarted", reason=why),
                                       owner_stopping=self.stop_requested.is_set)) as srv:  # not a stop's shutdown
                self._srv = srv
                self.redis = connect(srv.endpoint_file, role="coordinator", cfg=self.cfg.redis)
                if self.on_redis_ready is not None:
                    self.on_redis_ready(srv)
                self.bus = CommandBus(self.redis, self.job_id, self.cfg.redis, events=self.events)  # fences any older one
                self.registry = Registry(self.redis, self.job_id, self.cfg.redis)
                self.queue = RolloutQueue(self.redis, self.job_id)
                self._journal_script = self.redis.register_script(_JOURNAL)
                attached = self.resume and self._attach()
                if self.resume and not attached:
                    for r, pid in self._leftover_ranks().items():  # an incomplete earlier launch cannot be used
                        log.warning("rank %d (pid %d) of the earlier launch is still alive: killed before the restart", r, pid)
                        try:
                            os.killpg(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                    self._rewind_batches()
                if self.preemption is not None:
                    self.preemption.on_checkpoint(self.checkpoint)
                try:
                    while True:
                        try:
                            if not attached:
                                self.start_ranks()
                            attached = False
                            self._journal()
                            self.loop()
                            break
                        except RanksLost as e:  # a loss the running job cannot absorb: all ranks from the checkpoint
                            if not self._restart(e):
                                raise
                    status = "interrupted" if self.state.step < self.cfg.run.steps else "completed"
                    checkpoint = True
                except KeyboardInterrupt:  # a second signal: stop now; resume from the last checkpoint
                    status, checkpoint = "interrupted", False
                    if self.operator_stop is not None:
                        self.operator_stop.abandoned = "a second signal stopped it at once, without a checkpoint"
                except RedisRefusesWrites as e:  # a Redis problem, not a rank's: stop cleanly, say why and how to go on
                    checkpoint, self._writes_refused = False, True
                    raise JobError(f"{e}; the run stopped at step {self.state.step} (the last checkpoint is where a "
                                   "resume starts; fix Redis first)") from None
                except FencedError:  # a newer coordinator owns the run: leave its ranks and its Redis alone
                    fenced = True
                    srv.detach()
                    raise
                except BaseException as e:  # a rank died or a command failed: the last checkpoint stays the resume point
                    checkpoint = False
                    if isinstance(e, redis.ConnectionError):
                        srv.check()  # the watchdog gave up restarting Redis: raise why, not the client's symptom
                    raise
                finally:
                    if not fenced:
                        self.stop_ranks(checkpoint=checkpoint)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if not fenced:
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
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a line cut by a hard stop: named, dropped
                reason = f"{path} line {n} is not a complete record (cut by a hard stop?): dropped ({line[:60]!r})"
                log.warning("resume: %s", reason)
                self.events.emit("control", what="damaged_record", reason=reason)
                continue
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

        # a new launch: every rank slot is usable again, and processes of an earlier launch are refused
        self.registry.begin_launch(self.state.incarnation, self.world)
        if self.state.lost:  # new processes in every slot (a restart, a resume, a requeue): nobody is lost any more
            log.info("a new launch: rank(s) %s lost earlier are started again", format_ranks(self.state.lost))
            self.state.lost = []
            self._build_policy()
        for r in range(self.world):  # heartbeats of an earlier launch's processes must not count as this one's
            self.registry.forget(r)
        for j in range(self.state.step, min(self.state.step + self.bound + 1, self.cfg.run.steps)):
            for r in range(self.world):  # claims of the processes of an earlier launch are void
                self.queue.release(j, r)
        self._write_launch_file()
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
        self._final = True
        try:
            if checkpoint and not (set(self.launcher.dead()) - set(self.state.lost)):
                self._checkpoint_then_shutdown()
            elif not getattr(self, "_writes_refused", False):  # else it would wait for Redis once more: just stop them
                self.bus.send("shutdown", self._alive(), {})
        except Exception as e:  # the ranks are stopped below either way
            why = getattr(getattr(self, "_srv", None), "failure", None) if isinstance(e, redis.ConnectionError) else None
            log.warning("could not shut the ranks down cleanly: %s", why or e)
            if self.operator_stop is not None and not self.operator_stop.checkpoint:
                self.operator_stop.abandoned = f"the stop's checkpoint could not be taken ({why or e})"
        self.launcher.stop()
        self._abandon_checkpoint_in_progress()
        if self.operator_stop is not None:
            text = self.operator_stop.describe(self.state.step, self.state.checkpoint)
            log.warning("%s", text)
            self.events.emit("control", what="operator_stop", reason=text)

    def _checkpoint_then_shutdown(self) -> None:
        """The final checkpoint, then ``shutdown``; a second signal during the checkpoint abandons it (the ranks
        finish what they are staging, then take the shutdown; the directory goes once they have exited)."""
        try:
            tag = self.checkpoint()
            if self.operator_stop is not None and tag is not None:
                self.operator_stop.checkpoint = tag
        except KeyboardInterrupt:
            pass
        self.bus.send("shutdown", self._alive(), {})

    def _abandon_checkpoint_in_progress(self) -> None:
        """A checkpoint cut short by a second signal: logged; its directory (claimed by this coordinator, so no one
        else writes it) is removed once local ranks have exited; ranks started by srun may still write it, so it
        stays (incomplete: never resumed from; retain removes it later)."""
        from dynaresize.job import checkpoints as ckpt

        tag, self._ckpt_tag = self._ckpt_tag, None
        if tag is None:
            return
        reason = f"checkpoint {tag} abandoned (a second stop signal cut it short); resume point stays {self.state.checkpoint or 'none'}"
        if self.operator_stop is not None:
            self.operator_stop.abandoned = reason
        log.warning("%s", reason)
        self.events.emit("control", what="checkpoint_abandoned", reason=reason)
        if not isinstance(self.launcher, ExternalRanks):
            try:
                ckpt.discard(self.run_dir, tag)
            except OSError as e:
                log.warning("could not remove the abandoned checkpoint %s: %s", tag, e)

    # ---------------------------------------------------------------------------------------------------------
    # the schedule

    def loop(self) -> None:
        steps = self.cfg.run.steps
        k = self.state.step
        self.validate(self.state.version)  # before any update (version 0), unless done before a resume
        # fill the pipeline: batches k .. k+s-1 (already there after a resume, then this is a no-op)
        for j in range(k, min(k + self.bound, steps)):
            self._ctx, self._seq = f"f{j}", {}
            self.generate(j, wait=True)
        while k < steps and not self.stop_requested.is_set():
            t_step = time.monotonic()
            self._ctx, self._seq = f"s{k}", {}
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
            self.validate(k + 1)  # every rollout rank holds version k+1 and waits for the next step's commands
            k = self.state.step = k + 1
            self.state.loop_s += time.monotonic() - t_step
            self.state.elapsed_s = self._elapsed()
            self.report(k - 1, batch)
            every = self.cfg.run.checkpoint_every
            if every and k % every == 0 and k < steps:
                self.checkpoint()
            self._journal()
            if self.preemption is not None and self.preemption.poll().value != "continue":
                break  # checkpointed by the preemption hook; requeued or stopping

    # ---------------------------------------------------------------------------------------------------------
    # validation (a dataset task with val_files): held-out prompts, scored like training samples, never trained on

    def _check_prompts(self) -> None:
        """Chat-message prompts need the model's chat template: one message naming the record, before ranks start."""
        from dynaresize.models.hf import check_chat_template

        where = self.task.chat_record() if callable(getattr(self.task, "chat_record", None)) else None
        if where is not None:
            check_chat_template(self.tokenizer, self.model_dir, where)

    def _val_due(self, version: int) -> bool:
        every = self.cfg.task.dataset.val_every
        samples = self.task.val_samples() if callable(getattr(self.task, "val_samples", None)) else []
        return (bool(samples) and every > 0 and str(version) not in self.state.validation
                and (version % every == 0 or version == self.cfg.run.steps))

    def validate(self, version: int) -> None:
        """Generate ``val_samples`` responses per validation prompt with policy ``version`` (held by every rollout
        rank now), through the validation queue; record the mean reward and pass@k. Seeds depend on (run seed,
        prompt, index) only, so every pass answers the same draws and a resized run matches a static one."""
        from dynaresize.job.batching import val_items
        from dynaresize.contract.workqueue import RolloutQueue

        if not self._val_due(version):
            return
        t0 = time.monotonic()
        ds, ro = self.cfg.task.dataset, self.cfg.rollout
        items = val_items(self.task.val_samples(), self.tokenizer, self.cfg.run.seed, version, ds.val_samples)
        vq = RolloutQueue(self.redis, self.job_id, name="vq")
        vq.publish(version, items)
        payload = {"step": version, "version": self.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                   "temperature": ro.temperature, "top_p": ro.top_p, "validation": True}
        for _ in range(3):
            if vq.done(version) >= vq.total(version) or not self._rollouts():
                break
            for r in range(self.world):  # claims of a rank lost in an earlier attempt go back to the queue
                vq.release(version, r)
            self._await_rollout(self._send("generate", self._rollouts(), payload), self._rollouts(), version)
        results = vq.results(version)
        if len(results) < len(items):
            log.warning("validation at version %d: %d of %d samples generated; not recorded", version, len(results), len(items))
            return
        rewards = [float(r.extra.get("reward", 0.0)) for r in results]
        per_prompt = [rewards[p * ds.val_samples:(p + 1) * ds.val_samples] for p in range(len(items) // ds.val_samples)]
        rec = {"version": version, "step": version, "prompts": len(per_prompt), "k": ds.val_samples,
               "reward_mean": round(sum(rewards) / len(rewards), 6),
               "pass_at_k": round(sum(max(g) >= 1.0 for g in per_prompt) / len(per_prompt), 6),
               "reward_errors": len(reward_errors(results)), "seconds": round(time.monotonic() - t0, 3)}
        self.state.validation[str(version)] = rec
        for name in ("reward_mean", "pass_at_k"):
            self.events.emit("metric", name=f"val_{name}", value=rec[name], step=version, k=ds.val_samples)
        with open(self.run_dir / "validation.jsonl", "a") as f:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        vq.clear(version)
        log.info("validation at version %d: mean reward %.3f, pass@%d %.3f (%d prompts, %.1f s)", version,
                 rec["reward_mean"], ds.val_samples, rec["pass_at_k"], len(per_prompt), rec["seconds"])

    def observation(self, k: int):
        from dynaresize.policy import Observation, Topology

        return Observation(
            step=k - 1, topology=Topology(self.state.n_train, len(self._rollouts())),
            rollout_s=self.last.rollout_s, train_s=self.last.train_s, weight_sync_s=self.last.sync_s,
            tokens_generated=self.last.tokens_generated, tokens_trained=self.last.tokens_trained,
            mixed=getattr(self, "_switched_last", False),
        )

    def decide(self, k: int):
        """Feed the last step's measurements to the policy; ``None`` before anything was measured.

        ``policy.forced_splits`` (tests, experiments) replaces the policy's answer at the steps it names."""
        from dynaresize.policy import Action, Decision, Topology

        n_alive = len(self._alive())
        forced, why = self.cfg.policy.forced_splits.get(k), "forced by policy.forced_splits"
        if forced is not None and forced not in self._valid_counts():
            log.warning("step %d: forced split %d trainers is not possible with rank(s) %s lost; ignored", k, forced,
                        format_ranks(self.state.lost))
            forced = None
        if not self._rollouts():  # lost ranks took every rollout rank: trainers must move
            forced, why = max(self._valid_counts()), f"rank(s) {format_ranks(self.state.lost)} lost: no rollout rank left"
        if forced is not None and forced != self.state.n_train:
            self._switched_last = False
            d = Decision(Action.RESIZE, Topology(forced, n_alive - forced), why)
            self.events.emit("decision", step=k, action=d.action.value, reason=d.reason, target_train=forced,
                             target_rollout=n_alive - forced)
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
        return (self.cfg.pipeline.mixed_switch and self.bound > 0 and decision.target.n_train < self.state.n_train
                and bool(self._rollouts()))  # with no rollout rank left, no rollout runs beside training

    def switch(self, k: int, decision, ranks=None, rollout_version: int | None = None, mode: str = "optimized") -> str:
        """Move ranks between roles in place. ``ranks`` get the command now (default: all; ranks outside the old
        and new trainer sets only take note of the new split, so they may get it later)."""
        old, new = self.state.n_train, decision.target.n_train
        sid = f"sw{len(self.state.switches)}-s{k}"
        ranks = self._alive() if ranks is None else [r for r in ranks if r not in self.state.lost]
        n_alive = len(self._alive())
        self.events.emit(
            "switch_start", switch_id=sid, step=k, from_train=old, from_rollout=n_alive - old, to_train=new,
            to_rollout=n_alive - new, planned_critical_s=round(decision.critical_cost_s, 4), mode=mode,
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
        self.state.switches.append({"switch_id": sid, "step": k, "from": f"{old}:{n_alive - old}", "to": f"{new}:{n_alive - new}",
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
            joined = self._send("generate", range(new, old), cmd.payload)
            late = [(joined, t0, j, list(range(new, old)))]
        self.last.rollout_s = self._await_generate(gen, *late) if gen is not None else 0.0
        self._call("switch_role", range(old, self.world), {"switch_id": sid, "step": k, "from_train": old, "to_train": new})

    def generate(self, j: int, wait: bool):
        """Queue batch ``j`` and let the rollout ranks pull it. Returns (command, send time) or waits for it."""
        items, _ = self._work(j)
        self.queue.publish(j, items)  # claims of an earlier launch's processes were released by start_ranks
        if self.queue.done(j) >= self.queue.total(j):
            return None
        ro = self.cfg.rollout
        payload = {"step": j, "version": self.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                   "temperature": ro.temperature, "top_p": ro.top_p}
        sent = (self._send("generate", self._rollouts(), payload), time.monotonic(), j, self._rollouts())
        if wait:
            self._await_generate(sent)
            return None
        return sent

    def _await_generate(self, *sent) -> float:
        """Wait for the generate command(s) of one batch (two in a mixed step: the old pool's and the newcomers');
        only when all have acked must every sample be there. Returns the rollout's wall time from the first send."""
        j, t0, acked = sent[0][2], min(x[1] for x in sent), []
        for cmd, _, _, ranks in sent:
            acked += self._await_rollout(cmd, ranks, j)
        if self.queue.done(j) < self.queue.total(j) and not self._top_up(j, sent[0][0].payload):
            return max([a.acked_at for a in acked], default=time.time()) - (time.time() - (time.monotonic() - t0))
        if self._fill(j, sent[0][0].payload):  # extra rounds ran: the rollout ended with the last of them
            acked = []
        self._results[j] = self.queue.results(j)  # read once: the tokens now, the training batch next step
        self.last.tokens_generated = sum(len(r.response_ids) for r in self._results[j])
        return max([a.acked_at for a in acked], default=time.time()) - (time.time() - (time.monotonic() - t0))

    def _await_rollout(self, cmd, ranks, j: int) -> list:
        """Acks of one generate command. A rollout rank lost meanwhile is fenced off and removed (``faults.shrink``):
        its claimed samples go back to the queue and the survivors' acks are awaited."""
        ranks, acked = [r for r in ranks if r not in self.state.lost], []
        while ranks:
            try:
                return acked + list(self._await(cmd, ranks, "generate").acks.values())
            except RanksLost as e:
                if not self._can_shrink(e.ranks):
                    raise
                self._shrink(e.ranks, e.why)
                ranks = [r for r in ranks if r not in self.state.lost]
        return acked

    def _top_up(self, j: int, payload: dict) -> bool:
        """Samples of batch j are missing after every rollout rank acked: claims orphaned by a lost rank, or by a
        claim whose reply was lost to a Redis restart. Put them back and let the live rollout ranks pull them (with
        the weights they hold now: the same version, or after a boundary switch a newer one, within the staleness
        bound). Returns False when no rollout rank is left (the next step moves a trainer, then tops up)."""
        for attempt in range(3):
            missing = self.queue.total(j) - self.queue.done(j)
            if missing <= 0:
                return True
            rollouts = self._rollouts()
            if not rollouts:
                return False
            for r in range(self.world):  # every rank that generated for j acked (or is lost): nothing is in flight
                self.queue.release(j, r)
            self.events.emit("control", what="redispatch", reason=f"batch {j}: {missing} sample(s) put back to the queue "
                             f"and pulled by rank(s) {format_ranks(rollouts)}")
            cmd = self._send("generate", rollouts, {**payload, "version": self.state.version})
            self._await_rollout(cmd, rollouts, j)
        missing = self.queue.total(j) - self.queue.done(j)
        if missing > 0:
            raise JobError(f"generate {j}: {missing} samples still missing after 3 re-dispatches")
        return True

    def _fill(self, j: int, payload: dict) -> bool:
        """Dynamic sampling: while batch j has too few groups with unequal rewards, queue an extra round of prompts
        under step j and let the rollout ranks pull it (same policy version). A replay of the plan from the stored
        samples (after a resume) adds and generates nothing twice. Returns whether a round was generated now."""
        if j in self._filled or not self.assembler.filtering:
            return False
        ran = False
        while True:
            items, texts = self._work(j)
            n = self.assembler.next_round(j, items, texts, self.queue.results(j))
            if not n:
                break
            more, more_texts = work_items(self.task, self.tokenizer, self.cfg.run.seed, j, n, self.group, first=len(texts),
                                          stride=self._stride())
            self._items[j] = (items + more, texts + more_texts)
            self.queue.extend(j, self.assembler.rounds_of(len(texts) + n), more)
            if self.queue.done(j) < self.queue.total(j):
                if not self._rollouts():
                    return ran  # no rollout rank left: make_batch tops up once a trainer has moved
                cmd = self._send("generate", self._rollouts(), {**payload, "version": self.state.version})
                self._await_rollout(cmd, self._rollouts(), j)
                if self.queue.done(j) < self.queue.total(j) and not self._top_up(j, payload):
                    return ran
                ran = True
        self._filled.add(j)
        return ran

    def _stride(self) -> int:
        """Prompts a step may use at most: the step's own, plus every extra round dynamic sampling may add. A dataset
        task's step ``k`` reads records ``k * stride ..``, so no round ever takes a record of another step."""
        a = self.assembler
        return self.cfg.rollout.prompts_per_step + (a.max_rounds * a.round_prompts if a.filtering else 0)

    def _work(self, j: int):
        """Batch j's work items and prompt texts, built (prompts sampled, tokenised) once per step."""
        if j not in self._items:
            self._items[j] = work_items(self.task, self.tokenizer, self.cfg.run.seed, j, self.cfg.rollout.prompts_per_step,
                                        self.group, stride=self._stride())
            if j == self.state.step and not getattr(self, "_shown_prompt", False):  # what the model is really given
                self._shown_prompt = True
                first = self._items[j][0][0]
                self.events.emit("control", what="prompt_rendered", reason=self.tokenizer.decode(first.prompt_ids),
                                 key=first.key, tokens=len(first.prompt_ids))
        return self._items[j]

    def make_batch(self, k: int) -> TrainBatch:
        items, texts = self._work(k)
        if self.queue.done(k) < self.queue.total(k):  # lost ranks left it short and no rollout rank was left then
            ro = self.cfg.rollout
            self._top_up(k, {"step": k, "version": self.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                             "temperature": ro.temperature, "top_p": ro.top_p})
            self._results.pop(k, None)
        results = self._results.pop(k, None) or self.queue.results(k)  # not cached after a resume
        if self.assembler.filtering and k not in self._filled:  # after a resume: replay (and finish) its rounds
            ro = self.cfg.rollout
            self._fill(k, {"step": k, "version": self.state.version, "pull_batch": ro.pull_batch, "max_tokens": ro.max_tokens,
                           "temperature": ro.temperature, "top_p": ro.top_p})
            items, texts = self._work(k)  # with the rounds' prompts
            results = self.queue.results(k)
        self._check_rewards(k, results)
        try:
            batch, self._stats = self.assembler.build(k, items, texts, results)
        except UnfilledBatchError as e:
            raise JobError(str(e)) from None
        self._items.pop(k, None)
        self._filled.discard(k)
        if self._stats.groups_filler:
            self.events.emit("control", what="dynamic_sampling_unfilled", reason=f"batch {k}: {self._stats.groups_kept} "
                             f"groups with unequal rewards in {self._stats.groups_generated} prompts; "
                             f"{self._stats.groups_filler} dropped group(s) trained on to keep the batch size")
        self.redis.set(self._batch_key(k), batch.to_json(), ex=24 * 3600)
        return batch

    def _check_rewards(self, k, results) -> None:
        """Reward failures the rollout ranks reported: each one an event and a warning naming the sample (its
        score is 0); with ``reward.on_error: fail`` the first one fails the run."""
        errors = reward_errors(results)
        for err in errors[:20]:
            self.events.emit("control", what="reward_error", reason=err, step=k)
        if errors:
            log.warning("batch %s: %d reward failure(s) scored 0, e.g. %s", k, len(errors), errors[0])
            if self.cfg.reward.on_error == "fail":
                raise JobError(f"reward failed ({len(errors)} sample(s) of batch {k}; reward.on_error=fail): {errors[0]}")

    def _batch_key(self, k: int) -> str:
        from dynaresize.control.keys import Keys

        return f"{Keys(self.job_id).ns}:batch:{k}"

    def train(self, k: int, batch: TrainBatch, snapshot: bool = False):
        payload = {"step": k, "batch_key": self._batch_key(k), "n_train": self.state.n_train, "version_after": k + 1,
                   "snapshot": snapshot}
        return self._send("train", self._trainers(), payload), time.monotonic(), self._trainers()

    def _await_train(self, train, batch: TrainBatch) -> None:
        cmd, t0, ranks = train
        res = self._await(cmd, ranks, "train")
        wall0 = time.time() - (time.monotonic() - t0)
        self.last.train_s = max(a.acked_at for a in res.acks.values()) - wall0
        self.last.tokens_trained = batch.tokens
        losses = [float((a.result or {}).get("loss", 0.0)) for a in res.acks.values()]
        self._loss = sum(losses)  # per-rank shares of the global loss add up to it
        self._train_results = [a.result or {} for _, a in sorted(res.acks.items())]

    def finish(self, k: int, gen, train, batch: TrainBatch) -> None:
        """Wait for the step's training and the overlapping rollout; record what they took."""
        self._await_train(train, batch)
        self.last.rollout_s = self._await_generate(gen) if gen is not None else 0.0

    def sync_weights(self, version: int) -> None:
        t0 = time.monotonic()
        ranks = [0] + self._rollouts()
        self._call("sync_weights", ranks, {"version": version, "n_train": self.state.n_train, "lost": self.state.lost})
        self.last.sync_s = time.monotonic() - t0
        self.state.version = version

    def checkpoint(self, reason: str = "") -> str | None:
        """Every rank stages its state under ``checkpoints/<tag>/``, then the coordinator writes the tag's own
        state, then the top-level ``coordinator.json``, then old checkpoints beyond ``run.keep_checkpoints`` go.
        Returns the tag written (None: not written). The tag is a directory this coordinator claimed for the attempt
        (``step-<k>``, or ``step-<k>.<n>`` when the name is taken: a checkpoint another coordinator may still be
        writing is never deleted or reused). A replayed ack of ``stage_state`` is trusted only when what it names is
        there and intact; otherwise the ranks stage again into a new directory (a new command id: applied, not
        answered from the stored ack). A staging failure on a rank (a full disk: its ack carries the StagingError)
        or a failed state write is not fatal: a ``checkpoint_failed`` event, the partial tag removed, the previous
        checkpoint stays the resume point, the run goes on. A lost rank (dead, silent) is handled as before."""
        from dynaresize.job import checkpoints as ckpt

        step = self.state.step
        done = Path(self.state.checkpoint).name if self.state.checkpoint else None
        if done and ckpt.tag_step(done) == step and (self.run_dir / "checkpoints" / "coordinator.json").exists():
            return done  # this step is checkpointed already
        t0 = time.monotonic()
        ranks = self._alive()
        for attempt in (1, 2):
            tag = self._claim_checkpoint(step)
            staged = self._stage_into(tag, ranks) if tag is not None else None
            if staged is None:
                return None
            untrusted = self._untrusted_replays(tag, staged)
            if not untrusted:
                break
            again = "; the ranks stage again into a new directory" if attempt == 1 else ""
            self._checkpoint_failed(tag, {r: why + again for r, why in untrusted.items()})
        else:
            return None
        previous = self.state.checkpoint
        self.state.checkpoint = f"checkpoints/{tag}"
        self.state.elapsed_s = self._elapsed()
        self.bus.check_epoch()
        try:
            ckpt.save_tag_state(self.run_dir, tag, self.state)
            save_state(self.run_dir, self.state)
        except OSError as e:
            from dynaresize.staging import os_error_text

            self.state.checkpoint = previous
            self._checkpoint_failed(tag, {None: f"writing the coordinator state: {os_error_text(e)}"})
            return None
        self._ckpt_tag = None
        try:
            removed = ckpt.retain(self.run_dir, self.cfg.run.keep_checkpoints, current=tag)
            if removed:
                log.info("checkpoint %s written; removed older checkpoints %s", tag, ", ".join(removed))
        except OSError as e:  # the new checkpoint is in place; an old one left behind only takes space
            log.warning("checkpoint %s written, but removing older ones failed: %s", tag, e)
        self.events.emit("stage", step=self.state.step, stage="checkpoint", ranks=format_ranks(range(self.world)),
                         start=self.events.now() - (time.monotonic() - t0), end=self.events.now())
        return tag

    def _claim_checkpoint(self, step: int) -> str | None:
        """A fresh checkpoint directory for this attempt, owned by this coordinator (``checkpoints.claim_tag``)."""
        from dynaresize.job import checkpoints as ckpt

        try:
            self._ckpt_tag = ckpt.claim_tag(self.run_dir, step, {"epoch": self.bus.epoch, "run_id": self.job_id,
                                                                 "incarnation": self.state.incarnation})
        except OSError as e:
            from dynaresize.staging import os_error_text

            self._checkpoint_failed(f"step-{step}", {None: f"creating its directory: {os_error_text(e)}"}, discard=False)
            return None
        return self._ckpt_tag

    def _stage_into(self, tag: str, ranks: list[int]):
        """Every live rank stages its state into ``tag``: their acks, or None when a rank's staging failed
        (handled: logged, the tag removed)."""
        cmd = self._send("stage_state", ranks, {"tag": tag})
        try:
            return self._await(cmd, ranks, "stage_state")
        except RanksLost:
            self._ckpt_tag = None  # left incomplete (a resume sets it aside): not a stop's abandoned checkpoint
            raise  # a rank died or went silent: handled as before (restart, or the job fails)
        except JobError:
            failed = self._staging_failures(cmd, ranks)
            if not failed:
                self._ckpt_tag = None
                raise  # a rank failed for another reason than staging: as before
            self._checkpoint_failed(tag, failed)
            return None

    def _untrusted_replays(self, tag: str, staged) -> dict[int, str]:
        """Ranks whose ``stage_state`` ack was replayed (the stored result of an earlier application of the same
        command, e.g. the one a coordinator taken over from sent) while what it names is gone or damaged."""
        from dynaresize.job import checkpoints as ckpt

        out = {}
        for r, ack in sorted(staged.acks.items()):
            if not ack.replayed:
                continue
            problems = ckpt.rank_problems(self.run_dir, tag, r, self.state.version, self.state.n_train)
            if problems:
                out[r] = (f"rank {r}'s stage_state ack was replayed (the stored result of its first application; "
                          f"nothing was staged again), but what it names is gone or damaged: {problems[0]}; not trusted")
        return out

    # ---------------------------------------------------------------------------------------------------------
    # bookkeeping

    def report(self, k: int, batch: TrainBatch) -> None:
        self.bus.check_epoch()  # a coordinator that was fenced off while hung writes nothing more to the run
        reward = sum(batch.rewards) / max(1, len(batch.rewards))
        self.state.rewards[str(k)] = reward
        self.state.samples += len(batch.keys)
        self.state.tokens += batch.tokens
        stats = self._stats.as_dict() if self._stats is not None else {}
        self.events.emit("step_end", step=k, samples=len(batch.keys), tokens_generated=self.last.tokens_generated,
                         tokens_trained=batch.tokens, reward_mean=round(reward, 6), loss=round(self._loss, 8),
                         rollout_s=round(self.last.rollout_s, 4), train_s=round(self.last.train_s, 4), sync_s=round(self.last.sync_s, 4),
                         **{n: (round(v, 6) if isinstance(v, float) else v) for n, v in stats.items() if n != "reward_mean"})
        self._log_metrics(k, batch, stats)
        with open(self.run_dir / "batches.jsonl", "a") as f:
            f.write(json.dumps({"step": k, "keys": batch.keys, "versions": batch.versions, "rewards": batch.rewards,
                                "loss": self._loss, "n_train": self.state.n_train}, separators=(",", ":")) + "\n")
        if self.on_step:
            self.on_step({"step": k, "reward": reward, "roles": self.roles(), "switches": len(self.state.switches),
                          "rollout_s": self.last.rollout_s, "train_s": self.last.train_s})

    def _open_metrics(self):
        from dynaresize.metrics import MissingLoggerError, open_loggers

        try:
            return open_loggers(self.cfg.metrics, self.run_dir, config=self.cfg.model_dump(mode="json"), warn=log.warning)
        except MissingLoggerError as e:
            raise JobError(str(e)) from None

    def _log_metrics(self, k: int, batch: TrainBatch, stats: dict) -> None:
        """The step's scalars to every configured logger (``dynaresize.metrics.step_metrics`` names them)."""
        from dynaresize.metrics import step_metrics

        if self.metrics is not None:
            self.metrics.log(k, step_metrics(batch, self._train_results, self.last, self.state, n_rollout=len(self._rollouts()),
                                             max_tokens=self.cfg.rollout.max_tokens, eos_id=self.tokenizer.eos_token_id, stats=stats))

    def roles(self) -> str:
        return "".join("x" if r in self.state.lost else "T" if r < self.state.n_train else "R" for r in range(self.world))

    def _trainers(self) -> list[int]:
        return list(range(self.state.n_train))

    def _rollouts(self) -> list[int]:
        return [r for r in range(self.state.n_train, self.world) if r not in self.state.lost]

    def _alive(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.state.lost]

    # ---------------------------------------------------------------------------------------------------------
    # losing ranks

    def _valid_counts(self, lost=None) -> list[int]:
        """Trainer counts possible now: the trainer set is a prefix (its pre-built group must not hold a lost
        rank) and at least one live rank is left to roll out."""
        from dynaresize.comm.groups import candidate_trainer_counts, unit_from_cluster

        lost = set(self.state.lost if lost is None else lost)
        cap = min(lost) if lost else self.world
        n_alive = self.world - len(lost)
        return [t for t in candidate_trainer_counts(self.world, unit_from_cluster(self.cfg.cluster)) if t <= cap and n_alive - t >= 1]

    def _build_policy(self) -> None:
        """The policy plans over the live ranks only: after a shrink its candidates are the splits still possible."""
        from dynaresize.policy import ResizePolicy, SwitchCostModel, Topology

        n_alive = len(self._alive())
        cands = [Topology(t, n_alive - t) for t in self._valid_counts()]
        self.policy = ResizePolicy(self.cfg.policy, SwitchCostModel(self.cfg.switching.costs, self.cfg.switching.optimizations), cands)

    def _can_shrink(self, ranks) -> bool:
        """Only rollout ranks can go while the job runs on: a trainer holds a ZeRO shard nobody else has, rank 0 is
        the weight source, and a trainer count must stay possible."""
        lost = set(self.state.lost) | set(ranks)
        return (self.cfg.faults.shrink and 0 not in ranks and all(r >= self.state.n_train for r in ranks)
                and bool(self._valid_counts(lost)))

    def _shrink(self, ranks, why: str) -> None:
        """Fence the lost ranks off (a hung process that comes back is refused), put their claimed samples back,
        and re-plan over the live ranks."""
        for r in ranks:
            inc = self.registry.fence(r)
            self.events.emit("control", what="rank_lost", reason=why, rank=r, epoch=self.bus.epoch)
            log.warning("rank %d lost (%s): fenced off (incarnation now %d)", r, why, inc)
        self.state.lost = sorted(set(self.state.lost) | set(ranks))
        for j in range(self.state.step, min(self.state.step + self.bound + 1, self.cfg.run.steps)):
            for r in ranks:
                self.queue.release(j, r)
        self._build_policy()
        self.events.emit("control", what="shrink", reason=f"running on {len(self._alive())} of {self.world} ranks "
                         f"({format_ranks(self._alive())}); possible trainer counts {self._valid_counts()}")

    def _journal(self) -> None:
        """The state after the last finished step, in Redis, written only while this coordinator's epoch is the
        job's (one Lua script): what a coordinator that takes over continues from (:meth:`_attach`)."""
        from dataclasses import asdict

        from dynaresize.control.commands import FencedError
        from dynaresize.control.keys import Keys

        data = {"state": asdict(self.state), "last": asdict(self.last), "switched_last": getattr(self, "_switched_last", False)}
        keys = Keys(self.job_id)
        if not int(self._journal_script(keys=[keys.epoch, keys.journal], args=[self.bus.epoch, json.dumps(data)])):
            self.bus.check_epoch()
            raise FencedError(f"job {self.job_id}: journal not written (epoch {self.bus.epoch} is not the job's)")

    def _attach(self) -> bool:
        """``--resume`` while the ranks of the run are still alive (the coordinator was killed or hung, its ranks
        were not; its Redis either still answers and was adopted, or died with it and was started again on the same
        port from its append-only file): take the ranks over as they are, from the journal, instead of restarting
        them from the last checkpoint. The new epoch (taken already) fences off the old coordinator; the step in flight is run
        again with the same command ids, so what the ranks already applied is answered from their stored acks."""
        from dynaresize.control.keys import Keys
        from dynaresize.job.launcher import AttachedRanks

        raw = self.redis.get(Keys(self.job_id).journal)
        if raw is None:
            return False
        try:
            j = json.loads(raw)
            st = JobState(**j["state"])
            launch = json.loads((self.run_dir / LAUNCH_FILE).read_text())
        except (ValueError, TypeError, KeyError, OSError) as e:
            log.warning("journal or launch file unreadable (%s): resuming from the checkpoint", e)
            return False
        want = [r for r in range(self.world) if r not in st.lost]
        leftovers = self._leftover_ranks()
        if self.launcher_factory is not None or set(leftovers) != set(want):
            # only local ranks whose processes are seen alive are taken over; a Slurm requeue starts every rank
            # anew (and right after a Redis restart stale heartbeats still look fresh, so they prove nothing)
            return False
        # ranks whose registration expired while Redis was down (it dies with a killed coordinator and comes back
        # with this one) register again within a heartbeat or two: give them the heartbeat deadline and some
        deadline = time.monotonic() + (self.cfg.redis.heartbeat_s * self.cfg.redis.dead_after_heartbeats + 10 if leftovers else 0)
        while True:
            live = self.registry.live()
            if all(r in live for r in want) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if launch.get("incarnation") != st.incarnation or any(r not in live for r in want):
            return False  # run() stops what is left of that launch
        st.elapsed_s, st.loop_s = max(st.elapsed_s, self.state.elapsed_s), max(st.loop_s, self.state.loop_s)
        self.state = st
        self.last = StepTimes(**j.get("last", {}))
        self._switched_last = bool(j.get("switched_last", False))
        self._build_policy()
        self.pstate = policy_from_dict(st.policy) or self.policy.initial_state()
        self.launcher = AttachedRanks(self.run_dir, {r: live[r] for r in want})
        self._rewind_batches()
        self.events.emit("control", what="attach", reason=f"took over {len(want)} live rank(s) of launch {st.incarnation} "
                         f"at step {st.step} with epoch {self.bus.epoch}; the step in flight runs again, applied commands answered from their acks",
                         epoch=self.bus.epoch)
        log.warning("attached to %d live ranks at step %d (epoch %d)", len(want), st.step, self.bus.epoch)
        return True

    def _leftover_ranks(self) -> dict[int, int]:
        """Rank processes of this run's last launch still alive on this host (from ``ranks.json``; a pid counts
        only while its command line still names this run, so a recycled pid is never taken)."""
        import socket

        from dynaresize.control.server import pid_alive

        try:
            ranks = json.loads((self.run_dir / "ranks.json").read_text())
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
            if "dynaresize" in cmdline and self.run_dir.name in cmdline:  # --run-dir may be relative or absolute
                out[int(r)] = int(pid)
        return out

    def _restart(self, e: RanksLost) -> bool:
        """Restart every rank from the last checkpoint (local launches only; bounded by faults.max_restarts).
        A new epoch fences off whatever the killed processes had in flight."""
        from dynaresize.control.commands import CommandBus

        if self.stop_requested.is_set():  # never start ranks again while the run stops
            why = f"{self.operator_stop.signal}, an operator's stop" if self.operator_stop else "a stop was requested"
            raise JobError(f"{e}; not restarted: the run is stopping ({why})") from None
        relaunch = getattr(self.launcher, "relaunchable", False)
        if not relaunch or self.restarts >= self.cfg.faults.max_restarts:
            return False
        self.restarts += 1
        old = self._resume_state() or JobState(n_train=self.cfg.cluster.initial_train)  # the newest intact checkpoint
        where = f"checkpoint {old.checkpoint} (step {old.step})" if old.checkpoint else "the start"
        self.events.emit("control", what="restart", reason=f"{e}; restart {self.restarts}/{self.cfg.faults.max_restarts}: "
                         f"every rank again from {where}")
        log.warning("%s: restarting every rank from %s (restart %d/%d)", e, where, self.restarts, self.cfg.faults.max_restarts)
        self.launcher.stop(grace_s=0.0)
        old.incarnation = _next_incarnation(self.run_dir)
        old.elapsed_s, old.loop_s = self.state.elapsed_s, self.state.loop_s
        self.state = old
        self._rewind_batches()
        self._items.clear()
        self._results.clear()
        self._filled.clear()
        self.assembler.forget()
        self.last = StepTimes()
        self.bus = CommandBus(self.redis, self.job_id, self.cfg.redis, events=self.events)  # new epoch
        self._build_policy()
        self.pstate = policy_from_dict(self.state.policy) or self.policy.initial_state()
        return True

    def _elapsed(self) -> float:
        prev = getattr(self, "_elapsed_before", None)
        if prev is None:
            prev = self._elapsed_before = self.state.elapsed_s
        return prev + time.monotonic() - self.t_start

    def _call(self, kind: str, ranks, payload: dict):
        """Send a command and wait for every rank's ack, watching the ranks' liveness while waiting."""
        ranks = [r for r in ranks if r not in self.state.lost]
        return self._await(self._send(kind, ranks, payload), ranks, kind)

    def _send(self, kind: str, ranks, payload: dict):
        """Send with an id that a coordinator re-running the same step from the journal computes again: the ranks
        answer such a resent command with the stored result of its first application instead of applying it twice
        (launch incarnation, step, kind, how many of that kind so far in the step, digest of ranks and payload)."""
        import hashlib

        ranks = list(ranks)
        n = self._seq.get(kind, 0)
        self._seq[kind] = n + 1
        digest = hashlib.blake2b(json.dumps([ranks, payload], sort_keys=True).encode(), digest_size=4).hexdigest()
        cid = f"i{self.state.incarnation}.{self._ctx}.{kind}.{n}.{digest}"
        return self.bus.send(kind, ranks, payload, command_id=cid)

    def _await(self, cmd, ranks, what: str):
        """Wait for acks, watching the ranks waited on: one whose process exited or whose heartbeat is older than
        the deadline (hung, SIGSTOPped, its node gone) raises :class:`RanksLost`."""
        ranks = [r for r in ranks if r not in self.state.lost]
        while True:
            res = self.bus.await_acks(cmd.command_id, ranks, timeout=2.0)
            if not res.missing:
                self._require(res, what, ranks)
                return res
            self.registry.check_writable()  # ranks wait while Redis refuses writes: so do we (bounded), then stop
            exited = self.launcher.dead() if hasattr(self.launcher, "dead") else {}
            gone = {r: f"process exited with code {exited[r]}" for r in res.missing if r in exited}
            silent = self.registry.dead()
            gone.update({r: f"no heartbeat for {silent[r]:.1f} s" for r in res.missing if r in silent and r not in gone})
            if gone:
                err = RanksLost(gone, what, "; ".join(f"rank {r}: {w}" for r, w in sorted(gone.items())))
                if hasattr(self.launcher, "log_tail") and any(r in exited for r in gone):
                    r0 = next(r for r in sorted(gone) if r in exited)
                    err.args = (f"{err}; last lines of rank {r0}'s log:\n{self.launcher.log_tail(r0)}",)
                raise err

    def _require(self, res, what: str, ranks) -> None:
        if res.missing:
            raise JobError(f"{what}: no ack from rank(s) {format_ranks(res.missing)}")
        bad = {r: a.error for r, a in res.acks.items() if not a.ok}
        if bad:
            r, err = next(iter(sorted(bad.items())))
            if (err or "").startswith(RedisRefusesWrites.__name__):  # the rank's Redis writes were refused: not the rank's fault
                self._writes_refused = True
                raise JobError(f"{err.split(': ', 1)[-1]} (while rank {r} ran {what}); the run stopped at step "
                               f"{self.state.step} (the last checkpoint is where a resume starts; fix Redis first)")
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
            **_validation_summary(self.state.validation),
            "policy": "dynamic" if self.cfg.policy.enabled else "static",
        }
        if self.operator_stop is not None:
            out["operator_stop"] = {**asdict(self.operator_stop),
                                    "text": self.operator_stop.describe(self.state.step, self.state.checkpoint)}
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(self.run_dir / "summary.json")
        return out

    # ---------------------------------------------------------------------------------------------------------
    # checkpoint faults (dynaresize.job.checkpoints)

    def _staging_failures(self, cmd, ranks: list[int]) -> dict[int, str]:
        """After ``stage_state`` failed: the ranks whose ack carries a StagingError, with its text; empty when any
        rank did not ack (dead) or failed for another reason, so the caller fails the job as before."""
        res = self.bus.await_acks(cmd.command_id, ranks, timeout=1.0)
        bad = {r: a.error or "" for r, a in res.acks.items() if not a.ok}
        if res.missing or not bad or not all("StagingError" in e for e in bad.values()):
            return {}
        return bad

    def _checkpoint_failed(self, tag: str, failures: dict[int | None, str], discard: bool = True) -> None:
        """Log why checkpoint ``tag`` was not written; remove it when it is this coordinator's (``discard``)."""
        from dynaresize.job import checkpoints as ckpt

        keep = self.state.checkpoint or "none (a resume starts from scratch)"
        for r, err in sorted(failures.items(), key=lambda x: -1 if x[0] is None else x[0]):
            reason = f"{tag} not written: {err}; resume point stays {keep}"
            log.warning("checkpoint %s failed%s: %s", tag, "" if r is None else f" on rank {r}", reason)
            try:
                self.events.emit("control", what="checkpoint_failed", reason=reason, **({} if r is None else {"rank": r}))
            except OSError as e:  # the run directory's disk may be the full one: the warning above still says it
                log.warning("could not log checkpoint_failed: %s", e)
        if not discard:
            return
        if self._ckpt_tag == tag:
            self._ckpt_tag = None
        try:
            ckpt.discard(self.run_dir, tag)
        except OSError as e:
            log.warning("could not remove the failed checkpoint %s: %s", tag, e)

    def _resume_state(self) -> JobState | None:
        """The state a resume starts from: the newest checkpoint that verifies (``checkpoints.select_resume``).
        Newer tags found damaged are logged (``control`` what=checkpoint_skipped, naming the file) and set aside
        under ``checkpoints/damaged/``; a damaged or stale top-level ``coordinator.json`` is rewritten from the
        chosen tag's own copy. None intact: StateError (nothing deleted)."""
        from dynaresize.job import checkpoints as ckpt

        res = ckpt.select_resume(self.run_dir, self.world)
        if res is None:
            return None
        notes: list[str] = []
        if res.state_file_problem is not None:
            notes.append(f"{res.state_file_problem}; using the copy in checkpoints/{res.tag}")
        for tag, why in res.skipped:
            where = ""
            writer = ckpt.live_writer(self.run_dir, tag) if (self.run_dir / "checkpoints" / tag).is_dir() else None
            if writer is not None:  # a coordinator this one takes over from may still be writing it: not touched
                where = f"; left in place: {writer} may still be writing it"
            elif (self.run_dir / "checkpoints" / tag).is_dir():
                try:
                    where = f"; set aside as {ckpt.set_aside(self.run_dir, tag).relative_to(self.run_dir)}"
                except OSError as e:
                    where = f"; could not set it aside: {e}"
            notes.append(f"{tag} skipped: {why}{where}; resuming from {res.tag}")
        for note in notes:
            log.warning("resume: %s", note)
        if notes:
            with EventLog(self.run_dir / "events.jsonl") as ev:  # before run() opens the log: these precede 'resume'
                for note in notes:
                    ev.emit("control", what="checkpoint_skipped", reason=note)
        top = self.run_dir / "checkpoints" / "coordinator.json"
        if res.tag is not None and (res.state_file_problem is not None or res.skipped or not top.exists()):
            try:
                save_state(self.run_dir, res.state)  # the resume point of record is the chosen, intact one
            except OSError as e:
                log.warning("resume: could not rewrite %s: %s (the checkpoint tags are used next time too)", top, e)
        return res.state


@contextmanager
def _shielded(srv):
    """Start the run's redis-server with SIGTERM and SIGINT blocked, so that it, and every server its watchdog
    starts again (the watchdog thread is created meanwhile and keeps the mask), inherits them blocked: an
    operator's stop sent to every process of the job leaves Redis serving the stop's checkpoint; the coordinator
    SHUTDOWNs it at the end. Only this thread's mask changes, and only while the server starts."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        srv.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        yield srv
    finally:
        srv.stop()


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


def _validation_summary(val: dict[str, dict]) -> dict[str, Any]:
    """First and last validation pass (by policy version) for the summary; empty when none ran."""
    if not val:
        return {}
    first, last = val[min(val, key=int)], val[max(val, key=int)]
    return {"val_reward_first": first["reward_mean"], "val_reward_last": last["reward_mean"],
            "val_pass_at_k_first": first["pass_at_k"], "val_pass_at_k_last": last["pass_at_k"], "val_k": last["k"],
            "val_versions": [first["version"], last["version"]]}


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
