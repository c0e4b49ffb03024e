"""Every preflight check has a case here that makes it fail (or warn, for the
advisory ones), starting from a spec on which every check passes; a meta-test
refuses a registered check without a trigger."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from toolchain.quant.view import Quantization
from toolchain.checks.preflight import FAIL, PASS, REGISTRY, WARN, build_context, run_checks
from toolchain.errors import ToolchainError
from toolchain.spec import LimitsSection, load_spec
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
             "torch_dtype": "float16", "eos_token_id": 2}


def base(tmp_path: Path) -> dict:
    """A trtllm spec on which every check passes (Llama-3-8B-Instruct on an H100)."""
    return {"name": "chk", "target": "trtllm",
            "model": {"checkpoint": str(CONFIGS / "llama-3-8b-instruct"), "dtype": "bfloat16"},
            "limits": {"max_batch_size": 8, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 4096},
            "gpu": {"name": "H100 80GB"}, "build": {"host_memory_gib": 512},
            "serving": {"http_port": 0, "grpc_port": 0, "metrics_port": 0}}


def merge(data: dict, change: dict) -> dict:
    out = dict(data)
    for key, value in change.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def run(tmp_path: Path, change: dict | None = None, *, stage="plan", quant=None, setup=None) -> dict:
    data = merge(base(tmp_path), change or {})
    # The spec itself refuses bad limits; model_construct gets one past it, as a
    # spec built in code rather than loaded could be.
    raw_limits = data.pop("_limits", None)
    if setup:
        setup(tmp_path, data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    if raw_limits:
        spec = spec.model_copy(update={"limits": LimitsSection.model_construct(**raw_limits)})
    ws = Workspace(tmp_path / "ws")
    ctx = build_context(spec, stage, ws, quant=quant)
    return {r.id: r for r in run_checks(ctx)}


def config_dir(tmp_path: Path, cfg: dict, name="hf", generation=None) -> Path:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def use_config(cfg: dict, generation=None):
    def setup(tmp_path, data):
        data["model"]["checkpoint"] = str(config_dir(tmp_path, cfg, generation=generation))
    return setup


def engine_dir(tmp_path: Path, *, world=1, ranks=None, version="1.2.1", mbs=8) -> None:
    d = tmp_path / "ws" / "engines" / "chk" / "engine"
    d.mkdir(parents=True)
    for r in range(world if ranks is None else ranks):
        (d / f"rank{r}.engine").write_bytes(b"x")
    (d / "config.json").write_text(json.dumps({
        "version": version, "pretrained_config": {"mapping": {"world_size": world}},
        "build_config": {"max_batch_size": mbs, "max_beam_width": 1}}))


def tokenizer(tmp_path: Path, eos: str, names: dict[int, str], vocab: int | None = None) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": eos, "added_tokens_decoder": {str(i): {"content": n, "special": True} for i, n in names.items()}}))
    if vocab is not None:
        (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [], "model": {
            "vocab": {f"t{i}": i for i in range(vocab)}}}))
    return d


def busy_port(tmp_path, data):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    data["serving"].update(host="127.0.0.1", http_port=sock.getsockname()[1])
    busy_port.sock = sock  # kept open until the check ran


def fake_tritonserver(tmp_path, data):
    binary = tmp_path / "triton" / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    data["serving"]["tritonserver"] = str(binary)


def rope(scaling: dict) -> dict:
    return {**json.loads((CONFIGS / "llama-3-8b-instruct" / "config.json").read_text()), "rope_scaling": scaling}


DRAFT = {"speculative": {"mode": "draft_target", "max_draft_len": 4,
                         "draft_model": str(CONFIGS / "qwen2.5-0.5b-instruct")},
         "model": {"checkpoint": str(CONFIGS / "qwen2.5-7b-instruct")},
         "serving": {"streaming": False, "grpc_port": 8001, "kv_cache_free_gpu_mem_fraction": 0.8}}

# Mixtral-8x7B-Instruct-v0.1's config.json: 8 experts of width 14336, top-2.
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "sliding_window": None,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304, "head_dim": 256,
          "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 256000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "bos_token_id": 2,
          "eos_token_id": 1}

# check id -> (spec change, keyword arguments of run(), expected status)
REFUSED = "plan refuses"  # no check result: plan stops with a one-line error first

TRIGGERS = {
    "limits.input-vs-seq": ({"_limits": dict(max_batch_size=8, max_input_len=4096, max_seq_len=4096,
                                             max_num_tokens=8192)}, {}, FAIL),
    "limits.num-tokens-vs-input": ({"limits": {"max_input_len": 8192, "max_seq_len": 8192 + 512,
                                               "max_num_tokens": 4096}}, {}, FAIL),
    "limits.num-tokens-vs-block": ({"limits": {"max_num_tokens": 16, "max_input_len": 8}}, {}, FAIL),
    "limits.seq-vs-positions": ({"limits": {"max_seq_len": 16384}}, {}, WARN),
    "kv.paged-context-fmha": ({"build": {"use_paged_context_fmha": False, "kv_cache_reuse": True}}, {}, FAIL),
    "kv.int8-disables-paged-fmha": ({}, {"quant": Quantization(kv_cache="int8")}, FAIL),
    "kv.one-sequence": ({"limits": {"max_seq_len": 131072}, "serving": {"kv_cache_free_gpu_mem_fraction": 0.1}},
                        {}, FAIL),
    "kv.batch-concurrency": ({"limits": {"max_batch_size": 4096}}, {}, WARN),
    "memory.fits": ({"model": {"checkpoint": str(CONFIGS / "llama-3-70b")}}, {}, FAIL),
    "build.host-ram": ({"build": {"host_memory_gib": 8}}, {}, FAIL),
    "build.multiple-profiles": ({"build": {"multiple_profiles": True, "opt_num_tokens": 1024}}, {}, FAIL),
    "rope.unknown-type": ({}, {"setup": use_config(rope({"type": "wobbly", "factor": 2.0}))}, FAIL),
    "rope.missing-keys": ({}, {"setup": use_config(rope({"rope_type": "llama3", "factor": 8.0}))}, FAIL),
    "tp.heads": ({"parallelism": {"tp": 3}}, {}, FAIL),
    "pp.layers": ({"parallelism": {"pp": 33}, "gpu": {"per_node": 64}}, {}, FAIL),
    # a valid Mapping (1 x 4 = tp) that cannot divide 6 experts over 4 ranks
    "moe.parallelism": ({"parallelism": {"tp": 4, "moe_tp": 1, "moe_ep": 4}},
                        {"setup": use_config({**MIXTRAL, "num_local_experts": 6})}, FAIL),
    # a dense model: where its MLP goes under attention DP differs per upstream model class (archs/layout.py)
    "parallelism.attention-dp": ({"target": "llmapi", "parallelism": {"tp": 2, "attention_dp": True}}, {}, FAIL),
    "arch.quantization": ({}, {"quant": Quantization(method="smoothquant"), "setup": use_config(MIXTRAL)}, FAIL),
    # plan refuses an unregistered architecture before any check runs (plan/model.py load_model)
    "arch.supported": ({}, {"setup": use_config({**LLAMA2_7B, "architectures": ["GPT2LMHeadModel"]})}, REFUSED),
    # 1.2.1's trtllm-build has no Qwen3-MoE (tests/test_moe_qwen.py test_the_engine_path_refuses_qwen3_moe)
    "arch.engine-path": ({"model": {"checkpoint": str(CONFIGS / "qwen3-30b-a3b")}}, {}, FAIL),
    "quant.group-size": ({}, {"quant": Quantization(method="awq", group_size=32)}, FAIL),
    # an MLP that is not whole groups of 128 (padding would split a group): convert refuses it too
    "quant.group-padding": ({"parallelism": {"tp": 4}},
                            {"quant": Quantization(method="awq"), "setup": use_config({**LLAMA2_7B, "intermediate_size": 11000})},
                            FAIL),
    "quant.weight-only-padding": ({"parallelism": {"tp": 8}},
                                  {"quant": Quantization(method="int8_wo"), "setup": use_config(LLAMA2_7B)}, FAIL),
    "quant.moe-router-excluded": ({}, {"quant": Quantization(method="int8_wo"), "setup": "moe-checkpoint-without-router"},
                                  FAIL),
    "quant.lm-head-excluded": ({}, {"quant": Quantization(method="int8_wo"), "setup": "checkpoint-excludes-lm-head-only"},
                               FAIL),
    "quant.fp8-needs-sm89": ({"gpu": {"name": "A100 80GB"}}, {"quant": Quantization(method="fp8")}, FAIL),
    "quant.blackwell-int-formats": ({"gpu": {"name": None, "memory_gib": 180, "sm": 100}},
                                    {"quant": Quantization(method="awq")}, FAIL),
    # FP8 block scales are the PyTorch backend's alone (quant/formats.py FP8_BLOCK.engine_why_not)
    "quant.engine-path": ({}, {"quant": Quantization(method="fp8_block")}, FAIL),
    # the nvfp4 GEMM plugin runs only NVFP4 weights (quant/formats.py NVFP4.gemm_plugin)
    "quant.gemm-plugin": ({"build": {"gemm_plugin": "nvfp4"}}, {}, FAIL),
    # Hopper has no FP4 tensor cores (quant/formats.py NVFP4_GPUS)
    "quant.device": ({}, {"quant": Quantization(method="nvfp4")}, FAIL),
    "gpu.known": ({"gpu": {"name": None}}, {}, FAIL),
    "eos.resolved": ({}, {"setup": use_config({k: v for k, v in LLAMA2_7B.items() if k != "eos_token_id"})}, FAIL),
    "eos.tokenizer-default": ({}, {"setup": "tokenizer-eos-end-of-text"}, FAIL),
    "triton.tokenizer": ({}, {"setup": "tokenizer-too-big"}, FAIL),
    "triton.engine-dir": ({"parallelism": {"tp": 2}}, {"setup": "engine-missing-rank"}, FAIL),
    "triton.engine-version": ({}, {"setup": "engine-1.1"}, FAIL),
    "triton.world-size": ({}, {"setup": "engine-world-4"}, FAIL),
    "triton.batch-size": ({}, {"setup": "engine-mbs-4"}, FAIL),
    "triton.kv-fraction": (merge(DRAFT, {"serving": {"kv_cache_free_gpu_mem_fraction": 0.95}}), {}, FAIL),
    "triton.placeholders": ({}, {"setup": "repo-placeholder", "stage": "serve"}, FAIL),
    "launch.multi-node": ({"parallelism": {"tp": 8, "pp": 2}}, {}, FAIL),
    # 32 CPU rank processes: more than any test host's cores.
    "launch.cpu-ranks": ({"target": "cpu", "parallelism": {"tp": 32}, "serving": {"launch": "mpirun"}},
                         {"stage": "serve"}, FAIL),
    "triton.backend-present": ({}, {"setup": fake_tritonserver, "stage": "serve"}, FAIL),
    "serve.ports-free": ({}, {"setup": busy_port, "stage": "serve"}, FAIL),
    "serve.shm-size": ({"serving": {"instance_count": 1_000_000}}, {"stage": "serve"}, FAIL),
    "bench.workload-limits": ({"validation": {"workload": {"input_tokens": 4000}}}, {}, FAIL),
    "bench.streaming": ({"validation": {"workload": {"streaming": False}}}, {}, FAIL),
    "quality.openai-endpoint": ({"validation": {"quality": {"max_perplexity_ratio": 1.05}}}, {}, FAIL),
    "spec.mode-runnable": ({"target": "cpu", "speculative": {"mode": "eagle"}}, {}, FAIL),
    "spec.eagle-draft": ({"speculative": {"mode": "eagle"}}, {}, FAIL),
    "spec.medusa-heads": ({"speculative": {"mode": "medusa"}}, {}, FAIL),
    "spec.draft-len": ({"speculative": {"mode": "lookahead", "max_draft_len": 0}}, {}, FAIL),
    "spec.gather-context-logits": ({"speculative": {"mode": "medusa"}, "build": {"gather_context_logits": True}},
                                   {}, FAIL),
    "spec.beam-search": ({"speculative": {"mode": "medusa"}, "build": {"max_beam_width": 2}}, {}, FAIL),
    "spec.eagle-limits": ({"speculative": {"mode": "eagle"}, "parallelism": {"pp": 2}}, {}, FAIL),
    "spec.lookahead-draft-len": ({"speculative": {"mode": "lookahead", "max_draft_len": 10, "lookahead_window_size": 7,
                                                  "lookahead_ngram_size": 7, "lookahead_verification_set_size": 7}},
                                 {}, FAIL),
    "spec.draft-model": (merge(DRAFT, {"speculative": {"draft_model": None}}), {}, FAIL),
    "spec.draft-target-reuse": (merge(DRAFT, {"build": {"kv_cache_reuse": False}}), {}, FAIL),
    "spec.draft-target-grpc-port": (merge(DRAFT, {"serving": {"grpc_port": 9001}}), {}, WARN),
    "spec.draft-target-decoupled": (merge(DRAFT, {"serving": {"streaming": True}}), {}, FAIL),
    "spec.ngram-no-triton": ({"speculative": {"mode": "ngram", "max_draft_len": 4}}, {}, WARN),
    "llmapi.speculative": ({"target": "llmapi", "speculative": {"mode": "medusa", "max_draft_len": 4}}, {}, FAIL),
    "llmapi.quantization": ({"target": "llmapi", "quantization": {"method": "smoothquant"}}, {}, FAIL),
    "llmapi.options": ({"target": "llmapi", "llmapi": {"options": {"max_num_tokenz": 64}}}, {}, FAIL),
    "llmapi.parsers": ({"target": "llmapi", "llmapi": {"tool_parser": "hermes"}}, {}, FAIL),
    "llmapi.architecture": ({"target": "llmapi", "parallelism": {"tp": 2},
                             "model": {"checkpoint": str(CONFIGS / "phi-3-mini-128k-instruct")}}, {}, FAIL),
    "llmapi.runtime-version": ({"target": "llmapi"}, {"stage": "serve"}, FAIL),
    # build.kv_cache_reuse defaults to true; Gemma 3 runs without reuse on the PyTorch backend
    "llmapi.kv-reuse": ({"target": "llmapi", "model": {"checkpoint": str(CONFIGS / "gemma-3-1b-it")}}, {}, FAIL),
    "llmapi.num-tokens-vs-input": ({"target": "llmapi", "limits": {"max_input_len": 8192, "max_seq_len": 8192 + 512,
                                                                   "max_num_tokens": 4096}}, {}, FAIL),
    # Llama-3-8B has 32 heads and 8 KV heads: a prefill tp of 3 splits neither
    "dynamo.roles": ({"target": "llmapi", "dynamo": {"disaggregated": True, "prefill": {"tp": 3}}}, {}, FAIL),
    # the base spec's engine is bfloat16, which LoRA's converted adapters cannot be (contract38: TYPE_FP16 lora_weights)
    "lora.adapters": ({"lora": {"target_modules": ["attn_q"], "max_lora_rank": 8}}, {}, FAIL),
    # 1 MiB of host cache cannot hold one rank-64 adapter over Llama-3-8B's 32 layers
    "lora.cache": ({"model": {"dtype": "float16"}, "lora": {"target_modules": ["attn_q"], "max_lora_rank": 64,
                                                            "cache": {"host_memory_bytes": 1 << 20}}}, {}, FAIL),
}


def moe_checkpoint(tmp_path: Path, listed: list[str] | None, algo: str = "W8A16") -> None:
    """The converted checkpoint's config.json with this exclude_modules (None: the field absent)."""
    d = tmp_path / "ws" / "engines" / "chk" / "checkpoint"
    d.mkdir(parents=True)
    quant = {"quant_algo": algo, **({"exclude_modules": listed} if listed is not None else {})}
    (d / "config.json").write_text(json.dumps({"quantization": quant}))


