"""The NVFP4 and FP8 block-scale rows (issue 35, quant/formats.py) and what reads only the rows: their tensors and
bytes as TensorRT-LLM declares them, the plan's per-rank bytes (computed here by hand for a tiny model), the spec,
the refusals by device and by path in plan and convert alike (one line each, naming the fix), the pending
quantizer (fp8_block's) and HF export (nvfp4's) refused rather than written as another format, the CPU engine taking
both, the performance model's FP4 peak, and tune proposing each only where convert computes it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from toolchain import gpus
from toolchain.archs import moe
from toolchain.checkpoint.convert import plan_any
from toolchain.checkpoint.hf_quant import export_hf_quantized, hf_quant_problem
from toolchain.checks.preflight import FAIL, PASS, build_context, run_checks
from toolchain.engine.cpu.config import parse_dims
from toolchain.errors import ToolchainError
from toolchain.plan import perf
from toolchain.plan.model import load_model
from toolchain.plan.plan import plan_memory
from toolchain.quant import formats
from toolchain.quant.recipe import ModelShape, check_recipe
from toolchain.quant.view import Quantization
from toolchain.spec import DeploymentSpec, QuantizationSection, load_spec
from toolchain.tune.candidates import weight_methods
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"
NVFP4_ON_HOPPER = ("quantization.method nvfp4 needs FP4 tensor cores, which only Blackwell (SM 100, 103 and 120) has: "
                   "Hopper and older GPUs have none; the H100 80GB is SM 90: use quantization.method fp8 (SM 89 and "
                   "newer) or awq")
FP8_BLOCK_ON_ENGINE = ("quantization.method fp8_block has no engine path in TensorRT-LLM 1.2 (trtllm-build's quantize() "
                       "has no FP8_BLOCK_SCALES branch and would build the linears unquantized); use target llmapi")
NOT_IMPLEMENTED = "quantization.method {} ({}) is not implemented yet: no quantizer computes its tensors " \
                  "(use quantization.method fp8 until it lands)"
NO_HF_EXPORT = ("quantization.method nvfp4 (NVFP4) has no Hugging Face-format export yet (use the engine path (target "
                "trtllm or cpu), or quantization.method fp8 on the LLM-API path)")
# A tiny Llama whose widths leave partial 128x128 tiles at tp 1 and tp 2 and are whole groups of 16 per rank.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 384, "intermediate_size": 864,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16", "eos_token_id": 2}


# -- the rows ------------------------------------------------------------------------------------------------------

def test_nvfp4_row_holds_what_fp4linear_and_the_engine_export_hold():
    row = formats.METHODS["nvfp4"]
    assert (row.quant_algo, row.group_size, row.stats, row.math) == ("NVFP4", 16, ("amax",), "fp4")
    assert (row.hf_name, row.hf_weight, row.hf_why_not, row.engine_why_not) == ("nvfp4", "uint8", None, None)
    # ModelOpt's engine export per linear (notes/i35-facts.md 2.2, 3.1): packed e2m1, e4m3 per 16, two f32 scalars.
    stored = {t.suffix: (t.dims(200, 48, 128), t.dtype) for t in row.stored}
    assert stored == {"weight": ((200, 24), "uint8"), "weights_scaling_factor": ((200, 3), "fp8"),
                      "weights_scaling_factor_2": ((1,), "float32"), "activation_scaling_factor": ((1,), "float32")}
    # Loaded, the GEMM reads the interleaved copy padded to (128, 4) multiples and alpha (2.1, 4.1); the plain
    # block scales serve only trtllm-build's plugin-less path.
    built = {t.suffix: t.dims(200, 48, 128) for t in row.built}
    assert built["weights_block_scaling_factor_interleaved"] == (256, 4) and built["alpha"] == (1,)
    assert "weights_block_scaling_factor" not in built
    assert built["weight"] == (200, 48)  # trt.fp4, half a byte each
    assert formats.tensor_bytes(row.stored, 200, 48, 128, 2) == 200 * 48 / 2 + 200 * 3 + 4 + 4
    assert formats.tensor_bytes(row.built, 200, 48, 128, 2) == 200 * 24 + 256 * 4 + 3 * 4


def test_fp8_block_row_counts_a_partial_tile_whole():
    row = formats.METHODS["fp8_block"]
    assert (row.quant_algo, row.stats, row.math, row.hf_name) == ("FP8_BLOCK_SCALES", (), "fp8", "fp8_pb_wo")
    assert not row.calibration  # weights only: activations are scaled per 1x128 at run time
    dims = {t.suffix: t.dims(300, 1000, 128) for t in row.stored}
    assert dims == {"weight": (300, 1000), "weights_scaling_factor": (3, 8)}  # ceil(300/128), ceil(1000/128)
    assert formats.tensor_bytes(row.stored, 300, 1000, 128, 2) == 300 * 1000 + 3 * 8 * 4
    assert formats.tensor_bytes(row.stored, 256, 256, 128, 2) == 256 * 256 + 2 * 2 * 4  # whole tiles
    assert row.built == row.stored


@pytest.mark.parametrize("method, sms", [("nvfp4", {100, 103, 120}), ("fp8_block", {90, 100, 103})])
def test_each_row_says_which_gpus_and_paths_take_it(method, sms):
    row = formats.METHODS[method]
    assert {sm for sm in range(60, 200) if row.refused_on(sm) is None} == sms
    assert not row.integer and row.min_sm is None  # neither of the older rules
    assert row.paths == (("engine", "llmapi") if method == "nvfp4" else ("llmapi",))


def test_the_older_rules_are_unchanged():
    # FP8 below SM 89 and the integer formats on SM 100-119, as the rows' Devices now say it.
    assert [formats.FP8.refused_on(sm) for sm in (86, 89, 120)] == ["too old", None, None]
    assert formats.FP8.min_sm == formats.KV_CACHE["fp8"].min_sm == 89
    assert [formats.AWQ.refused_on(sm) for sm in (90, 100, 119, 120)] == [None, "blackwell", "blackwell", None]
    assert formats.KV_CACHE["int8"].integer and formats.IMPORTED_INT4.integer and not formats.FP8.integer


# -- the spec --------------------------------------------------------------------------------------------------------

def test_the_spec_takes_both_names_and_the_schema_lists_them():
    assert QuantizationSection(method="nvfp4").method == "nvfp4"
    assert QuantizationSection(method="fp8_block").method == "fp8_block"
    with pytest.raises(ValidationError):
        QuantizationSection(method="mxfp4")
    schema = json.dumps(DeploymentSpec.model_json_schema())
    assert '"nvfp4"' in schema and '"fp8_block"' in schema


# -- plan: bytes -----------------------------------------------------------------------------------------------------

def _spec(tmp_path: Path, target: str, gpu: str | dict | None, method: str, tp: int = 1, checkpoint: Path | None = None):
    if checkpoint is None:
        checkpoint = tmp_path / "tiny"
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "config.json").write_text(json.dumps(TINY))
    data = {"name": "fp4", "target": target, "model": {"checkpoint": str(checkpoint), "dtype": "float16"},
            "gpu": gpu if isinstance(gpu, dict) else {"name": gpu}, "build": {"host_memory_gib": 256},
            "parallelism": {"tp": tp},
            "quantization": {"method": method},
            "limits": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 2048},
            "serving": {"http_port": 0, "grpc_port": 0, "metrics_port": 0}}
    path = tmp_path / f"{target}-{method}-{tp}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


# Per rank, fp16 elsewhere: embedding 1000 x 384 on rank 0 (not parallel), lm_head 1000/tp x 384, norms
# (2 layers x 2 + 1) x 384. Linears (out, in) per rank at tp 1 / tp 2:
#   qkv (384 + 2*128, 384) / (192 + 2*64, 384), dense (384, 384) / (384, 192),
#   fc and gate (864, 384) / (432, 384), proj (384, 864) / (384, 432).
LINEARS = {1: [(640, 384), (384, 384), (864, 384), (864, 384), (384, 864)],
           2: [(320, 384), (384, 192), (432, 384), (432, 384), (384, 432)]}
FLOAT = {1: 1000 * 384 * 2 + 1000 * 384 * 2 + 5 * 384 * 2, 2: 1000 * 384 * 2 + 500 * 384 * 2 + 5 * 384 * 2}
# NVFP4 stored: half a byte per weight, an e4m3 byte per 16, two float32 scalars.
NVFP4_STORED = {1: 2 * (640 * 384 // 2 + 640 * 24 + 384 * 384 // 2 + 384 * 24 + 2 * (864 * 384 // 2 + 864 * 24)
                        + 384 * 864 // 2 + 384 * 54 + 5 * 8),
                2: 2 * (320 * 384 // 2 + 320 * 24 + 384 * 192 // 2 + 384 * 12 + 2 * (432 * 384 // 2 + 432 * 24)
                        + 384 * 432 // 2 + 384 * 27 + 5 * 8)}
# FP8 block: a byte per weight and 4 bytes per 128x128 tile, partial tiles whole (640 = 5 tiles, 864 = 7, 432 = 4).
FP8_BLOCK = {1: 2 * (640 * 384 + 5 * 3 * 4 + 384 * 384 + 3 * 3 * 4 + 2 * (864 * 384 + 7 * 3 * 4) + 384 * 864 + 3 * 7 * 4),
             2: 2 * (320 * 384 + 3 * 3 * 4 + 384 * 192 + 3 * 2 * 4 + 2 * (432 * 384 + 4 * 3 * 4) + 384 * 432 + 3 * 4 * 4)}


def _plan(spec):
    model = load_model(spec.model.checkpoint)
    return plan_memory(spec, model, Quantization.of(spec.quantization), gpus.resolve(spec))


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_bytes_per_rank_are_exact(tmp_path, tp):
    nvfp4 = _plan(_spec(tmp_path, "trtllm", "B200", "nvfp4", tp)).ranks
    assert [r.checkpoint_bytes for r in nvfp4] == [NVFP4_STORED[tp] + FLOAT[tp]] * tp
    # Loaded, each linear's block scales are the interleaved copy (rows padded to 128, columns to 4), and alpha joins
    # the two scalars.
    plain = {1: 640 * 24 + 384 * 24 + 2 * 864 * 24 + 384 * 54, 2: 320 * 24 + 384 * 12 + 2 * 432 * 24 + 384 * 27}
    interleaved = {1: 640 * 24 + 384 * 24 + 2 * 896 * 24 + 384 * 56, 2: 384 * 24 + 384 * 12 + 2 * 512 * 24 + 384 * 28}
    built = NVFP4_STORED[tp] + 2 * (interleaved[tp] - plain[tp] + 5 * 4)
    assert [r.weights_bytes for r in nvfp4] == [built + FLOAT[tp]] * tp
    block = _plan(_spec(tmp_path, "llmapi", "H100", "fp8_block", tp)).ranks
    assert [(r.checkpoint_bytes, r.weights_bytes) for r in block] == [(FP8_BLOCK[tp] + FLOAT[tp],) * 2] * tp


@pytest.mark.parametrize("method, gpu", [("nvfp4", "GB200 186GB"), ("fp8_block", "H100 80GB")])
def test_a_plan_that_does_not_fit_suggests_a_gpu_that_runs_its_format(tmp_path, method, gpu):
    # Llama-3-70B on one L4 (SM 89), which runs neither format: more L4s are no answer (quant.device refuses the
    # format there), so the one suggestion is the smallest GPU that both runs the format and holds the model.
    spec = _spec(tmp_path, "llmapi", "L4", method, checkpoint=CONFIGS / "llama-3-70b")
    plan = _plan(spec)
    assert not plan.fits and plan.suggestions == [f"gpu.name='{gpu}'"]


def test_convert_dry_run_plans_the_nvfp4_bytes_the_planner_does(tmp_path):
    spec = _spec(tmp_path, "trtllm", "B200", "nvfp4", 2)
    dry = plan_any(tmp_path / "tiny", tp=2, pp=1, dtype="float16", target="trtllm", gpu=("B200 180GB", 100),
                   quantization=Quantization(method="nvfp4"))
    assert [dry.rank_bytes(r) for r in range(2)] == [r.checkpoint_bytes for r in _plan(spec).ranks]
    # config.json says the block size: FP4Linear's fixed 16, not QuantConfig's default 128.
    assert dry.config["quantization"]["group_size"] == 16 and dry.config["quantization"]["quant_algo"] == "NVFP4"


# -- plan and convert: refusals --------------------------------------------------------------------------------------

def _checks(spec, tmp_path):
    ctx = build_context(spec, "plan", Workspace(tmp_path / "ws"))
    return {r.id: (r.status, r.message) for r in run_checks(ctx)}


@pytest.mark.parametrize("target, gpu, method, check, expected", [
    ("trtllm", "H100", "nvfp4", "quant.device", (FAIL, NVFP4_ON_HOPPER)),
    ("llmapi", "H100", "nvfp4", "quant.device", (FAIL, NVFP4_ON_HOPPER)),
    ("trtllm", "B200", "nvfp4", "quant.device", (PASS, "the formats run on SM 100")),
    ("trtllm", "B200", "nvfp4", "quant.engine-path", (PASS, "quantization.method=nvfp4 builds on the engine path")),
    ("llmapi", "B300", "nvfp4", "llmapi.quantization", (PASS, "convert writes a Hugging Face-format nvfp4/none "
                                                             "checkpoint")),
    ("trtllm", "H100", "fp8_block", "quant.engine-path", (FAIL, FP8_BLOCK_ON_ENGINE)),
    ("llmapi", "H100", "fp8_block", "quant.device", (PASS, "the formats run on SM 90")),
    ("llmapi", "GB200", "fp8_block", "llmapi.quantization", (PASS, "convert writes a Hugging Face-format "
                                                                   "fp8_block/none checkpoint")),
    ("llmapi", "L40S", "fp8_block", "quant.device",
     (FAIL, "quantization.method fp8_block runs its block-scaled FP8 GEMMs on Hopper (SM 90) and Blackwell SM 100/103 "
            "only, not on Ada (SM 89) or SM 120; the L40S is SM 89: use quantization.method fp8 (per-tensor scales, "
            "SM 89 and newer) or awq")),
    ("cpu", None, "nvfp4", "quant.device", (PASS, "the CPU engine runs the formats")),
    ("cpu", None, "fp8_block", "quant.engine-path", (FAIL, FP8_BLOCK_ON_ENGINE)),
])
def test_plan_refuses_by_device_and_path_in_one_line(tmp_path, target, gpu, method, check, expected):
    results = _checks(_spec(tmp_path, target, gpu, method), tmp_path)
    assert results[check] == expected
    assert "\n" not in expected[1]


def test_sm_120_takes_nvfp4_but_not_fp8_block(tmp_path):
    rtx = {"name": None, "memory_gib": 96, "sm": 120}
    ok = _checks(_spec(tmp_path, "llmapi", rtx, "nvfp4"), tmp_path)
    assert ok["quant.device"] == (PASS, "the formats run on SM 120")
    refused = _checks(_spec(tmp_path, "llmapi", rtx, "fp8_block"), tmp_path)
    assert refused["quant.device"][0] == FAIL and "; the 96 GiB GPU is SM 120: use " in refused["quant.device"][1]


SHAPE = ModelShape(hidden_size=384, intermediate_size=864, num_attention_heads=6, num_key_value_heads=2,
                   head_size=64, max_position_embeddings=2048)


def test_convert_refuses_with_the_plan_checks_lines():
    with pytest.raises(ToolchainError) as err:
        check_recipe(Quantization(method="nvfp4"), SHAPE, tp=1, target="trtllm", gpu_name="H100 80GB", gpu_sm=90)
    assert str(err.value) == NVFP4_ON_HOPPER
    with pytest.raises(ToolchainError) as err:
        check_recipe(Quantization(method="fp8_block"), SHAPE, tp=1, target="trtllm", gpu_name="H100 80GB", gpu_sm=90)
    assert str(err.value) == FP8_BLOCK_ON_ENGINE
    check_recipe(Quantization(method="nvfp4"), SHAPE, tp=1, target="trtllm", gpu_name="B200 180GB", gpu_sm=100)
    # On its own path fp8_block passes the device rule, then needs each fused part's rows in whole 128x128 tiles (the
    # fused loaders concatenate the parts' grids: quant/recipe.py tile_problems), which gate/up's 864 are not.
    with pytest.raises(ToolchainError) as err:
        check_recipe(Quantization(method="fp8_block"), SHAPE, tp=1, target="llmapi", gpu_name="H100 80GB", gpu_sm=90)
    assert str(err.value).startswith("quantization.method fp8_block at parallelism.tp 1: gate/up rows per rank")
    whole = dataclasses.replace(SHAPE, intermediate_size=896)  # seven tiles
    check_recipe(Quantization(method="fp8_block"), whole, tp=1, target="llmapi", gpu_name="H100 80GB", gpu_sm=90)


def test_a_mixture_of_experts_keeps_its_refusal(tmp_path):
    params = load_model(CONFIGS / "qwen3-30b-a3b").params
    for method in ("nvfp4", "fp8_block"):
        refusal = moe.quantization_refusal(params, method, "none")
        assert refusal.why == f"quantization {method} on Qwen3MoeForCausalLM is not supported yet"


# -- the pending quantizer and HF export -----------------------------------------------------------------------------

def test_the_hf_export_computes_both_and_the_engine_path_refuses_fp8_block(tmp_path, monkeypatch):
    # The LLM-API path loads the export (hf_quant_problem passes it), and the HF export computes it
    # (checkpoint/hf_quant.py HF_COMPUTED, tests/test_hf_fp4_fp8block.py): it gets past the pending gate to the source.
    for method in ("nvfp4", "fp8_block"):
        assert hf_quant_problem(QuantizationSection(method=method)) is None
        assert formats.METHODS[method].ready_on("llmapi")
        with pytest.raises(ToolchainError) as err:
            export_hf_quantized(tmp_path / "absent", tmp_path, QuantizationSection(method=method))
        assert str(err.value).startswith("HF checkpoint directory not found")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    # The engine converter never gets as far: the path rule refuses it first; its quantizer is pending there.
    with pytest.raises(ToolchainError) as err:
        plan_any(tmp_path / "tiny", tp=1, pp=1, target="trtllm", quantization=Quantization(method="fp8_block"))
    assert str(err.value) == FP8_BLOCK_ON_ENGINE
    with pytest.raises(ToolchainError) as err:
        formats.FP8_BLOCK.check_implemented("engine")
    assert str(err.value) == NOT_IMPLEMENTED.format("fp8_block", "FP8_BLOCK_SCALES")
    # A row whose HF export is pending is refused on the LLM-API path alone, before anything is read.
    monkeypatch.setattr(formats, "PENDING_HF_EXPORTS", frozenset({"nvfp4"}))
    with pytest.raises(ToolchainError) as err:
        export_hf_quantized(tmp_path / "absent", tmp_path, QuantizationSection(method="nvfp4"))
    assert str(err.value) == NO_HF_EXPORT
    formats.NVFP4.check_implemented("engine")
    assert formats.NVFP4.ready_on("engine") and not formats.NVFP4.ready_on("llmapi")


@pytest.mark.parametrize("algo", ["NVFP4", "FP8_BLOCK_SCALES"])
def test_the_cpu_engine_takes_both_formats_at_load(algo):
    cfg = {"architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": 1000, "hidden_size": 384,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_size": 64,
           "max_position_embeddings": 2048, "intermediate_size": 864, "hidden_act": "silu",
           "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None}}
    assert parse_dims(cfg, "config.json").format is formats.BY_ALGO[algo]


# -- performance model -----------------------------------------------------------------------------------------------

def test_fp4_peaks_on_blackwell_and_none_on_hopper():
    assert {name: gpus.lookup(name).peak("fp4") for name in ("B200", "GB200", "B300", "H100", "H200")} == {
        "B200": 9000.0, "GB200": 10000.0, "B300": 13125.0, "H100": None, "H200": None}
    assert (gpus.lookup("GB200").sm, gpus.lookup("B300").sm) == (100, 103)
    assert all(gpus.lookup(n).has_performance for n in ("GB200", "B300"))


def test_nvfp4_gemms_run_at_the_fp4_peak():
    # A 4096-token prefill of Llama-3-8B's linears on a B200: the GEMMs at 9 PFLOP/s dense FP4, where the
    # same step in fp8 runs at 4.5 (the roofline without efficiency losses).
    params = load_model(CONFIGS / "llama-3-8b-instruct").params
    roof = perf.Efficiency(1.0, 1.0, 1.0)
    b200 = gpus.lookup("B200")
    cost = {m: perf.stage_cost(params, tp=1, pp_rank=0, pp=1, quant=Quantization(method=m), dt_bytes=2, kv_bytes=2)
            for m in ("nvfp4", "fp8")}
    work = perf.context_work(4096)
    steps = {m: perf.step_time(cost[m], b200, work, math_precision=formats.METHODS[m].math, eff=roof) for m in cost}
    linear = {m: work.tokens * cost[m].gemm_flops for m in cost}
    assert linear["nvfp4"] == linear["fp8"]  # the same multiplications, at another rate
    assert steps["fp8"].compute_s - steps["nvfp4"].compute_s == pytest.approx(
        linear["fp8"] / 4500e12 - linear["nvfp4"] / 9000e12)


# -- tune ------------------------------------------------------------------------------------------------------------

def _tune_spec(target: str, gpu: str):
    build = "llama3-8b-llmapi-h100.yaml" if target == "llmapi" else "llama3-8b-awq-h100.yaml"
    return load_spec(REPO / "build" / build, [f"gpu.name={gpu}"])


def test_tune_proposes_each_only_where_convert_computes_it():
    # nvfp4 on both paths where the GPU runs it; fp8_block on the LLM-API path only (its HF export is computed, its
    # engine quantizer pending and no engine path takes it).
    found = {}
    for target, gpu in (("trtllm", "B200"), ("llmapi", "B200"), ("llmapi", "H100")):
        spec = _tune_spec(target, gpu)
        methods = weight_methods(spec, gpus.resolve(spec), False)
        assert "fp8" in methods
        found[target, gpu] = ("nvfp4" in methods, "fp8_block" in methods)
    assert found == {("trtllm", "B200"): (True, False), ("llmapi", "B200"): (True, True),
                     ("llmapi", "H100"): (False, True)}


def test_tune_proposes_them_where_they_run_once_computed(monkeypatch):
    # The gate is the row's quantizer: once its module lands (its name leaves PENDING_QUANTIZERS), the device
    # rule and the path rule decide.
    monkeypatch.setattr(formats, "PENDING_QUANTIZERS", frozenset())
    monkeypatch.setattr(formats, "PENDING_HF_EXPORTS", frozenset())
    found = {}
    for target, gpu in (("trtllm", "B200"), ("trtllm", "H100"), ("llmapi", "B200"), ("llmapi", "H100"),
                        ("llmapi", "L40S")):
        spec = _tune_spec(target, gpu)
        methods = weight_methods(spec, gpus.resolve(spec), False)
        found[target, gpu] = ("nvfp4" in methods, "fp8_block" in methods)
    assert found == {("trtllm", "B200"): (True, False), ("trtllm", "H100"): (False, False),
                     ("llmapi", "B200"): (True, True), ("llmapi", "H100"): (False, True),
                     ("llmapi", "L40S"): (False, False)}
