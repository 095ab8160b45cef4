"""Config of the discrete-event simulator (section ``sim``). Filled in by the simulator issue."""

from __future__ import annotations

from pydantic import Field

from dynaresize.config.base import Section


class SimConfig(Section):
    steps: int = Field(200, ge=1, description="RL steps to simulate")
