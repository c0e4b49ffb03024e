"""`response_format` as the engine's guided-decoding `Guide` (engine/cpu/guided.py), as trtllm-serve
maps it to the LLM API's GuidedDecodingParams (tensorrt_llm/serve/openai_server.py and
openai_protocol.py, `_response_format_to_guided_decoding_params`):

    text            -> none
    json            -> GuidedDecodingParams(json=schema)            -> Guide("json_schema", schema)
    json_schema     -> json=json_schema["schema"] (OpenAI's wrapper {"name", "schema", "strict"}),
                       or json_schema itself when it has no "schema" key
    json_object     -> GuidedDecodingParams(json_object=True)       -> Guide("json")
    regex           -> GuidedDecodingParams(regex=...)              -> Guide("regex", regex)
    ebnf            -> GuidedDecodingParams(grammar=...)            -> Guide("ebnf_grammar", ebnf)
    structural_tag  -> GuidedDecodingParams(structural_tag=<the response_format as JSON>)

A schema or grammar XGrammar rejects is refused by the engine (`request_problem`) with XGrammar's
message, before the request is admitted.
"""

from __future__ import annotations

import json

from toolchain.engine.cpu.guided import Guide
from toolchain.openai.protocol import ApiError, ResponseFormat


def _required(fmt: ResponseFormat, field: str, value):
    if value is None:
        # trtllm-serve's words (openai_protocol.py, ResponseFormat checks).
        raise ApiError(f"response_format.{field} is required for response_format.type == '{fmt.type}', but got None.")
    return value


def guide_for(fmt: ResponseFormat | None) -> Guide | None:
    """The Guide `fmt` asks for; None for no constraint."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json":
        return Guide("json_schema", json.dumps(_required(fmt, "schema", fmt.schema_)))
    if fmt.type == "json_schema":
        wrapper = _required(fmt, "json_schema", fmt.json_schema)
        schema = wrapper["schema"] if "schema" in wrapper else wrapper
        return Guide("json_schema", json.dumps(schema))
    if fmt.type == "json_object":
        return Guide("json")
    if fmt.type == "regex":
        return Guide("regex", _required(fmt, "regex", fmt.regex))
    if fmt.type == "ebnf":
        return Guide("ebnf_grammar", _required(fmt, "ebnf", fmt.ebnf))
    # structural_tag: upstream hands the whole response_format on as JSON, in XGrammar's form
    # ({"type": "structural_tag", "format": {...}}) or the older {"structures": [...], "triggers": [...]}
    # (UNVERIFIED against 1.2's exact serialisation); the engine compiles either.
    if fmt.structures is None:
        _required(fmt, "format", fmt.format)
    return Guide("structural_tag", fmt.model_dump_json(by_alias=True, exclude_none=True))