def named_setup(name: str):
    def checkpoint_excludes_lm_head_only(tmp_path, data):
        d = tmp_path / "ws" / "engines" / "chk" / "checkpoint"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"quantization": {"quant_algo": "W8A16",
                                                                    "exclude_modules": ["lm_head"]}}))

    def moe_checkpoint_without_router(tmp_path, data):
        data["model"]["checkpoint"] = str(CONFIGS / "mixtral-8x7b-v0.1")
        moe_checkpoint(tmp_path, ["lm_head", "transformer.vocab_embedding"])

    def tokenizer_eos_end_of_text(tmp_path, data):
        data["model"]["tokenizer"] = str(tokenizer(tmp_path, "<|end_of_text|>",
                                                   {128001: "<|end_of_text|>", 128009: "<|eot_id|>"}))

    def tokenizer_too_big(tmp_path, data):
        data["model"]["tokenizer"] = str(tokenizer(tmp_path, "<|eot_id|>", {128001: "<|end_of_text|>",
                                                                            128009: "<|eot_id|>"}, vocab=128300))

    def repo_placeholder(tmp_path, data):
        d = tmp_path / "ws" / "model_repo" / "chk" / "tensorrt_llm"
        d.mkdir(parents=True)
        (d / "config.pbtxt").write_text('name: "tensorrt_llm"\nmax_batch_size: ${triton_max_batch_size}\n')

    table = {
        "checkpoint-excludes-lm-head-only": checkpoint_excludes_lm_head_only,
        "moe-checkpoint-without-router": moe_checkpoint_without_router,
        "tokenizer-eos-end-of-text": tokenizer_eos_end_of_text,
        "tokenizer-too-big": tokenizer_too_big,
        "repo-placeholder": repo_placeholder,
        "engine-missing-rank": lambda t, d: engine_dir(t, world=2, ranks=1),
        "engine-1.1": lambda t, d: engine_dir(t, version="1.1.0"),
        "engine-world-4": lambda t, d: engine_dir(t, world=4),
        "engine-mbs-4": lambda t, d: engine_dir(t, mbs=4),
    }
    return table[name]


