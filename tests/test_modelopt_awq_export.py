"""A ModelOpt-style W4A16_AWQ TensorRT-LLM checkpoint (int4 packed two output rows a byte, float32 scales per
group of 64 inputs, one prequant vector for the fused qkv and one each for fc, gate, dense, proj) is read by
the CPU engine as a second, plain-torch reader (tools/modelopt_awq_export.py) reads it: the same logits. That
is the evidence docs/quantization.md rests on when it puts the SmolLM2 gap of ModelOpt's export (41.33 in
ModelOpt, 46.70 on the engine) in ModelOpt's export and not in our reading of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_hf_model
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.build import write_cpu_engine
from toolchain.engine.cpu import CpuEngine
from tools.modelopt_awq_export import dequantize_checkpoint, hf_model, int4_values, qkv_spread

GROUP = 64
DIMS = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, vocab_size=250)
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def modelopt_pack(q: torch.Tensor) -> torch.Tensor:
    """(out, in) int4 in [-8, 7] -> ModelOpt's (out/2, in) bytes: row 2j low nibble, row 2j+1 high nibble."""
    low, high = q[0::2].to(torch.int16) & 0xF, q[1::2].to(torch.int16) & 0xF
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def quantize_like_modelopt(w: torch.Tensor, prequant: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ as ModelOpt exports it: the weight divided by the prequant vector (the activation is multiplied by
    it), then symmetric int4 per group of GROUP inputs, scale amax / 7 in float32."""
    ws = w.float() / prequant[None, :]
    groups = ws.reshape(ws.shape[0], -1, GROUP)
    scale = groups.abs().amax(-1) / 7
    q = torch.clamp(torch.round(groups / scale[..., None]), -8, 7).reshape(ws.shape).to(torch.int8)
    return {"weight": modelopt_pack(q), "weights_scaling_factor": scale,
            "prequant_scaling_factor": prequant.to(torch.float16)}


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[Path, Path]:
    """(HF source, a ModelOpt-style W4A16_AWQ checkpoint of it) with per-linear prequant vectors far from 1."""
    src = make_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("hf"), seed=5, **DIMS)
    ckpt = tmp_path_factory.mktemp("ckpt")
    convert_checkpoint(src, ckpt, tp=1, pp=1, dtype="float16", target="cpu")
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(".weight") and any(f".{lin}." in n for lin in LINEARS)]:
        w = tensors.pop(name)
        prequant = torch.exp(torch.randn(w.shape[1], generator=g))  # AWQ scales spread over about e^±2
        for leaf, t in quantize_like_modelopt(w, prequant).items():
            tensors[name.removesuffix("weight") + leaf] = t
    save_file(tensors, str(ckpt / "rank0.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"] = {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": GROUP,
                              "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))
    return src, ckpt


def test_int4_values_reads_modelopts_nibble_order():
    q = torch.tensor([[-8, 7, 0], [1, -1, 3], [5, -3, -8], [2, 6, -2]], dtype=torch.int8)
    assert torch.equal(int4_values(modelopt_pack(q)), q.float())


def test_cpu_engine_reads_the_export_as_a_plain_torch_dequantization_does(export, tmp_path):
    src, ckpt = export
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    write_cpu_engine(ckpt, engine_dir, {"max_batch_size": 1, "max_input_len": 63, "max_seq_len": 64,
                                        "max_num_tokens": 64, "max_beam_width": 1})
    ids = torch.randint(3, DIMS["vocab_size"], (24,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = CpuEngine.load(engine_dir, num_threads=1)
    try:
        engine_logits = engine.forward_logits(ids).float()
    finally:
        engine.close()
    sd, _ = dequantize_checkpoint(ckpt)
    with torch.no_grad():
        torch_logits = hf_model(src, sd)(torch.tensor([ids])).logits[0].float()
    # the engine runs bf16 activations through its int4 kernel; a misread group order, nibble order, qkv
    # split or prequant side moves the logits by their own size, not by bf16's rounding
    err = (engine_logits - torch_logits).abs().max() / torch_logits.abs().max()
    assert err < 0.03, f"engine and plain-torch readings differ by {err:.3f} of the logits' range"
    assert torch.equal(engine_logits.argmax(-1), torch_logits.argmax(-1))


def test_a_misread_export_would_not_pass(export, tmp_path):
    """The comparison above can fail: the same checkpoint with the prequant vectors left out of the
    plain-torch reading gives other logits."""
    src, ckpt = export
    sd, _ = dequantize_checkpoint(ckpt)
    t = load_file(str(ckpt / "rank0.safetensors"))
    pre = t["transformer.layers.0.mlp.proj.prequant_scaling_factor"].float()
    misread = dict(sd, **{"model.layers.0.mlp.down_proj.weight": sd["model.layers.0.mlp.down_proj.weight"] / pre})
    ids = torch.tensor([list(range(3, 27))])
    with torch.no_grad():
        right, wrong = hf_model(src, sd)(ids).logits[0], hf_model(src, misread)(ids).logits[0]
    assert (right - wrong).abs().max() / right.abs().max() > 0.05


def test_qkv_spread_is_zero_where_q_k_v_share_one_vector_and_grows_with_their_gap():
    v = torch.exp(torch.randn(16, generator=torch.Generator().manual_seed(2)))
    same = {f"model.layers.0.self_attn.{p}_proj": v for p in "qkv"}
    assert qkv_spread(same) == [{"layer": 0, "max_abs_log2_ratio": 0.0, "mean_abs_log2_ratio": 0.0}]
    apart = dict(same, **{"model.layers.0.self_attn.k_proj": v * 4})  # mean = 2v: q, v at 1/2, k at 2
    assert qkv_spread(apart)[0]["max_abs_log2_ratio"] == pytest.approx(1.0, abs=1e-3)


def test_an_export_without_rotary_base_rotates_with_tensorrt_llms_default(tmp_path):
    """ModelOpt 0.47 over transformers 5 leaves `rotary_base` out of config.json (its map reads `rope_theta`
    off the config object, which now lives in rope_parameters). TensorRT-LLM then rotates with LLaMAConfig's
    default, 10000, and so does the engine: SmolLM2's 100000 lost is what cost its AWQ export 7 % perplexity
    here. The tool reads the model's own base and writes it into a copy of the export for a fifth reading."""
    from toolchain.engine.cpu.config import parse_dims
    from tools.modelopt_awq_export import hf_rope_base, with_rope_base

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}))
    assert hf_rope_base(hf) == 100000.0
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    make_hf_model("LlamaForCausalLM", tmp_path / "src", **DIMS, num_hidden_layers=1)
    convert_checkpoint(tmp_path / "src", ckpt, tp=1, pp=1, dtype="float32")
    config = json.loads((ckpt / "config.json").read_text())
    del config["rotary_base"]  # as ModelOpt's export writes it
    (ckpt / "config.json").write_text(json.dumps(config))
    assert parse_dims(config, "config.json").rotary_base == 10000.0
    fixed = with_rope_base(ckpt, tmp_path / "fixed", hf_rope_base(hf))
    assert parse_dims(json.loads((fixed / "config.json").read_text()), "config.json").rotary_base == 100000.0
    assert (fixed / "rank0.safetensors").resolve() == (ckpt / "rank0.safetensors").resolve()
