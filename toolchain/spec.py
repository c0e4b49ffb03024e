"""The deployment spec: one validated object that flows through every stage.

A spec is a YAML file (`build/<name>.yaml`). Unknown keys are rejected with the
key and the file named; `--set a.b=value` overrides are applied to the raw
mapping before validation, so an override is validated exactly like the file.
Relative paths in the spec are resolved against the spec file's directory.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from toolchain.archs.layout import Layout
from toolchain.archs.moe import mapping_problems
from toolchain.errors import ToolchainError
from toolchain.pretrained import require_built, require_built_adapter
from toolchain.speculative import DRAFT_ENGINE, Mode, mode_of
from toolchain.quant.formats import KvCacheKind, Method
from toolchain.spec_dynamo import DynamoSection, role_gpus_problem
from toolchain.spec_lora import LoraSection
from toolchain.spec_section import Section as _Section
from toolchain.spec_workload import ValidationSection
from toolchain.targets import TargetName, target_of


# Replica i of serving.replicas serves every port of the spec + REPLICA_PORT_STEP x i, so replicas sharing a host
# never collide (triton/cluster.py replica_spec).
REPLICA_PORT_STEP = 100


class ModelSection(_Section):
    checkpoint: Path = Path("checkpoint")
    """Hugging Face checkpoint directory (config.json + safetensors)."""
    tokenizer: Path | None = None
    """Tokenizer directory; defaults to the checkpoint directory."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weight dtype of the TensorRT-LLM checkpoint; `auto` takes HF `torch_dtype` (fp32 becomes fp16 as upstream does, except on target cpu)."""
    trust_remote_code: bool = False
    """Let Hugging Face run Python code shipped in the tokenizer or model directory (`auto_map`) when loading it;
    off by default, so a downloaded directory cannot run code: a tokenizer that needs its own code is refused with
    an error saying to set this. Also the LLM() `trust_remote_code` argument on the LLM-API path."""

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or self.checkpoint