def test_base_spec_passes_every_check(tmp_path):
    results = run(tmp_path)
    bad = {i: r.message for i, r in results.items() if r.status not in (PASS, "skip")}
    assert bad == {"triton.tokenizer": bad.get("triton.tokenizer")}  # no tokenizer ships with the config
    assert results["triton.tokenizer"].status == WARN


@pytest.mark.parametrize("check_id", sorted(TRIGGERS))
def test_check_triggers(tmp_path, check_id):
    change, kwargs, expected = TRIGGERS[check_id]
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("setup"), str):
        kwargs["setup"] = named_setup(kwargs["setup"])
    if expected == REFUSED:
        with pytest.raises(ToolchainError, match="unsupported architecture 'GPT2LMHeadModel'"):
            run(tmp_path, change, **kwargs)
        return
    result = run(tmp_path, change, **kwargs)[check_id]
    assert result.status == expected, result.message
    assert result.message and "\n" not in result.message


@pytest.mark.parametrize("moe,expected", [({"moe_tp": 4}, FAIL), ({"moe_ep": 4}, PASS)])
def test_per_group_experts_need_whole_groups_per_rank(tmp_path, moe, expected):
    """AWQ experts are never padded: 11008 wide over moe_tp 4 is 2752 per rank, not whole groups of 128 (convert
    refuses it in the same words); over moe_ep 4 each rank holds whole experts."""
    result = run(tmp_path, {"parallelism": {"tp": 4, **moe}}, quant=Quantization(method="awq"),
                 setup=use_config({**MIXTRAL, "intermediate_size": 11008}))["quant.group-padding"]
    assert result.status == expected, result.message
    assert ("11008 / moe_tp 4 = 2752) is not a multiple of the group size 128" in result.message) == (expected == FAIL)


