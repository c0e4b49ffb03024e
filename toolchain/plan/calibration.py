"""The performance model against public measurements: the points it is fitted to, the points it is checked on.

Two facts files feed it, kept apart on purpose:
- `data/silicon_points.json`: TTFT and TPOT that AIConfigurator 0.12.0 measured for TensorRT-LLM serving
  Llama-3.1 (made by `python -m tools.silicon_points`). `tools/fit_efficiency.py` fits the efficiency table
  (`data/efficiency.json`, which plan/perf/efficiency.py reads) to the training part and reports the error on the held-out part.
- `data/published_throughput.json` (release 0.17, engine path) and `data/published_v1_0.json` (release 1.0, PyTorch
  path), with the release/1.2 files beside them: NVIDIA's published `trtllm-bench` maximum throughputs. They are
  never fitted to; tests/test_perf_calibration.py and tests/test_published_v1_0.py check the fitted model against
  them, each point planned on the target of the path its file names.

`holdout_mape()` recomputes the held-out error from the committed points and the table plan/perf/efficiency.py loads, so the
figure the table states cannot drift from the data (benchmarks/prediction.py reports it as gpu_holdout_mape).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from toolchain import gpus
from toolchain.archs import get_family
from toolchain.errors import ToolchainError
from toolchain.plan import perf
from toolchain.plan.model import ModelInfo, load_model
from toolchain.plan.plan import plan_memory
from toolchain.quant import formats
from toolchain.quant.view import Quantization, quantization_of
from toolchain.spec import DeploymentSpec, spec_from_dict

DATA = Path(__file__).resolve().parent / "data"
MODELS = DATA / "models"
"""config.json of each Llama-3.1 size (shapes from meta-llama's model cards' config.json; only shapes matter), of
DeepSeek-R1 (build/configs/deepseek-r1 without its quantization_config: the published rows name the format) and of
gpt-oss-120b (build/configs/gpt-oss-120b with its MXFP4 quantization_config: the format is the checkpoint's own)."""
SILICON = DATA / "silicon_points.json"
EFFICIENCY_FILE = DATA / "efficiency.json"
MAX_NUM_TOKENS = 8192
"""The token budget per iteration of the measured runs: the recorded rows do not say, so the PyTorch backend's
default is assumed (BaseLlmArgs.max_num_tokens = 8192 in tensorrt_llm/llmapi/llm_args.py, as
toolchain/upstream/facts/llmapi.json records it)."""
HOLDOUT_EVERY = 4
"""Every 4th configuration (sorted) is held out whole: see `held_out`."""
WAVES = 10
"""Requests per run over the concurrency, assumed for the measured points (AIConfigurator's rows do not record
the client): their grid (Llama-3.1-70B fp8 on B200/H200, TP 1-8, ISL/OSL 1k/1k, 1k/8k, 8k/1k, C 4-128) is
SemiAnalysis InferenceMAX's, whose README ("Benchmark Client Configuration", github.com/jyothisambolu/InferenceMAX)
runs vLLM's benchmark_serving.py with --num-prompts CONC x 10, --max-concurrency CONC, --request-rate inf,
--ignore-eos and --random-range-ratio 0.8: a closed loop of 10 waves that starts with all C requests at once.
The measured TTFT bears it out: it grows by about (C - 1)/20 prompt-times, the first wave's mean queue of
(C - 1)/2 prompt-times over 10 waves (docs/planning.md). MAX_NUM_TOKENS stays the default although those
launch scripts pass --max_num_tokens 16384: without a refit 16384 fits the 70B points' TTFT a little worse
(22.8% against 21.2%), so the scripts of the measured date may have differed."""


@dataclass(frozen=True)
class Measured:
    """One measured point: a configuration (model, GPU, format, TP, ISL/OSL) at one concurrency."""

    model: str
    gpu: str
    method: str
    tp: int
    isl: int
    osl: int
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    backend_version: str
    measured: str
    id: str

    @property
    def config(self) -> tuple:
        return (self.model, self.gpu, self.method, self.tp, self.isl, self.osl)

    @property
    def throughput(self) -> float:
        """Output tokens/s of the closed loop: C requests, each osl tokens in TTFT + (osl - 1) x TPOT."""
        return self.concurrency * self.osl / ((self.ttft_ms + (self.osl - 1) * self.tpot_ms) / 1e3)


@cache
def measured_points() -> tuple[Measured, ...]:
    doc = json.loads(SILICON.read_text())
    return tuple(Measured(**dict(zip(doc["columns"], row, strict=True))) for row in doc["rows"])


@cache
def _configs() -> tuple[tuple, ...]:
    return tuple(sorted({p.config for p in measured_points()}))


def held_out(point: Measured) -> bool:
    """Whole configurations are held out, every HOLDOUT_EVERY-th in sorted order (so each model, GPU, TP and
    ISL/OSL mix is represented on both sides): a user plans a configuration nobody measured, so the error that
    matters is on configurations the fit never saw, not between two concurrencies of a curve it did see."""
    return _configs().index(point.config) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1


@cache
def model_info(name: str) -> ModelInfo:
    return load_model(MODELS / name)


def spec_for(model: str, gpu: str, method: str, tp: int, isl: int, osl: int, *, max_batch_size: int,
             max_num_tokens: int, kv_fraction: float, dtype: str = "bfloat16", target: str = "trtllm",
             attention_dp: bool = False, pp: int = 1, kv_cache: str | None = None, concurrency: int = 1,
             num_requests: int | None = None) -> DeploymentSpec:
    """A spec of one benchmarked configuration (one stage of `tp` ranks; an fp8 KV cache with fp8, nvfp4 or
    fp8_block weights, which trtllm-bench, AIConfigurator's fp8 runs and NVIDIA's FP4 and DeepSeek's FP8
    checkpoints use; with `attention_dp` the experts over all tp ranks, DEPn), so the prediction runs the same
    planner, memory plan and performance model as `toolchain plan`. A stored-only format (gpt-oss's MXFP4) is asked
    as method none, the checkpoint's config.json naming it, with the KV cache in the model dtype. `toolchain
    calibrate` (plan/calibrate.py) names the KV cache, pipeline stages and the workload a report ran; `model` may
    be a config directory's absolute path as well as a name under MODELS."""
    moe = {"attention_dp": True, "moe_ep": tp, "moe_tp": 1} if attention_dp else {}
    asked = "none" if method in formats.STORED_ONLY else method
    data = {
        "name": f"{Path(model).name}-{method}-tp{tp}",
        "target": target,
        "model": {"checkpoint": str(MODELS / model), "dtype": dtype},
        "quantization": {"method": asked, "kv_cache": kv_cache or ("fp8" if method in ("fp8", "nvfp4", "fp8_block")
                                                                   else "none")},
        "parallelism": {"tp": tp, "pp": pp, "gpus": tp * pp, **moe},
        "gpu": {"name": gpu, "per_node": 8},
        "limits": {"max_batch_size": max_batch_size, "max_input_len": isl, "max_seq_len": isl + osl,
                   "max_num_tokens": max_num_tokens},
        "serving": {"kv_cache_free_gpu_mem_fraction": kv_fraction},
        "validation": {"workload": {"input_tokens": isl, "output_tokens": osl, "concurrency": concurrency,
                                    **({"num_requests": num_requests} if num_requests else {})}},
    }
    return spec_from_dict(data, MODELS, f"calibration point {data['name']}")


@cache
def _kv_requests(model: str, gpu: str, method: str, tp: int, isl: int, osl: int) -> int:
    """How many isl + osl requests the KV cache of a measured configuration holds, from the memory plan
    (kv_cache_free_gpu_mem_fraction 0.9, the default of both paths)."""
    spec = spec_for(model, gpu, method, tp, isl, osl, max_batch_size=2048, max_num_tokens=MAX_NUM_TOKENS,
                    kv_fraction=0.9)
    info = model_info(model)
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    memory = plan_memory(spec, info, quant, gpus.lookup(gpu), suggest=False)
    blocks = -(-(isl + osl) // spec.build.tokens_per_block) * spec.build.tokens_per_block
    return max(1, memory.kv_tokens_capacity // blocks)


def measured_deployment(point: Measured, eff: perf.Efficiency) -> perf.Deployment:
    """The replica a measured point ran: bf16 weights, the format's weights and math, tp ranks, one stage."""
    p = model_info(point.model).params
    quant = Quantization(method=point.method, kv_cache="fp8" if point.method == "fp8" else "none")
    stage = perf.stage_cost(p, tp=point.tp, pp_rank=0, pp=1, quant=quant, dt_bytes=2,
                            kv_bytes=1 if point.method == "fp8" else 2)
    return perf.Deployment(gpus.lookup(point.gpu), (stage,), point.tp, quant.format.math, eff)


def batch_waiting(point: Measured) -> tuple[int, float]:
    """(batch_wait_timeout_iters, batch_wait_max_tokens_ratio) of a measured point's server: InferenceMAX's
    Llama-3.1-70B TensorRT-LLM launch scripts (benchmarks/70b_fp4_b200_trt_docker_profile.sh in the
    ajith-sirra-amd/InferenceMAX_Rocm_Team fork, and the docker script it profiles) write both (20 and 0.9) into
    the server's extra LLM API options for ISL/OSL 1024/1024 below TP 8 only ("For 1k/1k, use batch_wait_max_tokens_ratio and
    batch_wait_timeout_iters will improve the performance, by default they are all zeros"); everything else runs
    without batch waiting, TensorRT-LLM's default."""
    if point.model == "llama-3.1-70b" and (point.isl, point.osl) == (1024, 1024) and point.tp < 8:
        return 20, 0.9
    return 0, 0.0


def predict_measured(point: Measured, eff: perf.Efficiency | None = None) -> tuple[float, float, float]:
    """(TTFT ms, TPOT ms, output tokens/s) the model predicts for a measured point. When the concurrency is
    above what the KV cache holds, the engine runs as many as fit and the rest wait: in a closed loop of C
    clients and L running requests each request spends C / L times its service time in the system (Little's
    law), so its TTFT grows by (C / L - 1) x that time. The run is taken as WAVES x C requests from a standing
    start, so the first wave's queue weighs in the mean TTFT (perf.first_wave_ttft)."""
    dep = measured_deployment(point, eff or perf.DEFAULT_EFFICIENCY)
    if eff is None:
        dep = dataclasses.replace(dep, eff=perf.measured_row(point.gpu, "pytorch"))
    running = min(point.concurrency, _kv_requests(*point.config))
    wait_iters, wait_ratio = batch_waiting(point)
    workload = perf.Workload(point.isl, point.osl, MAX_NUM_TOKENS, batch_wait_iters=wait_iters,
                             batch_wait_ratio=wait_ratio, requests=WAVES * running)
    at = perf.steady_state(dep, workload, running)
    ttft, tpot = at.ttft_s * 1e3, at.tpot_s * 1e3
    service = ttft + (point.osl - 1) * tpot
    ttft += (point.concurrency / running - 1) * service
    # the closed loop's throughput, as the measured one is derived (Measured.throughput)
    return ttft, tpot, point.concurrency * point.osl / ((ttft + (point.osl - 1) * tpot) / 1e3)


def ape(predicted: float, measured: float) -> float:
    """Absolute percentage error."""
    return abs(predicted - measured) / measured * 100


def mape(points, eff_of=None) -> dict[str, float]:
    """Mean absolute percentage error of TTFT, TPOT and throughput over `points` (eff_of(point) -> Efficiency,
    the loaded table by default)."""
    sums = {"ttft": 0.0, "tpot": 0.0, "throughput": 0.0}
    points = list(points)
    for pt in points:
        ttft, tpot, tput = predict_measured(pt, eff_of(pt) if eff_of else None)
        sums["ttft"] += ape(ttft, pt.ttft_ms)
        sums["tpot"] += ape(tpot, pt.tpot_ms)
        sums["throughput"] += ape(tput, pt.throughput)
    return {k: v / max(len(points), 1) for k, v in sums.items()}


def holdout_mape() -> dict[str, float]:
    """The held-out error of the table plan/perf/efficiency.py loads, recomputed from the committed points: TTFT, TPOT and
    throughput MAPE in percent, and `gpu_holdout_mape`, their mean (the benchmark key)."""
    errors = mape(p for p in measured_points() if held_out(p))
    errors["gpu_holdout_mape"] = sum(errors.values()) / 3
    return errors


# ------------------------------------------------------------------------- the published check (never fitted)

PUBLISHED = DATA / "published_throughput.json"
PUBLISHED_BLACKWELL_FP4 = DATA / "published_blackwell_fp4.json"
"""release/1.2's Blackwell NVFP4 points, PyTorch backend: checked and reported apart from the 0.17 engine table."""
PUBLISHED_V1_0 = DATA / "published_v1_0.json"
"""release 1.0's Hopper FP8 Llama points (totals of the replica), PyTorch backend (`path` pytorch): checked and
reported apart from the 0.17 engine table, whose configurations they mostly repeat on the other path."""
PUBLISHED_V1_0_BLACKWELL_FP4 = DATA / "published_v1_0_blackwell_fp4.json"
"""release 1.0's Blackwell NVFP4 Llama points (3.3 70B TP1, 3.1 405B TP4 on B200 and GB200; totals of the replica),
PyTorch backend: reported with release/1.2's Blackwell file, apart from the Hopper tables."""
PUBLISHED_MOE_FAMILIES = DATA / "published_moe_families.json"
"""release/1.2's mixture-of-experts points, per GPU: DeepSeek R1 (attention DP over 4 or 8 GPUs) and gpt-oss-120b as
released (DEP2 and TP1); its `kept` note says what is modelled how and lists the points that wait."""
BENCH_KV_FRACTION = 0.95
"""perf-overview.md (0.17): "In majority of cases, we also use a higher KV cache percentage by setting
--kv_cache_free_gpu_mem_fraction 0.95"."""


@dataclass(frozen=True)
class Published:
    """One of NVIDIA's published `trtllm-bench throughput` figures."""

    model: str
    gpu: str
    method: str
    tp: int
    isl: int
    osl: int
    output_tokens_per_s: float
    attention_dp: bool = False
    """DEPn: attention data parallelism with the experts over all n GPUs (moe_ep n)."""
    per_gpu: bool = False
    """The figure is per GPU (the file says so for all its rows); else the replica's."""
    kv_cache: str | None = None
    """The published run's KV cache, where the file records it. The check plans the one `spec_for` picks, which
    differs for gpt-oss on Blackwell: measured with FP8 KV, planned with bf16 (the planner refuses FP8 KV on the
    stored MXFP4 checkpoint, which has no KV scales)."""
    path: str | None = None
    """How trtllm-bench ran it, from the file's `path`: "engine" (a trtllm-bench build engine) or "pytorch" (the
    PyTorch backend, no engine); None where the file does not say yet (then `predict_published` chooses the target
    by format and family)."""
    release: str | None = None
    """The TensorRT-LLM release whose perf-overview.md published the figure, from the file's `release`."""


PATHS = ("engine", "pytorch")


@cache
def published_points(path: Path = PUBLISHED) -> tuple[Published, ...]:
    doc = json.loads(path.read_text())
    header = {"per_gpu": bool(doc.get("per_gpu", False)), "path": doc.get("path"), "release": doc.get("release")}
    if header["path"] not in (None, *PATHS):
        raise ToolchainError(f"{path.name}: path {header['path']!r} is not one of {', '.join(PATHS)}",
                             "name how trtllm-bench ran the table: engine or pytorch")
    return tuple(Published(**{**header, **dict(zip(doc["columns"], row, strict=True))}) for row in doc["rows"])


def param_count(p) -> int:
    """Parameters of a dense Llama-style model: embedding and lm_head, attention, MLP and norms per layer."""
    kv = p.num_key_value_heads * p.head_size
    q = p.num_attention_heads * p.head_size
    layer = p.hidden_size * (q + 2 * kv) + q * p.hidden_size + 3 * p.hidden_size * p.intermediate_size
    return 2 * p.vocab_size * p.hidden_size + p.num_hidden_layers * (layer + 2 * p.hidden_size) + p.hidden_size


def bench_build_limits(point: Published) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) that `trtllm-bench build --dataset` picks for a configuration
    (tensorrt_llm/bench/build/tuning.py, calc_engine_setting and finetune_setting): requests the KV cache holds
    by its own estimate (all GPUs' memory less the weights, x 0.95, over the KV bytes per token, over isl + osl),
    capped at 4096; max_num_tokens that many x (1 + isl / osl), capped at 32768; then each rounded up to its
    step, with floors of 64 sequences and 2048 tokens."""
    p = model_info(point.model).params
    weight_bytes = {"fp8": 1, "nvfp4": 0.5 + 1 / 16}.get(point.method, 2)  # NVFP4: e2m1 plus an e4m3 per 16
    kv_bytes = 1 if point.method in ("fp8", "nvfp4") else 2
    gib = 1024 ** 3
    per_token = 2 * p.num_hidden_layers * max(point.tp, p.num_key_value_heads) * p.head_size * kv_bytes / gib
    engine = param_count(p) / 1000 ** 3 * weight_bytes
    available = gpus.lookup(point.gpu).memory_bytes / gib * point.tp - engine
    return bench_rounding(available * BENCH_KV_FRACTION / per_token / (point.isl + point.osl), point)


def bench_rounding(requests: float, point: Published) -> tuple[int, int]:
    """trtllm-bench's limits from the requests the KV cache holds (`bench_build_limits`): capped, scaled by
    1 + isl / osl for the tokens, rounded up to their steps."""
    raw_bs = min(requests, 4096)
    raw_tokens = min(raw_bs * (1 + point.isl / point.osl), 32768)
    if raw_bs < 256:
        batch = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        batch = 128 * math.ceil(raw_bs / 128)
    else:
        batch = 256 * math.ceil(raw_bs / 256)
    if raw_tokens < 4096:
        tokens = max(2048, 256 * math.ceil(raw_tokens / 256))
    elif raw_tokens < 8192:
        tokens = 512 * math.ceil(raw_tokens / 512)
    else:
        tokens = 1024 * math.ceil(raw_tokens / 1024)
    return batch, tokens


def planned_bench_limits(point: Published) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) of a mixture-of-experts point: trtllm-bench's rounding (`bench_rounding`)
    of the requests one rank's KV cache holds by the memory plan, since its own estimate (`param_count`) is a
    dense Llama's; under attention DP the limits are each rank's, as LLM() takes them."""
    spec = spec_for(point.model, point.gpu, point.method, point.tp, point.isl, point.osl, max_batch_size=2048,
                    max_num_tokens=MAX_NUM_TOKENS, kv_fraction=BENCH_KV_FRACTION, target="llmapi",
                    attention_dp=point.attention_dp)
    info = model_info(point.model)
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    memory = plan_memory(spec, info, quant, gpus.lookup(point.gpu), suggest=False)
    requests = memory.kv_tokens_capacity / (point.isl + point.osl)
    return bench_rounding(requests, point)


def pytorch_bench_limits(point: Published) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) trtllm-bench gives the PyTorch backend when neither is passed
    (tensorrt_llm/bench/benchmark/utils/general.py get_settings): the same calc_engine_setting heuristic as the
    engine build (`bench_build_limits`), then, chunked prefill being off by default, "Forcing max_num_tokens to
    {max_isl + max_batch_size}" when that is more: a whole prompt and a token of every other request fit a step."""
    batch, tokens = planned_bench_limits(point) if model_info(point.model).params.is_moe else bench_build_limits(point)
    return batch, max(tokens, point.isl + batch)


def bench_target(point: Published) -> str:
    """The target a published point is planned on: its path's (pytorch: the LLM API, engine: trtllm-build). A
    file that names no path yet: the LLM API for the formats and families only the PyTorch backend runs
    (release/1.2's FP4 table was measured there, its trtllm-bench default; Llama 4 ran there in the v1.0 table)."""
    if point.path is not None:
        return "llmapi" if point.path == "pytorch" else "trtllm"
    pytorch_only = get_family(model_info(point.model).params.architecture).engine_refusal is not None
    return "llmapi" if pytorch_only or point.method in ("nvfp4", "fp8_block", "mxfp4") else "trtllm"


def point_path(point: Published) -> str:
    """How trtllm-bench ran a published point: its file's `path`, else the path of the target it is planned on."""
    return point.path or {"llmapi": "pytorch", "trtllm": "engine"}[bench_target(point)]


def published_limits(point: Published) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) of a published point as trtllm-bench set them on its path."""
    if point.path == "pytorch":
        return pytorch_bench_limits(point)
    return planned_bench_limits(point) if model_info(point.model).params.is_moe else bench_build_limits(point)


def predict_published(point: Published) -> perf.Performance:
    """What `toolchain plan` predicts for a published configuration, built as trtllm-bench built it on its path."""
    batch, tokens = published_limits(point)
    spec = spec_for(point.model, point.gpu, point.method, point.tp, point.isl, point.osl, max_batch_size=batch,
                    max_num_tokens=tokens, kv_fraction=BENCH_KV_FRACTION,
                    dtype="float16" if point.method == "none" else "bfloat16", target=bench_target(point),
                    attention_dp=point.attention_dp)
    info = model_info(point.model)
    quant = quantization_of(spec.quantization, info.hf_config, hf_quant_config=info.hf_quant_config)
    device = gpus.lookup(point.gpu)
    # the shipped model's prediction, never rows a user calibrated on this machine (`toolchain calibrate`)
    return perf.predict(spec, info, quant, device, plan_memory(spec, info, quant, device, suggest=False),
                        release=point.release, calibrated=False)


def published_check(path: Path = PUBLISHED) -> list[tuple[Published, float]]:
    """Each published point with the model's predicted maximum output tokens/s, per GPU where the point is
    (PUBLISHED_V1_0: release 1.0's Hopper FP8 points on the PyTorch path; PUBLISHED_BLACKWELL_FP4 and
    PUBLISHED_V1_0_BLACKWELL_FP4: the Blackwell FP4 points of release/1.2 and 1.0; PUBLISHED_MOE_FAMILIES:
    DeepSeek R1, gpt-oss-120b and Llama 4 Scout)."""
    out = []
    for pt in published_points(path):
        got = predict_published(pt)
        out.append((pt, got.per_gpu_output_tokens_per_s if pt.per_gpu else got.max_output_tokens_per_s))
    return out
