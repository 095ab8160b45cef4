"""A worker rank's emulated accelerator: the timing model and the pacer together, and the emulated rollout engine.

The worker (dynaresize/worker/core.py) holds an :class:`Emulator` when ``cluster.device: emulated`` and paces through
it; the rollout engine is the torch engine whose per-iteration and prefill calls wait out the modelled time. The
torch engine decodes one command's batch at a time (``rollout.pull_batch`` rows, no continuous batching): a slot
freed by a finished response stays empty until the batch ends.
"""

from __future__ import annotations

from typing import Any, Sequence

from dynaresize.emulation.model import TimingModel, distinct_prompt_tokens
from dynaresize.emulation.pacer import Pacer
from dynaresize.engines.rollout_torch import TorchRollout

OVERRUNS_METRIC = "emulation.pacing"  # the metric event a rank writes with its cumulative pacing record


class Emulator:
    def __init__(self, cfg, world: int):
        self.model = TimingModel(cfg)
        self.pacer = Pacer(cfg.emulation.overrun_tolerance)
        self.world = world
        self.switch: dict[str, float] = {}  # op -> modelled seconds, of the switch this rank is in
        self.switched: tuple[int, int] | None = None  # (from, to) trainers of the last switch, until its stage-in
        self.trained_s = 0.0  # modelled training seconds since that switch
        self._reported = -1

    def report(self) -> dict[str, Any] | None:
        """The cumulative pacing record when spans were paced since the last report, else None."""
        n = sum(s.spans for s in self.pacer.kinds.values())
        if n == self._reported:
            return None
        self._reported = n
        return self.pacer.to_json()


class EmulatedRollout(TorchRollout):
    """The torch rollout engine, with each prefill and decode iteration lasting its modelled time."""

    def __init__(self, *args: Any, emulator: Emulator, **kw: Any):
        super().__init__(*args, **kw)
        self.emu = emulator

    def _prefilled(self, start: float, prompts: Sequence[Sequence[int]]) -> None:
        self.emu.pacer.finish("prefill", start, self.emu.model.prefill_s(distinct_prompt_tokens(prompts)))

    def _decoded(self, start: float, active: int, context: float) -> None:
        self.emu.pacer.finish("decode", start, self.emu.model.decode_iteration_s(active, context))