@pytest.mark.parametrize("config,quant,expected,says", [
    (GEMMA2, Quantization(method="awq"), FAIL, "only int8_wo, int4_wo"),
    (GEMMA2, Quantization(method="int8_wo"), PASS, "Gemma2ForCausalLM int8_wo"),
    (MIXTRAL, Quantization(method="smoothquant"), FAIL, "quantization smoothquant on MixtralForCausalLM"),
    (MIXTRAL, Quantization(method="int8_wo", kv_cache="fp8"), PASS, "MixtralForCausalLM int8_wo"),
    (MIXTRAL, Quantization(), PASS, "MixtralForCausalLM none"),
    (MIXTRAL, Quantization(method="awq"), PASS, "MixtralForCausalLM awq"),
])
def test_arch_quantization_reads_the_family_row(tmp_path, config, quant, expected, says):
    """One check asks every family's `quantization` refusal (the same one convert and the HF export ask)."""
    result = run(tmp_path, {}, quant=quant, setup=use_config(config))["arch.quantization"]
    assert result.status == expected and says in result.message, result.message


# Qwen3-8B's and Qwen3-30B-A3B's config.json facts (no such config ships in build/configs).
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "head_dim": 128,
         "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
         "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_key_value_heads": 4,
             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True}


def _checkpoint(source):
    """A build/configs directory by name, or a config dict written to a config-only directory."""
    if isinstance(source, str):
        return lambda tmp_path, data: data["model"].update(checkpoint=str(CONFIGS / source))
    return use_config(source)


