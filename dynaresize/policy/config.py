"""Config of the resizing policy (section ``policy``). The policy itself is pure; this is only its knobs."""

from __future__ import annotations

from pydantic import Field

from dynaresize.config.base import Section


class PolicyConfig(Section):
    enabled: bool = Field(True, description="Resize at runtime; false holds the initial split (the static baseline)")
    ewma_alpha: float = Field(0.5, gt=0, le=1, description="Weight of the newest observation in the stage-time EWMA")
    imbalance_threshold: float = Field(
        0.15, ge=0, description="Relative stage-time imbalance |rollout-train|/max that counts as a signal"
    )
    consecutive_signals: int = Field(2, ge=1, description="Signals in a row needed before a resize is considered")
    min_dwell_steps: int = Field(3, ge=0, description="Steps a topology must be kept before it may change")
    cooldown_steps: int = Field(2, ge=0, description="Steps after a resize during which signals are ignored")
    payback_horizon_steps: int = Field(10, ge=1, description="Horizon over which the expected saving is summed")
    payback_margin: float = Field(1.5, ge=1, description="Expected saving must exceed the switch cost times this margin")
