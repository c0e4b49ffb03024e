"""The spec: validation, overrides, path resolution, documented fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec, load_spec

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def _all_fields(model: type[BaseModel], prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name, field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _all_fields(ann, prefix + name + ".")


def test_every_field_has_default_and_docstring():
    for name, field in _all_fields(DeploymentSpec):
        assert not field.is_required(), f"{name} has no default"
        assert field.description, f"{name} has no docstring"


def test_embedded_spec_loads_and_resolves_paths():
    spec = load_spec(REPO / "build" / "tiny-llama.yaml")
    assert spec.name == "tiny-llama"
    assert spec.model.checkpoint == REPO / "models" / "tiny-llama"
    assert spec.model.tokenizer_dir == spec.model.checkpoint
    assert spec.serving.host == "127.0.0.1"
    assert spec.validation.slo.ttft_p99_ms is not None


def test_unknown_key_names_key_and_file(tmp_path):
    path = _write(tmp_path, "name: x\nparallelism:\n  tp: 2\n  tpp: 1\n")
    with pytest.raises(ToolchainError) as err:
        load_spec(path)
    assert "parallelism.tpp" in str(err.value) and str(path) in str(err.value)


def test_overrides_are_typed_and_validated(tmp_path):
    path = _write(tmp_path, "name: x\n")
    spec = load_spec(path, ["parallelism.tp=4", "serving.streaming=false", "validation.slo.ttft_p99_ms=12.5"])
    assert spec.parallelism.tp == 4 and spec.serving.streaming is False
    assert spec.validation.slo.ttft_p99_ms == 12.5
    with pytest.raises(ToolchainError, match="parallelism.tp"):
        load_spec(path, ["parallelism.tp=0"])
    with pytest.raises(ToolchainError, match="unknown key 'limits.nope'"):
        load_spec(path, ["limits.nope=1"])
    with pytest.raises(ToolchainError, match="bad override"):
        load_spec(path, ["parallelism.tp"])


@pytest.mark.parametrize("override, message", [
    ("parallelism.tpp=4", "unknown key 'parallelism.tpp' in --set parallelism.tpp=4; did you mean 'parallelism.tp'?"),
    ("paralelism.tp=4", "unknown key 'paralelism' in --set paralelism.tp=4; did you mean 'parallelism'?"),
    ("serving.http_prot=9", "unknown key 'serving.http_prot' in --set serving.http_prot=9; "
                            "did you mean 'serving.http_port'?"),
    ("name.x=1", "'name' is a field, not a section (it has no 'x') in --set name.x=1"),
    ("validation.workload.classes.name=a", "'validation.workload.classes' is a field, not a section"),
    ("validation.workload.shared_prefix.tokens=3", "unknown key 'validation.workload.shared_prefix.tokens' in --set "
                                                   "validation.workload.shared_prefix.tokens=3; did you mean "
                                                   "'validation.workload.shared_prefix.prefix_tokens'?"),
    ("parallelism.tp=0", "invalid 'parallelism.tp' in --set parallelism.tp=0: Input should be greater"),
])
def test_a_bad_override_is_blamed_on_the_override_with_the_closest_field(tmp_path, override, message):
    """Issue 33: a typo in `--set` names the override and the field meant, never the spec file (which has no such
    key); a key inside a free-form mapping (llmapi.options) is the mapping's own."""
    path = _write(tmp_path, "name: x\n")
    with pytest.raises(ToolchainError) as err:
        load_spec(path, [override])
    assert str(err.value).startswith(message) and str(path) not in str(err.value)
    assert load_spec(path, ["llmapi.options.enable_chunked_prefill=true"]).llmapi.options == {
        "enable_chunked_prefill": True}


def test_an_unknown_key_in_the_file_says_which_field_was_meant(tmp_path):
    path = _write(tmp_path, "name: x\nparalelism: {tp: 2}\n")
    with pytest.raises(ToolchainError, match=f"unknown key 'paralelism' in {path}; did you mean 'parallelism'"):
        load_spec(path)


@pytest.mark.parametrize("text, fragment", [
    ("name: [unclosed\n", "malformed YAML"),
    ("- a\n- b\n", "must hold a mapping"),
    ("limits:\n  max_input_len: 1024\n  max_seq_len: 512\n", "max_input_len"),
    ("parallelism: {tp: 4, pp: 2, gpus: 4}\n", "8 ranks but only 4 GPUs"),
    ("target: tpu\n", "invalid 'target'"),
    ("name: 'bad name/'\n", "invalid 'name'"),
    ("speculative: {mode: ngram, max_draft_len: 4, use_draft_logits: true}\n", "use_draft_logits needs mode draft_target"),
    ("target: llmapi-cpu\nspeculative: {mode: draft_target, max_draft_len: 4, draft_model: /d, use_draft_logits: true}\n",
     "use_draft_logits builds a draft engine for the BLS"),
])
def test_invalid_specs_give_one_line(tmp_path, text, fragment):
    with pytest.raises(ToolchainError) as err:
        load_spec(_write(tmp_path, text))
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(ToolchainError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_spec_hash_changes_with_content(tmp_path):
    path = _write(tmp_path, "name: x\n")
    assert load_spec(path).spec_hash() == load_spec(path).spec_hash()
    assert load_spec(path).spec_hash() != load_spec(path, ["limits.max_batch_size=3"]).spec_hash()