class ParallelismSection(_Section):
    tp: int = Field(1, ge=1, le=64)
    """Tensor-parallel size: each linear layer is split over this many ranks."""
    pp: int = Field(1, ge=1, le=64)
    """Pipeline-parallel size: the decoder layers are split into this many stages."""
    gpus: int | None = Field(None, ge=1)
    """GPUs available to the deployment; unset, tp x pp. When given, tp x pp must not exceed it (plan suggests no
    larger tp)."""
    parallel_embedding: bool = False
    """Shard the input embedding over the TP ranks (TRT-LLM `use_parallel_embedding`)."""
    embedding_sharding_dim: Literal[0, 1] = 0
    """With parallel_embedding: 0 splits the vocabulary rows, 1 the hidden columns."""
    moe_tp: int | None = Field(None, ge=1, le=64)
    """Mixture-of-experts models: over how many of the tp ranks each expert's width is split (TensorRT-LLM
    `moe_tp_size`, LLM() `moe_tensor_parallel_size`). Unset: derived as TensorRT-LLM's Mapping does, tp // moe_ep,
    or tp when moe_ep is unset too. moe_tp x moe_ep must equal tp."""
    moe_ep: int | None = Field(None, ge=1, le=64)
    """Mixture-of-experts models: over how many of the tp ranks the experts are divided, each holding
    num_experts / moe_ep whole experts (`moe_ep_size`, LLM() `moe_expert_parallel_size`). Unset: tp // moe_tp, or 1."""
    attention_dp: bool = False
    """Mixture-of-experts models on the LLM-API path: attention data parallelism (LLM() `enable_attention_dp`). The
    tp ranks become attention data-parallel ranks: each holds the whole attention, the shared expert and lm_head,
    schedules its own requests (up to limits.max_batch_size each) and keeps their KV with every KV head, while the
    experts stay split as moe_tp x moe_ep. Needs tp > 1; the engine targets (cpu, trtllm) have no such mode."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """This section as one frozen value: tp, pp, the experts' moe_tp x moe_ep as TensorRT-LLM's Mapping derives
        them, and the embedding split (archs/layout.py); what every stage reads its split from."""
        return Layout.of(self)

    @model_validator(mode="after")
    def _moe_fits_tp(self) -> "ParallelismSection":
        problems = mapping_problems(self.tp, self.moe_tp, self.moe_ep)
        if problems:
            raise ValueError(problems[0])
        return self

    @model_validator(mode="after")
    def _attention_dp_needs_ranks(self) -> "ParallelismSection":
        if self.attention_dp and self.tp == 1:
            # Upstream accepts it and changes nothing (MappingBase.dp_size is tp_size, 1): refused as a no-op.
            raise ValueError("parallelism.attention_dp makes the tp ranks data-parallel, and tp is 1: set tp > 1 or "
                             "remove attention_dp")
        return self

    @model_validator(mode="after")
    def _fits_gpus(self) -> "ParallelismSection":
        if self.gpus is not None and self.tp * self.pp > self.gpus:
            raise ValueError(
                f"tp x pp = {self.tp} x {self.pp} = {self.tp * self.pp} ranks but only {self.gpus} GPUs are declared; "
                "lower tp or pp, or raise parallelism.gpus"
            )
        return self


class LimitsSection(_Section):
    max_batch_size: int = Field(8, ge=1)
    """Most requests in flight at once (engine and Triton max_batch_size)."""
    max_input_len: int = Field(512, ge=1)
    """Longest prompt in tokens."""
    max_seq_len: int = Field(1024, ge=2)
    """Longest prompt + generated tokens."""
    max_num_tokens: int = Field(4096, ge=1)
    """Most tokens processed in one engine step (batched prefill budget)."""

    @model_validator(mode="after")
    def _ordered(self) -> "LimitsSection":
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"limits.max_input_len ({self.max_input_len}) must be below limits.max_seq_len ({self.max_seq_len}) "
                "so at least one token can be generated"
            )
        return self


class ServingSection(_Section):
    host: str = "127.0.0.1"
    """Address tritonserver binds its HTTP, gRPC and metrics endpoints to."""
    http_port: int = Field(8000, ge=0, le=65535)
    """HTTP port (0 picks a free one)."""
    grpc_port: int = Field(8001, ge=0, le=65535)
    """gRPC port (0 picks a free one)."""
    metrics_port: int = Field(8002, ge=0, le=65535)
    """Prometheus metrics port (0 picks a free one)."""
    metrics_host: str | None = None
    """Address the metrics endpoint binds to; unset: `host` when that is loopback, else 127.0.0.1."""
    admin_key_file: Path | None = None
    """File holding the key for Triton's administrative APIs (model repository, shared memory, statistics, trace,
    logging), sent as header `admin-key`. They need it whenever `host` is not loopback, or whenever this is set."""
    admin_key_env: str = Field("TRITON_ADMIN_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable holding that key when admin_key_file is unset."""
    streaming: bool = True
    """Deploy decoupled models so clients can stream tokens."""
    accumulate_tokens: bool = False
    """Streaming through tensorrt_llm_bls: each response carries the text so far, not the new piece (its parameter)."""
    tritonserver: Path | None = None
    """tritonserver binary; default: `tritonserver` on PATH, else the one inside the nvidia-pytriton wheel."""
    startup_timeout_s: float = Field(180.0, gt=0)
    """Seconds to wait for the server to report ready."""
    instance_count: int = Field(1, ge=1)
    """Instances of preprocessing, postprocessing and the BLS."""
    max_queue_delay_microseconds: int = Field(0, ge=0)
    """Dynamic batcher delay in front of the models."""
    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, lt=1)
    """Share of the memory left after the weights given to the KV cache: free GPU memory, or for target cpu the
    host memory available (the executor refuses 1.0: calculateFreeMemBytes in kvCacheManager.cpp)."""
    max_tokens_in_paged_kv_cache: int | None = Field(None, ge=1)
    """Cap on the KV cache in tokens; with the fraction, the smaller limit wins (unset: the fraction alone)."""
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    """guaranteed_no_evict admits a request only with blocks for its longest output; max_utilization admits on
    current need and pauses the newest request when blocks run out (it resumes later, tokens kept)."""
    max_queue_size: int = Field(0, ge=0)
    """Requests that may wait for admission; more are refused with the executor's "queue is full" error (0: no bound)."""
    exclude_input_in_output: bool = True
    """Default for responses: return only generated tokens."""
    guided_decoding_backend: Literal["xgrammar"] | None = None
    """`xgrammar`: structured output (JSON, JSON schema, regex, EBNF) through the tensorrt_llm model's
    guided_decoding_guide_type / guided_decoding_guide inputs; model-repo writes the tokenizer-info file the backend
    reads (xgrammar_tokenizer_info_path). On the LLM-API path it is LLM()'s guided_decoding_backend (model.yaml, the
    trtllm-serve config), which response_format needs. Unset: guided decoding off, such requests are refused.
    Upstream's other value, llguidance, is not offered: the CPU engine implements XGrammar only."""
    engine_threads: int = Field(1, ge=0, le=256)
    """torch threads of the CPU engine inside the server (target cpu); 0 = every core this host gives the
    process. Small models decode fastest on one; 100M+ parameter models gain from more."""
    launch: Literal["single", "mpirun"] | None = None
    """How the engine's tp x pp ranks run. `mpirun`: one tritonserver per rank under mpirun, TensorRT-LLM's
    leader mode (for target cpu the ranks compute together over gloo); `single`: one tritonserver whose CPU
    engine runs every rank's shard in one process. Unset: mpirun for target trtllm, single for target cpu."""
    oversubscribe: bool = False
    """Let mpirun start more CPU ranks than this host has cores (--oversubscribe; target cpu with launch mpirun)."""
    replicas: int = Field(1, ge=1, le=64)
    """Copies of the deployment that `serve --print` and `serve --manifests` launch on a GPU target (trtllm, llmapi),
    each on tp x pp GPUs of its own: replica i takes the next tp x pp GPUs of its host (CUDA_VISIBLE_DEVICES,
    docker --gpus) and serves every port + 100 x i; the manifests run a Deployment or LeaderWorkerSet of this many
    replicas behind one Service, and the Slurm scripts a job array of as many tasks. `toolchain tune` writes it.
    Targets cpu and llmapi-cpu serve one server on this host: 1 (`toolchain dynamo` runs several CPU workers)."""


