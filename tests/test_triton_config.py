"""Rendered model repository: every config.pbtxt parses as Triton's ModelConfig,
carries no placeholder, and declares the TensorRT-LLM 1.2 tensors.

The expected tables below are written by hand from TensorRT-LLM's 1.2 templates
(triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt), not from
toolchain/triton/templates.py; test_upstream_triton_conformance.py holds the same
configs against the templates parsed mechanically.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from conftest import write_spec
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.triton.config import ConfigError, ModelConfig, Tensor, check_ensemble
from toolchain.triton.repo import run_model_repo
from toolchain.triton.templates import RepoOptions, build_models
from toolchain.workspace import Workspace
from triton_helpers import make_tiny_tokenizer

MODELS = {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
MBS = 6

# name: (TYPE, dims, required). LOGITS is TYPE_FP32 for these deployments.
ENSEMBLE_IN = {
    "text_input": ("STRING", [1], True), "decoder_text_input": ("STRING", [1], False),
    "max_tokens": ("INT32", [1], True), "num_return_sequences": ("INT32", [1], False),
    "bad_words": ("STRING", [-1], False), "stop_words": ("STRING", [-1], False),
    "exclude_input_in_output": ("BOOL", [1], False), "end_id": ("INT32", [1], False), "pad_id": ("INT32", [1], False),
    "top_k": ("INT32", [1], False), "top_p": ("FP32", [1], False), "temperature": ("FP32", [1], False),
    "length_penalty": ("FP32", [1], False), "repetition_penalty": ("FP32", [1], False),
    "min_tokens": ("INT32", [1], False), "presence_penalty": ("FP32", [1], False),
    "frequency_penalty": ("FP32", [1], False), "seed": ("UINT64", [1], False),
    "return_log_probs": ("BOOL", [1], False), "return_context_logits": ("BOOL", [1], False),
    "return_generation_logits": ("BOOL", [1], False), "return_perf_metrics": ("BOOL", [1], False),
    "return_num_input_tokens": ("BOOL", [1], False), "return_num_output_tokens": ("BOOL", [1], False),
    "beam_width": ("INT32", [1], False), "stream": ("BOOL", [1], False),
    "prompt_embedding_table": ("FP16", [-1, -1], False), "prompt_table_extra_id": ("UINT64", [1], False),
    "prompt_vocab_size": ("INT32", [1], False), "embedding_bias_words": ("STRING", [-1], False),
    "embedding_bias_weights": ("FP32", [-1], False), "lora_task_id": ("UINT64", [1], False),
    "lora_weights": ("FP16", [-1, -1], False), "lora_config": ("INT32", [-1, 3], False),
    "guided_decoding_guide_type": ("STRING", [1], False), "guided_decoding_guide": ("STRING", [1], False),
}
TEXT_OUT = {
    "text_output": ("STRING", [-1]), "cum_log_probs": ("FP32", [-1]), "output_log_probs": ("FP32", [-1, -1]),
    "context_logits": ("FP32", [-1, -1]), "generation_logits": ("FP32", [-1, -1, -1]),
    "batch_index": ("INT32", [1]), "sequence_index": ("INT32", [1]),
    "kv_cache_alloc_new_blocks": ("INT32", [1]), "kv_cache_reused_blocks": ("INT32", [1]),
    "kv_cache_alloc_total_blocks": ("INT32", [1]), "arrival_time_ns": ("INT64", [1]),
    "first_scheduled_time_ns": ("INT64", [1]), "first_token_time_ns": ("INT64", [1]),
    "last_token_time_ns": ("INT64", [1]), "acceptance_rate": ("FP32", [1]),
    "total_accepted_draft_tokens": ("INT32", [1]), "total_draft_tokens": ("INT32", [1]),
    "num_input_tokens": ("INT32", [1]), "num_output_tokens": ("INT32", [1]),
}
BLS_IN = {k: v for k, v in ENSEMBLE_IN.items() if k != "prompt_table_extra_id"} | {
    "prompt_table_extra_id": ("UINT64", [1], False),
    "image_input": ("FP16", [-1, 3, -1, -1], False), "image_bytes_input": ("UINT8", [-1, -1, -1, -1], False),
    "video_bytes_input": ("UINT8", [-1, -1, -1, -1], False), "image_url_input": ("STRING", [1], False),
    "num_draft_tokens": ("INT32", [1], False), "use_draft_logits": ("BOOL", [1], False),
}
BLS_SCALARS = {"return_log_probs", "return_context_logits", "return_generation_logits", "num_return_sequences",
               "lora_task_id", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
               "use_draft_logits"}
PRE_IN = {
    "QUERY": ("STRING", [1], True), "REQUEST_OUTPUT_LEN": ("INT32", [1], True),
    "DECODER_QUERY": ("STRING", [1], False), "BAD_WORDS_DICT": ("STRING", [-1], False),
    "STOP_WORDS_DICT": ("STRING", [-1], False), "EMBEDDING_BIAS_WORDS": ("STRING", [-1], False),
    "EMBEDDING_BIAS_WEIGHTS": ("FP32", [-1], False), "END_ID": ("INT32", [1], False),
    "PAD_ID": ("INT32", [1], False), "PROMPT_TABLE_EXTRA_ID": ("UINT64", [1], False),
    "IMAGE_BYTES": ("UINT8", [-1, -1, -1, -1], False), "VIDEO_BYTES": ("UINT8", [-1, -1, -1, -1], False),
    "IMAGE_URL": ("STRING", [1], False), "IMAGES": ("STRING", [-1], False),
}
PRE_OUT = {
    "INPUT_ID": ("INT32", [-1]), "REQUEST_INPUT_LEN": ("INT32", [1]), "DECODER_INPUT_ID": ("INT32", [-1]),
    "REQUEST_DECODER_INPUT_LEN": ("INT32", [1]), "BAD_WORDS_IDS": ("INT32", [2, -1]),
    "STOP_WORDS_IDS": ("INT32", [2, -1]), "EMBEDDING_BIAS": ("FP32", [-1]), "REQUEST_OUTPUT_LEN": ("INT32", [-1]),
    "OUT_END_ID": ("INT32", [1]), "OUT_PAD_ID": ("INT32", [1]), "OUT_PROMPT_TABLE_EXTRA_IDS": ("UINT64", [-1]),
    # multimodal outputs (names and types from the 1.2 template)
    "PIXEL_VALUES": ("FP16", [-1, -1, -1, -1]), "ASPECT_RATIO_IDS": ("INT64", [-1]),
    "ASPECT_RATIO_MASK": ("INT64", [-1, -1]), "CROSS_ATTENTION_MASK": ("INT64", [-1, -1, -1]),
    "IMAGE_SIZES": ("INT64", [-1, 2]), "IS_VIDEO_INPUT": ("BOOL", [1]), "ATTENTION_MASK": ("INT64", [-1]),
    "IMAGE_GRID_THW": ("INT64", [3]), "VISION_INPUT_ID": ("INT32", [-1]),
}
POST_IN = {"TOKENS_BATCH": ("INT32", [-1, -1], True), "SEQUENCE_LENGTH": ("INT32", [-1], True)}
POST_OUT = {"OUTPUT": ("STRING", [-1])}
_SCALAR = ("INT32", [1], False)
LLM_IN = {
    "input_ids": ("INT32", [-1], False), "input_lengths": ("INT32", [1], True),
    "request_output_len": ("INT32", [1], True), "decoder_input_ids": ("INT32", [-1], False),
    "decoder_input_lengths": _SCALAR, "encoder_input_features": ("FP16", [-1, -1], False),
    "encoder_output_lengths": _SCALAR, "end_id": _SCALAR, "pad_id": _SCALAR,
    "stop_words_list": ("INT32", [2, -1], False), "bad_words_list": ("INT32", [2, -1], False),
    "embedding_bias": ("FP32", [-1], False), "beam_width": _SCALAR, "temperature": ("FP32", [1], False),
    "runtime_top_k": _SCALAR, "runtime_top_p": ("FP32", [1], False), "runtime_top_p_min": ("FP32", [1], False),
    "runtime_top_p_decay": ("FP32", [1], False), "runtime_top_p_reset_ids": _SCALAR,
    "len_penalty": ("FP32", [1], False), "early_stopping": ("BOOL", [1], False),
    "repetition_penalty": ("FP32", [1], False), "presence_penalty": ("FP32", [1], False),
    "frequency_penalty": ("FP32", [1], False), "min_tokens": _SCALAR,
    "beam_search_diversity_rate": ("FP32", [1], False), "seed": ("UINT64", [1], False),
    "num_return_sequences": _SCALAR,
    **{flag: ("BOOL", [1], False) for flag in (
        "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
        "return_num_input_tokens", "return_num_output_tokens", "exclude_input_in_output", "streaming", "stop")},
    "draft_input_ids": ("INT32", [-1], False), "draft_logits": ("FP32", [-1, -1], False),
    "draft_acceptance_threshold": ("FP32", [1], False), "lookahead_window_size": _SCALAR,
    "lookahead_ngram_size": _SCALAR, "lookahead_verification_set_size": _SCALAR,
    "prompt_embedding_table": ("FP16", [-1, -1], False), "prompt_table_extra_ids": ("UINT64", [-1], False),
    "prompt_vocab_size": _SCALAR, "cross_attention_mask": ("BOOL", [-1, -1], False),
    "skip_cross_attn_blocks": ("BOOL", [1], False), "mrope_rotary_cos_sin": ("FP32", [-1], False),
    "mrope_position_deltas": ("INT64", [1], False), "lora_task_id": ("UINT64", [1], False),
    "lora_weights": ("FP16", [-1, -1], False), "lora_config": ("INT32", [-1, 3], False),
    "retention_token_range_starts": ("INT32", [-1], False), "retention_token_range_ends": ("INT32", [-1], False),
    "retention_token_range_priorities": ("INT32", [-1], False),
    "retention_token_range_durations_ms": ("INT32", [-1], False), "retention_decode_priority": _SCALAR,
    "retention_decode_duration_ms": _SCALAR, "context_phase_params": ("UINT8", [-1], False),
    "guided_decoding_guide_type": ("STRING", [1], False), "guided_decoding_guide": ("STRING", [1], False),
}
# Per-row scalars the backend reads as [B] (reshape []), per the 1.2 template.
LLM_SCALARS = {"input_lengths", "request_output_len", "end_id", "pad_id", "beam_width", "temperature",
               "runtime_top_k", "runtime_top_p", "runtime_top_p_min", "runtime_top_p_decay",
               "runtime_top_p_reset_ids", "len_penalty", "early_stopping", "repetition_penalty", "min_tokens",
               "beam_search_diversity_rate", "presence_penalty", "frequency_penalty", "seed", "return_log_probs",
               "return_context_logits", "return_generation_logits", "return_perf_metrics", "return_num_input_tokens",
               "return_num_output_tokens", "exclude_input_in_output", "stop", "streaming", "prompt_vocab_size",
               "lora_task_id", "num_return_sequences", "encoder_output_lengths", "decoder_input_lengths",
               "draft_acceptance_threshold"}
LLM_OUT = {"output_ids": ("INT32", [-1, -1]), "sequence_length": ("INT32", [-1]),
           "context_phase_params": ("UINT8", [-1])} | {k: v for k, v in TEXT_OUT.items() if k != "text_output"}

EXPECTED = {
    "ensemble": (ENSEMBLE_IN, TEXT_OUT), "tensorrt_llm_bls": (BLS_IN, TEXT_OUT), "preprocessing": (PRE_IN, PRE_OUT),
    "postprocessing": (POST_IN, POST_OUT), "tensorrt_llm": (LLM_IN, LLM_OUT),
}


def _deploy_spec(tmp_path: Path, target: str = "cpu", **serving):
    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    return load_spec(write_spec(tmp_path / "spec.yaml", hf, target=target, limits={"max_batch_size": MBS},
                                serving={"kv_cache_free_gpu_mem_fraction": 0.55, **serving}))


def _render(tmp_path: Path, target="cpu", **serving):
    spec = _deploy_spec(tmp_path, target=target, **serving)
    ws = Workspace(tmp_path / "ws")
    manifest = run_model_repo(spec, ws)
    return spec, ws, manifest, ws.model_repo_dir(spec)


def _parse(repo: Path) -> dict[str, pb.ModelConfig]:
    out = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        text = path.read_text()
        assert "${" not in text, f"{path} has a placeholder"
        cfg = text_format.Parse(text, pb.ModelConfig())
        assert cfg.name == path.parent.name
        out[cfg.name] = cfg
    return out


@pytest.fixture(params=[("cpu", True), ("cpu", False), ("trtllm", True)], ids=["cpu-stream", "cpu-unary", "trtllm"])
def rendered(request, tmp_path):
    target, streaming = request.param
    spec, ws, manifest, repo = _render(tmp_path, target, streaming=streaming)
    return spec, ws, manifest, repo, _parse(repo)


def test_every_config_parses_without_placeholders(rendered):
    _, _, manifest, repo, configs = rendered
    assert set(configs) == MODELS == set(manifest.outputs["models"])
    assert all((repo / m / "1").is_dir() for m in MODELS)
    assert (repo / "manifest.json").is_file()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tensors_match_the_1_2_templates(rendered, model):
    cfg = rendered[4][model]
    want_in, want_out = EXPECTED[model]
    got_in = {t.name: (pb.DataType.Name(t.data_type).removeprefix("TYPE_"), list(t.dims), not t.optional)
              for t in cfg.input}
    got_out = {t.name: (pb.DataType.Name(t.data_type).removeprefix("TYPE_"), list(t.dims)) for t in cfg.output}
    assert got_in == want_in
    assert got_out == want_out
    assert len(cfg.output) == len(want_out)  # kv_cache_alloc_total_blocks only once


def test_scalar_reshapes(rendered):
    configs = rendered[4]
    llm = {t.name for t in configs["tensorrt_llm"].input if t.HasField("reshape") and not t.reshape.shape}
    assert llm == LLM_SCALARS
    bls = {t.name for t in configs["tensorrt_llm_bls"].input if t.HasField("reshape")}
    assert bls == BLS_SCALARS
    assert not any(t.HasField("reshape") for t in configs["ensemble"].input)


def test_ensemble_wiring(rendered):
    configs = rendered[4]
    ens = configs["ensemble"]
    dtypes = {t.name: t.data_type for t in ens.input}
    steps = [s.model_name for s in ens.ensemble_scheduling.step]
    assert steps == ["preprocessing", "tensorrt_llm", "postprocessing"]
    for step in ens.ensemble_scheduling.step:
        model = configs[step.model_name]
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key, value in step.input_map.items():
            assert key in inputs, f"{step.model_name} has no input {key}"
            assert value in dtypes, f"{step.model_name}.{key} reads {value} before anything produced it"
            assert dtypes[value] == inputs[key].data_type, f"{step.model_name}.{key} type differs from {value}"
        required = {n for n, t in inputs.items() if not t.optional}
        assert required <= set(step.input_map), f"{step.model_name}: required inputs unmapped"
        for key, value in step.output_map.items():
            assert key in outputs, f"{step.model_name} has no output {key}"
            dtypes[value] = outputs[key].data_type
    consumed = {v for s in ens.ensemble_scheduling.step for v in s.input_map.values()}
    assert {t.name for t in ens.input} <= consumed
    for t in ens.output:
        assert dtypes.get(t.name) == t.data_type, f"ensemble output {t.name} not produced with its type"
    pre, llm, post = ens.ensemble_scheduling.step
    # routing of the ensemble template
    assert pre.input_map["QUERY"] == "text_input" and pre.input_map["REQUEST_OUTPUT_LEN"] == "max_tokens"
    assert llm.input_map["runtime_top_k"] == "top_k" and llm.input_map["len_penalty"] == "length_penalty"
    assert llm.input_map["streaming"] == "stream" and llm.input_map["end_id"] == pre.output_map["OUT_END_ID"]
    assert llm.input_map["stop_words_list"] == pre.output_map["STOP_WORDS_IDS"]
    assert post.input_map["TOKENS_BATCH"] == llm.output_map["output_ids"]
    assert post.input_map["SEQUENCE_LENGTH"] == llm.output_map["sequence_length"]
    assert post.output_map["OUTPUT"] == "text_output"
    assert "stop" not in llm.input_map  # the ensemble has no stop input


def test_batching_instances_and_decoupling(rendered):
    spec, _, _, repo, configs = rendered
    assert {c.max_batch_size for c in configs.values()} == {MBS}
    for name in ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"):
        assert [pb.ModelInstanceGroup.Kind.Name(g.kind) for g in configs[name].instance_group] == ["KIND_CPU"]
    assert configs["tensorrt_llm"].instance_group[0].count == 1
    for name in ("tensorrt_llm", "tensorrt_llm_bls"):
        assert configs[name].model_transaction_policy.decoupled is spec.serving.streaming
    for name in ("preprocessing", "tensorrt_llm"):
        assert list(configs[name].dynamic_batching.preferred_batch_size) == [MBS]
    assert configs["postprocessing"].HasField("dynamic_batching")
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / name / "1" / "model.py").is_file() and configs[name].backend == "python"
    assert configs["ensemble"].platform == "ensemble" and not list((repo / "ensemble" / "1").iterdir())
    params = {k: v.string_value for k, v in configs["preprocessing"].parameters.items()}
    assert Path(params["tokenizer_dir"]) == spec.model.tokenizer_dir.resolve()
    assert configs["postprocessing"].parameters["tokenizer_dir"].string_value == params["tokenizer_dir"]


def test_cpu_target_runs_the_engine_in_the_python_backend(tmp_path):
    spec, ws, _, repo = _render(tmp_path, "cpu")
    llm = _parse(repo)["tensorrt_llm"]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert llm.backend == "python" and (repo / "tensorrt_llm" / "1" / "model.py").is_file()
    assert params["gpt_model_path"] == str(ws.engine_dir(spec).resolve())
    assert (Path(params["toolchain_path"]) / "toolchain" / "__init__.py").is_file()
    assert params["exclude_input_in_output"] == "true"


def test_trtllm_target_uses_the_tensorrtllm_backend(tmp_path):
    spec, ws, _, repo = _render(tmp_path, "trtllm")
    llm = _parse(repo)["tensorrt_llm"]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert llm.backend == "tensorrtllm"
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()
    assert params["gpt_model_path"] == str(ws.engine_dir(spec).resolve())
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.55"
    assert params["max_beam_width"] == "1" and params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert params["executor_worker_path"].endswith("trtllmExecutorWorker")
    assert "toolchain_path" not in params
    assert not any(v.startswith("${") for v in params.values())
    # Empty only where the backend requires the key and empty means "off".
    assert {k for k, v in params.items() if not v} == {"guided_decoding_backend", "xgrammar_tokenizer_info_path"}


POSTPROCESSING_GOLDEN = """\
name: "postprocessing"
max_batch_size: 6
input {
  name: "TOKENS_BATCH"
  data_type: TYPE_INT32
  dims: -1
  dims: -1
}
input {
  name: "SEQUENCE_LENGTH"
  data_type: TYPE_INT32
  dims: -1
}
output {
  name: "OUTPUT"
  data_type: TYPE_STRING
  dims: -1
}
instance_group {
  count: 2
  kind: KIND_CPU
}
dynamic_batching {
}
parameters {
  key: "skip_special_tokens"
  value {
    string_value: "true"
  }
}
parameters {
  key: "tokenizer_dir"
  value {
    string_value: "/models/tok"
  }
}
parameters {
  key: "trust_remote_code"
  value {
    string_value: "false"
  }
}
backend: "python"
"""


def _options(**over) -> RepoOptions:
    base = dict(target="cpu", max_batch_size=6, decoupled=True, instance_count=2, max_queue_delay_microseconds=100,
                engine_dir=Path("/engines/x"), tokenizer_dir=Path("/models/tok"), kv_cache_free_gpu_mem_fraction=0.9,
                exclude_input_in_output=True, toolchain_path=Path("/src"))
    return RepoOptions(**(base | over))


def test_golden_postprocessing_and_batching_block():
    models = build_models(_options())
    assert models["postprocessing"].render() == POSTPROCESSING_GOLDEN
    pre = models["preprocessing"].render()
    block = re.search(r"dynamic_batching \{.*?\n\}\n", pre, re.S).group(0)
    assert block == ("dynamic_batching {\n  preferred_batch_size: 6\n  max_queue_delay_microseconds: 100\n"
                     "  default_queue_policy {\n  }\n}\n")  # max_queue_size 0 (unbounded) is the proto default
    assert models["tensorrt_llm"].render(header="line one\nline two").startswith("# line one\n# line two\nname:")


def test_unset_values_are_refused():
    good = dict(name="m", max_batch_size=1, inputs=[Tensor("x", "TYPE_INT32", (1,))],
                outputs=[Tensor("y", "TYPE_INT32", (1,))], backend="python")
    ModelConfig(**good).render()
    bad = [
        dict(parameters={"tokenizer_dir": None}), dict(parameters={"tokenizer_dir": ""}),
        dict(parameters={"engine_dir": "${engine_dir}"}), dict(backend="${triton_backend}"),
        dict(max_batch_size=None), dict(inputs=[Tensor("x", "LOGITS", (1,))]),
        dict(inputs=[Tensor("x", "TYPE_INT32", ())]), dict(backend=None),
        dict(outputs=[Tensor("y", "TYPE_INT32", (1,)), Tensor("y", "TYPE_INT32", (1,))]),
    ]
    for change in bad:
        with pytest.raises(ConfigError):
            ModelConfig(**(good | change)).render()


def test_ensemble_check_catches_bad_wiring():
    models = build_models(_options())
    ens = models["ensemble"]
    ens.ensemble_steps[2].input_map["TOKENS_BATCH"] = "_NOT_PRODUCED"
    with pytest.raises(ConfigError, match="produced by no earlier step"):
        check_ensemble(ens, models)
    models = build_models(_options())
    models["tensorrt_llm"].max_batch_size = 2
    with pytest.raises(ConfigError, match="exceeds"):
        check_ensemble(models["ensemble"], models)


def test_reused_when_current_rerendered_when_inputs_change(tmp_path):
    spec, ws, first, repo = _render(tmp_path)
    again = run_model_repo(spec, ws)
    assert again.created == first.created
    spec.serving.http_port = 9999  # serving endpoints are not part of the repository
    assert run_model_repo(spec, ws).created == first.created
    time.sleep(0.01)
    ws.engine_dir(spec).mkdir(parents=True)
    (ws.engine_dir(spec) / "manifest.json").write_text('{"stage": "build-engine"}')
    rebuilt = run_model_repo(spec, ws)
    assert rebuilt.created > first.created and rebuilt.inputs["engine_manifest"] != "missing"
    forced = run_model_repo(spec, ws, force=True)
    assert forced.created > rebuilt.created
    leftovers = [p.name for p in repo.parent.iterdir() if p.name.startswith(".")]
    assert not leftovers


def test_missing_tokenizer_is_a_one_line_error(tmp_path):
    spec = _deploy_spec(tmp_path)
    spec.model.tokenizer = tmp_path / "nowhere"
    with pytest.raises(ToolchainError, match="tokenizer directory not found"):
        run_model_repo(spec, Workspace(tmp_path / "ws"))


def test_cli_model_repo_and_serve_print(tmp_path, capsys):
    from toolchain.cli import main

    spec = _deploy_spec(tmp_path)
    root = tmp_path / "ws"
    assert main(["--root", str(root), "model-repo", str(spec.source)]) == 0
    out = capsys.readouterr()
    assert "rendered" in out.out and "tensorrt_llm backend python" in out.out and "build-engine" in out.err
    assert main(["--root", str(root), "model-repo", str(spec.source)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["--root", str(root), "serve", str(spec.source), "--print"]) == 2  # no engine yet
    assert "build-engine" in capsys.readouterr().err
    engine = root / "engines" / spec.name / "engine"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text("{}")
    assert main(["--root", str(root), "serve", str(spec.source), "--print", "--set", "serving.http_port=18123"]) == 0
    line = capsys.readouterr().out.strip()
    assert "tritonserver" in line and "--http-port=18123" in line and "--http-address=127.0.0.1" in line
    assert main(["--root", str(root), "serve", str(spec.source), "--set", "target=trtllm"]) == 2
    # An engine dir whose config.json is not a trtllm-build engine is caught before launch.
    assert "preflight check triton.engine-dir failed" in capsys.readouterr().err


def _upstream_tree(root: Path) -> Path:
    """A stand-in for tensorrtllm_backend's all_models/inflight_batcher_llm (the real
    one is on GPU hosts, not here): each Python model with a model.py, the BLS with lib/."""
    tree = root / "triton_backend" / "all_models" / "inflight_batcher_llm"
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        (tree / name / "1").mkdir(parents=True)
        (tree / name / "1" / "model.py").write_text(f"# upstream {name}\n")
    (tree / "tensorrt_llm_bls" / "1" / "lib").mkdir()
    (tree / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").write_text("# upstream decode\n")
    (tree / "tensorrt_llm_bls" / "1" / "__pycache__").mkdir()
    (tree / "tensorrt_llm_bls" / "1" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"x")
    return tree


def test_python_models_from_an_upstream_tree(tmp_path, capsys):
    """--python-models takes NVIDIA's pre/post/BLS model.py and helpers, renders only the
    configs, keeps the CPU tensorrt_llm model, says which it used, and re-renders when
    an upstream file changes."""
    from toolchain.cli import main

    spec = _deploy_spec(tmp_path)
    tree = _upstream_tree(tmp_path / "backend")
    root = tmp_path / "ws"
    # the repository root is found under the directory given
    assert main(["--root", str(root), "model-repo", str(spec.source), "--python-models", str(tmp_path / "backend")]) == 0
    out = capsys.readouterr().out
    assert "python models: NVIDIA's from" in out and "tensorrt_llm_bls" in out
    repo = Workspace(root).model_repo_dir(spec)
    for name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / name / "1" / "model.py").read_text() == f"# upstream {name}\n"
        assert (repo / name / "config.pbtxt").is_file()
    assert (repo / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").is_file()
    assert not (repo / "tensorrt_llm_bls" / "1" / "__pycache__").exists()
    assert "class TritonPythonModel" in (repo / "tensorrt_llm" / "1" / "model.py").read_text()  # CPU engine
    (tree / "postprocessing" / "1" / "model.py").write_text("# upstream postprocessing, patched\n")
    assert main(["--root", str(root), "model-repo", str(spec.source), "--python-models", str(tree)]) == 0
    assert "rendered" in capsys.readouterr().out
    assert (repo / "postprocessing" / "1" / "model.py").read_text().endswith("patched\n")
    assert main(["--root", str(root), "model-repo", str(spec.source)]) == 0  # back to ours
    assert "the toolchain's" in capsys.readouterr().out
    assert "class TritonPythonModel" in (repo / "postprocessing" / "1" / "model.py").read_text()


def test_python_models_dir_without_the_models_is_one_line(tmp_path, capsys):
    from toolchain.cli import main

    spec = _deploy_spec(tmp_path)
    tree = _upstream_tree(tmp_path / "backend")
    (tree / "tensorrt_llm_bls" / "1" / "model.py").unlink()
    for bad in (tree, tmp_path / "nowhere"):
        assert main(["--root", str(tmp_path / "ws"), "model-repo", str(spec.source), "--python-models", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "\n" not in err and "--python-models" in err


def test_cpu_target_serves_the_builds_beam_width(tmp_path):
    from toolchain.engine.build import build_config

    hf = tmp_path / "hf"
    make_tiny_tokenizer(hf)
    (hf / "config.json").write_text("{}")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf, target="cpu", build={"max_beam_width": 3}))
    assert build_config(spec)["max_beam_width"] == 3  # what the CPU engine then enforces
    ws = Workspace(tmp_path / "ws")
    run_model_repo(spec, ws)
    params = {k: v.string_value for k, v in _parse(ws.model_repo_dir(spec))["tensorrt_llm"].parameters.items()}
    assert params["max_beam_width"] == "3" and params["decoding_mode"] == "beam_search"