@pytest.mark.parametrize("source,tp,method,expected,says", [
    ("llama-3-8b-instruct", 2, "none", PASS, "LlamaForCausalLM at tp 2"),
    ("mistral-7b-instruct-v0.3", 2, "none", PASS, "MistralForCausalLM at tp 2"),
    ("qwen2.5-7b-instruct", 2, "none", PASS, "Qwen2ForCausalLM at tp 2"),
    (QWEN3, 2, "none", PASS, "Qwen3ForCausalLM at tp 2"),
    (MIXTRAL, 2, "none", PASS, "MixtralForCausalLM at tp 2"),
    ("qwen1.5-moe-a2.7b", 2, "none", PASS, "Qwen2MoeForCausalLM at tp 2"),
    (QWEN3_MOE, 2, "none", PASS, "Qwen3MoeForCausalLM at tp 2"),
    ("gemma-3-1b-it", 1, "none", PASS, "Gemma3ForCausalLM at tp 1"),
    ("gemma-3-1b-it", 1, "fp8", FAIL, "Gemma3ForCausalLM quantized on the LLM-API path"),
    (GEMMA2, 1, "none", FAIL, "registers no Gemma 2 model"),
    ("phi-3-mini-128k-instruct", 1, "none", PASS, "Phi3ForCausalLM at tp 1"),
    ("phi-3-mini-128k-instruct", 2, "none", FAIL, "Phi3ForCausalLM at tp 2 on the LLM-API path"),
    ("gpt-oss-120b", 8, "none", PASS, "GptOssForCausalLM at tp 8"),
    ("gpt-oss-120b", 16, "none", FAIL, "tp above num_key_value_heads 8"),
])
def test_llmapi_architecture_gates_each_family(tmp_path, source, tp, method, expected, says):
    """Which families TensorRT-LLM 1.2's PyTorch backend loads (the family's llmapi_refusal), on config-only
    checkpoints: every registered family accepted or refused in one line at plan."""
    change = {"target": "llmapi", "parallelism": {"tp": tp}, "quantization": {"method": method}}
    result = run(tmp_path, change, setup=_checkpoint(source))["llmapi.architecture"]
    assert result.status == expected and says in result.message and "\n" not in result.message, result.message


