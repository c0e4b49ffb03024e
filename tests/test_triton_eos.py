"""End ids resolved from generation_config.json reach the preprocessing model,
so an instruct model stops at its chat terminator without the client's help."""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.spec import load_spec
from toolchain.triton.repo import repo_options
from toolchain.triton.templates import build_models
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]


def _preprocessing_params(spec, tmp_path) -> dict:
    config = build_models(repo_options(spec, Workspace(tmp_path)))["preprocessing"]
    return {k: str(v) for k, v in config.parameters.items()}


def test_llama3_instruct_ends_at_eot_and_stops_at_end_of_text(tmp_path):
    spec = load_spec(REPO / "build" / "llama3-8b-awq-h100.yaml")
    params = _preprocessing_params(spec, tmp_path)
    assert params["end_id"] == "128009"          # <|eot_id|>, config.json's eos
    assert params["stop_token_ids"] == "128001"  # <|end_of_text|>, the other generation_config EOS


def test_single_eos_model_renders_no_extra_stops(tmp_path):
    spec = load_spec(REPO / "build" / "tiny-llama.yaml")
    params = _preprocessing_params(spec, tmp_path)
    eos = json.loads((spec.model.checkpoint / "generation_config.json").read_text())["eos_token_id"]
    assert params["end_id"] == str(eos)
    assert "stop_token_ids" not in params
