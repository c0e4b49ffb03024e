"""The speculative-mode rows (toolchain/speculative.py): each runtime name is one the pinned release has, the
spec admits exactly the rows' modes, and every target a mode does not run on is refused with the row's reason."""

from __future__ import annotations

import typing

import pytest

from toolchain import upstream
from toolchain.spec import SpeculativeSection
from toolchain.speculative import CPU, MODES, refusal
from toolchain.targets import ENGINE, LLMAPI, TARGETS


def test_the_spec_admits_the_rows_modes():
    assert set(typing.get_args(SpeculativeSection.model_fields["mode"].annotation)) == set(MODES)


def test_build_modes_are_trtllm_build_choices():
    choices = upstream.facts("trtllm_build")["flags"]["--speculative_decoding_mode"]["choices"]
    for name, row in MODES.items():
        assert row.build_mode is None or row.build_mode in choices, name


def test_decoding_modes_are_the_backends():
    params = {p["name"]: p for p in upstream.facts("backend_parameters")["parameters"]}
    for name, row in MODES.items():
        assert row.decoding_mode is None or row.decoding_mode in params["decoding_mode"]["values"], name


def test_decoding_types_are_llm_api_configs_of_the_pytorch_backend():
    types = upstream.facts("llmapi")["speculative"]["types"]
    for name, row in MODES.items():
        if row.decoding_type is not None:
            allows = types[row.decoding_type]["supports_backend"]["allows"]
            assert allows == "all" or "pytorch" in allows, name


@pytest.mark.parametrize("name", [m for m in MODES if m != "none"])
def test_every_gap_has_its_reason(name):
    row = MODES[name]
    gaps = [p for p in (ENGINE, LLMAPI) if p not in row.paths]
    if ENGINE in row.paths and ENGINE not in row.cpu:
        gaps.append(CPU)
    assert all(row.why_not.get(g) for g in gaps), (name, gaps, row.why_not)
    for target in TARGETS.values():
        why = refusal(name, target)
        assert (why is None) == row.runs_on(target), (name, target.name)
        assert why is None or why.startswith(f"speculative.mode={name} "), why


def test_refusals_name_where_to_go():
    assert refusal("eagle3", TARGETS["cpu"]) == (
        "speculative.mode=eagle3 cannot run on target cpu: EAGLE-3 drafts run on the PyTorch backend only "
        "(speculative_config decoding_type Eagle); use target llmapi")
    assert refusal("eagle", TARGETS["cpu"]).endswith("use target trtllm, or speculative.mode ngram or medusa on cpu")
    assert refusal("medusa", TARGETS["llmapi"]).endswith("use target trtllm, or speculative.mode draft_target or ngram")
    assert refusal("ngram", TARGETS["llmapi-cpu"]).startswith(
        "speculative.mode=ngram is not run by the CPU stand-in of the LLM API yet; use target cpu")
    assert refusal("none", TARGETS["llmapi-cpu"]) is None
