"""`toolchain schema`: the JSON Schema an editor checks specs with, and docs/spec-reference.md, both from spec.py."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec, load_spec
from toolchain.spec_reference import markdown_reference

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "spec-reference.md"


def _schema(capsys) -> dict:
    assert main(["schema"]) == 0
    return json.loads(capsys.readouterr().out)


def _fields(model: type[BaseModel], prefix: str = ""):
    """(dotted section, field name, field) of every field a spec file may hold."""
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        yield prefix, name, field
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _fields(inner, f"{prefix}.{name}" if prefix else name)
        for arg in getattr(inner, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _fields(arg, f"{prefix}.{name}[]" if prefix else f"{name}[]")


def test_committed_reference_is_what_spec_py_renders():
    assert DOC.is_file(), "run: toolchain schema --markdown --out docs/spec-reference.md"
    assert DOC.read_text() == markdown_reference(), \
        "docs/spec-reference.md is stale: run toolchain schema --markdown --out docs/spec-reference.md"


def test_reference_lists_every_field_with_its_default_and_description():
    text = DOC.read_text()
    sections = text.split("\n## ")
    by_title = {s.split("\n", 1)[0].strip("`"): s for s in sections[1:]}
    for section, name, field in _fields(DeploymentSpec):
        table = by_title[section or "top level"]
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{section}.{name} missing from {DOC.name}"
        assert " ".join(field.description.split()) in row.replace("\\|", "|"), f"{section}.{name} description"
        if not field.is_required() and field.default_factory is None:
            default = str(field.default) if isinstance(field.default, Path) else field.default
            assert f"| `{json.dumps(default)}` |" in row, f"{section}.{name} default"
    assert "| `max_seq_len` | int (>= 2) | `1024` |" in by_title["limits"]
    assert '"guaranteed_no_evict" \\| "max_utilization"' in by_title["serving"]


def test_markdown_command_prints_the_committed_reference(capsys, tmp_path):
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == DOC.read_text()
    assert main(["schema", "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["title"] == "trtllm-toolchain deployment spec"


@pytest.mark.parametrize("spec", sorted((REPO / "build").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_spec_is_valid_under_the_schema(capsys, spec):
    validator = jsonschema.Draft202012Validator(_schema(capsys))
    assert [e.message for e in validator.iter_errors(yaml.safe_load(spec.read_text()))] == []


@pytest.mark.parametrize("bad, where", [
    ({"model": {"checkpoint": "x", "dtpye": "float16"}}, "dtpye"),          # a misspelt key
    ({"target": "tensorrt"}, "tensorrt"),                                  # not a target
    ({"parallelism": {"tp": 0}}, "tp"),                                    # below the bound
    ({"quantization": {"method": "int3_wo"}}, "int3_wo"),
    ({"validation": {"workload": {"classes": [{"name": "a", "sharee": 1}]}}}, "sharee"),
])
def test_schema_refuses_what_the_loader_refuses(capsys, tmp_path, bad, where):
    jsonschema.Draft202012Validator.check_schema(schema := _schema(capsys))
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(bad))
    assert errors and any(where in e.message or where in e.json_path for e in errors)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ToolchainError):
        load_spec(path)


def test_loader_only_field_is_not_in_the_schema(capsys):
    props = _schema(capsys)["properties"]
    assert "source" not in props and {"model", "parallelism", "dynamo"} <= set(props)
