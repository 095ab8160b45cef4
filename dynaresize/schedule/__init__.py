"""The pipeline scheduler core (pure): events in, actions out, shared by the simulator and the runtime.

See :mod:`dynaresize.schedule.core` for the state machine and docs/schedule.md for its state diagram.
"""

from dynaresize.schedule.core import PipelineScheduler, replay
from dynaresize.schedule.types import (
    Assign, Decided, DynamicSampling, Extend, GroupsDone, Mechanisms, OptimizerStepDone, RankLost, RankReady, Restart, Role,
    ScheduleError, SchedulerAction, SchedulerConfig, SchedulerEvent, SendWeights, Step, StepMeasured, Switch, SwitchDone, Train, TrainChunkDone,
    Validate, ValidationDone, WeightsArrived, version_of,
)

__all__ = [
    "Assign", "Decided", "DynamicSampling", "Extend", "GroupsDone", "Mechanisms", "OptimizerStepDone", "PipelineScheduler",
    "RankLost", "RankReady", "Restart", "Role", "ScheduleError", "SchedulerAction", "SchedulerConfig", "SchedulerEvent", "SendWeights", "Step",
    "StepMeasured", "Switch", "SwitchDone", "Train", "TrainChunkDone", "Validate", "ValidationDone", "WeightsArrived", "replay",
    "version_of",
]
