"""The quantization view (toolchain/quant/view.py): one value, resolved once from the spec's section and the
source checkpoint's config, gives the planner and convert the same answers about the same checkpoint."""

from __future__ import annotations

import pytest

from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.view import Quantization, quantization_of
from toolchain.spec import QuantizationSection

AUTOAWQ = {"quantization_config": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64,
                                   "zero_point": True}}
GPTQ = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}


def test_the_section_reads_as_a_request():
    section = QuantizationSection(method="awq", group_size=64, kv_cache="int8", rounding="nearest", alpha=0.8,
                                  exclude_modules=["transformer.layers.0.*"],
                                  calibration={"samples": 8, "seq_len": 64})
    q = quantization_of(section)
    assert q == Quantization(method="awq", kv_cache="int8", group_size=64, alpha=0.8, rounding="nearest",
                             exclude_modules=("transformer.layers.0.*",), calibration_samples=8,
                             calibration_seq_len=64)
    assert (q.format, q.kv_format, q.quant_algo, q.kv_cache_quant_algo) == (
        formats.AWQ, formats.KV_CACHE["int8"], "W4A16_AWQ", "INT8")
    assert q.per_group and q.integer and not q.weight_only and q.needs_calibration and q.active
    assert q.describe() == "W4A16_AWQ g64" and q.imported is None and not q.reads_stored
    # without the checkpoint's config the request stands as it is; with one, the source is recorded
    assert quantization_of(q) is q and quantization_of(q, {}) == q


@pytest.mark.parametrize("config, kind, group", [(AUTOAWQ, "awq", 64), (GPTQ, "gptq", 128)])
def test_a_stored_int4_checkpoint_under_method_none(config, kind, group):
    q = quantization_of(QuantizationSection(), config)
    # the request is the spec's (its refusals name the spec's fields); the weights are the checkpoint's int4
    assert (q.method, q.group_size, q.active) == ("none", 128, False)
    assert (q.imported, q.weight_method, q.weight_group_size, q.format) == (kind, "awq", group, formats.IMPORTED_INT4)
    assert q.quant_algo == "W4A16_AWQ" and q.per_group and q.reads_stored and not q.needs_calibration
    assert q.describe() == f"W4A16_AWQ g{group} (stored {kind.upper()} int4 with zero points, imported as is)"


def test_a_method_asked_of_a_stored_checkpoint_is_the_request_convert_refuses():
    q = quantization_of(QuantizationSection(method="fp8"), AUTOAWQ)
    assert q.prequantized is not None and q.imported is None
    assert (q.weight_method, q.format, q.weight_group_size) == ("fp8", formats.FP8, 128)


def test_a_config_convert_cannot_import():
    config = {"quantization_config": {"quant_method": "bitsandbytes"}}
    # the planner reads it as unquantized; convert (which passes the config's path) refuses it, naming it
    assert quantization_of(QuantizationSection(), config).prequantized is None
    with pytest.raises(ToolchainError, match="^ckpt/config.json: quantization_config quant_method 'bitsandbytes' "
                                             "cannot be imported"):
        quantization_of(QuantizationSection(), config, origin="ckpt/config.json")


def test_a_modelopt_export_replaces_the_request():
    fmt = {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8", "group_size": None, "exclude_modules": []}
    q = quantization_of(QuantizationSection(kv_cache="fp8"), {}, modelopt=fmt)
    assert q == Quantization(method="awq", kv_cache="fp8", group_size=128, modelopt=True)
    assert q.active and q.reads_stored and not q.needs_calibration and q.imported is None
    refusals = [(QuantizationSection(method="fp8"), "the checkpoint is already quantized (ModelOpt W4A16_AWQ); "
                                                   "quantization.method 'fp8' would quantize it twice"),
                (QuantizationSection(kv_cache="int8"), "quantization.kv_cache int8 needs calibration, which cannot run "
                                                      "a pre-quantized (ModelOpt W4A16_AWQ) checkpoint")]
    for section, message in refusals:
        with pytest.raises(ToolchainError, match=message.replace("(", r"\(").replace(")", r"\)")):
            quantization_of(section, {}, modelopt=fmt)
    no_kv = {**fmt, "kv_cache_quant_algo": None}
    with pytest.raises(ToolchainError, match="carries no FP8 KV-cache scales"):
        quantization_of(QuantizationSection(kv_cache="fp8"), {}, modelopt=no_kv)