def test_every_check_has_a_trigger_and_a_doc():
    run_checks  # noqa: B018 - importing toolchain.checks.preflight registers every check
    assert set(REGISTRY) == set(TRIGGERS)
    assert all(c.doc for c in REGISTRY.values())


def test_stage_selection(tmp_path):
    """convert and build-engine run the engine checks, model-repo and serve the
    serving ones; plan-only checks (enforced by convert itself) never guard a stage."""
    for stage, present, absent in [("convert", "limits.input-vs-seq", "eos.resolved"),
                                   ("model-repo", "eos.resolved", "memory.fits"),
                                   ("serve", "serve.ports-free", "build.host-ram")]:
        (tmp_path / stage).mkdir()
        ids = set(run(tmp_path / stage, stage=stage))
        assert present in ids and absent not in ids and "tp.heads" not in ids


def test_eos_resolution_prefers_the_chat_terminator(tmp_path):
    def setup(t, data):
        data["model"]["tokenizer"] = str(tokenizer(t, "<|eot_id|>", {128001: "<|end_of_text|>",
                                                                    128009: "<|eot_id|>"}))
    r = run(tmp_path, setup=setup)
    assert r["eos.resolved"].status == PASS and r["eos.tokenizer-default"].status == PASS
    msg = r["eos.resolved"].message
    assert msg.startswith("end_id 128009 (<|eot_id|>), stop ids [128001 (<|end_of_text|>)], pad_id 128009")


