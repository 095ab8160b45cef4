"""A worker rank's emulated accelerator: the timing model and the pacer together, and the emulated rollout engine.

The worker (dynaresize/worker/core.py) holds an :class:`Emulator` when ``cluster.device: emulated`` and paces through
it; the rollout engine is the torch engine whose per-iteration and prefill calls wait out the modelled time. The
torch engine decodes one command's batch at a time (``rollout.pull_batch`` rows, no continuous batching): a slot
freed by a finished response stays empty until the batch ends.
"""

from __future__ import annotations

from typing import Any, Sequence

from dynaresize.emulation.model import WORKER_SWITCH_OPS, TimingModel, distinct_prompt_tokens
from dynaresize.emulation.pacer import Pacer
from dynaresize.engines.rollout_torch import TorchRollout
from dynaresize.events import SwitchOp

OVERRUNS_METRIC = "emulation.pacing"  # the metric event a rank writes with its cumulative pacing record


class EmulatedOutOfMemory(RuntimeError):
    """A switch into a split whose ranks the emulated GPU cannot hold (the memory model, docs/memory.md): what a real
    GPU's out-of-memory error would be, raised before the switch moves anything."""


class Emulator:
    """A rank's timing model and pacer, and the bookkeeping that spans commands: the switch in progress (its ops'
    modelled seconds on this rank) and, after a switch into training, the training that may hide the deferred
    optimizer state until the first optimizer step."""

    def __init__(self, cfg, world: int):
        self.model = TimingModel(cfg)
        self.pacer = Pacer(cfg.emulation.overrun_tolerance)
        self.world = world
        self._switch: dict[SwitchOp, float] = {}  # op -> modelled seconds, of the switch this rank is in
        self._switched: tuple[int, int] | None = None  # (from, to) trainers of the last switch, until its stage-in
        self._trained_s = 0.0  # modelled training seconds since that switch
        self._reported = -1
        from dynaresize.config.memory import memory_report

        rep = memory_report(cfg)  # the emulated GPU's memory: enforced when a figure is known (gpu_memory_gb)
        self.memory = rep.table if rep.table is not None and rep.table.capacity is not None else None

    # -- training -----------------------------------------------------------------------------------------------
    def fwd_bwd_s(self, prompt_lens: Sequence[int], response_lens: Sequence[int], n_train: int) -> float:
        """Modelled forward/backward of these samples on one of ``n_train`` trainers (counted as training that
        hides a deferred optimizer stage-in)."""
        s = self.model.train_s(prompt_lens, response_lens, n_train)
        self._trained_s += s
        return s

    def step_s(self, pending: bool) -> float:
        """Modelled optimizer step, plus what the deferred optimizer state of the last switch adds to it when it is
        installed now (``pending``: the trainer still holds it) and the training before did not hide it."""
        extra = 0.0
        if pending and self._switched is not None:
            extra = self.model.deferred_stage_in_s(*self._switched, self.world, self._trained_s)
            self._switched = None
        return self.model.optimizer_step_s() + extra

    # -- memory -------------------------------------------------------------------------------------------------
    def check_split(self, to_train: int, rank: int) -> None:
        """Raise :class:`EmulatedOutOfMemory` on every rank of a switch into a split that does not fit, all with the
        same message: the first rank whose role does not fit (rank 0 for trainers, the first rollout rank for
        rollout), its role and figures (whichever rank's error the coordinator meets first, it reads the same; and
        no rank waits in the switch's collectives for one that failed)."""
        if self.memory is None:
            return
        sp = self.memory.split(to_train)
        if sp.fits:
            return
        role, m = sp.over()[0]
        first = 0 if role == "trainer" else to_train
        raise EmulatedOutOfMemory(
            f"emulated GPU out of memory: rank {first} as a {role} of the split {to_train}:{sp.n_rollout} needs "
            f"{m.device / (1 << 30):.1f} GiB of {self.memory.capacity / (1 << 30):.1f} GiB ({m.describe()} GiB); "
            f"the switch was not made (rank {rank} stopped before moving anything)")

    # -- switches -----------------------------------------------------------------------------------------------
    def begin_switch(self, from_train: int, to_train: int, rank: int) -> None:
        self._switch = self.model.switch_ops_s(from_train, to_train, self.world, rank)
        if rank < to_train:  # a trainer after the switch: its deferred optimizer state is charged at its first step
            self._switched, self._trained_s = (from_train, to_train), 0.0

    def pace_switch_op(self, op: SwitchOp, start: float, end: float) -> float:
        """The end of switch op ``op`` begun at ``start`` (real end ``end``): its modelled seconds plus those of the
        ops before it in the switch's order that this rank did not run (an op the CPU worker skips still costs what
        the plan says); ``end`` for an op outside the switch in progress."""
        if op not in self._switch:
            return end
        modelled = 0.0
        for o in WORKER_SWITCH_OPS:
            modelled += self._switch.pop(o, 0.0)
            if o is op:
                break
        return self.pacer.finish(f"switch.{op.value}", start, modelled)

    def end_switch(self) -> None:
        self._switch = {}

    # -- weights and reports --------------------------------------------------------------------------------------
    def fetched(self, started: float, real_s: float) -> None:
        """A fetched version installs no earlier than the modelled weight transfer after its fetch started."""
        self.pacer.settle("weight_fetch", started, real_s, self.model.weight_sync_s())

    def report(self) -> dict[str, Any] | None:
        """The cumulative pacing record when spans were paced since the last report, else None."""
        n = sum(s.spans for s in self.pacer.kinds.values())
        if n == self._reported:
            return None
        self._reported = n
        return self.pacer.to_json()


class EmulatedRollout(TorchRollout):
    """The torch rollout engine, with each prefill and decode iteration lasting its modelled time, over the simulated
    GPU's KV slots (``max_running`` capped by ``sim.rollout.max_seqs_per_gpu``).

    While sequences keep running, the emulated device works back to back: an iteration (or a newcomer's prefill)
    begins where the previous one ended, not when the host got round to it, so the host's work between two
    iterations (scoring the responses that ended, completing them to the data plane, reading the next commands)
    overlaps the device's iteration, as a GPU's asynchronously launched decode overlaps its host. What does not fit
    in the modelled time is recorded as an overrun of that iteration. Once no sequence is left the chain ends: the
    next span starts when its work starts (an idle device does not bank time)."""

    def __init__(self, *args: Any, emulator: Emulator, max_running: int = 64, **kw: Any):
        super().__init__(*args, max_running=min(max_running, emulator.model.max_seqs), **kw)
        self.emu = emulator
        self._device_free: float | None = None  # end of the last paced span while sequences kept running

    def _begin(self, start: float) -> float:
        return start if self._device_free is None else min(start, self._device_free)

    def _prefilled(self, start: float, prompts: Sequence[Sequence[int]]) -> None:
        end = self.emu.pacer.finish("prefill", self._begin(start), self.emu.model.prefill_s(distinct_prompt_tokens(prompts)))
        self._device_free = end

    def _decoded(self, start: float, active: int, context: float) -> None:
        end = self.emu.pacer.finish("decode", self._begin(start), self.emu.model.decode_iteration_s(active, context))
        self._device_free = end if self.running else None

    def abort(self, keys=None) -> list[str]:
        out = super().abort(keys)
        if not self.running:
            self._device_free = None
        return out
