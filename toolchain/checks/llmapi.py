"""Checks of the LLM-API path (targets llmapi and llmapi-cpu): what the PyTorch backend of
TensorRT-LLM 1.2.1 refuses or does not have (tensorrt_llm/llmapi/llm_args.py, the facts in
upstream/facts/llmapi.json), caught before anything is written."""

from __future__ import annotations

from toolchain.archs import get_family
from toolchain.archs.layout import splits_tp
from toolchain.checks.registry import (ENGINE, FAIL, GPU_ONLY, LLMAPI_PATH, PASS, SERVING, SKIP, UNREGISTERED, Context,
                                       check)
from toolchain.dynamo.roles import role_values
from toolchain.llmapi.args import llm_args, options_problem
from toolchain.openai.tools import parsers_problem
from toolchain.spec_dynamo import ROLES
from toolchain.speculative import mode_of, refusal
from toolchain.targets import target_of
from toolchain.versions import TRITON_IMAGE, TRTLLM_VERSION, in_line

BOTH = ENGINE + SERVING
# What speculative.draft_model names, in the refusal of a spec without it, for each mode whose row drafts with it.
DRAFT_CHECKPOINT = {"draft_target": "an HF checkpoint directory", "eagle3": "the EAGLE-3 draft checkpoint"}


@check("llmapi.speculative", BOTH,
       "Medusa, lookahead and EAGLE-1/2 exist only on the engine path (TensorRT-LLM speculative-decoding docs)",
       paths=LLMAPI_PATH)
def _speculative(ctx: Context):
    sp = ctx.spec.speculative
    row = mode_of(sp.mode)
    if sp.mode == "none":
        return PASS, "no speculative decoding"
    refused = refusal(sp.mode, target_of(ctx.spec))
    if refused:
        return FAIL, refused
    if row.draft == "draft_model" and sp.draft_model is None:
        what = DRAFT_CHECKPOINT.get(sp.mode, "its draft checkpoint")  # a new draft-model mode needs no entry
        return FAIL, f"speculative.mode={sp.mode} needs speculative.draft_model ({what})"
    if row.drafts_in_target:
        layers = _mtp_layers(ctx)
        if not layers:
            return FAIL, ("speculative.mode=mtp needs a model with multi-token prediction layers "
                          "(num_nextn_predict_layers in config.json, as DeepSeek-V3 has); this one has none: "
                          "use draft_target, eagle3 or ngram")
        if ctx.spec.parallelism.pp > 1:  # DeepseekV3ForCausalLM asserts it (_torch/models/modeling_deepseekv3.py)
            return FAIL, "speculative.mode=mtp with parallelism.pp > 1: PP + MTP combination is not supported; set pp 1"
        found = ctx.family()
        if found is None or not found[0].mtp_rows:  # the CPU stand-in's convert keeps the layer by those rows
            return FAIL, ("speculative.mode=mtp needs a family whose MTP layer this toolchain knows "
                          "(DeepseekV3ForCausalLM's, archs/deepseek_v3.py MTP_ROWS)")
        return PASS, f"speculative_config decoding_type MTP over the model's {layers} MTP layer(s)"
    if sp.max_draft_len < 1:
        return FAIL, f"speculative.mode={sp.mode} needs speculative.max_draft_len >= 1"
    return PASS, f"speculative_config decoding_type {row.decoding_type}"


@check("llmapi.quantization", ENGINE,
       "the PyTorch backend loads pre-quantized Hugging Face-format checkpoints of some formats only "
       "(TensorRT-LLM docs/source/features/quantization.md)", paths=LLMAPI_PATH)
def _quantization(ctx: Context):
    from toolchain.checkpoint.hf_quant import hf_quant_problem

    q = ctx.quant
    if not q.active:
        return PASS, "unquantized: the checkpoint is served as it is"
    if q.modelopt:  # stored quantized (quant/view.py stored_format): LLM() loads it as it is
        return PASS, f"the checkpoint is stored {q.describe(ctx.device.sm if ctx.device else None)}, served as it is"
    problem = hf_quant_problem(q)
    if problem:
        return FAIL, problem
    # target llmapi-cpu runs it too: the CPU stand-in imports that checkpoint as stored.
    return PASS, f"convert writes a Hugging Face-format {q.method}/{q.kv_cache} checkpoint"