class CalibrationSection(_Section):
    dataset: str = "builtin"
    """Calibration text: `builtin` (the Python standard-library sources on this machine, no download) or a prompts file (.jsonl with a "text" per line, else one prompt per line)."""
    samples: int = Field(32, ge=1, le=4096)
    """Calibration sequences (prompts, or built-in windows of seq_len tokens)."""
    seq_len: int = Field(256, ge=8)
    """Tokens per calibration sequence; must not exceed the model's context."""


class QuantizationSection(_Section):
    method: Method = "none"
    """Weight format: int8_wo/int4_wo (W8A16/W4A16, per channel), awq (W4A16_AWQ, calibrated int4 per group), smoothquant (W8A8_SQ_PER_CHANNEL), fp8 (per-tensor FP8, Ada/Hopper), nvfp4 (NVFP4: FP4 weights and activations with an FP8 scale per 16 channels, Blackwell SM 100/103/120), fp8_block (FP8_BLOCK_SCALES: an FP8 scale per 128x128 weight tile, Hopper and SM 100/103, target llmapi only); none also imports AutoAWQ/GPTQ checkpoints as stored. nvfp4 and fp8_block are planned and checked; convert refuses them until their quantizers land."""
    group_size: int = 128
    """Input channels per int4 scale for awq: 64 or 128 (the sizes TensorRT-LLM implements)."""
    rounding: Literal["gptq", "nearest"] = "gptq"
    """How awq rounds weights onto its searched per-group grid: gptq spreads each input channel's rounding error over the channels not yet rounded (same W4A16_AWQ layout, lower output error); nearest is classic AWQ."""
    alpha: float = Field(0.5, ge=0, le=1)
    """SmoothQuant migration strength: s = amax_x^alpha / amax_w^(1-alpha)."""
    kv_cache: KvCacheKind = "none"
    """KV-cache precision; int8 and fp8 use per-layer scales from calibration."""
    exclude_modules: list[str] = Field(default_factory=list)
    """fnmatch globs of TensorRT-LLM module names kept unquantized (e.g. "transformer.layers.0.*"); the embedding and lm_head always are, and a mixture of experts' router and shared expert gate."""
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    """Data for awq, smoothquant, fp8, nvfp4 and KV-cache scales."""

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value not in (64, 128):
            raise ValueError(f"group size {value} is not supported; TensorRT-LLM's per-group int4 implements 64 and 128 only, use one of them")
        return value


class GpuSection(_Section):
    name: str | None = None
    """GPU model from the planner's table (H100 80GB, H100 PCIe, H200 141GB, A100 80GB, A100 40GB, L40S, L4, RTX 4090, RTX 3090, B200 180GB, GB200 186GB, B300 288GB); gives memory, SM version, and the bandwidth, peak FLOP/s and interconnect the performance prediction reads."""
    memory_gib: float | None = Field(None, gt=0)
    """Memory of one GPU in GiB; overrides the table, or describes a GPU not in it (then also set `sm`)."""
    sm: int | None = Field(None, ge=60, le=199)
    """Compute capability as major*10+minor (80 Ampere, 89 Ada, 90 Hopper, 100 Blackwell); overrides the table."""
    per_node: int = Field(8, ge=1, le=64)
    """GPUs per host; a world size (tp x pp) above it spans the hosts listed in `hostfile`."""
    hostfile: Path | None = None
    """MPI hostfile naming the hosts of a multi-node deployment (passed to mpirun)."""
    hourly_usd: float | None = Field(None, gt=0)
    """Price of one GPU per hour in US dollars; `toolchain plan` then gives the predicted cost per million output
    tokens at the predicted maximum throughput."""


