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


def test_a_multimodal_config_names_its_ids_in_text_config():
    """Llama4ForConditionalGeneration keeps eos_token_id and pad_token_id in text_config; without a
    generation_config.json they are still found there, and the top level wins where both say."""
    from toolchain.eos import resolve

    nested = {"architectures": ["Llama4ForConditionalGeneration"],
              "text_config": {"eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018}}
    got = resolve(nested, None, None)
    assert (got.end_id, got.stop_ids, got.pad_id) == (200001, (200007, 200008), 200018)
    assert resolve({**nested, "eos_token_id": 7}, None, None).end_id == 7
