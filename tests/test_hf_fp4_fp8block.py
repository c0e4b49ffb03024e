"""NVFP4 and FP8 block scales in the Hugging Face format (issue 35; toolchain/checkpoint/hf_quant.py): the tensors
ModelOpt's export writes per linear and TensorRT-LLM's PyTorch loaders read (notes/i35-facts.md sections 3.1, 4.1,
4.2), the scales q/k/v and gate/up must share, hf_quant_config.json and config.json as ModelOpt writes them, the
way back onto the engine checkpoint (export -> import gives the rows' `stored` tensors), a DeepSeek-V3-style FP8
block-scale checkpoint (config.json quant_method "fp8", weight_scale_inv) imported as stored and refused in any
block size but 128x128, the planner counting both at their stored size, as convert --dry-run does, convert splitting
the FP8 scale grid by whole tiles at tp 1 and 2 and refusing (as plan does) a tp that would cut one, and CpuLLM
serving both."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import make_hf_model
from toolchain.archs.common import Shard
from toolchain.archs import get_family
from toolchain.checkpoint.convert import convert_checkpoint, plan_any
from toolchain.checkpoint.hf_quant import export_hf_quantized, hf_quantized_to_engine_tensors, read_hf_quant_format
from toolchain.checkpoint.quantize import Component, Quantizer
from toolchain.checks.preflight import FAIL, PASS, build_context, run_checks
from toolchain.errors import ToolchainError
from toolchain.llmapi.stage import run_convert_llmapi
from toolchain.quant import formats
from toolchain.quant.fp4 import dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4
from toolchain.quant.fp8_block import BLOCK, block_amax, dequantize_fp8_block, quantize_fp8_block
from toolchain.quant.recipe import LayoutPlan, ModelShape, check_recipe
from toolchain.quant.view import Quantization, quantization_of
from toolchain.spec import QuantizationSection, load_spec
from toolchain.targets import LLMAPI
from toolchain.workspace import Workspace

# Widths in whole 128x128 tiles and blocks of 16 at tp 1 and tp 2: two heads of 128 (q 256, one per rank), two KV
# heads (k and v 256 each, one head a rank at tp 2: a Llama's weight mapper would not repeat a shared head's block
# scales), the MLP 512 (four tiles, two per rank).
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=2, vocab_size=250,
            max_position_embeddings=256)
HEAD = DIMS["hidden_size"] // DIMS["num_attention_heads"]
INTER = DIMS["intermediate_size"]
LAYERS = 2
ATTN = ("q_proj", "k_proj", "v_proj")
LINEARS = [f"model.layers.{i}.{m}" for i in range(LAYERS)
           for m in [f"self_attn.{p}" for p in (*ATTN, "o_proj")] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]]
ST = {torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
FP8_BLOCK_ON_ENGINE = ("quantization.method fp8_block has no engine path in TensorRT-LLM 1.2 (trtllm-build's quantize() "
                       "has no FP8_BLOCK_SCALES branch and would build the linears unquantized); use target llmapi")
DEEPSEEK_QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}


def calib(n: int = 4, length: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, DIMS["vocab_size"], (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from triton_helpers import make_tiny_tokenizer

    src = make_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), seed=5, **DIMS)
    make_tiny_tokenizer(src, DIMS["vocab_size"])
    return src


_EXPORTS: dict = {}


@pytest.fixture(scope="module")
def export(source, tmp_path_factory):
    """method -> (exported directory, summary), each exported once per module."""
    def get(method: str):
        if method not in _EXPORTS:
            out = tmp_path_factory.mktemp(method)
            q = QuantizationSection(method=method, calibration={"samples": 4, "seq_len": 32})
            _EXPORTS[method] = (out, export_hf_quantized(source, out, q, "float16", calibration=calib()))
        return _EXPORTS[method]
    return get


def headers(directory: Path) -> dict[str, tuple[list[int], str]]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({n: (list(fh.get_slice(n).get_shape()), ST[fh.get_tensor(n).dtype]) for n in fh.keys()})
    return out


def shapes(name: str) -> tuple[int, int]:
    """(out, in) of an HF linear of the tiny model."""
    h, i, kv = DIMS["hidden_size"], INTER, DIMS["num_key_value_heads"] * HEAD
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}[name.rsplit(".", 1)[1]]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# -- NVFP4 -----------------------------------------------------------------------------------------------------------

def test_nvfp4_tensors_are_modelopts(export):
    out, summary = export("nvfp4")
    got = headers(out)
    for p in LINEARS:
        o, i = shapes(p)
        # modelopt unified_export_hf.py: weight uint8 (out, in/2), weight_scale e4m3 (out, in/16), two f32 scalars.
        assert {leaf: got.pop(f"{p}.{leaf}") for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale")} \
            == {"weight": ([o, i // 2], "U8"), "weight_scale": ([o, i // 16], "F8_E4M3"), "weight_scale_2": ([], "F32"),
                "input_scale": ([], "F32")}, p
    assert all(d == "F16" for _, d in got.values()) and "lm_head.weight" in got  # the rest stays in the model dtype
    assert (summary["format"], summary["quant_algo"]) == ("nvfp4", "NVFP4")


def test_nvfp4_fused_parts_share_their_global_and_input_scales(export, source):
    out, _ = export("nvfp4")
    hf, orig = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    for layer in range(LAYERS):
        for group in ([f"self_attn.{p}" for p in ATTN], ["mlp.gate_proj", "mlp.up_proj"]):
            prefixes = [f"model.layers.{layer}.{m}" for m in group]
            ws = [orig[p + ".weight"].float() for p in prefixes]
            # TensorRT-LLM's NVFP4LinearMethod.load_weight_scales asserts both are equal across the parts.
            for leaf in ("weight_scale_2", "input_scale"):
                assert len({float(hf[f"{p}.{leaf}"]) for p in prefixes}) == 1, (prefixes, leaf)
            shared = hf[prefixes[0] + ".weight_scale_2"]
            assert torch.equal(shared, nvfp4_global_scale(torch.stack([w.abs().max() for w in ws]).max()))
            for p, w in zip(prefixes, ws, strict=True):
                # the block scales and codes are the ones quantizing with the shared global gives, bit for bit
                packed, block, _ = quantize_nvfp4(w, shared)
                assert torch.equal(hf[p + ".weight"], packed) and torch.equal(bits(hf[p + ".weight_scale"]), bits(block))
                err = (dequantize_nvfp4(packed, block, shared) - w).norm() / w.norm()
                assert float(err) < 0.15, p  # e2m1: 8 magnitudes per block of 16


def test_nvfp4_configs_are_modelopts(export):
    out, _ = export("nvfp4")
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert list(hq) == ["producer", "quantization"]
    # process_layer_quant_config (modelopt/torch/export/quant_utils.py): group_size after the KV algorithm.
    assert hq["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    assert list(hq["quantization"]) == ["quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    # convert_hf_quant_config_format's NVFP4 branch
    assert qc["config_groups"] == {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}}
    assert list(qc) == ["config_groups", "ignore", "quant_algo", "producer", "quant_method"]
    assert (qc["quant_algo"], qc["quant_method"], qc["ignore"]) == ("NVFP4", "modelopt", hq["quantization"]["exclude_modules"])


# -- FP8 block scales ------------------------------------------------------------------------------------------------

def test_fp8_block_tensors_are_the_tile_scales(export, source):
    out, summary = export("fp8_block")
    got = headers(out)
    hf, orig = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    for p in LINEARS:
        o, i = shapes(p)
        # FP8BlockScalesLinearMethod: weight e4m3 (out, in), weight_scale f32 (ceil(out/128), ceil(in/128)).
        assert (got.pop(p + ".weight"), got.pop(p + ".weight_scale")) == (([o, i], "F8_E4M3"),
                                                                          ([-(-o // 128), -(-i // 128)], "F32")), p
        assert p + ".input_scale" not in hf  # weights only: activations are scaled per 1x128 at run time
        w = orig[p + ".weight"].float()
        assert torch.equal(hf[p + ".weight_scale"], block_amax(w) / 448)
        assert float((dequantize_fp8_block(hf[p + ".weight"], hf[p + ".weight_scale"]) - w).norm() / w.norm()) < 0.05
    assert all(d == "F16" for _, d in got.values())
    assert (summary["format"], summary["quant_algo"]) == ("fp8_pb_wo", "FP8_BLOCK_SCALES")


def test_fp8_block_configs_use_modelopts_name(export):
    out, _ = export("fp8_block")
    # ModelOpt passes its format string through (process_layer_quant_config's else branch, no group_size);
    # TensorRT-LLM maps "fp8_pb_wo" to FP8_BLOCK_SCALES and the missing group_size to 128.
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq == {"quant_algo": "fp8_pb_wo", "kv_cache_quant_algo": None,
                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(qc) == ["ignore", "quant_algo", "producer", "quant_method"] and qc["quant_algo"] == "fp8_pb_wo"
    assert read_hf_quant_format(out) == {"quant_algo": "FP8_BLOCK_SCALES", "kv_cache_quant_algo": None,
                                         "group_size": None, "exclude_modules": ["lm_head", "model.embed_tokens"]}


def test_the_reader_takes_either_name_and_config_json_alone(export, tmp_path):
    out, _ = export("fp8_block")
    for name, where in (("FP8_BLOCK_SCALES", "hf_quant_config.json"), ("fp8_pb_wo", "config.json")):
        copy = shutil.copytree(out, tmp_path / f"{name}-{where}")
        if where == "hf_quant_config.json":
            hq = json.loads((copy / where).read_text())
            hq["quantization"]["quant_algo"] = name
            (copy / where).write_text(json.dumps(hq))
        else:
            (copy / "hf_quant_config.json").unlink()
        assert read_hf_quant_format(copy)["quant_algo"] == "FP8_BLOCK_SCALES"


# -- back onto the engine checkpoint ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["nvfp4", "fp8_block"])
def test_export_then_import_gives_the_rows_stored_tensors(export, tmp_path, method):
    out, _ = export(method)
    row = formats.METHODS[method]
    ours, config = hf_quantized_to_engine_tensors(out)
    assert config["quantization"]["quant_algo"] == row.quant_algo
    assert config["quantization"].get("group_size") == row.group_size  # NVFP4's 16 written, fp8_block none
    hf = load_file(str(out / "model.safetensors"))
    torch_dtype = {"uint8": torch.uint8, "fp8": torch.float8_e4m3fn, "float32": torch.float32}
    for layer in range(LAYERS):
        at = f"transformer.layers.{layer}"
        qkv = (DIMS["num_attention_heads"] + 2 * DIMS["num_key_value_heads"]) * HEAD
        linears = {"attention.qkv": (qkv, 256), "attention.dense": (256, 256), "mlp.fc": (INTER, 256),
                   "mlp.gate": (INTER, 256), "mlp.proj": (256, INTER)}
        for module, (o, i) in linears.items():
            for t in row.stored:
                got = ours[f"{at}.{module}.{t.suffix}"]
                assert (tuple(got.shape), got.dtype) == (t.dims(o, i, 128), torch_dtype[t.dtype]), (module, t.suffix)
        # q, k, v stacked by rows, weights and scales alike (the fused loaders concatenate, nothing requantized)
        parts = [f"model.layers.{layer}.self_attn.{p}" for p in ATTN]
        assert torch.equal(bits(ours[f"{at}.attention.qkv.weight"]), torch.cat([bits(hf[p + ".weight"]) for p in parts]))
        assert torch.equal(bits(ours[f"{at}.attention.qkv.weights_scaling_factor"]),
                           torch.cat([bits(hf[p + ".weight_scale"]) for p in parts]))
        # HF gate_proj is the engine's fc, up_proj its gate
        assert torch.equal(bits(ours[f"{at}.mlp.fc.weight"]), bits(hf[f"model.layers.{layer}.mlp.gate_proj.weight"]))
    if method == "nvfp4":
        assert ours["transformer.layers.0.attention.qkv.weights_scaling_factor_2"].shape == (1,)


@pytest.mark.parametrize("method", ["nvfp4", "fp8_block"])
def test_convert_imports_the_export_as_stored(export, tmp_path, method):
    """At tp 1 the rank file is exactly hf_quantized_to_engine_tensors' engine checkpoint."""
    out, _ = export(method)
    ours, config = hf_quantized_to_engine_tensors(out)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert convert_checkpoint(out, ckpt, tp=1, pp=1, dtype="float16", target="cpu", path=LLMAPI) == config
    written = load_file(str(ckpt / "rank0.safetensors"))
    assert set(written) == set(ours), sorted(set(written) ^ set(ours))
    assert [n for n in ours if written[n].dtype != ours[n].dtype or not torch.equal(bits(written[n]), bits(ours[n]))] \
        == []