def test_eos_resolution_without_tokenizer_and_for_qwen(tmp_path):
    from toolchain.eos import resolve

    llama = json.loads((CONFIGS / "llama-3-8b-instruct" / "config.json").read_text())
    gen = json.loads((CONFIGS / "llama-3-8b-instruct" / "generation_config.json").read_text())
    e = resolve(llama, gen, None)
    assert (e.end_id, e.stop_ids, e.pad_id) == (128009, (128001,), 128009)
    qwen = json.loads((CONFIGS / "qwen2.5-7b-instruct" / "config.json").read_text())
    qgen = json.loads((CONFIGS / "qwen2.5-7b-instruct" / "generation_config.json").read_text())
    e = resolve(qwen, qgen, None)
    assert (e.end_id, e.stop_ids, e.pad_id) == (151645, (151643,), 151643)


def test_lookahead_draft_len_formula():
    from toolchain.checks.speculative import lookahead_draft_len

    assert lookahead_draft_len(7, 7, 7) == 83  # the reference's example
    assert lookahead_draft_len(1, 1, 0) == 0


def test_tiny_llama_passes_every_check_at_every_stage(tmp_path):
    spec = load_spec(REPO / "build" / "tiny-llama.yaml", ["serving.http_port=0", "serving.grpc_port=0",
                                                          "serving.metrics_port=0"])
    for stage in ("plan", "convert", "build-engine", "model-repo", "serve", "deploy"):
        results = run_checks(build_context(spec, stage, Workspace(tmp_path)))
        assert [r.id for r in results if r.status == FAIL] == [], stage


def test_engine_version_against_the_containers_table(tmp_path):
    """The serving image is the first Triton release whose Dockerfile builds
    TensorRT-LLM 1.2.1 (26.04; 25.12 ships 1.1.0). An engine from 1.2.0rc8 shares
    its TensorRT and only warns; one from 1.1.0 cannot load."""
    from toolchain import versions

    assert versions.TRITON_CONTAINER == "26.04" and versions.container_for("1.1.0") == "25.12"
    assert versions.TRITON_IMAGE == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert versions.tensorrt_of("1.2.0rc8") == versions.TENSORRT_VERSION
    for version, expected in [("1.2.1", PASS), ("1.2.0rc8", WARN), ("1.1.0", FAIL), ("1.2.0rc2", FAIL)]:
        sub = tmp_path / version
        sub.mkdir()
        result = run(sub, {}, setup=lambda t, d, v=version: engine_dir(t, version=v))["triton.engine-version"]
        assert result.status == expected, (version, result.message)


