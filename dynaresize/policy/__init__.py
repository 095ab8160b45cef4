"""The resizing policy (pure): observations in, hold-or-resize decisions with a priced switch plan out.

See :mod:`dynaresize.policy.policy` for the API and the hysteresis rules.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "candidate_topologies": "candidates", "from_cluster": "candidates", "SwitchCostModel": "costs",
    "ResizePolicy": "policy", "greedy_config": "policy", "ResizeAction": "types", "Decision": "types",
    "Observation": "types", "OpGroup": "types", "PlannedOp": "types", "PolicyState": "types", "Topology": "types",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """Lazy: every config load imports ``dynaresize.policy.config``; the policy itself imports numpy, whose BLAS
    threads would start before the Slurm entry blocks SIGTERM (a preemption's signal could then reach one of them
    instead of the watcher thread)."""
    if name in _WHERE:
        return getattr(importlib.import_module(f"dynaresize.policy.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