def test_a_stored_fp8_block_checkpoint_is_refused_where_trtllm_build_would_build_it(export, tmp_path):
    # FP8 block scales only where the LLM-API path loads the result (CpuLLM's convert passes path llmapi).
    out, _ = export("fp8_block")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for target in ("cpu", "trtllm"):
        with pytest.raises(ToolchainError) as err:
            convert_checkpoint(out, ckpt, tp=1, pp=1, dtype="float16", target=target)
        assert str(err.value) == FP8_BLOCK_ON_ENGINE and not any(ckpt.iterdir())


# -- DeepSeek-V3-style FP8 block-scale checkpoints ------------------------------------------------------------------

def deepseek_style(source: Path, out: Path, block: list[int] | None = None) -> Path:
    """The tiny model as a DeepSeek-V3 / Qwen3-FP8 checkpoint: every decoder linear e4m3 with its float32
    weight_scale_inv grid (quantize_fp8_block), the rest bf16, config.json's quantization_config as transformers'
    FineGrainedFP8Config writes it."""
    out.mkdir()
    state = {n: t.to(torch.bfloat16) for n, t in load_file(str(source / "model.safetensors")).items()}
    for p in LINEARS:
        state[p + ".weight"], state[p + ".weight_scale_inv"] = quantize_fp8_block(state[p + ".weight"].float())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.update(torch_dtype="bfloat16", quantization_config={**DEEPSEEK_QC, "weight_block_size": block or [128, 128]})
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def deepseek(source, tmp_path_factory) -> Path:
    return deepseek_style(source, tmp_path_factory.mktemp("ds") / "fp8")