@check("llmapi.architecture", BOTH, "the PyTorch backend's model of the family must load it at this tp "
       "(TensorRT-LLM tensorrt_llm/_torch/models/modeling_*.py; the family's llmapi_refusal)", paths=LLMAPI_PATH)
def _architecture(ctx: Context):
    if ctx.model is None:
        return SKIP, "model config not readable here or not a registered family; the stage reports why"
    p = ctx.model.params
    family = get_family(p.architecture)
    why = family.llmapi_problem(p, ctx.spec.parallelism.tp, ctx.spec.parallelism.pp, ctx.quant.active)
    if why is not None:
        return FAIL, why
    return PASS, f"{p.architecture} at tp {ctx.spec.parallelism.tp}"


@check("llmapi.kv-reuse", BOTH, "a family the PyTorch backend runs without KV cache reuse must not ask for it "
       "(the family's llmapi_no_reuse: Gemma 3, tests/integration/defs/accuracy/test_llm_api_pytorch.py "
       "TestGemma3_1BInstruct)", paths=LLMAPI_PATH)
def _kv_reuse(ctx: Context):
    found = ctx.family()
    why = found[0].llmapi_no_reuse if found is not None else None
    if found is None or why is None:
        return (SKIP, UNREGISTERED) if found is None else (PASS, "kv_cache_config.enable_block_reuse follows "
                                                                  "build.kv_cache_reuse")
    arch = found[1]
    kv = llm_args(ctx.spec, ctx.spec.model.checkpoint).get("kv_cache_config") or {}
    asked = [f"kv_cache_config.{k}" for k in ("enable_block_reuse", "enable_partial_reuse") if kv.get(k, True)]
    if asked:
        fix = ("set build.kv_cache_reuse: false" if "kv_cache_config.enable_block_reuse" in asked
               else "remove it from llmapi.options")
        return FAIL, f"{arch} on the LLM-API path runs without KV cache reuse ({why}), but {asked[0]} is on; {fix}"
    return PASS, f"{arch}: kv_cache_config.enable_block_reuse and enable_partial_reuse written false"


@check("llmapi.options", BOTH, "every llmapi.options key must be an LLM-API argument of the pinned release "
       "(TorchLlmArgs forbids unknown keys)", paths=LLMAPI_PATH)
def _options(ctx: Context):
    problem = options_problem(ctx.spec)
    if problem:
        return FAIL, problem + "; fix llmapi.options in the spec"
    n = len(ctx.spec.llmapi.options)
    return PASS, f"{n} extra LLM-API option(s), all known" if n else "no extra LLM-API options"


@check("llmapi.parsers", SERVING, "llmapi.tool_parser / llmapi.reasoning_parser must name a parser trtllm-serve has "
       "(tensorrt_llm/serve/tool_parser/tool_parser_factory.py, tensorrt_llm/llmapi/reasoning_parser.py; the CPU "
       "server implements qwen3 and deepseekv3) for a family whose tool calls it reads", paths=LLMAPI_PATH)
def _parsers(ctx: Context):
    api = ctx.spec.llmapi
    if api.tool_parser is None and api.reasoning_parser is None:
        return PASS, "no tool or reasoning parser"
    arch = ctx.model.params.architecture if ctx.model is not None else None
    problem = parsers_problem(api.tool_parser, api.reasoning_parser, arch, on_cpu=ctx.spec.on_cpu)
    if problem:
        return FAIL, f"{problem}; fix llmapi.tool_parser / llmapi.reasoning_parser in the spec"
    named = ", ".join(f"--{k} {v}" for k, v in (("tool_parser", api.tool_parser),
                                                 ("reasoning_parser", api.reasoning_parser)) if v)
    return PASS, f"the OpenAI server starts with {named}"


@check("llmapi.num-tokens-vs-input", ENGINE,
       "without chunked prefill max_num_tokens caps a prompt (TensorRT-LLM llmapi/llm.py _check_arguments)",
       paths=LLMAPI_PATH)
