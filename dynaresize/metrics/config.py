"""Config of the run's metric loggers (section ``metrics``): JSONL always, TensorBoard and W&B (offline) on request."""

from __future__ import annotations

from pydantic import Field

from dynaresize.config.base import Section


class WandbConfig(Section):
    enabled: bool = Field(False, description="Also log to Weights & Biases, offline only (files under <run_dir>/wandb; sync them yourself)")
    project: str = Field("dynaresize", min_length=1, description="W&B project name recorded in the offline run")
    name: str | None = Field(None, description="W&B run name (null: the run directory's name)")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run")


class MetricsConfig(Section):
    tensorboard: bool = Field(
        False, description="Write TensorBoard event files to <run_dir>/tensorboard (needs the 'metrics' extra: tensorboard)"
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases in offline mode (needs the 'wandb' extra)")
