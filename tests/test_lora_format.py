"""PEFT adapters into TensorRT-LLM's converted LoRA format (checkpoint/lora.py): the files hf_lora_convert.py
writes, read back against PEFT's own merged model, cut per TP rank as the C++ LoRA cache does, and every
adapter TensorRT-LLM would read differently from PEFT refused in one line.

The adapters are made here by PEFT itself on a tiny Llama built by transformers (GQA, so k/v are narrower)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from toolchain.checkpoint.lora import (
    CONFIG_FILE,
    LLAMA_HF_TO_TRTLLM,
    LORA_MODULE_IDS,
    WEIGHTS_FILE,
    convert_adapter,
    module_dims,
    read_converted,
    shard,
)
from toolchain.errors import ToolchainError

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 32, 48, 4, 2, 2
DIMS = module_dims(HIDDEN, INTER, HEADS, KV_HEADS, HIDDEN // HEADS)
ATTN = ["q_proj", "v_proj"]
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRT_TO_HF = {trt: hf for hf, trt in LLAMA_HF_TO_TRTLLM.items()}


def make_adapter(out: Path, targets: list[str], *, seed: int = 0, **lora) -> tuple[dict, dict]:
    """Save a random PEFT adapter on a tiny Llama to `out`; return the base and the merged state dicts."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    settings = {"init_lora_weights": False, "r": 4, "lora_alpha": 8, "target_modules": targets, **lora}
    peft_model = get_peft_model(model, LoraConfig(**settings))
    peft_model.save_pretrained(out)
    merged = peft_model.merge_and_unload().state_dict()
    return base, merged


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for name, targets, extra in (("attn", ATTN, {}), ("every", EVERY, {}), ("rslora", EVERY, {"use_rslora": True})):
        base, merged = make_adapter(root / name, targets, seed=len(made), **extra)
        made[name] = (root / name, base, merged)
    return made


def hf_weight(layer: int, module: str) -> str:
    hf = TRT_TO_HF[module]
    return f"model.layers.{layer}.{'self_attn' if hf.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{hf}.weight"


def test_files_are_hf_lora_convert_layout(adapters, tmp_path):
    adapter = adapters["attn"][0]
    convert_adapter(adapter, tmp_path)  # float16, hf_lora_convert.py's default storage type
    weights, keys = np.load(tmp_path / WEIGHTS_FILE), np.load(tmp_path / CONFIG_FILE)
    # q_proj: A [4, 32] + B [32, 4] = 256 values; v_proj (2 KV heads x 8): A [4, 32] + B [16, 4] = 192, padded to 256.
    assert weights.dtype == np.float16 and weights.shape == (1, 2 * LAYERS, 256)
    assert keys.dtype == np.int32 and keys.shape == (1, 2 * LAYERS, 3)
    assert sorted(map(tuple, keys[0].tolist())) == sorted(
        (LORA_MODULE_IDS[m], layer, 4) for layer in range(LAYERS) for m in ("attn_q", "attn_v"))
    peft = load_file(str(adapter / "adapter_model.safetensors"))
    for row, (module_id, layer, _rank) in zip(weights[0], keys[0].tolist(), strict=True):
        hf = "q_proj" if module_id == LORA_MODULE_IDS["attn_q"] else "v_proj"
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{hf}"
        a, b = peft[f"{prefix}.lora_A.weight"], peft[f"{prefix}.lora_B.weight"]
        expected = torch.cat([a.half().flatten(), (b * 2.0).half().flatten()]).numpy()  # alpha / r = 8 / 4
        np.testing.assert_array_equal(row[: len(expected)], expected)
        assert not row[len(expected):].any()

    convert_adapter(adapters["every"][0], tmp_path / "every", dtype="float32")
    weights, keys = np.load(tmp_path / "every" / WEIGHTS_FILE), np.load(tmp_path / "every" / CONFIG_FILE)
    # gate/up: 4*32 + 48*4 = 320 = down: 4*48 + 32*4, the longest rows.
    assert weights.dtype == np.float32 and weights.shape == (1, 7 * LAYERS, 320)
    assert {int(m) for m in keys[0, :, 0]} == {LORA_MODULE_IDS[LLAMA_HF_TO_TRTLLM[m]] for m in EVERY}
    # The default HF map's Llama MLP names: gate_proj is mlp_h_to_4h, up_proj mlp_gate.
    assert LLAMA_HF_TO_TRTLLM["gate_proj"] == "mlp_h_to_4h" and LORA_MODULE_IDS["mlp_h_to_4h"] == 5
    assert LLAMA_HF_TO_TRTLLM["up_proj"] == "mlp_gate" and LORA_MODULE_IDS["mlp_gate"] == 7


