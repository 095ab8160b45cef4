"""The base class every config section derives from.

Rules shared by all sections: unknown keys are errors (``extra="forbid"``), assignments are validated, and every
field carries a one-line ``description`` (a unit test walks the whole tree and fails on a field without one;
``dynaresize config fields`` prints them).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A YAML config section: strict, documented, JSON-serialisable."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=False)
