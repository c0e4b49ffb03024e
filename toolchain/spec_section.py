"""The base of every section of the deployment spec (`spec.py`, `spec_workload.py`).

One class, so that every section refuses unknown keys, takes each field's docstring as its description (the JSON
Schema and docs/spec-reference.md read it) and validates an assignment as it validates a file; and so that the
loader tells a section from a value by this class (`spec.py` `_section_model`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from toolchain.errors import ToolchainError

_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    def derived(self: _S, changes: dict[str, Any]) -> _S:
        """This section with dotted fields replaced ("limits.max_batch_size": 64), validated as a loaded file is
        (a combination the validators refuse raises ToolchainError with their message); the fields no file holds
        (Field(exclude=True), the spec's `source`) are kept."""
        data = self.model_dump(mode="python")
        for dotted, value in changes.items():
            *parents, last = dotted.split(".")
            node = data
            for key in parents:
                node = node[key]
            node[last] = value
        try:
            out = type(self).model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            raise ToolchainError(f"{'.'.join(map(str, first['loc']))}: "
                                 f"{first['msg'].removeprefix('Value error, ')}") from None
        for name, info in type(self).model_fields.items():
            if info.exclude:
                setattr(out, name, getattr(self, name))
        return out
