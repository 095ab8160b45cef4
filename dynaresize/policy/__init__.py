"""The resizing policy (pure): observations in, hold-or-resize decisions with a priced switch plan out.

See :mod:`dynaresize.policy.policy` for the API and the hysteresis rules.
"""

from dynaresize.policy.candidates import candidate_topologies, from_cluster
from dynaresize.policy.costs import SwitchCostModel
from dynaresize.policy.policy import ResizePolicy, greedy_config
from dynaresize.policy.types import Action, Decision, Observation, OpGroup, PlannedOp, PolicyState, Topology

__all__ = [
    "Action", "Decision", "Observation", "OpGroup", "PlannedOp", "PolicyState", "ResizePolicy", "SwitchCostModel",
    "Topology", "candidate_topologies", "from_cluster", "greedy_config",
]
