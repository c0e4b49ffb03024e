"""Every config.pbtxt the model-repo stage writes, held against upstream's own
templates and the C++ backend's parameter reads (toolchain/upstream/facts/
model_templates.json and backend_parameters.json, extracted from
NVIDIA/TensorRT-LLM triton_backend at the 1.2 line), for both targets."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from conftest import write_spec
from toolchain.spec import load_spec
from toolchain.triton import backend_params
from toolchain.triton.repo import run_model_repo
from toolchain.upstream import facts
from toolchain.workspace import Workspace
from triton_helpers import make_tiny_tokenizer

TEMPLATES = facts("model_templates")["models"]
CPU_ONLY = {"toolchain_path", "engine_threads"}  # read by the CPU stand-in alone
VARIANTS = {
    "default": {},
    "not-streaming": {"serving": {"streaming": False}},
    "reuse-chunked": {"build": {"kv_cache_reuse": False, "chunked_context": True}},
    "lora": {"lora": {"target_modules": ["attn_q", "mlp_4h_to_h"], "max_lora_rank": 16,
                      "cache": {"optimal_adapter_size": 4, "gpu_memory_fraction": 0.2, "host_memory_bytes": 1 << 24}}},
}
TRTLLM_ONLY = {
    "lookahead": {"speculative": {"mode": "lookahead", "max_draft_len": 83, "lookahead_window_size": 7,
                                  "lookahead_ngram_size": 7, "lookahead_verification_set_size": 7}},
}


def render(tmp_path: Path, target: str, **sections) -> dict[str, pb.ModelConfig]:
    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, target=target, **sections))
    ws = Workspace(tmp_path / "ws")
    run_model_repo(spec, ws)
    return {p.parent.name: text_format.Parse(p.read_text(), pb.ModelConfig())
            for p in ws.model_repo_dir(spec).glob("*/config.pbtxt")}


def as_triton_json(cfg: pb.ModelConfig) -> dict:
    """The model config as a backend receives it (Triton hands backends JSON)."""
    return json_format.MessageToDict(cfg, preserving_proto_field_name=True)


CASES = [(t, v, s) for t in ("cpu", "trtllm") for v, s in VARIANTS.items()] + \
        [("trtllm", v, s) for v, s in TRTLLM_ONLY.items()]


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-{v}" for t, v, _ in CASES])
def rendered(request, tmp_path_factory):
    target, _, sections = request.param
    return target, render(tmp_path_factory.mktemp("repo"), target, **sections)


def test_the_backend_reads_every_parameter_it_needs_and_rejects_none(rendered):
    target, configs = rendered
    cfg = as_triton_json(configs["tensorrt_llm"])
    warnings: list[str] = []
    values = backend_params.read(cfg, warn=warnings.append)  # raises where the backend fails the load
    present = set(cfg["parameters"])
    # A warning for a key we wrote means the backend could not parse our value and fell back.
    assert [w for w in warnings if w.split()[0] in present] == []
    assert values["gpt_model_type"] == "inflight_fused_batching"


def test_tensorrt_llm_parameters_are_the_templates_keys(rendered):
    target, configs = rendered
    template = set(TEMPLATES["tensorrt_llm"]["parameters"])
    extra = set(configs["tensorrt_llm"].parameters) - template
    assert extra == (CPU_ONLY if target == "cpu" else set())
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        ours = set(configs[name].parameters)
        assert set(TEMPLATES[name]["parameters"]) - ours == set(), f"{name} leaves out a template parameter"


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_tensors_match_the_template(rendered, model):
    _, configs = rendered
    template, ours = TEMPLATES[model], configs[model]
    for kind, want_list, got_list in (("input", template["inputs"], ours.input),
                                      ("output", template["outputs"], ours.output)):
        got = {t.name: t for t in got_list}
        assert [t["name"] for t in want_list if t["name"] not in got] == [], f"{model}: {kind}s missing"
        assert sorted(set(got) - {t["name"] for t in want_list}) == [], f"{model}: {kind}s upstream lacks"
        for want in want_list:
            t = got[want["name"]]
            where = f"{model} {kind} {want['name']} ({TEMPLATES[model]['path']}:{want['line']})"
            if not want["data_type"].startswith("${"):
                assert pb.DataType.Name(t.data_type) == want["data_type"], where
            assert list(t.dims) == want["dims"], where
            assert (list(t.reshape.shape) if t.HasField("reshape") else None) == want["reshape"], where
            if kind == "input":
                assert (t.optional, t.allow_ragged_batch) == (want["optional"], want["allow_ragged_batch"]), where


def test_placeholders_are_filled_with_values(rendered):
    _, configs = rendered
    for name, template in TEMPLATES.items():
        cfg = configs[name]
        fields = {p["field"] for p in template["placeholders"]}
        if "max_batch_size" in fields:
            assert cfg.max_batch_size > 0, name
        if "decoupled" in fields:
            assert cfg.HasField("model_transaction_policy"), name
        if "default_queue_policy" in fields:
            assert cfg.dynamic_batching.HasField("default_queue_policy"), name
        text = text_format.MessageToString(cfg)
        assert "${" not in text, name


def test_backend_is_the_cpp_one_on_gpu_hosts(rendered):
    target, configs = rendered
    assert TEMPLATES["tensorrt_llm"]["backend"] == "${triton_backend}"
    assert configs["tensorrt_llm"].backend == ("tensorrtllm" if target == "trtllm" else "python")
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert configs[name].backend == TEMPLATES[name]["backend"] == "python"
    assert configs["ensemble"].platform == TEMPLATES["ensemble"]["platform"] == "ensemble"
