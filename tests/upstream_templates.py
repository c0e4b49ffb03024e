"""Repositories filled from upstream's inflight_batcher_llm templates, as users make them by hand.

The template text is not committed (it is upstream's): each template is rebuilt from its parsed facts
(toolchain/upstream/facts/model_templates.json, TensorRT-LLM 0c8de69a) through Triton's ModelConfig protobuf, with
every `${placeholder}` where the template has it, quoted (parameters, backend) or not (max_batch_size, decoupled,
queue sizes, instance counts, chosen data types). It is then filled by `fill`, this file's own implementation of
fill_template.py's documented rule (NVIDIA/TensorRT-LLM triton_backend/tools/fill_template.py): the argument split
on ',' then ':' with a backslash escaping the next character, the defaults max_queue_size and
max_queue_delay_microseconds 0, every given key present in the file, string.Template.safe_substitute.

The parameter sets are those of upstream's docs (tensorrtllm_backend docs/llama.md at v0.21.0, lines 58-62 and
147-151; TensorRT-LLM docs/source/advanced/speculative-decoding.md for draft-target), with the placeholders those
docs predate added where the 1.2 templates would otherwise not parse (marked below).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as pb

from toolchain.upstream import facts as upstream_facts

# Unquoted data-type placeholders get a type no template tensor uses, swapped for the placeholder in the text.
DTYPE_STAND_INS = {"logits_datatype": "TYPE_UINT16", "encoder_input_features_data_type": "TYPE_UINT32",
                   "prompt_embedding_table_data_type": "TYPE_INT8"}
DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0"}


def template_text(model: str) -> str:
    """The template of `model` rebuilt from its facts, placeholders in place."""
    facts = upstream_facts("model_templates")["models"][model]
    cfg = pb.ModelConfig(name=model)
    if facts["backend"]:
        cfg.backend = facts["backend"]
    if facts["platform"]:
        cfg.platform = facts["platform"]
    numbers: dict[str, str] = {}

    def stand_in(field: str) -> int | None:
        for p in facts["placeholders"]:
            if p["field"] == field:
                number = 900001 + len(numbers)
                numbers[str(number)] = "${%s}" % p["placeholder"]
                return number
        return None

    cfg.max_batch_size = stand_in("max_batch_size") or 0
    for kind, tensors in (("input", cfg.input), ("output", cfg.output)):
        for t in facts[f"{kind}s"]:
            dtype = t["data_type"]
            item = tensors.add(name=t["name"], dims=t["dims"],
                               data_type=pb.DataType.Value(DTYPE_STAND_INS.get(dtype[2:-1], dtype)))
            if t["reshape"] is not None:
                item.reshape.SetInParent()
                item.reshape.shape.extend(t["reshape"])
            if kind == "input":
                item.optional, item.allow_ragged_batch = t["optional"], t["allow_ragged_batch"]
    if any(p["field"] == "decoupled" for p in facts["placeholders"]):
        cfg.model_transaction_policy.decoupled = True
    preferred = stand_in("preferred_batch_size")
    if preferred is not None:
        cfg.dynamic_batching.preferred_batch_size.append(preferred)
        cfg.dynamic_batching.max_queue_delay_microseconds = stand_in("max_queue_delay_microseconds") or 0
        cfg.dynamic_batching.default_queue_policy.max_queue_size = stand_in("default_queue_policy") or 0
    elif model == "postprocessing":
        cfg.dynamic_batching.SetInParent()  # `dynamic_batching {}` (UNVERIFIED: the facts keep no empty block)
    count = stand_in("count")
    for group in facts["instance_group"]:
        cfg.instance_group.add(count=count or group.get("count", 1), kind=pb.ModelInstanceGroup.Kind.Value(group["kind"]))
    for key, entry in facts["parameters"].items():
        cfg.parameters[key].string_value = entry["value"]
    for step in facts["ensemble_steps"]:
        json_format.ParseDict(step, cfg.ensemble_scheduling.step.add())
    text = text_format.MessageToString(cfg)
    for number, placeholder in numbers.items():
        text = text.replace(f": {number}\n", f": {placeholder}\n")
    for name, dtype in DTYPE_STAND_INS.items():
        text = text.replace(f"data_type: {dtype}\n", "data_type: ${%s}\n" % name)
    return text.replace("decoupled: true\n", "decoupled: ${decoupled_mode}\n")


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep`; a backslash keeps the next character (fill_template.py's escape)."""
    parts, current, escaped = [], "", False
    for ch in text:
        if escaped:
            current, escaped = current + ch, False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]