def _num_tokens(ctx: Context):
    # The PyTorch backend refuses every request whose prompt is longer than max_num_tokens unless
    # enable_chunked_prefill is on (NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm.py, BaseLLM._check_arguments:
    # `backend == "pytorch" and not enable_chunked_prefill` -> RequestError "should not exceed max_num_tokens";
    # stored version at commit 4c05a74891e4df8066f08ed4ce14b0972abe4e25). A spec whose max_input_len admits
    # such prompts would be refused at serve time, so it fails here as limits.num-tokens-vs-input does on the
    # engine path (and `toolchain tune` drops such candidates on either path).
    lim = ctx.spec.limits
    if lim.max_num_tokens >= lim.max_input_len or ctx.spec.build.chunked_context:
        return PASS, f"prompts up to max_input_len {lim.max_input_len} fit"
    return FAIL, (f"limits.max_num_tokens ({lim.max_num_tokens}) is below limits.max_input_len "
                  f"({lim.max_input_len}) and chunked prefill is off: the LLM API refuses longer prompts; raise "
                  f"max_num_tokens to {lim.max_input_len} or set build.chunked_context=true (enable_chunked_prefill)")


def _mtp_layers(ctx: Context) -> int:
    config = ctx.model.hf_config if ctx.model is not None else {}
    return int(config.get("num_nextn_predict_layers") or 0)


@check("llmapi.runtime-version", ("serve",),
       "the LLM() arguments and the llmapi model are those of the pinned TensorRT-LLM release", paths=LLMAPI_PATH,
       devices=GPU_ONLY, elsewhere=(PASS, "the CPU stand-in needs no TensorRT-LLM"))
def _runtime_version(ctx: Context):
    from importlib import metadata

    if ctx.stage == "plan":
        return SKIP, "checked on the serving host when serve starts"
    try:
        found = metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError:
        return FAIL, (f"TensorRT-LLM is not installed in this environment: serve target llmapi inside the "
                      f"{TRITON_IMAGE} image (TensorRT-LLM {TRTLLM_VERSION})")
    if not in_line(found):
        return FAIL, (f"TensorRT-LLM {found} is installed, the spec's arguments are checked against "
                      f"{TRTLLM_VERSION}: use the {TRITON_IMAGE} image")
    return PASS, f"TensorRT-LLM {found}"


@check("dynamo.roles", (), "a disaggregated deployment's prefill and decode workers: each role's tp splits the model "
       "as parallelism.tp must (tp.heads), and its max_num_tokens takes a whole prompt without chunked prefill "
       "(llmapi.num-tokens-vs-input)", paths=LLMAPI_PATH)
def _dynamo_roles(ctx: Context):
    spec, p = ctx.spec, ctx.model.params if ctx.model is not None else None
    if not spec.dynamo.disaggregated or not spec.dynamo.roles_given:
        return PASS, "no per-role settings (every worker runs the shared ones)"
    told = []
    for role in ROLES:
        values = role_values(spec, role)
        layout = spec.parallelism.layout.with_tp(values["tp"])
        if p is not None and not splits_tp(p, layout, values["tp"]):
            good = [t for t in (1, 2, 4, 8, 16, 32, 64) if splits_tp(p, layout, t)]
            return FAIL, (f"dynamo.{role}.tp={values['tp']} does not split num_attention_heads="
                          f"{p.num_attention_heads}, num_key_value_heads={p.num_key_value_heads}, intermediate_size="
                          f"{p.intermediate_size}; use tp {', '.join(map(str, good))}")
        if values["max_num_tokens"] < spec.limits.max_input_len and not spec.build.chunked_context:
            return FAIL, (f"dynamo.{role}.max_num_tokens {values['max_num_tokens']} is below limits.max_input_len "
                          f"{spec.limits.max_input_len} and chunked prefill is off: the role's workers would refuse "
                          f"longer prompts; raise it or set build.chunked_context=true")
        told.append(f"{role} tp {values['tp']}, batch {values['max_batch_size']}, {values['max_num_tokens']} "
                    f"tokens/step, KV share {values['kv_cache_free_gpu_mem_fraction']}")
    return PASS, "; ".join(told)
