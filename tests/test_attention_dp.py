"""Attention data parallelism (`parallelism.attention_dp`, LLM() `enable_attention_dp`): refused where upstream has
none or where it would change nothing, planned as the PyTorch backend places it (the whole attention and every KV
head on each rank, the experts still split), rendered into the LLM-API arguments and Dynamo's engine args as the
pinned llm_args.py names them, and accepted by the CPU stand-in as the no-op it is there."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import make_hf_model, write_spec
from toolchain import upstream
from toolchain.archs.layout import layout_problems
from toolchain.errors import ToolchainError
from toolchain.gpus import lookup
from toolchain.plan import memory as mem
from toolchain.plan.model import load_model
from toolchain.plan.plan import plan_memory
from toolchain.quant.view import Quantization
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY_MIXTRAL = REPO / "models" / "tiny-mixtral"  # config.json is all plan reads
LLAMA_8B = REPO / "build" / "configs" / "llama-3-8b-instruct"
FACTS = upstream.facts("llmapi")


def spec_for(tmp_path: Path, checkpoint: Path, target: str = "llmapi", **parallelism):
    data = {"name": "adp", "target": target, "model": {"checkpoint": str(checkpoint), "dtype": "float16"},
            "gpu": {"name": "H100 80GB"}, "parallelism": {"tp": 2, **parallelism},
            "serving": {"http_port": 0, "grpc_port": 0, "metrics_port": 0}}
    path = tmp_path / f"spec-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


# ---- the spec ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target, parallelism, fragment", [
    ("trtllm", {"attention_dp": True}, "target trtllm builds an engine, which has no attention data parallelism"),
    ("cpu", {"attention_dp": True}, "target cpu builds an engine"),
    ("llmapi", {"tp": 1, "attention_dp": True}, "tp is 1"),
])
def test_refused_on_the_engine_path_and_at_tp_1_in_one_line(tmp_path, target, parallelism, fragment):
    with pytest.raises(ToolchainError) as err:
        spec_for(tmp_path, TINY_MIXTRAL, target, **parallelism)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_dense_model_is_refused_by_the_one_layout_rule(tmp_path):
    spec = spec_for(tmp_path, LLAMA_8B, attention_dp=True)
    params = load_model(LLAMA_8B).params
    assert [axis for axis, _ in layout_problems(params, spec.parallelism.layout)] == ["attention_dp"]
    moe = spec_for(tmp_path, TINY_MIXTRAL, attention_dp=True)
    assert layout_problems(load_model(TINY_MIXTRAL).params, moe.parallelism.layout) == []


# ---- the plan ----------------------------------------------------------------------------------------------------
def _attention_bytes(p, tp: int) -> int:
    (_, qkv_out, qkv_in), (_, dense_out, dense_in) = mem.linear_shapes(p, tp)[:2]
    return (qkv_out * qkv_in + dense_out * dense_in) * 2  # float16


def test_each_rank_holds_the_whole_attention_and_every_kv_head(tmp_path):
    p = load_model(TINY_MIXTRAL).params
    plain = plan_memory(spec_for(tmp_path, TINY_MIXTRAL), load_model(TINY_MIXTRAL), Quantization(),
                        lookup("H100 80GB"))
    adp = plan_memory(spec_for(tmp_path, TINY_MIXTRAL, attention_dp=True), load_model(TINY_MIXTRAL), Quantization(),
                      lookup("H100 80GB"))
    # KV per token per rank doubles at tp 2: 4 layers x 2 (K, V) x all 2 KV heads x 64 x 2 bytes, not 1 KV head.
    assert [r.kv_bytes_per_token for r in plain.ranks] == [2 * 4 * 1 * 64 * 2] * 2
    assert [r.kv_bytes_per_token for r in adp.ranks] == [2 * 4 * 2 * 64 * 2] * 2
    # The attention weights per rank double; the experts keep their split (moe_tp 2 by default).
    common = dict(tp=2, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2)
    split, whole = mem.rank_weights(p, **common), mem.rank_weights(p, attention_dp=True, **common)
    assert _attention_bytes(p, 1) == 2 * _attention_bytes(p, 2)
    assert whole.layers - split.layers == p.num_hidden_layers * (_attention_bytes(p, 1) - _attention_bytes(p, 2))
    # lm_head is whole on each rank, so the tied embedding serves it again (no second copy).
    assert split.lm_head == p.vocab_size // 2 * p.hidden_size * 2 and whole.lm_head == 0
    assert whole.embedding == split.embedding == p.vocab_size * p.hidden_size * 2


def test_a_shared_expert_is_whole_on_each_rank():
    p = load_model(TINY_MIXTRAL).params
    import dataclasses

    shared = dataclasses.replace(p, shared_expert_size=512)
    split = mem.expert_bytes(shared, 2, 1, 2)
    whole = mem.expert_bytes(shared, 2, 1, 2, shared_tp=1)
    assert whole - split == 3 * (512 - 256) * p.hidden_size * 2  # fc (gate + up) and proj, 512 wide instead of 256


# ---- the LLM-API arguments and Dynamo -------------------------------------------------------------------------
def test_rendered_as_the_pinned_llm_args_field(tmp_path):
    from toolchain.dynamo import checks
    from toolchain.llmapi.args import llm_args, llm_args_problem, model_yaml, options_problem, serve_config

    field = FACTS["llm_args"]["fields"]["enable_attention_dp"]
    assert field["type"] == "bool" and field["default"] is False
    assert upstream.facts("mapping")["init_params"]["enable_attention_dp"]["default"] is False
    spec = spec_for(tmp_path, TINY_MIXTRAL, attention_dp=True)
    for args in (model_yaml(spec, TINY_MIXTRAL), serve_config(spec)):
        assert args["enable_attention_dp"] is True and args["tensor_parallel_size"] == 2
    assert llm_args_problem(llm_args(spec, TINY_MIXTRAL)) is None
    # Off, the key is left to upstream's default.
    assert "enable_attention_dp" not in serve_config(spec_for(tmp_path, TINY_MIXTRAL))
    # Dynamo's workers read the same engine-args YAML, and Dynamo sets the key itself (its example configs).
    assert "enable_attention_dp" in checks.DYNAMO_WORKER_KEYS
    assert "enable_attention_dp" in upstream.facts("dynamo")["examples"]["engine_prefill"]["doc"]
    assert checks.runtime_release_problem(spec) is None
    # Through llmapi.options it would bypass the plan: refused, naming the spec field.
    raw = spec_for(tmp_path, TINY_MIXTRAL)
    raw.llmapi.options = {"enable_attention_dp": True}
    assert "parallelism.attention_dp" in options_problem(raw)


def test_dynamo_engine_args_carry_it(tmp_path):
    from toolchain.dynamo import checks, manifests

    spec = spec_for(tmp_path, TINY_MIXTRAL, attention_dp=True)
    assert checks.problems(spec) == []
    engine_args = yaml.safe_load(manifests.config_map(spec)["data"][manifests.ENGINE_ARGS])
    assert engine_args["enable_attention_dp"] is True


# ---- the CPU stand-in ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory) -> Path:
    return make_hf_model("MixtralForCausalLM", tmp_path_factory.mktemp("hf-mixtral-adp"), seed=21,
                         num_local_experts=4, num_experts_per_tok=2)


def test_the_stand_in_runs_the_same_engine_with_it(hf_mixtral):
    from toolchain.llmapi.cpu_llm import engine_spec

    args = {"model": str(hf_mixtral), "backend": "pytorch", "tensor_parallel_size": 2, "max_seq_len": 128}
    assert engine_spec({**args, "enable_attention_dp": True}) == engine_spec(args)


@pytest.mark.parametrize("extra, fragment", [
    ({"enable_lm_head_tp_in_adp": True}, "enable_lm_head_tp_in_adp requires enable_attention_dp"),
    ({"enable_attention_dp": "yes"}, "enable_attention_dp must be true or false"),
])
def test_the_stand_in_refuses_what_upstream_refuses(hf_mixtral, extra, fragment):
    from toolchain.llmapi.cpu_llm import LlmArgsError, engine_spec

    with pytest.raises(LlmArgsError, match=fragment):
        engine_spec({"model": str(hf_mixtral), "tensor_parallel_size": 2, **extra})


def test_llmapi_cpu_convert_of_a_dense_model_refuses_it(tmp_path, hf_llama):
    from toolchain.llmapi.stage import run_convert_llmapi
    from toolchain.workspace import Workspace

    spec = load_spec(write_spec(tmp_path / "s.yaml", hf_llama, target="llmapi-cpu",
                                parallelism={"tp": 2, "attention_dp": True}))
    with pytest.raises(ToolchainError) as err:
        run_convert_llmapi(spec, Workspace(tmp_path))
    assert "mixture-of-experts" in str(err.value) and "remove parallelism.attention_dp" in err.value.hint


def test_plan_fails_a_dense_model_in_its_own_check(tmp_path):
    from toolchain.checks.preflight import build_context, run_checks
    from toolchain.workspace import Workspace

    for checkpoint, status in ((LLAMA_8B, "fail"), (TINY_MIXTRAL, "pass")):
        spec = spec_for(tmp_path, checkpoint, attention_dp=True)
        results = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}
        assert results["parallelism.attention-dp"].status == status, results["parallelism.attention-dp"]