def fill(text: str, args: str, where: str = "config.pbtxt") -> str:
    """fill_template.py's substitution of "k1:v1,k2:v2" into `text`."""
    values = dict(DEFAULTS)
    for item in _split(args, ","):
        key, value = _split(item, ":")  # more or fewer than one ':' is a ValueError, as upstream's unpacking
        assert key in text, f"key '{key}' does not exist in the file {where}"
        values[key] = value
    return string.Template(text).safe_substitute(values)


def plain_set(tokenizer: Path, engine: Path) -> dict[str, str]:
    """docs/llama.md lines 58-62 (non-streaming), triton_max_batch_size 64."""
    return {
        "preprocessing": f"tokenizer_dir:{tokenizer},triton_max_batch_size:64,preprocessing_instance_count:1",
        "postprocessing": f"tokenizer_dir:{tokenizer},triton_max_batch_size:64,postprocessing_instance_count:1",
        "tensorrt_llm_bls": "triton_max_batch_size:64,decoupled_mode:False,bls_instance_count:1,"
                            "accumulate_tokens:False,logits_datatype:TYPE_FP32",
        "ensemble": "triton_max_batch_size:64,logits_datatype:TYPE_FP32",
        # prompt_embedding_table_data_type: the docs predate it; the 1.2 template does not parse without it.
        "tensorrt_llm": "triton_backend:tensorrtllm,triton_max_batch_size:64,decoupled_mode:False,max_beam_width:1,"
                        f"engine_dir:{engine},max_tokens_in_paged_kv_cache:2560,max_attention_window_size:2560,"
                        "kv_cache_free_gpu_mem_fraction:0.5,exclude_input_in_output:True,enable_kv_cache_reuse:False,"
                        "batching_strategy:inflight_fused_batching,max_queue_delay_microseconds:0,"
                        "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32,"
                        "prompt_embedding_table_data_type:TYPE_FP16",
    }


def streaming_set(tokenizer: Path, engine: Path) -> dict[str, str]:
    """docs/llama.md lines 147-151 (decoupled): line 149's missing comma before logits_datatype is corrected
    (as printed, upstream's tool would fail to unpack 'accumulate_tokens:Truelogits_datatype:TYPE_FP32')."""
    out = plain_set(tokenizer, engine)
    out["tensorrt_llm_bls"] = ("triton_max_batch_size:64,decoupled_mode:True,bls_instance_count:1,"
                               "accumulate_tokens:True,logits_datatype:TYPE_FP32")
    out["tensorrt_llm"] = (out["tensorrt_llm"].replace("decoupled_mode:False", "decoupled_mode:True")
                           .replace("inflight_fused_batching", "inflight_batching"))
    return out


def draft_target_set(tokenizer: Path, engine: Path, draft_engine: Path, gpus: tuple[str, str] = ("1", "0")
                     ) -> dict[str, str]:
    """speculative-decoding.md, "Using Draft Target Model approach with Triton Inference Server": batch 4,
    no streaming, the target on GPU 1 and the draft on GPU 0 (`gpus`). logits_datatype, encoder_input_features_data_type and prompt_embedding_table_data_type are
    added (the doc predates them; the 1.2 templates do not parse without them)."""
    dtypes = "logits_datatype:TYPE_FP32"
    engine_args = ("triton_backend:tensorrtllm,engine_dir:{engine},decoupled_mode:False,max_tokens_in_paged_kv_cache:,"
                   "max_attention_window_size:,batch_scheduler_policy:guaranteed_no_evict,"
                   "batching_strategy:inflight_fused_batching,kv_cache_free_gpu_mem_fraction:0.8,"
                   "exclude_input_in_output:false,triton_max_batch_size:4,max_queue_delay_microseconds:0,"
                   "max_beam_width:1,enable_kv_cache_reuse:true,normalize_log_probs:true,enable_chunked_context:,"
                   "gpu_device_ids:{gpu},decoding_mode:top_k_top_p,"
                   f"{dtypes},encoder_input_features_data_type:TYPE_FP16,prompt_embedding_table_data_type:TYPE_FP16")
    return {
        "ensemble": f"triton_max_batch_size:4,{dtypes}",
        "preprocessing": f"tokenizer_dir:{tokenizer},triton_max_batch_size:4,preprocessing_instance_count:1",
        "postprocessing": f"tokenizer_dir:{tokenizer},triton_max_batch_size:4,postprocessing_instance_count:1",
        "tensorrt_llm_bls": "triton_max_batch_size:4,decoupled_mode:False,accumulate_tokens:false,bls_instance_count:1,"
                            "tensorrt_llm_model_name:tensorrt_llm,tensorrt_llm_draft_model_name:tensorrt_llm_draft,"
                            f"{dtypes}",
        "tensorrt_llm": engine_args.format(engine=engine, gpu=gpus[0]),
        "tensorrt_llm_draft": engine_args.format(engine=draft_engine, gpu=gpus[1]),
    }