@pytest.fixture(scope="module")
def stored(export, deepseek, source):
    """kind -> (the FP8 block-scale checkpoint, its model dtype, the fp weights it was quantized from): ModelOpt's
    fp8_pb_wo export of the fp16 model, and the DeepSeek-style checkpoint of its bf16 copy."""
    orig = load_file(str(source / "model.safetensors"))
    return {"export": (export("fp8_block")[0], "float16", {n: t.float() for n, t in orig.items()}),
            "deepseek": (deepseek, "bfloat16", {n: t.to(torch.bfloat16).float() for n, t in orig.items()})}


def test_deepseek_style_is_detected_once_as_stored_fp8_block(deepseek):
    config = json.loads((deepseek / "config.json").read_text())
    q = quantization_of(QuantizationSection(), config)
    assert (q.method, q.quant_algo, q.modelopt, q.reads_stored, q.needs_calibration) == (
        "fp8_block", "FP8_BLOCK_SCALES", True, True, False)
    # quant_method "fp8" without a block size is not this format (TensorRT-LLM raises NotImplementedError for it)
    per_tensor = {**config, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    assert quantization_of(QuantizationSection(), per_tensor).method == "none"
    with pytest.raises(ToolchainError, match="already quantized"):
        quantization_of(QuantizationSection(method="fp8"), config)


def test_deepseek_style_reads_back_as_stored(deepseek):
    ours, config = hf_quantized_to_engine_tensors(deepseek)
    assert config["quantization"] == {"quant_algo": "FP8_BLOCK_SCALES", "kv_cache_quant_algo": None,
                                      "exclude_modules": ["lm_head", "transformer.vocab_embedding"]}
    hf = load_file(str(deepseek / "model.safetensors"))
    for layer in range(LAYERS):
        at, base = f"transformer.layers.{layer}", f"model.layers.{layer}"
        # weight_scale_inv is the dequant multiplier, as ModelOpt's weight_scale (FP8BlockScalesLinearMethod)
        assert torch.equal(ours[f"{at}.attention.qkv.weights_scaling_factor"],
                           torch.cat([hf[f"{base}.self_attn.{p}.weight_scale_inv"] for p in ATTN]))
        assert torch.equal(bits(ours[f"{at}.mlp.proj.weight"]), bits(hf[f"{base}.mlp.down_proj.weight"]))
        assert torch.equal(ours[f"{at}.mlp.proj.weights_scaling_factor"], hf[f"{base}.mlp.down_proj.weight_scale_inv"])
        assert ours[f"{at}.input_layernorm.weight"].dtype == torch.bfloat16


def test_convert_imports_a_deepseek_style_checkpoint(deepseek, tmp_path):
    ours, config = hf_quantized_to_engine_tensors(deepseek)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert convert_checkpoint(deepseek, ckpt, tp=1, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI) == config
    written = load_file(str(ckpt / "rank0.safetensors"))
    assert [n for n in ours if not torch.equal(bits(written[n]), bits(ours[n]))] == []


def test_other_block_sizes_are_refused_in_one_line(source, tmp_path):
    bad = deepseek_style(source, tmp_path / "b64", block=[64, 64])
    line = (f"{bad}: weight_block_size [64, 64]: TensorRT-LLM's QuantConfig asserts \"FP8_BLOCK_SCALES only supports "
            "block_size=(128,128)\" (tensorrt_llm/models/modeling_utils.py)")
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError) as err:
        convert_checkpoint(bad, out, tp=1, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI)
    assert err.value.message == line and "\n" not in str(err.value) and not any(out.iterdir())
    with pytest.raises(ToolchainError, match=r"FP8_BLOCK_SCALES only supports block_size=\(128,128\)"):
        quantization_of(QuantizationSection(), json.loads((bad / "config.json").read_text()))


