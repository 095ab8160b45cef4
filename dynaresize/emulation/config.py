"""Config of the emulated accelerator (section ``emulation``; used when ``cluster.device: emulated``).

The GPU profile itself is not here: it is the simulator's physics of the same config (``sim.rollout`` for decode
and prefill, ``sim.train`` for training, ``switching.costs`` for weight transfers and switch ops), so one file
drives the emulated run and ``dynaresize simulate`` alike.
"""

from __future__ import annotations

from pydantic import Field

from dynaresize.config.base import Section


class EmulationConfig(Section):
    time_scale: float = Field(
        0.005, gt=0, description="Wall seconds per modelled GPU second (0.005: a 200 s modelled step lasts 1 s); one "
        "factor for every modelled duration, so ratios between runs are those of the GPU profile"
    )
    tokens_per_token: float = Field(
        200.0, gt=0, description="Modelled tokens per real token, prompts and responses alike (the tiny model's 5-28 "
        "token responses stand for 1k-5.6k-token responses of the profiled model; ASSUMPTION, a scale factor)"
    )
    overrun_tolerance: float = Field(
        0.05, ge=0, description="Real compute may exceed the modelled wall time by this fraction before it counts as an "
        "overrun (the emulation is then not faithful there; the summary lists every overrun)"
    )
