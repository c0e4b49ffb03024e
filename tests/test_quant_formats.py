"""The quantization format table (toolchain/quant/formats.py): it names every spec method and KV-cache
kind, its shapes and byte sizes are the ones TensorRT-LLM's layers declare, and its SM rules are the
ones convert and the plan checks both enforce."""

from typing import get_args

import pytest

from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.recipe import ModelShape, check_recipe
from toolchain.quant.view import Prequantized, Quantization, quantization_of
from toolchain.spec import QuantizationSection

SHAPE = ModelShape(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                   head_size=64, max_position_embeddings=512)


def test_rows_cover_the_spec():
    fields = QuantizationSection.model_fields
    assert tuple(formats.METHODS) == get_args(fields["method"].annotation)
    assert tuple(formats.KV_CACHE) == get_args(fields["kv_cache"].annotation)
    assert len({f.quant_algo for f in formats.METHODS.values()}) == len(formats.METHODS)


def test_shapes_as_the_layers_declare_them():
    # WeightOnlyGroupwiseQuantLinear (TensorRT-LLM tensorrt_llm/quantization/layers.py): packed int4
    # (out/2, in), per-group scales (out, in/g), prequant (in,), zero points declared (in/g, out).
    dims = {t.suffix: t.dims(8, 256, 128) for t in formats.AWQ.stored}
    assert dims == {"weight": (4, 256), "weights_scaling_factor": (8, 2), "prequant_scaling_factor": (256,)}
    assert {t.suffix: t.dims(8, 256, 128) for t in formats.IMPORTED_INT4.stored}["zero"] == (2, 8)
    assert [t.suffix for t in formats.INT8_WO.stored] == ["weight"]  # trtllm-build quantizes it


@pytest.mark.parametrize("row, stored, built", [
    (formats.NONE, 2 * 4096, 2 * 4096),
    (formats.INT8_WO, 2 * 4096, 4096 + 64 * 2),
    (formats.INT4_WO, 2 * 4096, 2048 + 64 * 2),
    (formats.AWQ, 2048 + 64 * 4 + 64 * 2, 2048 + 64 * 2 + 64 * 2),
    (formats.IMPORTED_INT4, 2048 + 64 * 4 + 64 * 2, 2048 + 64 * 2 + 64 * 2),
    (formats.SMOOTHQUANT, 4096 + 64 * 4 + 4 + 64 * 2, 4096 + 64 * 4 + 4 + 64 * 2),
    (formats.FP8, 4096 + 8, 4096 + 8),
])
def test_bytes_derive_from_the_tensors(row, stored, built):
    # A (64, 64) linear in a 2-byte model dtype with groups of 64.
    assert formats.tensor_bytes(row.stored, 64, 64, 64, 2) == stored
    assert formats.tensor_bytes(row.built, 64, 64, 64, 2) == built


@pytest.mark.parametrize("sm", [75, 80, 89, 90, 100, 103, 110, 120])
@pytest.mark.parametrize("method", list(formats.METHODS))
@pytest.mark.parametrize("kv", list(formats.KV_CACHE))
def test_convert_refuses_what_the_rows_refuse(sm, method, kv):
    # On target llmapi every path rule passes (fp8_block is LLM-API only), so only the SM rules speak.
    refused = formats.METHODS[method].refused_on(sm) or formats.KV_CACHE[kv].refused_on(sm)
    recipe = Quantization(method=method, kv_cache=kv, group_size=64)
    if refused:
        match = {"too old": "Ada or Hopper", "blackwell": "Blackwell", "worded": f"; the GPU is SM {sm}: use "}
        with pytest.raises(ToolchainError, match=match[refused]):
            check_recipe(recipe, SHAPE, tp=1, target="llmapi", gpu_sm=sm)
    else:
        check_recipe(recipe, SHAPE, tp=1, target="llmapi", gpu_sm=sm)
    worded = (method == "nvfp4" and sm not in (100, 103, 120)) or (method == "fp8_block" and sm not in (90, 100, 103))
    assert (refused == "worded") == worded
    if worded:
        return  # the weights' rule speaks first; test_fp4_rows.py words it
    assert (refused == "too old") == (sm < 89 and "fp8" in (method, kv))
    assert (refused == "blackwell") == (100 <= sm < 120 and (method in ("int8_wo", "int4_wo", "awq", "smoothquant")
                                                              or kv == "int8"))


def test_imported_int4_is_refused_on_blackwell():
    pre = Prequantized("gptq", 64, 4, True)
    with pytest.raises(ToolchainError, match="an imported int4 checkpoint does not build on Blackwell"):
        check_recipe(Quantization(prequantized=pre), SHAPE, tp=1, gpu_sm=100)
    check_recipe(Quantization(prequantized=pre), SHAPE, tp=1, gpu_sm=90)


# -- a row names everything that handles its format (docs/architecture.md "A quantization method") ------------