def test_gpu_only_checks_are_listed_as_skipped_on_the_cpu_engine(tmp_path):
    """A check registered for GPUs only (a rule of trtllm-build or the tensorrtllm backend) still appears on the
    CPU engine's target, skipped with the name of the target it applies to; --skip-check takes precedence."""
    gpu_only = [c.id for c in REGISTRY.values() if c.devices == ("gpu",) and c.elsewhere is None]
    assert "limits.num-tokens-vs-input" in gpu_only and "triton.engine-version" in gpu_only
    results = run(tmp_path, {"target": "cpu"})
    assert {i: (results[i].status, results[i].message) for i in gpu_only} == \
        {i: ("skip", "applies to target trtllm") for i in gpu_only}
    # a GPU-only rule the CPU engine meets by design declares what it reports there instead of a skip
    assert REGISTRY["triton.backend-present"].elsewhere == ("pass", "target cpu runs the Python backend")
    assert REGISTRY["llmapi.runtime-version"].elsewhere == ("pass", "the CPU stand-in needs no TensorRT-LLM")
    spec = load_spec(REPO / "build" / "tiny-llama.yaml")
    skipped = run_checks(build_context(spec, "plan", Workspace(tmp_path)), ["limits.num-tokens-vs-input"])
    assert [r.message for r in skipped if r.id == "limits.num-tokens-vs-input"] == ["skipped by --skip-check"]


@pytest.mark.parametrize("model,listed,quant,expected,says", [
    # what convert wrote before: the list replaces the default, so the router and Qwen2-MoE's gate are quantized
    ("mixtral-8x7b-v0.1", ["lm_head", "transformer.vocab_embedding"], "int8_wo", FAIL, "without mlp.router (32 in all"),
    ("qwen1.5-moe-a2.7b", ["lm_head", "transformer.vocab_embedding"], "int4_wo", FAIL,
     "without mlp.router, mlp.shared_expert_gate, mlp.shared_expert_gate.weight (72 in all over 24 layers)"),
    # the gate's module alone: a weight-only build still quantizes its weight tensor (weight_only_quantize_dict)
    ("qwen1.5-moe-a2.7b", ["lm_head", "transformer.vocab_embedding", "*router", "*shared_expert_gate"], "int8_wo",
     FAIL, "without mlp.shared_expert_gate.weight (24 in all"),
    ("qwen1.5-moe-a2.7b", ["lm_head", "transformer.vocab_embedding", "*router", "*shared_expert_gate",
                           "*shared_expert_gate.weight"], "int8_wo", PASS, "router and shared_expert_gate unquantized"),
    ("mixtral-8x7b-v0.1", [], "fp8", FAIL, "without mlp.router"),  # an empty list replaces the default as well
    ("mixtral-8x7b-v0.1", None, "fp8", PASS, "keeps the router unquantized"),  # absent: upstream's defaults
    ("llama-3-8b-instruct", ["lm_head"], "int8_wo", PASS, "no quantized mixture of experts"),
])
def test_moe_router_exclusion_names_what_the_list_leaves_quantized(tmp_path, model, listed, quant, expected, says):
    """quantize_layers reads the checkpoint's list against module names and, for W8A16/W4A16, the build's
    weight_only_quantize_dict against tensor names; the check names what of the router and the shared expert's
    gate either leaves to quantization, and what to add."""
    def setup(tmp_path, data):
        data["model"]["checkpoint"] = str(CONFIGS / model)
        moe_checkpoint(tmp_path, listed, Quantization(method=quant).quant_algo)

    result = run(tmp_path, {}, stage="build-engine", quant=Quantization(method=quant), setup=setup)["quant.moe-router-excluded"]
    assert result.status == expected and says in result.message, result.message
    if expected == FAIL:
        assert "'*router'" in result.message and "Required but not provided tensors" in result.message
