"""The spec combinations a Dynamo deployment refuses, each in one line naming what to change."""

from __future__ import annotations

from toolchain import upstream
from toolchain.dynamo import flags
from toolchain.errors import ToolchainError
from toolchain.llmapi.args import SECTIONS, known_args, options_problem, serve_config
from toolchain.spec import DeploymentSpec
from toolchain.spec_dynamo import ROLES
from toolchain.targets import CPU, CPU_STAND_IN, GPU, LLMAPI, TENSORRT_LLM, named, target_of

# The keys Dynamo's disaggregated engine configs set beyond an aggregated one, per role (facts dynamo.json
# examples engine_prefill / engine_decode).
DISAGG_KEYS = ("cache_transceiver_config", "disable_overlap_scheduler")


# Dynamo 1.6.1 runs TensorRT-LLM 1.3.0rc29 (facts dynamo.json release.trtllm_extra_pin), while the engine-args YAML is
# checked against the 1.2 line's llm_args.py (facts llmapi.json); the code index holds no llm_args.py at v1.3.0rc29.
# A key passes for 1.3.0rc29 when upstream promises it does not change or Dynamo 1.6.1 itself relies on it:
# - a committed LLM() argument (no `status` in 1.2's llm_args.py): upstream's API policy keeps committed arguments
#   consistent across releases, changing only prototype / beta / deprecated ones (NVIDIA/TensorRT-LLM
#   docs/source/developer-guide/api-change.md, "API Types and Stability Guarantees");
# - a key Dynamo 1.6.1's worker passes to LLM() itself (the ai-dynamo 1.6.1 wheel, dynamo/trtllm/workers/llm_worker.py,
#   the arg_map it merges --extra-engine-args over);
# - the disaggregation keys Dynamo's own prefill/decode engine configs set (DISAGG_KEYS).
DYNAMO_WORKER_KEYS = frozenset({
    "model", "scheduler_config", "tensor_parallel_size", "pipeline_parallel_size", "moe_expert_parallel_size",
    "enable_attention_dp", "backend", "kv_cache_config", "gpus_per_node", "max_num_tokens", "max_seq_len",
    "max_beam_width", "max_batch_size", "return_perf_metrics", "enable_iter_perf_stats", "kv_connector_config",
    "load_format"})


def runtime_release_problem(spec: DeploymentSpec) -> str | None:
    """An engine-args key (target llmapi) that may differ in the TensorRT-LLM release Dynamo runs, or None."""
    facts = upstream.facts("llmapi")
    runtime = upstream.facts("dynamo")["release"]["trtllm_extra_pin"].split("==")[-1]
    for key, value in serve_config(spec).items():
        paths = [(key, (known_args().get(key) or {}).get("status"))]
        if key in SECTIONS and isinstance(value, dict):
            fields = facts[SECTIONS[key]].get("fields", {})
            paths += [(f"{key}.{sub}", (fields.get(sub) or {}).get("status")) for sub in value]
        for path, status in paths:
            if status is None or path in DYNAMO_WORKER_KEYS or path in DISAGG_KEYS:
                continue
            return (f"llmapi.options.{path} is a {status} LLM-API argument in TensorRT-LLM 1.2.1, which upstream may "
                    f"change between releases, and Dynamo runs TensorRT-LLM {runtime}; remove it for `toolchain "
                    "dynamo` on target llmapi (trtllm-serve and Triton on 1.2.1 keep it)")
    return None


def problems(spec: DeploymentSpec) -> list[str]:
    """What Dynamo refuses in `spec`, in this order: the path, the router, then the LLM-API path on its device."""
    # Dynamo's workers run LLM(): the target row's `llm_runtime` says which (none on the engine path).
    d, runtime = spec.dynamo, target_of(spec).llm_runtime
    out = []
    if runtime is None:
        out.append(f"Dynamo serves the LLM-API path; target {spec.target} is the engine path (set target: "
                   f"{named(LLMAPI, GPU)} on a GPU host, {named(LLMAPI, CPU)} on this one)")
    if d.router not in flags.choices("frontend", "--router-mode"):
        out.append(f"dynamo.router {d.router!r} is not one of the frontend's --router-mode choices")
    if d.router == "kv" and not spec.build.kv_cache_reuse:
        out.append("dynamo.router kv routes by the workers' cached KV blocks, which build.kv_cache_reuse false turns "
                   "off (no block is ever stored); set build.kv_cache_reuse: true or dynamo.router: round-robin")
    if runtime is None:
        return out
    if spec.lora.enabled:
        # ai-dynamo/dynamo docs/features/lora/README.md @11adf995, "Backend Support": "TensorRT-LLM | ❌ | Not yet
        # supported" (LoRA there is the vLLM worker's); no Dynamo trtllm worker flag or handler builds a LoRARequest.
        out.append("lora: Dynamo's TensorRT-LLM workers do not serve LoRA adapters (Dynamo's LoRA is vLLM-only); "
                   "serve this spec with `toolchain deploy` (trtllm-serve / Triton) or remove the lora section")
    parsers = [f"llmapi.{k}" for k in ("tool_parser", "reasoning_parser") if getattr(spec.llmapi, k) is not None]
    if parsers:
        # Dynamo parses in its own frontend, by other names (the trtllm worker's --dyn-tool-call-parser and
        # --dyn-reasoning-parser, facts dynamo.json): passing trtllm-serve's names on would be a guess.
        out.append(f"{' and '.join(parsers)} name trtllm-serve's parsers, which `toolchain dynamo` does not pass to "
                   "Dynamo (its workers take their own --dyn-tool-call-parser / --dyn-reasoning-parser names); "
                   "unset them for Dynamo")
    if d.disaggregated and runtime == CPU_STAND_IN:
        out.append("dynamo.disaggregated needs KV-cache transfer between prefill and decode workers, which the CPU "
                   f"engine does not have; set it on target {named(LLMAPI, GPU)} (GPU hosts) or serve aggregated here")
    if runtime == TENSORRT_LLM and spec.parallelism.world_size > spec.gpu.per_node:
        out.append(f"one worker of tp x pp = {spec.parallelism.world_size} GPUs spans hosts (gpu.per_node "
                   f"{spec.gpu.per_node}); Dynamo's multinode workers are not rendered yet: keep tp x pp within a host")
    for role in ROLES if d.disaggregated and runtime == TENSORRT_LLM else ():
        tp = d.role(role).tp
        if tp is not None and tp * spec.parallelism.pp > spec.gpu.per_node:
            out.append(f"one {role} worker of dynamo.{role}.tp x pp = {tp * spec.parallelism.pp} GPUs spans hosts "
                       f"(gpu.per_node {spec.gpu.per_node}); Dynamo's multinode workers are not rendered yet: lower "
                       f"dynamo.{role}.tp")
    why = options_problem(spec)
    if why:
        out.append(why)
    elif runtime == TENSORRT_LLM:  # the CPU stand-in runs the 1.2 line's arguments; Dynamo's GPU workers run another release
        why = runtime_release_problem(spec)
        if why:
            out.append(why)
    return out


def check(spec: DeploymentSpec) -> None:
    found = problems(spec)
    if found:
        raise ToolchainError(found[0])
