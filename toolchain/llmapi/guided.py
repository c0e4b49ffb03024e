"""The LLM API's `GuidedDecodingParams` (tensorrt_llm/sampling_params.py) for the CPU stand-in, and the
engine `Guide` each one asks for (engine/cpu/guided.py): exactly one of

    json            a JSON schema (a JSON string, a dict, or a pydantic model class)  -> Guide("json_schema")
    regex           a regular expression                                               -> Guide("regex")
    grammar         an EBNF grammar                                                    -> Guide("ebnf_grammar")
    json_object     True: any JSON object                                              -> Guide("json")
    structural_tag  XGrammar's structural tag, as JSON text                            -> Guide("structural_tag")
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(kw_only=True)
class GuidedDecodingParams:
    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def problem(self) -> str | None:
        count = sum(bool(getattr(self, f.name)) for f in fields(self))
        if count > 1:  # the LLM API's words (GuidedDecodingParams._validate)
            return f"Only one guide can be used for a request, but got {count}."
        return None

    def guide(self):
        """The engine's Guide, or None when no field is set."""
        from toolchain.engine.cpu.guided import Guide

        if self.json is not None:
            return Guide("json_schema", _schema_text(self.json))
        if self.regex:
            return Guide("regex", self.regex)
        if self.grammar:
            return Guide("ebnf_grammar", self.grammar)
        if self.json_object:
            return Guide("json")
        if self.structural_tag:
            return Guide("structural_tag", self.structural_tag)
        return None


def _schema_text(schema: Any) -> str:
    # As the LLM API takes it: a JSON string as is, a dict dumped, a pydantic model by its JSON schema.
    if isinstance(schema, str):
        return schema
    if hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    return json.dumps(schema)
