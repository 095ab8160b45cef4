"""Bounded state staging to node-local disk (``store``: :class:`Stager`, :class:`Prefetch`, :class:`StagingError`)."""

from dynaresize.staging.store import (Prefetch, StagedSnapshot, Stager, StagingError, default_dir, os_error_text, read_manifest,
                                      verify_snapshot)

__all__ = ["Prefetch", "StagedSnapshot", "Stager", "StagingError", "default_dir", "os_error_text", "read_manifest",
           "verify_snapshot"]
