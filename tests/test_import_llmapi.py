"""The engine-flow deployment moved to the LLM-API path (toolchain/importer/llmapi.py): every mapped field and every
Loss rule held to the pinned llm_args facts, the shipped trtllm examples and variations of them (INT8 KV cache,
SmoothQuant, Medusa, draft-target, LoRA, Triton parameters) moved and checked as `toolchain plan` checks them, and
both plans side by side. Config-only checkpoints, no servers."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from toolchain import upstream
from toolchain.archs import get_family
from toolchain.checks.preflight import FAIL, build_context, run_checks
from toolchain.errors import ToolchainError
from toolchain.importer.llmapi import (CARRIED, ENGINE_ONLY, PARAMETERS, PLUMBING, REWRITTEN, SPEC_HELD, Loss,
                                       compare_plans, counterparts, nearest_modes, side_by_side, to_llmapi)
from toolchain.llmapi.args import SECTIONS, llm_args, options_problem
from toolchain.llmapi.repo import MODEL as LLMAPI_MODEL
from toolchain.plan.model import load_model
from toolchain.quant.formats import KV_CACHE, METHODS, STORAGE_BYTES
from toolchain.spec import DeploymentSpec, _section_model, spec_from_dict
from toolchain.speculative import MODES
from toolchain.targets import LLMAPI

BUILD = Path(__file__).resolve().parents[1] / "build"
FACTS = upstream.facts("llmapi")
ARGS = FACTS["llm_args"]["fields"]
TRTLLM_SPECS = sorted(p.name for p in BUILD.glob("*.yaml") if yaml.safe_load(p.read_text()).get("target") == "trtllm")


def _raw(name: str, **changes) -> dict:
    data = yaml.safe_load((BUILD / name).read_text())
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return data


def _load(data: dict) -> DeploymentSpec:
    spec = spec_from_dict(copy.deepcopy(data), BUILD, "test")
    return spec


def _fails(spec: DeploymentSpec) -> list[str]:
    ctx = build_context(spec, "plan")
    return [f"{r.id}: {r.message}" for r in run_checks(ctx) if r.status == FAIL]


def _field_exists(path: str) -> bool:
    """An llm_args field, or section.field of a section whose fields the facts record."""
    head, _, rest = path.partition(".")
    if head not in ARGS:
        return False
    if not rest:
        return True
    section = SECTIONS.get(head)
    return section is not None and rest.split(".")[0] in FACTS[section]["fields"]


def _anywhere(name: str) -> bool:
    return name in ARGS or any(name in FACTS[s]["fields"] for s in SECTIONS.values())


# ---- the tables against the pinned facts --------------------------------------------------------------------------
def test_every_mapped_field_is_an_llm_args_field():
    mapped = counterparts()
    assert mapped["quantization.kv_cache"] == "kv_cache_config.dtype"
    for spec_path, arg in mapped.items():
        if arg.startswith("triton_config."):
            assert arg.split(".")[1] in FACTS["model_yaml"]["triton_config"], spec_path
            continue
        assert _field_exists(arg), f"{spec_path} -> {arg}: not in the pinned llm_args facts"


def test_every_rule_rests_on_the_facts():
    for name, rule in {**ENGINE_ONLY, **PARAMETERS}.items():
        for field in rule.present:
            assert _field_exists(field), f"{name}: {field} is not an llm_args field of the pinned release"
        for field in rule.absent:
            assert not _anywhere(field), f"{name}: the pinned llm_args has {field}, so the setting is not lost"
        for named in re.findall(r"llmapi\.options\.([a-z_.]+[a-z_])", f"{rule.nearest} {rule.to or ''}"):
            assert _field_exists(named), f"{name}: nearest names llmapi.options.{named}, not an llm_args field"


def test_every_spec_field_has_its_place():
    def leaves(model, prefix=""):
        for key, field in model.model_fields.items():
            section = _section_model(field.annotation)
            if key == "source":
                continue
            if section is not None and "list" not in str(field.annotation):
                yield from leaves(section, f"{prefix}{key}.")
            else:
                yield prefix + key

    mapped = counterparts()

    def under(path: str, prefixes) -> bool:
        return any(path == p or path.startswith(p + ".") for p in prefixes)

    for path in leaves(DeploymentSpec):
        places = [under(path, ENGINE_ONLY), under(path, mapped) or under(path, CARRIED) or path in REWRITTEN]
        assert any(places), f"{path}: neither engine-only, mapped, carried nor rewritten (importer/llmapi.py)"
    assert not set(ENGINE_ONLY) & set(mapped), "a field both engine-only and written to LLM()"


def test_every_backend_parameter_has_its_place():
    names = {p["name"] for p in upstream.facts("backend_parameters")["parameters"]}
    names |= set(upstream.facts("model_templates")["models"]["tensorrt_llm"]["parameters"])
    for name in names:
        places = [name in SPEC_HELD, name in PLUMBING, name in PARAMETERS]
        assert places.count(True) == 1, f"tensorrt_llm parameter {name}: {places}"


# ---- the shipped examples -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TRTLLM_SPECS)
def test_shipped_trtllm_spec_moves_and_passes_the_llmapi_checks(name):
    source = _load(_raw(name))
    model = load_model(source.model.checkpoint)
    par = source.parallelism
    refused = get_family(model.params.architecture).llmapi_problem(model.params, par.tp, par.pp, False)
    if refused is not None:  # the family's own row: the PyTorch backend has no model for it
        with pytest.raises(ToolchainError, match="cannot move to the LLM-API path"):
            to_llmapi(_raw(name), base=BUILD)
        return
    out, losses = to_llmapi(_raw(name), base=BUILD)
    assert out["target"] == "llmapi"
    for path in ENGINE_ONLY:  # what only the engine path reads is gone
        section, _, key = path.partition(".")
        assert key not in (out.get(section) or {}), path
    spec = _load(out)
    assert _fails(spec) == []
    assert options_problem(spec) is None
    for loss in losses:
        assert "\n" not in loss.line() and loss.line().startswith(f"{loss.setting}=")


def test_int8_kv_cache_and_smoothquant_move_to_the_nearest_loaded_formats():
    from toolchain.checkpoint.hf_quant import hf_quant_problem

    raw = _raw("llama3-70b-sq-tp4pp2.yaml")
    out, losses = to_llmapi(raw, base=BUILD)
    by = {loss.setting: loss for loss in losses}
    kv, method = by["quantization.kv_cache"], by["quantization.method"]
    assert kv.value == "int8" and method.value == "smoothquant"
    assert kv.what_is_lost == hf_quant_problem(_load(raw).quantization.model_copy(update={"method": "none"}))
    sm = 90  # the spec's H100
    # INT8's one byte per element: the other one-byte KV format that runs on the GPU.
    same = [k.name for k in KV_CACHE.values() if k.storage and k.name != "int8" and k.refused_on(sm) is None
            and STORAGE_BYTES[k.storage] == STORAGE_BYTES[KV_CACHE["int8"].storage]]
    assert kv.nearest.split()[0] == out["quantization"]["kv_cache"] == same[0]
    # The weights: a one-byte format the PyTorch backend loads, one of those the row's own refusal names.
    chosen = METHODS[out["quantization"]["method"]]
    assert LLMAPI in chosen.paths and chosen.refused_on(sm) is None
    assert chosen.name in METHODS["smoothquant"].hf_why_not
    assert method.nearest.split()[0] == chosen.name
    assert "llm_args" not in kv.line()
    spec = _load(out)
    assert llm_args(spec, "m")["kv_cache_config"]["dtype"] == "fp8"
    assert _fails(spec) == []


@pytest.mark.parametrize("kv", [k for k in KV_CACHE if k != "none"])
def test_a_kv_cache_alone_is_kept_or_moved_to_its_nearest(kv):
    from toolchain.checkpoint.hf_quant import hf_quant_problem

    raw = _raw("llama3-70b-tp4pp2.yaml", quantization={"kv_cache": kv})
    out, losses = to_llmapi(raw, base=BUILD)
    refused = hf_quant_problem(_load(raw).quantization)
    lost = [loss for loss in losses if loss.setting.startswith("quantization.")]
    if refused is None:
        assert lost == [] and out["quantization"]["kv_cache"] == kv
        return
    assert [(loss.setting, loss.value, loss.what_is_lost) for loss in lost] == [("quantization.kv_cache", kv, refused)]
    new = KV_CACHE[out["quantization"]["kv_cache"]]
    assert new.refused_on(90) is None and lost[0].nearest.startswith(new.name)
    assert out["quantization"].get("method", "none") == raw["quantization"].get("method", "none")
    assert _fails(_load(out)) == []


def test_int8_kv_cache_on_a_gpu_without_fp8_has_no_kv_quantization():
    out, losses = to_llmapi(_raw("llama3-70b-sq-tp4pp2.yaml", gpu={"name": "A100 80GB"}), base=BUILD)
    assert KV_CACHE["fp8"].refused_on(80) is not None  # the table: FP8 needs Ada/Hopper
    kv = next(loss for loss in losses if loss.setting == "quantization.kv_cache")
    assert out["quantization"]["kv_cache"] == "none" and kv.nearest.startswith("none")
    method = METHODS[out["quantization"]["method"]]
    assert method.refused_on(80) is None and LLMAPI in method.paths


def test_medusa_becomes_no_speculation_naming_the_nearest_modes():
    raw = _raw("llama3-8b-awq-h100.yaml", speculative={"mode": "medusa", "heads": "heads", "choices": "{0}, {0, 0}"})
    out, losses = to_llmapi(raw, base=BUILD)
    loss = next(loss for loss in losses if loss.setting == "speculative.mode")
    assert loss.what_is_lost == MODES["medusa"].why_not[LLMAPI]
    assert "speculative" not in out
    types = FACTS["speculative"]["types"]
    nearest = nearest_modes(MODES["medusa"])
    assert nearest and f"speculative.mode {nearest[0].name}" in loss.nearest
    for mode in nearest:  # each a decoding type the pinned release runs on the PyTorch backend
        allows = types[mode.decoding_type]["supports_backend"]["allows"]
        assert allows == "all" or "pytorch" in allows
    assert _fails(_load(out)) == []


def test_draft_target_keeps_its_draft_and_reports_the_bls_controls():
    out, losses = to_llmapi(_raw("qwen2.5-7b-draft-target.yaml", speculative__use_draft_logits=True), base=BUILD)
    settings = {loss.setting for loss in losses}
    assert {"speculative.mode", "speculative.draft_kv_cache_free_gpu_mem_fraction",
            "speculative.use_draft_logits"} <= settings
    spec = _load(out)
    cfg = llm_args(spec, "m")["speculative_config"]
    assert cfg["decoding_type"] in FACTS["speculative"]["types"]
    assert set(cfg) - {"decoding_type"} <= set(FACTS["speculative"]["base_fields"])
    assert out["validation"]["workload"]["endpoint"] == LLMAPI_MODEL  # the BLS is gone
    assert _fails(spec) == []


def test_lora_adapters_lose_triton_selection():
    assert not any(name.startswith("lora") for name in FACTS["triton_model"]["inputs"])
    out, losses = to_llmapi(_raw("llama3-8b-awq-h100.yaml", lora={"adapters": {"sql": "adapters/sql"},
                                                                  "max_lora_rank": 8}), base=BUILD)
    loss = next(loss for loss in losses if loss.setting == "lora.adapters")
    assert loss.value == "sql" and "lora_request" in loss.nearest
    assert out["lora"]["adapters"] == {"sql": "adapters/sql"}


def test_triton_parameters_carried_or_lost():
    params = {"gpt_model_type": "V1", "max_attention_window_size": "2560", "kv_cache_host_memory_bytes": "1000000",
              "kv_cache_onboard_blocks": "true", "multi_block_mode": "${multi_block_mode}", "sink_token_length": "",
              "enable_context_fmha_fp32_acc": "True", "gpt_model_path": "/engines/x"}
    out, losses = to_llmapi(_raw("llama3-70b-tp4pp2.yaml"), params, base=BUILD)
    lost = {loss.setting: loss for loss in losses}
    assert set(lost) == {"gpt_model_type", "max_attention_window_size", "enable_context_fmha_fp32_acc"}
    options = out["llmapi"]["options"]
    assert options["kv_cache_config"] == {"host_cache_size": 1000000}  # onboard_blocks true is the default
    spec = _load(out)
    assert options_problem(spec) is None and _fails(spec) == []
    fused, _ = to_llmapi(_raw("llama3-70b-tp4pp2.yaml"), {"gpt_model_type": "inflight_fused_batching",
                                                          "max_attention_window_size": "8192"}, base=BUILD)
    assert "llmapi" not in fused or "options" not in fused["llmapi"]


def test_a_spec_already_on_the_llmapi_path_is_refused():
    with pytest.raises(ToolchainError, match="already on the LLM-API path"):
        to_llmapi(_raw("llama3-8b-llmapi-h100.yaml"), base=BUILD)


def test_loss_line_is_one_line():
    loss = Loss("quantization.kv_cache", "int8", "not loaded", "fp8")
    assert loss.line() == "quantization.kv_cache=int8: not loaded -> nearest: fp8"


# ---- both plans ---------------------------------------------------------------------------------------------------
def test_compare_plans_predicts_both_side_by_side():
    raw = _raw("llama3-70b-sq-tp4pp2.yaml")
    out, _ = to_llmapi(raw, base=BUILD)
    plans = compare_plans(_load(raw), _load(out))
    assert list(plans) == ["trtllm", "llmapi"]
    assert plans["trtllm"]["kv_cache_dtype"] != plans["llmapi"]["kv_cache_dtype"]  # int8 -> fp8
    for plan in plans.values():
        assert plan["performance"] and plan["verdict"]
    text = side_by_side(plans)
    assert "trtllm" in text.splitlines()[0] and "llmapi" in text.splitlines()[0]
    assert plans["llmapi"]["verdict"] in text
