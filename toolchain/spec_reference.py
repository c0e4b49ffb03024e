"""The spec's reference, derived from the pydantic models in `spec.py`.

`json_schema()` is the JSON Schema an editor validates `build/*.yaml` against
(YAML language server, VS Code); `markdown_reference()` renders the same schema
as the field tables of docs/spec-reference.md. Both come from the models alone,
so a field added to spec.py appears in both, and a test keeps the committed
document equal to what this module renders.
"""

from __future__ import annotations

import json
import re
from typing import Any

from toolchain.spec import DeploymentSpec

# Set by the loader, never read from a file (Field(exclude=True) in spec.py).
_LOADER_ONLY = ("source",)
_BOUNDS = (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"), ("exclusiveMaximum", "< {}"),
           ("minLength", "at least {} characters"), ("pattern", "matches `{}`"))


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a spec file as `load_spec` reads it."""
    schema = DeploymentSpec.model_json_schema(mode="validation")
    for key in _LOADER_ONLY:
        schema["properties"].pop(key, None)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "trtllm-toolchain deployment spec",
            "description": "A build/<name>.yaml file: `toolchain plan` it, then convert, build-engine, model-repo, serve "
                           "and bench.", **{k: v for k, v in schema.items() if k != "title"}}


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(prop: dict[str, Any]) -> str:
    """A short type text: `int`, `"a" | "b"`, `list of str`, `section`, with `or null` for optional fields."""
    if "$ref" in prop:  # a nested section: its own table follows
        return "section"
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object":
        return "mapping"
    if kind == "string" and prop.get("format") == "path":
        return "path"
    return {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "null": "null"}.get(kind, kind)


def _bounds(prop: dict[str, Any]) -> list[str]:
    found = [text.format(prop[key]) for key, text in _BOUNDS if key in prop]
    for alt in prop.get("anyOf", []):
        found += _bounds(alt)
    return found


def _default(prop: dict[str, Any]) -> str:
    if "default" not in prop:
        return "see below" if "$ref" in prop else "`[]`" if prop.get("type") == "array" else "`{}`"
    return f"`{json.dumps(prop['default'])}`"


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _section_rows(schema: dict[str, Any], defs: dict[str, Any], path: str, out: list[str]) -> None:
    out += [f"## `{path or 'top level'}`", ""]
    if schema.get("description") and path:
        out += [_cell(schema["description"]), ""]
    out += ["| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for field, prop in schema["properties"].items():
        kind = _type(prop)
        bounds = _bounds(prop)
        if bounds:
            kind += f" ({', '.join(bounds)})"
        ref = prop.get("$ref") or prop.get("items", {}).get("$ref")
        if ref:
            nested.append((field, ref, "$ref" not in prop))
        out.append(f"| `{field}` | {_cell(kind)} | {_default(prop)} | {_cell(prop.get('description', ''))} |")
    out.append("")
    for field, ref, is_list in nested:
        sub = f"{path}.{field}" if path else field
        _section_rows(defs[_ref_name(ref)], defs, sub + ("[]" if is_list else ""), out)


def markdown_reference() -> str:
    """Every field of the spec, section by section: type (with bounds), default and description."""
    schema = json_schema()
    out = ["# Spec reference", "",
           "<!-- Generated from toolchain/spec.py by `toolchain schema --markdown`; do not edit by hand. -->", "",
           "Every field a `build/<name>.yaml` spec may hold. Unknown keys are refused; `--set a.b=value` overrides "
           "any of these on the command line; relative paths are resolved against the spec file's directory. "
           "`toolchain schema` prints the same as JSON Schema for editors, and `toolchain init` writes a starting "
           "spec.", ""]
    _section_rows(schema, schema["$defs"], "", out)
    return "\n".join(out).rstrip() + "\n"
