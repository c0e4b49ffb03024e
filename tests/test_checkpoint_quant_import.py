"""Pre-quantized Hugging Face imports: AutoAWQ (GEMM) and GPTQ checkpoints are
built here from a model (packers written from the format facts, no download)
and converted without re-quantizing: the engine's weights must equal the
source's dequantized weights exactly, and its logits those of the HF model
holding them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_model
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.errors import ToolchainError
from toolchain.quant import prequantized as pq

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def build_prequantized(src: Path, out: Path, kind: str, group: int = 128, desc_act: bool = False) -> Path:
    """Write `src` as an AutoAWQ-GEMM or GPTQ checkpoint, plus `out`/reference: the same model with
    every linear replaced by its dequantized int4 weight (what the quantized model computes)."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    packed, ref = {}, {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or not module.endswith(LINEARS):
            packed[name] = ref[name] = t
            continue
        q, z, s = pq.asym_quantize_per_group(t.float(), group)
        if kind == "gptq":
            z = z.clamp(min=1)  # v1 cannot store a zero point of 0 (it reads back as 16)
            parts = pq.pack_gptq(q, z, s, group)
            if desc_act:
                parts["g_idx"] = parts["g_idx"].flip(0)
        else:
            parts = pq.pack_awq_gemm(q, z, s)
        packed.update({f"{module}.{k}": v for k, v in parts.items()})
        ref[name] = pq.dequantize_asym(q, z, s.half().float(), group).to(t.dtype)
    out.mkdir(parents=True)
    save_file(packed, str(out / "model.safetensors"))
    qc = ({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True}
          if kind == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                 "sym": False})
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (out / "reference").mkdir()
    save_file(ref, str(out / "reference" / "model.safetensors"))
    (out / "reference" / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("imp"), hidden_size=256,
                         intermediate_size=512, vocab_size=300)


def _engine(ckpt: Path, tmp: Path):
    from toolchain.engine.cpu import CpuEngine

    eng = tmp / "engine"
    eng.mkdir()
    for f in ckpt.glob("rank*.safetensors"):
        (eng / f.name).hardlink_to(f)
    cfg = {"pretrained_config": json.loads((ckpt / "config.json").read_text()),
           "build_config": {"max_batch_size": 1, "max_input_len": 60, "max_seq_len": 64, "max_num_tokens": 64}}
    (eng / "config.json").write_text(json.dumps(cfg))
    return CpuEngine.load(eng)


@pytest.mark.parametrize("kind", ["awq", "gptq"])
@pytest.mark.parametrize("tp", [1, 2])
def test_import_round_trip(base, tmp_path, kind, tp):
    from transformers import AutoModelForCausalLM

    hf = build_prequantized(base, tmp_path / kind, kind)
    out = tmp_path / "ckpt"
    out.mkdir()
    cfg = convert_checkpoint(hf, out, tp=tp, pp=1, dtype="float32", target="cpu")
    assert cfg["quantization"] == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None,
                                   "exclude_modules": ["lm_head", "transformer.vocab_embedding"],
                                   "group_size": 128, "has_zero_point": True, "pre_quant_scale": False}
    engine = _engine(out, tmp_path)
    ids = list(range(3, 40))
    ref = AutoModelForCausalLM.from_pretrained(hf / "reference", dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = engine.forward_logits(ids)
    # The int4 kernel takes bf16 activations (about 1% off); a layout error (zero or scales
    # transposed, groups misplaced) is off by the size of the logits themselves.
    assert float((got - want).abs().max()) < 3e-2 * float(want.abs().max())


def test_gptq_act_order_rejected_before_weights(base, tmp_path):
    hf = build_prequantized(base, tmp_path / "g", "gptq", desc_act=True)
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError, match="act-order"):
        convert_checkpoint(hf, out, tp=1, pp=1, dtype="float16", target="cpu")
    assert not any(out.iterdir())


@pytest.mark.parametrize("tp", [1, 2])
def test_imported_zero_has_the_groupwise_layer_layout(base, tmp_path, tp):
    """trtllm-build's W4A16_AWQ preprocessing transposes `weights_scaling_factor`
    but not `zero`, and WeightOnlyGroupwiseQuant{Column,Row}Linear declare it
    (in/g, out) in the model dtype (TensorRT-LLM tensorrt_llm/models/modeling_utils.py
    preprocess_perlayer_weights; tensorrt_llm/quantization/layers.py). So the
    checkpoint stores it that way, split per rank like the scales."""
    from safetensors import safe_open

    from toolchain.upstream import facts

    layers = facts("quantized_layers")["layers"]
    hf = build_prequantized(base, tmp_path / "awq", "awq")
    out = tmp_path / "ckpt"
    out.mkdir()
    convert_checkpoint(hf, out, tp=tp, pp=1, dtype="float16", target="trtllm")
    g, hidden, inter = 128, 256, 512
    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        prefix = "transformer.layers.0."
        for name, (inp, outp) in {"attention.dense": (hidden // tp, hidden), "mlp.fc": (hidden, inter // tp),
                                  "mlp.proj": (inter // tp, hidden)}.items():
            scale = f.get_tensor(f"{prefix}{name}.weights_scaling_factor")
            zero = f.get_tensor(f"{prefix}{name}.zero")
            assert tuple(scale.shape) == (outp, inp // g), name   # transposed by trtllm-build
            assert tuple(zero.shape) == (inp // g, outp), name    # read as stored
            assert zero.dtype == torch.float16, name
            # the same, from the layer declarations themselves (facts/quantized_layers.json)
            layer = layers["WeightOnlyGroupwiseQuantRowLinear" if name in ("attention.dense", "mlp.proj")
                           else "WeightOnlyGroupwiseQuantLinear"]
            assert layer["parameters"]["zero"]["dtype"] == "dtype"  # the model dtype
            assert "zero" not in {r["suffix"] for r in facts("quantized_layers")["preprocess"]["W4A16_AWQ"]}
            assert eval(layer["parameters"]["zero"]["shape"], {},  # noqa: S307 - upstream's own arithmetic
                        {"in_features": inp, "out_features": outp, "group_size": g}) == tuple(zero.shape)
            assert f"{prefix}{name}.prequant_scaling_factor" not in f.keys()
