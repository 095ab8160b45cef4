"""What a rank that was declared lost gets when it tries to act: the coordinator side (the registry) raises it, the
rank side (the work queue, the worker) stops on it. Below both, like the rest of the contract."""

from __future__ import annotations


class FencedRankError(RuntimeError):
    """This rank was declared lost by the coordinator and may not act as the rank any more."""
