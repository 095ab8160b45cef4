"""What a test may add to a worker rank, and the production default: nothing.

A rank calls :meth:`Hooks.point` at the named points of its work (``switch_role.offload`` right after a switch's
offload, ``stage_state.weights`` between the weights and the optimizer state of a checkpoint,
``fetch_weights.started`` once a background weight read started (at ``v<version>``), ``push_weights.relay`` once a
relay (a rollout rank) queued a version to forward (at ``v<version>``), ``train_chunk.accumulated``
after a chunk's backward (at ``step-<step>``)); the production hooks do nothing there. Tests start ranks through a test-side entry (``tests/support/``) that passes other hooks:
the fault matrix kills or stops the rank at a point, and test-only commands (inline batches, state digests) come
in as extra handlers from :meth:`Hooks.commands`.
"""

from __future__ import annotations

from typing import Any, Callable

Handler = Callable[..., dict[str, Any]]  # (worker, **payload) -> result


class Hooks:
    """The production hooks: no-ops."""

    def point(self, rank: int, name: str, at: str = "") -> None:
        """Rank ``rank`` passes point ``name``; ``at`` says where (a step ``step-4``, a checkpoint tag)."""

    def commands(self) -> dict[str, Handler]:
        """Handlers of command kinds beyond the contract's, by kind (none in production)."""
        return {}