def write_repository(out: Path, params: dict[str, str]) -> Path:
    """One model directory per entry of `params`, its config.pbtxt the template filled with it (a draft is the
    tensorrt_llm template renamed, as the speculative-decoding doc's copy and sed do)."""
    for model, args in params.items():
        template = "tensorrt_llm" if model == "tensorrt_llm_draft" else model
        text = template_text(template)
        if model != template:
            text = text.replace(f'name: "{template}"', f'name: "{model}"', 1)
        path = out / model / "config.pbtxt"
        (path.parent / "1").mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text, args, str(path)))
    return out


def write_engine_config(out: Path, *, max_batch_size: int, max_input_len: int = 1024, max_seq_len: int = 2560,
                        max_num_tokens: int = 8192, dtype: str = "float16", max_draft_len: int = 0,
                        speculative_mode: int = 1, version: str = "1.2.1", tp: int = 1, **build) -> Path:
    """An engine directory's config.json as TensorRT-LLM 1.2 writes it (builder.py EngineConfig.to_dict: the
    BuildConfig field list), and one rank file per rank so it looks built."""
    out.mkdir(parents=True, exist_ok=True)
    plugin = {"gpt_attention_plugin": dtype, "gemm_plugin": dtype, "lora_plugin": None, "paged_kv_cache": None,
              "tokens_per_block": 32, "use_paged_context_fmha": True, "context_fmha": True,
              "remove_input_padding": True, "multiple_profiles": False, "use_fp8_context_fmha": False,
              "reduce_fusion": False, "user_buffer": False}
    plugin.update(build.pop("plugin", {}))
    build_config = {
        "max_input_len": max_input_len, "max_seq_len": max_seq_len, "opt_batch_size": 8,
        "max_batch_size": max_batch_size, "max_beam_width": 1, "max_num_tokens": max_num_tokens,
        "opt_num_tokens": min(max_num_tokens, max_batch_size), "max_prompt_embedding_table_size": 0,
        "kv_cache_type": "PAGED", "gather_context_logits": False, "gather_generation_logits": False,
        "strongly_typed": True, "force_num_profiles": None, "profiling_verbosity": "layer_names_only",
        "enable_debug_output": False, "max_draft_len": max_draft_len, "speculative_decoding_mode": speculative_mode,
        "use_refit": False, "input_timing_cache": None, "output_timing_cache": "model.cache",
        "lora_config": {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 64, "lora_target_modules": [],
                        "trtllm_modules_to_hf_modules": {}, "max_loras": None, "max_cpu_loras": None},
        "auto_parallel_config": None, "weight_sparsity": False, "weight_streaming": False, "plugin_config": plugin,
        "use_strip_plan": False, "max_encoder_input_len": 1024, "monitor_memory": False, "use_mrope": False,
        "dry_run": False, "visualize_network": None,
    }
    build_config.update(build)
    pretrained = {"architecture": "LlamaForCausalLM", "dtype": dtype, "vocab_size": 250, "hidden_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1, "cp_size": 1, "moe_tp_size": tp,
                              "moe_ep_size": 1},
                  "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128,
                                   "exclude_modules": None}}
    (out / "config.json").write_text(json.dumps({"version": version, "pretrained_config": pretrained,
                                                 "build_config": build_config}, indent=1))
    for rank in range(tp):
        (out / f"rank{rank}.engine").write_bytes(b"")
    return out
