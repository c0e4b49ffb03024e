"""The base of every section of the deployment spec (`spec.py`, `spec_workload.py`).

One class, so that every section refuses unknown keys, takes each field's docstring as its description (the JSON
Schema and docs/spec-reference.md read it) and validates an assignment as it validates a file; and so that the
loader tells a section from a value by this class (`spec.py` `_section_model`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