class BuildSection(_Section):
    trtllm_build: Path | None = None
    """trtllm-build executable (target trtllm); default: `trtllm-build` on PATH."""
    workers: int = Field(0, ge=0, le=64)
    """Ranks built in parallel (trtllm-build --workers); 0 = one per rank, bounded by build.host_memory_gib (two rank
    checkpoints per worker), 1 when that is unset."""
    mpi: Literal["auto", "always", "never"] = "auto"
    """Build one rank per MPI process with one log per rank; `auto` does so when tp x pp > 1 (the printed line always;
    build-engine on a host without mpirun falls back to one process with --workers)."""
    host_memory_gib: float | None = Field(None, gt=0)
    """RAM of the build host in GiB, for the --workers bound and the build.host-ram check; unset: --workers 1
    (trtllm-build's default) and the check only warns, whatever machine plans."""
    gemm_plugin: Literal["auto", "float16", "bfloat16", "float32", "fp8", "nvfp4", "disable"] = "auto"
    """--gemm_plugin: `auto` (model dtype) suits fp16/bf16 models and the unquantized GEMMs (lm_head) of quantized ones; for quantization.method nvfp4 it resolves to `nvfp4`, the plugin FP4Linear's FP4 GEMM needs."""
    context_fmha: bool = True
    """--context_fmha: fused attention in the context phase; off also turns paged and FP8 context FMHA off."""
    use_paged_context_fmha: bool = True
    """--use_paged_context_fmha: the context phase reads the paged KV cache; KV-cache reuse and chunked context need it."""
    tokens_per_block: int = Field(32, ge=1, le=1024)
    """--tokens_per_block: tokens per KV-cache block, a power of 2 (written explicitly: the default moved from 64 to 32)."""
    multiple_profiles: bool = False
    """--multiple_profiles: several TensorRT profiles for different token counts (longer build, faster runtime)."""
    opt_num_tokens: int | None = Field(None, ge=1)
    """--opt_num_tokens: tuning point of the profile; cannot be combined with multiple_profiles."""
    use_fused_mlp: bool = True
    """--use_fused_mlp: one GEMM for fc and gate (trtllm-build applies it only to unquantized and FP8 models)."""
    reduce_fusion: bool = False
    """--reduce_fusion: fuse the all-reduce with residual and norm (Llama with tp > 1)."""
    max_beam_width: int = Field(1, ge=1, le=64)
    """--max_beam_width: widest beam search the engine serves (not with speculative decoding)."""
    gather_context_logits: bool = False
    """--gather_context_logits: return prompt logits (max_num_tokens x vocab x 4 bytes more; not with speculative decoding)."""
    kv_cache_reuse: bool = True
    """Reuse KV blocks of shared prefixes (Triton enable_kv_cache_reuse); needs paged context FMHA and a non-INT8 KV cache."""
    chunked_context: bool = False
    """Process long prompts in chunks (Triton enable_chunked_context) so max_num_tokens may be below max_input_len; needs paged context FMHA."""
    log_level: Literal["verbose", "info", "warning", "error"] = "info"
    """trtllm-build --log_level."""

    @model_validator(mode="after")
    def _power_of_two(self) -> "BuildSection":
        if self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"tokens_per_block {self.tokens_per_block} must be a power of 2 (e.g. 32 or 64)")
        return self


