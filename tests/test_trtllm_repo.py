"""The tensorrt_llm model of a target-trtllm repository: it parses with Triton's
protobuf and carries the parameters of upstream's tensorrt_llm template (every
one whose value is known; those left out are listed in TRITON_UNSET with a
reason), and the build/speculative sections reach it."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from conftest import write_spec
from toolchain.engine.trtllm import TRITON_UNSET
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.triton.repo import run_model_repo
from toolchain.upstream import facts
from toolchain.workspace import Workspace
from triton_helpers import make_tiny_tokenizer

# The keys of upstream's tensorrt_llm template (toolchain/upstream/facts/model_templates.json).
TEMPLATE_KEYS = set(facts("model_templates")["models"]["tensorrt_llm"]["parameters"])
# Keys the C++ backend reads without a fallback: present even when their feature is off.
REQUIRED_EMPTY = {"guided_decoding_backend", "xgrammar_tokenizer_info_path"}


def render(tmp_path: Path, **sections) -> tuple[dict[str, pb.ModelConfig], Path]:
    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, target="trtllm", **sections))
    ws = Workspace(tmp_path / "ws")
    run_model_repo(spec, ws)
    repo = ws.model_repo_dir(spec)
    configs = {}
    for path in repo.glob("*/config.pbtxt"):
        configs[path.parent.name] = text_format.Parse(path.read_text(), pb.ModelConfig())
    return configs, ws.engine_dir(spec).resolve()


def params(cfg: pb.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_tensorrt_llm_carries_every_1_2_parameter(tmp_path):
    configs, _ = render(tmp_path)
    got = params(configs["tensorrt_llm"])
    assert set(TRITON_UNSET) <= TEMPLATE_KEYS
    assert set(got) - TEMPLATE_KEYS == set(), "a parameter the upstream template does not have"
    assert TEMPLATE_KEYS - set(TRITON_UNSET) - set(got) == set(), "a template parameter left out without a reason"
    assert not REQUIRED_EMPTY & set(TRITON_UNSET)
    assert all((v or k in REQUIRED_EMPTY) and "${" not in v for k, v in got.items())
    assert got["enable_kv_cache_reuse"] == "true" and got["enable_chunked_context"] == "false"
    assert got["decoding_mode"] == "top_k_top_p" and got["num_nodes"] == "1"
    assert configs["tensorrt_llm"].backend == "tensorrtllm"


def test_build_and_speculative_sections_reach_the_parameters(tmp_path):
    configs, _ = render(tmp_path / "la", build={"kv_cache_reuse": False, "chunked_context": True},
                        speculative={"mode": "lookahead", "max_draft_len": 83, "lookahead_window_size": 7,
                                     "lookahead_ngram_size": 7, "lookahead_verification_set_size": 7})
    got = params(configs["tensorrt_llm"])
    assert got["enable_kv_cache_reuse"] == "false" and got["enable_chunked_context"] == "true"
    assert got["decoding_mode"] == "lookahead"
    assert (got["lookahead_window_size"], got["lookahead_ngram_size"], got["lookahead_verification_set_size"]) == \
        ("7", "7", "7")
    configs, _ = render(tmp_path / "bw", build={"max_beam_width": 4})
    assert params(configs["tensorrt_llm"])["decoding_mode"] == "beam_search"
    assert params(configs["tensorrt_llm"])["max_beam_width"] == "4"


def test_medusa_tree_is_the_one_convert_recorded(tmp_path, hf_llama_words):
    """model-repo renders the Medusa tree from the converted checkpoint's manifest (the heads are not
    read again), and without a converted checkpoint says in one line to convert first."""
    from conftest import write_medusa_heads

    from toolchain.checkpoint.stage import run_convert

    heads = write_medusa_heads(tmp_path / "heads", hf_llama_words)
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_llama_words, target="trtllm",
                                speculative={"mode": "medusa", "heads": str(heads), "choices": "{0}, {0, 0}, {0, 1}"}))
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(ToolchainError) as err:
        run_model_repo(spec, ws)
    assert "no Medusa draft tree recorded" in str(err.value) and "toolchain convert" in str(err.value)
    run_convert(spec, ws)
    run_model_repo(spec, ws)
    cfg = text_format.Parse((ws.model_repo_dir(spec) / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig())
    got = params(cfg)
    assert got["decoding_mode"] == "medusa" and got["medusa_choices"] == "{0}, {0, 0}, {0, 1}"


def test_draft_target_adds_the_draft_model(tmp_path):
    configs, engine = render(tmp_path, speculative={"mode": "draft_target", "max_draft_len": 4,
                                                    "draft_model": str(tmp_path),
                                                    "draft_kv_cache_free_gpu_mem_fraction": 0.15},
                             serving={"streaming": False})
    assert {"tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"} <= set(configs)
    draft, target = params(configs["tensorrt_llm_draft"]), params(configs["tensorrt_llm"])
    assert draft["gpt_model_path"] == str(engine / "draft" / "engine") and target["gpt_model_path"] == str(engine)
    assert draft["kv_cache_free_gpu_mem_fraction"] == "0.15" and draft["gpu_device_ids"] == "0"
    assert target["enable_kv_cache_reuse"] == draft["enable_kv_cache_reuse"] == "true"
    assert configs["tensorrt_llm_draft"].model_transaction_policy.decoupled is False
    assert params(configs["tensorrt_llm_bls"])["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"


def test_cpu_target_serves_the_draft_with_the_cpu_model(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, speculative={"mode": "draft_target"}))
    ws = Workspace(tmp_path / "ws")
    run_model_repo(spec, ws)
    repo = ws.model_repo_dir(spec)
    draft = text_format.Parse((repo / "tensorrt_llm_draft" / "config.pbtxt").read_text(), pb.ModelConfig())
    assert draft.backend == "python" and "gpu_device_ids" not in params(draft)
    assert params(draft)["gpt_model_path"] == str(ws.engine_dir(spec).resolve() / "draft" / "engine")
    assert (repo / "tensorrt_llm_draft" / "1" / "model.py").read_bytes() == \
        (repo / "tensorrt_llm" / "1" / "model.py").read_bytes()
    bls = text_format.Parse((repo / "tensorrt_llm_bls" / "config.pbtxt").read_text(), pb.ModelConfig())
    assert params(bls)["tensorrt_llm_draft_model_name"] == "tensorrt_llm_draft"
    got = params(text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(), pb.ModelConfig()))
    # The scheduler and KV-cache parameters come from the spec on both targets; the GPU-only ones stay out.
    assert got["enable_kv_cache_reuse"] == "true" and got["enable_chunked_context"] == "false"
    assert "lora_cache_max_adapter_size" not in got


def test_scheduler_and_kv_cache_settings_reach_the_tensorrt_llm_model(tmp_path):
    """The executor knobs of the serving section, rendered as the C++ backend reads them: parameters,
    and max_queue_size in dynamic_batching (model_instance_state.cc hands it to the executor)."""
    serving = {"max_tokens_in_paged_kv_cache": 4096, "batch_scheduler_policy": "max_utilization",
               "max_queue_size": 64, "kv_cache_free_gpu_mem_fraction": 0.85}
    configs, _ = render(tmp_path, serving=serving, build={"chunked_context": True, "kv_cache_reuse": False})
    model = configs["tensorrt_llm"]
    got = params(model)
    assert got["max_tokens_in_paged_kv_cache"] == "4096" and got["batch_scheduler_policy"] == "max_utilization"
    assert got["kv_cache_free_gpu_mem_fraction"] == "0.85"
    assert got["enable_chunked_context"] == "true" and got["enable_kv_cache_reuse"] == "false"
    assert model.dynamic_batching.default_queue_policy.max_queue_size == 64


def test_a_kv_fraction_of_one_is_refused_before_the_executor_refuses_it(tmp_path):
    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    # TensorRT-LLM's calculateFreeMemBytes: "freeMemFraction (1.0) must be smaller than 1.0f".
    with pytest.raises(ToolchainError, match="kv_cache_free_gpu_mem_fraction"):
        load_spec(write_spec(tmp_path / "spec.yaml", hf, serving={"kv_cache_free_gpu_mem_fraction": 1.0}))