def test_every_row_names_its_quantizer_kernel_and_export():
    from toolchain.checkpoint import hf_quant, quantize
    from toolchain.engine.cpu import qlinear

    # The rows whose quantizer or CPU kernel is still to be written (issue 35): the two lists in quant/formats.py,
    # kept visible and small. A name leaves its list when its dispatcher branch lands, and this test then holds it.
    assert formats.PENDING_QUANTIZERS == {"fp8_block"}
    assert formats.PENDING_CPU_KERNELS == set()
    # Every Hugging Face export is computed (checkpoint/hf_quant.py HF_COMPUTED), fp8_block's too, which no engine
    # path computes: a row's HF export is pending exactly while its quantizer has no branch there.
    assert formats.PENDING_HF_EXPORTS == set()
    for row in formats.HF_EXPORTS.values():
        assert (row.quantizer in hf_quant.HF_COMPUTED) != (row.name in formats.PENDING_HF_EXPORTS), row.name
        assert (row.name in formats.HF_IMPORTS) == row.ready_on("llmapi"), row.name
    for row in formats.ALL:
        # Its quantizer: a computing one has its branch in the writer and reads calibration statistics that
        # collect_stats gathers (fp8_block alone none: its activations are scaled at run time); the others write
        # fp weights (trtllm-build / none) or read stored ones; a pending one has no branch yet.
        if row.quantizer in quantize.COMPUTED:
            assert row.quantizer_ready and set(row.stats) <= {"amax", "absmean", "cov"}, row.name
            assert row.stats or row.quantizer == "fp8_block", row.name
        elif row.quantizer in ("trtllm-build", "none"):
            assert row.stored == formats.FP_WEIGHT and not row.stats, row.name
        elif row.quantizer == "imported":
            assert row is formats.IMPORTED_INT4
        elif row.quantizer == "stored_rows":  # read by the family's rows as stored, never a spec method
            assert row.name in formats.STORED_ONLY and not row.stats, row.name
        else:
            assert row.quantizer in formats.PENDING_QUANTIZERS and not row.quantizer_ready, row.name
        # Its CPU kernel: every quantized row runs on the CPU engine, or its kernel is pending; only `none` is a
        # plain fp linear.
        if row is formats.NONE:
            assert row.cpu_kernel is None
        else:
            assert (row.cpu_kernel in qlinear.KERNELS) != (row.cpu_kernel in formats.PENDING_CPU_KERNELS), row.name
            assert row.cpu_kernel_ready == (row.cpu_kernel in qlinear.KERNELS), row.name
        # Its HF export, or the row says why there is none (hf_quant_problem repeats it).
        assert (row.hf_name is None) != (row.hf_why_not is None) or row is formats.NONE, row.name
        if row.name in formats.METHODS and row.hf_why_not:
            problem = hf_quant_problem_of(hf_quant, row.name)
            assert problem == f"quantization.method {row.name} {row.hf_why_not}"


def hf_quant_problem_of(hf_quant, method: str) -> str | None:
    return hf_quant.hf_quant_problem(QuantizationSection(method=method))


def test_dispatchers_refuse_an_unknown_format():
    import torch

    from toolchain.engine.cpu import qlinear

    t = {"x.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match="no CPU kernel 'int2'"):
        qlinear.build_linear(t, "x", False, "int2")


@pytest.mark.parametrize("method, kv, active", [("none", "none", False), ("none", "int8", True),
                                                ("fp8", "none", True), ("awq", "fp8", True)])
def test_one_quantized_at_all_answer(method, kv, active):
    section = QuantizationSection(method=method, kv_cache=kv)
    assert quantization_of(section).active is Quantization(method=method, kv_cache=kv).active is active
    # A checkpoint stored as AutoAWQ int4 under method none asks for nothing: it is imported as it is.
    stored = quantization_of(section, {"quantization_config": {"quant_method": "awq", "group_size": 64}})
    assert stored.active is active and (stored.imported == "awq") is (method == "none")


def test_quantized_at_all_is_defined_once():
    # Every stage asks the view (Quantization.active, quant/view.py), which alone asks the row-level rule
    # (formats.active): no module spells the rule again or calls it around the view.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "toolchain"
    rule = re.compile(r"""method\s*!=\s*["']none["']\s+or\s+\S*kv_cache\s*!=\s*["']none["']|"""
                      r"""method\s*==\s*["']none["']\s+and\s+\S*kv_cache\s*==\s*["']none["']""")
    spelled = [str(p.relative_to(root)) for p in root.rglob("*.py") if rule.search(p.read_text())]
    assert spelled == ["quant/formats.py"]
    callers = [str(p.relative_to(root)) for p in root.rglob("*.py") if "formats.active(" in p.read_text()]
    assert callers == ["quant/view.py"]
    defined = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if re.search(r"def active\(self\) -> bool", p.read_text())]
    assert defined == ["quant/view.py"]


def test_the_architecture_map_names_the_files_a_method_touches():
    # docs/architecture.md "A quantization method" lists the files a new row needs; each must exist and hold
    # what the list says it holds.
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "architecture.md").read_text()
    section = doc.split("**A quantization method**", 1)[1].split("\n\n**", 1)[0]
    for path, marker in [("toolchain/quant/formats.py", "quantizer: str"),
                         ("toolchain/checkpoint/quantize.py", "COMPUTED = "),
                         ("toolchain/engine/cpu/qlinear.py", "KERNELS = "),
                         ("toolchain/checkpoint/hf_quant.py", "def _quantize_group"),
                         ("tests/test_quant_formats.py", "def test_every_row_names")]:
        assert f"`{path}`" in section, path
        assert marker in (repo / path).read_text(), path