# -- planned at the stored size --------------------------------------------------------------------------------------

def plan_spec(tmp_path: Path, checkpoint: Path, target: str, gpu: str, tp: int):
    data = {"name": "stored", "target": target, "model": {"checkpoint": str(checkpoint), "dtype": "auto"},
            "gpu": {"name": gpu}, "parallelism": {"tp": tp}, "build": {"host_memory_gib": 256},
            "limits": {"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 256},
            "serving": {"http_port": 0, "grpc_port": 0, "metrics_port": 0}}
    path = tmp_path / f"{target}-{tp}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["export", "deepseek"])
def test_plan_counts_an_fp8_block_checkpoint_at_the_bytes_convert_writes(stored, tmp_path, kind, tp):
    checkpoint, dtype, _ = stored[kind]
    ctx = build_context(plan_spec(tmp_path, checkpoint, "llmapi", "H100", tp), "plan", Workspace(tmp_path / "ws"))
    assert (ctx.quant.method, ctx.quant.modelopt) == ("fp8_block", True)  # the checkpoint's format, not the spec's
    assert {r.id: r.status for r in run_checks(ctx)}["quant.group-padding"] == PASS  # whole tiles on every rank
    dry = plan_any(checkpoint, tp=tp, pp=1, dtype=dtype, target="cpu", path=LLMAPI)
    assert [r.checkpoint_bytes for r in ctx.memory.ranks] == [dry.rank_bytes(r) for r in range(tp)]
    # (the e4m3 weights at a byte each, not the bf16 ones the spec's method none would be)
    linears = LAYERS * (512 * 256 + 256 * 256 + 3 * INTER * 256) // tp
    assert ctx.memory.ranks[0].checkpoint_bytes < dry.rank_bytes(0) + linears


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_counts_an_nvfp4_export_at_the_bytes_convert_writes(export, tmp_path, tp):
    out, _ = export("nvfp4")
    ctx = build_context(plan_spec(tmp_path, out, "trtllm", "B200", tp), "plan", Workspace(tmp_path / "ws"))
    assert (ctx.quant.method, ctx.quant.modelopt) == ("nvfp4", True)
    dry = plan_any(out, tp=tp, pp=1, dtype="float16", target="trtllm", gpu=("B200 180GB", 100))
    assert dry.config["quantization"]["quant_algo"] == "NVFP4"
    assert [r.checkpoint_bytes for r in ctx.memory.ranks] == [dry.rank_bytes(r) for r in range(tp)]


# -- the tile grid split per rank -----------------------------------------------------------------------------------

def rank_slice(hf_name: str, w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice of an HF linear's fp weight as TensorRT-LLM splits it: q, gate and up by rows, k and v by
    KV heads (one head on every rank it is duplicated to when nkv < tp), o_proj and down_proj by input columns."""
    leaf, nkv = hf_name.rsplit(".", 1)[1], DIMS["num_key_value_heads"]
    if leaf in ("o_proj", "down_proj"):
        return w.chunk(tp, dim=1)[rank]
    if leaf in ("k_proj", "v_proj") and nkv < tp:
        head = rank // (tp // nkv)
        return w[head * HEAD:(head + 1) * HEAD]
    return w.chunk(tp, dim=0)[rank]


# engine linear -> its HF parts, in the order the engine stacks them (HF gate_proj is the engine's fc, up_proj its gate)
ENGINE_PARTS = {"attention.qkv": [f"self_attn.{p}" for p in ATTN], "attention.dense": ["self_attn.o_proj"],
                "mlp.fc": ["mlp.gate_proj"], "mlp.gate": ["mlp.up_proj"], "mlp.proj": ["mlp.down_proj"]}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["export", "deepseek"])
def test_each_rank_holds_the_tiles_of_its_own_weight_slice(stored, tmp_path, kind, tp):
    """Convert's split of the scale grid (Quantizer.split, layout "tiles"): every rank's grid and e4m3 weight are
    quantize_fp8_block of its own fp weight slice, part by part, stacked as the fused loaders concatenate them
    (FP8BlockScalesLinearMethod.load_weights_fused_qkv_linear: torch.cat((q_scale, k_scale, v_scale)))."""
    checkpoint, dtype, fp = stored[kind]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    convert_checkpoint(checkpoint, ckpt, tp=tp, pp=1, dtype=dtype, target="cpu", path=LLMAPI)
    for rank in range(tp):
        written = load_file(str(ckpt / f"rank{rank}.safetensors"))
        for layer in range(LAYERS):
            for module, parts in ENGINE_PARTS.items():
                names = [f"model.layers.{layer}.{p}" for p in parts]
                mine = [quantize_fp8_block(rank_slice(n, fp[n + ".weight"], rank, tp)) for n in names]
                at = f"transformer.layers.{layer}.{module}"
                assert torch.equal(written[at + ".weights_scaling_factor"], torch.cat([s for _, s in mine])), (at, rank)
                assert torch.equal(bits(written[at + ".weight"]), torch.cat([bits(q) for q, _ in mine])), (at, rank)
    ranks = [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(tp)]
    if tp == 2:  # a rank holds one q, one k and one v head: a tile row each, its own
        grids = [r["transformer.layers.0.attention.qkv.weights_scaling_factor"] for r in ranks]
        assert grids[0].shape == grids[1].shape == (3, 2) and not torch.equal(grids[0], grids[1])
    # convert --dry-run plans every rank's tensors at the shapes and dtypes written
    dry = plan_any(checkpoint, tp=tp, pp=1, dtype=dtype, target="cpu", path=LLMAPI)
    assert [{t.name: (t.shape, t.dtype) for t in rank} for rank in dry.ranks] == \
        [{n: (tuple(t.shape), t.dtype) for n, t in rank.items()} for rank in ranks]


def test_a_rank_cut_through_a_tile_is_refused_by_the_split():
    """Quantizer.split refuses a rank that would hold part of a tile (check_tiles refuses such a spec before
    convert reads a weight, so this is its last guard, exercised directly)."""
    quant = quantization_of(QuantizationSection(method="fp8_block"))
    split = Quantizer(quant, nh=4, nkv=2, tp=2, layers_per_stage=[[0]], layout=LayoutPlan(INTER), intermediate=INTER,
                      dtype=torch.float16)
    ws = [torch.randn(256, 256), torch.randn(128, 256), torch.randn(128, 256)]  # four heads of 64: k 64 rows a rank
    qs = [quantize_fp8_block(w) for w in ws]
    weight = Component("weight", "weight", [q for q, _ in qs], torch.float8_e4m3fn)
    grid = Component("weights_scaling_factor", "tiles", [s for _, s in qs], torch.float32)
    with pytest.raises(ToolchainError, match="rank 0 of tp 2 would hold part of a 128x128 tile"):
        split.split(grid, Shard.QKV, weight)
    split.tp = 1  # whole parts: each rank (the one) takes every tile, the parts stacked
    (whole,) = split.split(grid, Shard.QKV, weight)
    assert torch.equal(whole, torch.cat(grid.parts))


# -- refused where a rank would cut a tile ---------------------------------------------------------------------------

# Four heads of 64 and two KV heads: at tp 1 q 256, k and v 128 each, the MLP 384, all whole tiles; at tp 2 a rank's k
# and v are 64 rows and its MLP 192, and at tp 4 its q 64 too.
CUT = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 384,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
       "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16",
       "quantization_config": DEEPSEEK_QC}
CUT_LINE = ("quantization.method fp8_block at parallelism.tp 2: k/v rows per rank (KV heads x head_size) 64, gate/up "
            "rows per rank (intermediate_size / tp, down_proj's input) 192 not a multiple of its 128x128 tiles, whose "
            "scale grids the fused layers concatenate per part (use parallelism.tp 1)")


def test_a_split_that_cuts_a_tile_is_refused_in_one_line_by_plan_and_convert(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CUT))
    with pytest.raises(ToolchainError) as err:
        plan_any(tmp_path / "m", tp=2, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI)
    assert str(err.value) == CUT_LINE and "\n" not in CUT_LINE
    assert plan_any(tmp_path / "m", tp=1, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI).config["quantization"][
        "quant_algo"] == "FP8_BLOCK_SCALES"
    spec = plan_spec(tmp_path, tmp_path / "m", "llmapi", "H100", 2)
    results = {r.id: (r.status, r.message) for r in run_checks(build_context(spec, "plan", Workspace(tmp_path / "w")))}
    assert results["quant.group-padding"] == (FAIL, CUT_LINE)
    ok = {r.id: r.status for r in run_checks(build_context(plan_spec(tmp_path, tmp_path / "m", "llmapi", "H100", 1),
                                                             "plan", Workspace(tmp_path / "w1")))}
    assert ok["quant.group-padding"] == PASS
    # the LLM-API path's convert checks the split the PyTorch backend will do, before it writes anything
    with pytest.raises(ToolchainError) as err:
        run_convert_llmapi(spec, Workspace(tmp_path / "ws"))
    assert str(err.value) == CUT_LINE


def test_kv_heads_shared_across_ranks_need_a_family_whose_mapper_repeats_their_block_scales():
    # A Llama's HfWeightMapper._duplicate_kv_weights repeats weight, bias and NVFP4's weight_scale, not
    # weight_scale_inv; Qwen3-MoE's mapper repeats it (archs/qwen_moe.py duplicates_kv_block_scales).
    llama = ModelShape(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1,
                       head_size=128, max_position_embeddings=2048)
    with pytest.raises(ToolchainError) as err:
        check_recipe(Quantization(method="fp8_block"), llama, tp=2, target="llmapi", splits=lambda t: t in (1, 2))
    assert str(err.value) == (
        "quantization.method fp8_block at parallelism.tp 2: the 1 KV heads would be repeated across ranks, and "
        "TensorRT-LLM's weight mapper for this family repeats their weights but not their block scales, so the "
        "checkpoint would not load (use parallelism.tp 1)")
    qwen3_moe = dataclasses.replace(llama, kv_block_scales_duplicated=True)
    check_recipe(Quantization(method="fp8_block"), qwen3_moe, tp=2, target="llmapi")
    assert get_family("Qwen3MoeForCausalLM").duplicates_kv_block_scales
    assert not get_family("LlamaForCausalLM").duplicates_kv_block_scales


def test_a_duplicated_kv_head_must_be_whole_tiles_and_no_tp_may_leave_only_fp8():
    # one KV head of 64 rows, on every rank at tp 2 (in a family whose mapper repeats its block scales); q 64 x 6
    # heads = 384 (three tiles at tp 1, 192 a rank at tp 2)
    shape = ModelShape(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=1,
                       head_size=64, max_position_embeddings=2048, kv_block_scales_duplicated=True)
    with pytest.raises(ToolchainError) as err:
        check_recipe(Quantization(method="fp8_block"), shape, tp=2, target="llmapi", splits=lambda t: t in (1, 2))
    assert str(err.value) == (
        "quantization.method fp8_block at parallelism.tp 2: q rows per rank (heads x head_size / tp, o_proj's input) "
        "192, k/v rows per rank (KV heads x head_size) 64 not a multiple of its 128x128 tiles, whose scale grids the "
        "fused layers concatenate per part (use quantization.method fp8)")
    # at tp 1 the KV head is a part of its own: 64 rows, half a tile
    with pytest.raises(ToolchainError, match=r"tp 1: k/v rows per rank \(KV heads x head_size\) 64 not a multiple"):
        check_recipe(Quantization(method="fp8_block"), shape, tp=1, target="llmapi")
    wide = ModelShape(384, 1024, 3, 1, 128, 2048, True)  # heads of 128: whole at tp 1; only q's 384 / 2 cuts a tile at tp 2
    check_recipe(Quantization(method="fp8_block"), wide, tp=1, target="llmapi")
    with pytest.raises(ToolchainError, match=r"tp 2: q rows per rank \(heads x head_size / tp, o_proj's input\) 192 "
                                             r"not a multiple of its 128x128 tiles"):
        check_recipe(Quantization(method="fp8_block"), wide, tp=2, target="llmapi")
    assert formats.FP8_BLOCK.tile == BLOCK  # the row's tile is the quantizer's
    check_recipe(Quantization(method="fp8"), shape, tp=2, target="llmapi")  # the per-tensor format has no tiles


# -- served by the LLM-API path's CPU stand-in ----------------------------------------------------------------------

@pytest.mark.parametrize("kind, tp", [("nvfp4", 1), ("fp8_block", 1), ("fp8_block", 2), ("deepseek", 1),
                                      ("deepseek", 2)])
def test_cpu_llm_serves_the_checkpoint_as_the_engine_runs_it(export, deepseek, tmp_path, kind, tp):
    """CpuLLM (what Triton's llmapi model and the OpenAI server run on target llmapi-cpu) loads the HF-format
    checkpoint (the export of `kind`, or the DeepSeek-style one) through convert's import and the CPU engine's kernel
    of the format: at tp 1 its logits are the CPU engine's on the same tensors (hf_quantized_to_engine_tensors), at
    tp 2, every rank holding its own tiles, the same to float rounding; its greedy tokens are those logits' argmax."""
    from test_hf_quant_export import _engine_dir, _logits
    from test_modelopt_import import generate

    from toolchain.llmapi.cpu_llm import CpuLLM

    out = deepseek if kind == "deepseek" else export(kind)[0]
    algo = "FP8_BLOCK_SCALES" if kind == "deepseek" else formats.METHODS[kind].quant_algo
    prompt = [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6]
    tensors, config = hf_quantized_to_engine_tensors(out)
    (want,) = _logits(_engine_dir(tmp_path / "engine", tensors, config), [prompt])
    with CpuLLM(model=str(out), backend="pytorch", tensor_parallel_size=tp, max_batch_size=2, max_seq_len=64,
                max_num_tokens=128, kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 1024},
                work_dir=tmp_path / "llm") as llm:
        assert llm.engine.dims.quant_algo == algo
        got = llm.engine.forward_logits(prompt)
        tokens = generate(llm, prompt)
    if tp == 1:
        assert torch.equal(got, want)
    else:
        # the two ranks' partial sums added in another order: measured 3.1e-6 (fp16 export); with bf16 activations
        # a last-bit difference can flip one e4m3 rounding of a 1x128 activation group, which moved one logit by
        # 1.1e-3 of the largest with F.linear's summation order and 6.9e-3 with linear.matmul's (measured, deepseek
        # at tp 2); the tokens stay the same.
        assert float((got - want).abs().max() / want.abs().max()) < 1e-2
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(tokens) == 12 and tokens[0] == int(want[-1].argmax())