class SpeculativeSection(_Section):
    mode: Mode = "none"
    """Speculative decoding: a separate draft model, Medusa heads, EAGLE-1, lookahead, n-gram prompt lookup, or none;
    on the LLM-API path also eagle3 (an EAGLE-3 draft in draft_model) and mtp (the model's own multi-token
    prediction layers, where its config has them)."""
    max_draft_len: int = Field(0, ge=0, le=1024)
    """Most draft tokens per step (trtllm-build --max_draft_len); medusa/eagle: 0 takes it from the checkpoint."""
    draft_model: Path | None = None
    """draft_target: HF checkpoint of the draft model (same tokenizer); converted and built at tp 1 next to the target.
    eagle3: the EAGLE-3 draft checkpoint (speculative_model_dir)."""
    heads: Path | None = None
    """medusa: directory of trained Medusa heads (medusa_lm_head.safetensors + config.json, as
    `toolchain medusa-heads` writes); convert adds them to a MedusaForCausalLM checkpoint.
    eagle: the EAGLE-1 draft (config.json + safetensors with fc.* and layers.*); convert writes
    an EagleForCausalLM checkpoint with one EagleNet per tree level."""
    draft_kv_cache_free_gpu_mem_fraction: float = Field(0.1, gt=0, lt=1)
    """draft_target: share of free GPU memory for the draft's KV cache; with the target's share it must stay below 1."""
    use_draft_logits: bool = False
    """draft_target only: build the draft with --gather_generation_logits so the BLS may compare logits, not only
    tokens (upstream's use_draft_logits; requests still choose with the `use_draft_logits` input)."""
    ngram_size: int = Field(3, ge=1, le=32)
    """ngram: longest suffix of the sequence looked up earlier in it for a draft (prompt lookup's
    max_matching_ngram_size); shorter suffixes are tried down to 1."""
    lookahead_window_size: int = Field(0, ge=0)
    """lookahead: window size W (Triton lookahead_window_size)."""
    lookahead_ngram_size: int = Field(0, ge=0)
    """lookahead: n-gram size N (Triton lookahead_ngram_size)."""
    lookahead_verification_set_size: int = Field(0, ge=0)
    """lookahead: verification set size G (Triton lookahead_verification_set_size)."""
    choices: str | None = None
    """medusa/eagle: draft tree as "{0, 0, 0}, {0, 1}" (Triton medusa_choices / eagle_choices); default the backend's."""
    target_gpu_device_ids: list[int] | None = None
    """draft_target on target trtllm (orchestrator mode): the target engine's GPUs, one per rank (tensorrt_llm's
    gpu_device_ids; [1] in TensorRT-LLM's speculative-decoding.md); unset: 0 .. tp x pp - 1."""
    draft_gpu_device_ids: list[int] | None = None
    """draft_target on target trtllm: the draft engine's one GPU (tensorrt_llm_draft's gpu_device_ids); unset: [0]."""
    expected_acceptance: float | None = Field(None, ge=0, le=1)
    """The share of draft tokens the target is expected to accept, for `toolchain plan`'s performance prediction:
    a step then yields 1 + expected_acceptance x max_draft_len tokens. Unset: the mode's default
    (toolchain/speculative.py), none where no published figure fits."""

    @model_validator(mode="after")
    def _draft_logits_need_a_draft(self) -> "SpeculativeSection":
        # Only draft_target's separate draft engine has logits for the BLS to send: the other modes draft
        # without a model (ngram, lookahead), inside the target engine (medusa, eagle) or without the BLS
        # (eagle3, mtp), so the flag would build nothing.
        if self.use_draft_logits and mode_of(self.mode).adds != DRAFT_ENGINE:
            raise ValueError(f"use_draft_logits needs mode draft_target (a draft engine's logits), not {self.mode}; "
                             "remove speculative.use_draft_logits")
        return self


class LlmApiSection(_Section):
    options: dict[str, Any] = Field(default_factory=dict)
    """More LLM-API arguments for targets llmapi/llmapi-cpu, merged into model.yaml and the trtllm-serve
    config over the ones the spec derives (e.g. {cuda_graph_config: {max_batch_size: 8}}); every key is
    checked against the pinned release's TorchLlmArgs."""
    cancellation_check_period_ms: int = Field(100, ge=1)
    """How often Triton's llmapi model polls for cancelled requests (triton_config)."""
    openai_port: int = Field(8080, ge=0, le=65535)
    """Port of the OpenAI-compatible server (trtllm-serve on a GPU host; the CPU server for llmapi-cpu); 0 picks a free one."""
    served_model_name: str | None = None
    """The `model` name the OpenAI server answers to; default: the spec's name."""
    tool_parser: str | None = None
    """trtllm-serve's --tool_parser: the format tool calls are parsed from in chat answers (qwen3, deepseekv3 on
    the CPU server too; qwen3_coder, kimi_k2, deepseekv3.1, deepseek_v32 on a GPU host only). Unset: a chat request
    with tools is refused by the CPU server (trtllm-serve would answer it as plain text)."""
    reasoning_parser: str | None = None
    """trtllm-serve's --reasoning_parser: deepseek-r1 or qwen3 splits the answer's <think> text into
    reasoning_content."""