@pytest.mark.parametrize("name,targets", [("attn", ATTN), ("every", EVERY), ("rslora", EVERY)])
def test_read_back_matches_peft_merged_model(adapters, tmp_path, name, targets):
    adapter, base, merged = adapters[name]
    converted = read_converted(convert_adapter(adapter, tmp_path, dtype="float32"), DIMS, num_layers=LAYERS)
    assert set(converted) == {(layer, LLAMA_HF_TO_TRTLLM[m]) for layer in range(LAYERS) for m in targets}
    x = torch.randn(5, INTER, generator=torch.Generator().manual_seed(1))
    for (layer, module), (a, b) in converted.items():
        d_in, d_out = DIMS[module]
        assert a.shape == (4, d_in) and b.shape == (d_out, 4) and a.dtype == b.dtype == torch.float32
        key, inputs = hf_weight(layer, module), x[:, :d_in]
        ours = inputs @ base[key].T + inputs @ a.T @ b.T
        assert not torch.equal(merged[key], base[key])  # the adapter really changes this module
        torch.testing.assert_close(ours, inputs @ merged[key].T, atol=1e-5, rtol=0)


def test_rslora_scale_is_alpha_over_sqrt_rank(adapters, tmp_path):
    adapter = adapters["rslora"][0]
    converted = read_converted(convert_adapter(adapter, tmp_path, dtype="float32"), DIMS)
    peft = load_file(str(adapter / "adapter_model.safetensors"))
    b = peft["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(converted[(1, "mlp_4h_to_h")][1], b * 4.0, atol=0, rtol=0)  # 8 / sqrt(4)


@pytest.mark.parametrize("module", ["attn_q", "attn_k", "mlp_h_to_4h", "attn_dense", "mlp_4h_to_h"])
def test_tp2_shards_recompose_the_full_delta(adapters, tmp_path, module):
    converted = read_converted(convert_adapter(adapters["every"][0], tmp_path, dtype="float32"), DIMS)
    a, b = converted[(0, module)]
    x = torch.randn(3, a.shape[1], generator=torch.Generator().manual_seed(2))
    full = x @ a.T @ b.T
    parts = [shard(a, b, module, 2, rank) for rank in range(2)]
    if module in ("attn_dense", "mlp_4h_to_h"):  # row-parallel: each rank sees its block of the input; sum
        block = a.shape[1] // 2
        assert all(pa.shape == (4, block) and pb.shape == b.shape for pa, pb in parts)
        recomposed = sum(x[:, r * block: (r + 1) * block] @ pa.T @ pb.T for r, (pa, pb) in enumerate(parts))
    else:  # column-parallel: each rank writes its block of the output; concatenate
        assert all(pa.shape == a.shape and pb.shape == (b.shape[0] // 2, 4) for pa, pb in parts)
        recomposed = torch.cat([x @ pa.T @ pb.T for pa, pb in parts], dim=-1)
    torch.testing.assert_close(recomposed, full, atol=1e-5, rtol=0)
    assert not torch.equal(parts[0][0 if module in ("attn_dense", "mlp_4h_to_h") else 1],
                           parts[1][0 if module in ("attn_dense", "mlp_4h_to_h") else 1])


def one_line(error: pytest.ExceptionInfo, *words: str) -> None:
    text = str(error.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_tp_that_does_not_split_is_refused(adapters, tmp_path):
    converted = read_converted(convert_adapter(adapters["every"][0], tmp_path, dtype="float32"), DIMS)
    with pytest.raises(ToolchainError) as e:
        shard(*converted[(0, "attn_k")], "attn_k", 3, 0)  # k out dim 16
    one_line(e, "attn_k", "out dim 16", "tp 3")
    with pytest.raises(ToolchainError) as e:
        shard(*converted[(0, "mlp_4h_to_h")], "mlp_4h_to_h", 5, 0)  # down in dim 48
    one_line(e, "mlp_4h_to_h", "in dim 48", "tp 5")


@pytest.mark.parametrize("edit,words", [
    ({"bias": "all"}, ["bias='all'"]),
    ({"bias": "lora_only"}, ["bias='lora_only'"]),
    ({"lora_bias": True}, ["lora_bias"]),
    ({"use_dora": True}, ["DoRA"]),
    ({"modules_to_save": ["score"]}, ["modules_to_save ['score']"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save ['lm_head']", "per-request"]),
    ({"target_modules": ["q_proj", "qkv_proj"]}, ["['qkv_proj']", "no TensorRT-LLM LoRA module"]),
    ({"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_up_proj"]}, ["['gate_up_proj']"]),
    ({"rank_pattern": {"q_proj": 2}}, ["rank_pattern"]),
    ({"alpha_pattern": {"q_proj": 2}}, ["alpha_pattern"]),
    ({"fan_in_fan_out": True}, ["fan_in_fan_out"]),
    ({"r": 0}, ["r=0"]),
])
def test_config_refusals_are_one_line(adapters, tmp_path, edit, words):
    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["attn"][0], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ToolchainError) as e:
        convert_adapter(adapter, tmp_path / "out")
    one_line(e, *words)
    assert not (tmp_path / "out").exists()


PREFIX = "base_model.model.model.layers.0.self_attn"


@pytest.mark.parametrize("change,words", [
    (lambda t: t.update({f"{PREFIX}.q_proj.lora_B.bias": torch.zeros(32)}), ["q_proj.lora_B.bias", "not a LoRA A/B"]),
    (lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(64, 32)}), ["lm_head.weight"]),
    (lambda t: t.update({f"{PREFIX}.rotary.lora_A.weight": torch.zeros(4, 32),
                         f"{PREFIX}.rotary.lora_B.weight": torch.zeros(32, 4)}), ["rotary", "no TensorRT-LLM LoRA module"]),
    (lambda t: t.pop(f"{PREFIX}.v_proj.lora_B.weight"), ["layer 0 attn_v has only lora_A"]),
    (lambda t: t.update({f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(8, 32)}), ["lora_A [8, 32]", "rank 4"]),
])
def test_weight_refusals_are_one_line(adapters, tmp_path, change, words):
    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["attn"][0], adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ToolchainError) as e:
        convert_adapter(adapter, tmp_path / "out")
    one_line(e, *words)


def test_dora_adapter_made_by_peft_is_refused(tmp_path):
    make_adapter(tmp_path / "dora", ATTN, use_dora=True)
    with pytest.raises(ToolchainError) as e:
        convert_adapter(tmp_path / "dora", tmp_path / "out")
    one_line(e, "use_dora=true")


def test_missing_files_and_bfloat16_are_refused(adapters, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["attn"][0], adapter)
    with pytest.raises(ToolchainError) as e:
        convert_adapter(adapter, tmp_path / "out", dtype="bfloat16")
    one_line(e, "'bfloat16'")
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(ToolchainError) as e:
        convert_adapter(adapter, tmp_path / "out")
    one_line(e, "no adapter_model.safetensors", "found adapter_model.bin")
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(ToolchainError) as e:
        convert_adapter(adapter, tmp_path / "out")
    one_line(e, "no adapter_config.json")


def test_read_converted_refuses_as_the_runtime_does(adapters, tmp_path):
    converted = convert_adapter(adapters["attn"][0], tmp_path, dtype="float32")
    bigger = module_dims(64, 96, 4, 2, 16)  # an adapter for another (smaller) base
    with pytest.raises(ToolchainError) as e:
        read_converted(converted, bigger)
    one_line(e, "lora_weights has to few values for attn_q")
    with pytest.raises(ToolchainError) as e:
        read_converted(converted, {"attn_q": DIMS["attn_q"]})
    one_line(e, "lora module attn_v not enabled for this model")
    with pytest.raises(ToolchainError) as e:
        read_converted(converted, DIMS, num_layers=1)
    one_line(e, "Expected layerId to be in the range [0, numModelLayers)")
    np.save(tmp_path / CONFIG_FILE, np.load(tmp_path / CONFIG_FILE)[0])
    with pytest.raises(ToolchainError) as e:
        read_converted(converted, DIMS)
    one_line(e, "Expected batch dimension to be 1")
