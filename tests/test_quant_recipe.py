"""The quantization section of the spec and `check_recipe`: every bad
combination is one line, names the field, and comes before any weight is read."""

from __future__ import annotations

import pytest

from toolchain.errors import ToolchainError
from toolchain.quant.recipe import ModelShape, check_recipe, is_excluded
from toolchain.quant.view import Quantization, parse_prequantized
from toolchain.spec import load_spec

TINY = ModelShape(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                  head_size=64, max_position_embeddings=1024)


def _fails(fragment: str, recipe: Quantization, shape: ModelShape = TINY, **kw) -> ToolchainError:
    with pytest.raises(ToolchainError) as err:
        check_recipe(recipe, shape, **{"tp": 1, **kw})
    assert fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    return err.value


def test_spec_section_defaults_and_overrides(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\n")
    q = load_spec(path).quantization
    assert (q.method, q.group_size, q.kv_cache, q.exclude_modules) == ("none", 128, "none", [])
    assert q.calibration.dataset == "builtin" and q.calibration.samples >= 1
    (tmp_path / "prompts.txt").write_text("a\n")
    spec = load_spec(path, ["quantization.method=awq", "quantization.group_size=64",
                            "quantization.calibration.dataset=prompts.txt"])
    assert spec.quantization.method == "awq" and spec.quantization.group_size == 64
    assert spec.quantization.calibration.dataset == str(tmp_path / "prompts.txt")


@pytest.mark.parametrize("override, fragment", [
    ("quantization.group_size=32", "quantization.group_size"),
    ("quantization.method=int3", "quantization.method"),
    ("quantization.kv_cache=int4", "quantization.kv_cache"),
    ("quantization.alpha=1.5", "quantization.alpha"),
    ("quantization.rounding=stochastic", "quantization.rounding"),
    ("quantization.calibration.samples=0", "quantization.calibration.samples"),
])
def test_spec_rejects_bad_values_in_one_line(tmp_path, override, fragment):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\n")
    with pytest.raises(ToolchainError) as err:
        load_spec(path, [override])
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_rounding_reaches_the_view(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nquantization: {method: awq}\n")
    assert Quantization.of(load_spec(path).quantization).rounding == "gptq"
    assert Quantization.of(load_spec(path, ["quantization.rounding=nearest"]).quantization).rounding == "nearest"
    _fails("quantization.rounding 'stochastic'", Quantization(method="awq", rounding="stochastic"))


def test_group_size_message_names_the_fix(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("quantization: {method: awq, group_size: 256}\n")
    with pytest.raises(ToolchainError, match="64 and 128"):
        load_spec(path)


def test_valid_recipes_pass():
    for method in ("none", "int8_wo", "int4_wo", "awq", "smoothquant", "fp8"):
        for tp in (1, 2):
            plan = check_recipe(Quantization(method=method, kv_cache="int8"), TINY, tp=tp)
            assert plan.padded_intermediate == 768


def test_per_group_padding_and_divisibility():
    # I = 640 at g128 tp2: M = 256, the MLP dim is zero-padded to 768 (quantization/layers.py WeightOnlyGroupwiseQuantLinear padding)
    shape = ModelShape(256, 640, 4, 2, 64, 1024)
    assert check_recipe(Quantization(method="awq"), shape, tp=2).padded_intermediate == 768
    # attention dims are never padded
    small = ModelShape(64, 128, 4, 2, 16, 512)
    _fails("multiple of max(64, group) x tp", Quantization(method="awq"), small)
    err = _fails("= 256", Quantization(method="awq"), ModelShape(128, 256, 2, 2, 64, 512), tp=2)
    assert "group_size 64" in str(err)  # the hint: g64 gives M = 128, which fits
    check_recipe(Quantization(method="awq", group_size=64), ModelShape(128, 256, 2, 2, 64, 512), tp=2)


def test_gpu_rules():
    _fails("quantization.method fp8 needs an Ada or Hopper", Quantization(method="fp8"), gpu_name="A100", gpu_sm=80)
    _fails("quantization.kv_cache fp8", Quantization(method="awq", kv_cache="fp8"), gpu_sm=86)
    for method in ("int8_wo", "int4_wo", "awq", "smoothquant"):
        _fails("Blackwell", Quantization(method=method), gpu_name="B200", gpu_sm=100)
    _fails("kv_cache int8", Quantization(method="fp8", kv_cache="int8"), gpu_sm=100)
    check_recipe(Quantization(method="fp8", kv_cache="fp8"), TINY, tp=1, gpu_sm=90)
    check_recipe(Quantization(method="awq", kv_cache="int8"), TINY, tp=1, gpu_sm=80)


def test_calibration_problems(tmp_path):
    _fails("quantization.calibration.seq_len 2048", Quantization(method="awq", calibration_seq_len=2048))
    _fails("no such file", Quantization(method="smoothquant", calibration_dataset=str(tmp_path / "none.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    _fails("is empty", Quantization(method="fp8", calibration_dataset=str(empty)))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    _fails("cannot read", Quantization(kv_cache="int8", calibration_dataset=str(binary)))
    # methods without calibration never look at the dataset
    check_recipe(Quantization(method="int8_wo", calibration_dataset=str(tmp_path / "none.txt")), TINY, tp=1)


def test_prequantized_rules():
    awq = parse_prequantized({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
                              "zero_point": True}, "cfg")
    assert awq.kind == "awq" and awq.zero_point
    check_recipe(Quantization(prequantized=awq), TINY, tp=2)
    _fails("quantize it twice", Quantization(method="awq", prequantized=awq))
    _fails("kv_cache", Quantization(kv_cache="int8", prequantized=awq))
    gptq = parse_prequantized({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "cfg")
    _fails("act-order", Quantization(prequantized=gptq))
    g32 = parse_prequantized({"quant_method": "gptq", "bits": 4, "group_size": 32}, "cfg")
    _fails("group_size 32", Quantization(prequantized=g32))
    gemv = parse_prequantized({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "cfg")
    _fails("GEMM", Quantization(prequantized=gemv))
    with pytest.raises(ToolchainError, match="bitsandbytes"):
        parse_prequantized({"quant_method": "bitsandbytes"}, "cfg")
    assert parse_prequantized(None, "cfg") is None


def test_exclude_globs():
    assert is_excluded("transformer.layers.0.attention.qkv", ["transformer.layers.0.*"])
    assert not is_excluded("transformer.layers.1.mlp.fc", ["transformer.layers.0.*", "*.qkv"])
    _fails("empty pattern", Quantization(method="int8_wo", exclude_modules=("",)))