class DeploymentSpec(_Section):
    name: str = Field("model", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Deployment name: output directories are engines/<name>, model_repo/<name>, reports/<name>."""
    target: TargetName = "cpu"
    """`trtllm`: trtllm-build engines and the tensorrtllm backend (TensorRT-LLM 1.2.1); `cpu`: the same repository
    with the CPU engine standing in for the engine; `llmapi`: the LLM-API path (PyTorch backend, no engine build:
    Triton's llmapi model and trtllm-serve); `llmapi-cpu`: that path's repository and OpenAI server on the CPU engine."""
    model: ModelSection = Field(default_factory=ModelSection)
    """Source checkpoint and dtype."""
    parallelism: ParallelismSection = Field(default_factory=ParallelismSection)
    """Tensor and pipeline parallelism."""
    limits: LimitsSection = Field(default_factory=LimitsSection)
    """Engine build limits."""
    serving: ServingSection = Field(default_factory=ServingSection)
    """Triton server settings."""
    validation: ValidationSection = Field(default_factory=ValidationSection)
    """Latency workload and SLOs."""
    gpu: GpuSection = Field(default_factory=GpuSection)
    """The GPUs the deployment runs on, for the memory plan and the preflight checks."""
    build: BuildSection = Field(default_factory=BuildSection)
    """trtllm-build plugins and flags, and the runtime features they enable."""
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    """Speculative decoding."""
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    """Weight, activation and KV-cache quantization applied by convert."""
    llmapi: LlmApiSection = Field(default_factory=LlmApiSection)
    """The LLM-API path (targets llmapi and llmapi-cpu)."""
    dynamo: DynamoSection = Field(default_factory=DynamoSection)
    """NVIDIA Dynamo deployments of the LLM-API path (`toolchain dynamo`)."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters served beside the base model (multi-LoRA)."""

    source: Path | None = Field(None, exclude=True)
    """The file this spec was loaded from (set by the loader)."""

    @property
    def llmapi_path(self) -> bool:
        """The LLM-API path (no engine): targets llmapi and llmapi-cpu."""
        return target_of(self).llmapi_path

    @property
    def on_cpu(self) -> bool:
        """Served by the CPU engine on this host: targets cpu and llmapi-cpu."""
        return target_of(self).on_cpu

    @property
    def rank_processes(self) -> bool:
        """Target cpu with serving.launch mpirun: one tritonserver per rank, as on GPUs."""
        return self.target == "cpu" and self.serving.launch == "mpirun"

    @model_validator(mode="after")
    def _replicas_fit(self) -> "DeploymentSpec":
        n, s, par = self.serving.replicas, self.serving, self.parallelism
        if n == 1:
            return self
        if self.on_cpu:
            raise ValueError(f"serving.replicas {n}: target {self.target} serves one server on this host; set it to 1 "
                             "(`toolchain dynamo` runs several CPU workers of target llmapi-cpu)")
        if par.gpus is not None and n * par.world_size > par.gpus:
            raise ValueError(f"serving.replicas x tp x pp = {n} x {par.tp} x {par.pp} = {n * par.world_size} GPUs but "
                             f"parallelism.gpus is {par.gpus}; lower serving.replicas or raise parallelism.gpus")
        top = max(s.http_port, s.grpc_port, s.metrics_port, self.llmapi.openai_port)
        if top + REPLICA_PORT_STEP * (n - 1) > 65535:
            raise ValueError(f"replica {n - 1} would serve port {top} + {REPLICA_PORT_STEP * (n - 1)}, above 65535; "
                             "lower the serving ports or serving.replicas")
        return self

    @model_validator(mode="after")
    def _roles_fit_gpus(self) -> "DeploymentSpec":
        par = self.parallelism
        problem = role_gpus_problem(self.dynamo, par.tp, par.pp, par.gpus)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _attention_dp_on_llmapi_path(self) -> "DeploymentSpec":
        if self.parallelism.attention_dp and not self.llmapi_path:
            # Only the PyTorch backend's Mapping has enable_attention_dp; trtllm-build's engines split attention by tp.
            raise ValueError(f"parallelism.attention_dp is an LLM-API option (enable_attention_dp) and target "
                             f"{self.target} builds an engine, which has no attention data parallelism; set target "
                             "llmapi (llmapi-cpu on a CPU host) or remove attention_dp")
        return self

    @model_validator(mode="after")
    def _launch_fits_target(self) -> "DeploymentSpec":
        if self.llmapi_path and self.speculative.use_draft_logits:
            raise ValueError(f"speculative.use_draft_logits builds a draft engine for the BLS; target {self.target} "
                             "has neither (LLM() runs the draft itself): remove it")
        launch = self.serving.launch
        if launch is None:
            return self
        if self.llmapi_path:
            raise ValueError(f"serving.launch applies to the engine targets (cpu, trtllm), not {self.target}: "
                             "LLM() starts its own rank workers; remove serving.launch")
        if self.target == "trtllm" and launch == "single":
            raise ValueError("target trtllm always runs its ranks under mpirun (TensorRT-LLM's leader or "
                             "orchestrator mode); remove serving.launch or set it to mpirun")
        mode = self.speculative.mode
        if self.target == "cpu" and launch == "mpirun" and not mode_of(mode).cpu_ranks:
            raise ValueError(f"speculative.mode {mode} is not run across CPU rank processes (draft_target needs "
                             "the orchestrator mode; Medusa/EAGLE trees run in one process): set serving.launch "
                             "single")
        return self

    @model_validator(mode="after")
    def _placement_fits(self) -> "DeploymentSpec":
        sp = self.speculative
        for key, count in (("target_gpu_device_ids", self.parallelism.world_size), ("draft_gpu_device_ids", 1)):
            ids = getattr(sp, key)
            if ids is not None and (self.target != "trtllm" or mode_of(sp.mode).adds != DRAFT_ENGINE):
                raise ValueError(f"speculative.{key} places the engines of draft_target on target trtllm "
                                 f"(orchestrator mode), not {sp.mode} on {self.target}; remove it")
            if ids is not None and (len(ids) != count or min(ids) < 0 or len(set(ids)) != count):
                raise ValueError(f"speculative.{key} {ids}: list {count} distinct GPU indices >= 0 (one per rank)")
        return self

    @model_validator(mode="after")
    def _class_adapters_named(self) -> "DeploymentSpec":
        names = list(self.lora.adapters)
        for c in self.validation.workload.classes:
            if c.adapter is not None and c.adapter not in names:
                raise ValueError(f"validation.workload.classes {c.name!r} names adapter {c.adapter!r}, which "
                                 f"lora.adapters does not hold ({', '.join(names) or 'none'}); name one of them "
                                 "or remove the class's adapter")
        return self

    def spec_hash(self) -> str:
        """Stable hash of every field (paths as resolved), for manifests."""
        data = self.model_dump(mode="json")
        if not self.lora.enabled:  # a spec without LoRA hashes as it did before the section existed
            data.pop("lora")
        for part, key in (("speculative", "target_gpu_device_ids"), ("speculative", "draft_gpu_device_ids"),
                          ("serving", "accumulate_tokens")):  # and one without a GPU placement or accumulating BLS
            if data[part][key] in (None, False):
                data[part].pop(key)
        for role in ("prefill", "decode"):  # so does one without per-role Dynamo settings
            if not getattr(self.dynamo, role).given:
                data["dynamo"].pop(role)
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _section_model(annotation: Any) -> type[_Section] | None:
    """The section a field holds (`X | None` unwrapped), or None when it holds a value (a list of sections
    included: `--set` sets a list whole)."""
    for candidate in (annotation, *(get_args(annotation) if get_origin(annotation) is not list else ())):
        if isinstance(candidate, type) and issubclass(candidate, _Section):
            return candidate
    return None


def _holds_any_keys(annotation: Any) -> bool:
    """A free-form mapping (llmapi.options): any key below it is the mapping's, not the spec's."""
    return annotation is Any or get_origin(annotation) is dict


def _key_problem(keys: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """(why the dotted spec path `keys` names no field, "; did you mean 'the closest field'?" or ""); None
    when it names one (or reaches into a free-form mapping)."""
    model: type[_Section] = DeploymentSpec
    for i, key in enumerate(keys):
        here = ".".join(keys[:i + 1])
        fields = model.model_fields
        if key not in fields:
            close = difflib.get_close_matches(key, [f for f in fields if f != "source"], n=1)
            parent = ".".join(keys[:i])
            return f"unknown key '{here}'", (f"; did you mean '{'.'.join(filter(None, (parent, close[0])))}'?"
                                              if close else "")
        annotation = fields[key].annotation
        section = _section_model(annotation)
        if section is None:
            if i + 1 < len(keys) and not _holds_any_keys(annotation):
                return f"'{here}' is a field, not a section (it has no '{keys[i + 1]}')", ""
            return None
        model = section
    return None


def _set_path(data: dict, dotted: str, raw: str, origin: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ToolchainError(f"bad override '{dotted}={raw}'", "write --set section.field=value")
    # The key is checked against the spec's fields here, so a typo is blamed on the override that has it
    # (validation would name the spec file, where the key is not).
    problem = _key_problem(keys)
    if problem:
        raise ToolchainError(f"{problem[0]} in --set {dotted}={raw}{problem[1]}",
                             "`toolchain schema --markdown` lists every field")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ToolchainError(f"override '{dotted}': '{key}' is not a section in {origin}")
        node = child
    # YAML parsing gives `--set a.b=8` an int, `true` a bool, `null` None.
    node[keys[-1]] = yaml.safe_load(raw) if raw != "" else ""


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ToolchainError(f"bad override '{item}'", "write --set section.field=value, e.g. --set parallelism.tp=2")
        pairs.append((key.strip(), value.strip()))
    return pairs


def apply_overrides(data: dict, items: list[str] | tuple[str, ...], origin: str) -> None:
    """Apply `--set a.b=value` items to the raw mapping `data`, before validation."""
    for key, value in parse_overrides(items):
        _set_path(data, key, value, origin)


def _format_validation_error(err: ValidationError, origin: str, overrides: tuple[str, ...] = ()) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<top level>"
    # A value that came from `--set` is blamed on that override, not on the file that does not hold it.
    for key, value in parse_overrides(overrides):
        if loc == key or loc.startswith(key + "."):
            origin = f"--set {key}={value}"
    if first["type"] == "extra_forbidden":
        what, close = _key_problem([str(p) for p in first["loc"]]) or (f"unknown key '{loc}'", "")
        return f"{what} in {origin}{close or '; remove it or check its spelling'}"
    msg = first["msg"].removeprefix("Value error, ")
    return f"invalid '{loc}' in {origin}: {msg}"


def _resolve_paths(spec: DeploymentSpec, base: Path) -> None:
    def resolve_path(p: Path) -> Path:
        p = Path(p).expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    def resolve(p: Path | None) -> Path | None:
        return None if p is None else resolve_path(p)

    spec.model.checkpoint = resolve_path(spec.model.checkpoint)
    spec.model.tokenizer = resolve(spec.model.tokenizer)
    spec.gpu.hostfile = resolve(spec.gpu.hostfile)
    spec.speculative.draft_model = resolve(spec.speculative.draft_model)
    spec.speculative.heads = resolve(spec.speculative.heads)
    if spec.build.trtllm_build is not None and "/" in str(spec.build.trtllm_build):
        spec.build.trtllm_build = resolve(spec.build.trtllm_build)
    calib = spec.quantization.calibration
    if calib.dataset != "builtin":
        calib.dataset = str(resolve(Path(calib.dataset)))
    spec.validation.workload.prompts_file = resolve(spec.validation.workload.prompts_file)
    if spec.serving.tritonserver is not None and "/" in str(spec.serving.tritonserver):
        spec.serving.tritonserver = resolve(spec.serving.tritonserver)
    spec.serving.admin_key_file = resolve(spec.serving.admin_key_file)
    spec.lora.adapters = {name: resolve_path(path) for name, path in spec.lora.adapters.items()}


def spec_from_dict(data: dict[str, Any], base: Path, origin: str = "<spec>",
                   overrides: list[str] | tuple[str, ...] = ()) -> DeploymentSpec:
    """Validate `data` (read from `origin`, with the `--set` items `overrides` applied) into a spec."""
    try:
        spec = DeploymentSpec.model_validate(data)
    except ValidationError as err:
        raise ToolchainError(_format_validation_error(err, origin, tuple(overrides))) from None
    _resolve_paths(spec, base)
    return spec


def load_spec(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> DeploymentSpec:
    """Load, override and validate a spec file."""
    path = Path(path)
    if not path.is_file():
        raise ToolchainError(f"spec file not found: {path}", "pass a YAML spec such as build/tiny-llama.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ToolchainError(f"malformed YAML in {path}{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ToolchainError(f"{path} must hold a mapping of sections (name, model, parallelism, ...)")
    apply_overrides(data, overrides, str(path))
    spec = spec_from_dict(data, path.parent.resolve(), str(path), overrides)
    spec.source = path.resolve()
    require_built(spec.model.checkpoint)
    for adapter in spec.lora.adapters.values():
        require_built_adapter(adapter)
    return spec
