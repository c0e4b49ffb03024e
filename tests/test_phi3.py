"""Phi-3 (Phi3ForCausalLM): the fused HF projections laid out per rank value by value, the checkpoint
config.json TensorRT-LLM's Phi3Config reads, longrope on the CPU engine against transformers at tp 1,
tp 2 and pp 2, quantized Phi-3 against the same weights converted as Llama, and the refusals.

The plain family (no longrope) runs in the parity matrix of test_parity_families.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, load_engine  # noqa: F401

from toolchain.archs import load_params
from toolchain.checkpoint import sharding
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.engine.cpu.rope import Rotary
from toolchain.errors import ToolchainError
from toolchain.quant.view import Quantization

ORIGINAL = 24  # original_max_position_embeddings of the tiny longrope model
SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]  # head_size 16 -> 8 factors
LONG = [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]
LONGROPE = dict(max_position_embeddings=131072, original_max_position_embeddings=ORIGINAL,
                rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
NEW = 12
# Below original_max_position_embeddings to the end (short factors throughout), and past it from the
# first token (long factors throughout): transformers and the engine pick the same table at every step.
SHORT_PROMPT = [1, 5, 9, 33, 200, 7]
LONG_PROMPT = [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7, 8, 9, 10, 11, 12, 13, 50, 60, 70, 80, 90, 100,
               110, 120, 130, 140]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    return make_hf_model("Phi3ForCausalLM", tmp_path_factory.mktemp("hf-phi3"), seed=21, pad_token_id=0)


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory) -> Path:
    return make_hf_model("Phi3ForCausalLM", tmp_path_factory.mktemp("hf-phi3-long"), seed=22, pad_token_id=0,
                         **LONGROPE)


@pytest.fixture(scope="module")
def phi3_wide(tmp_path_factory) -> Path:
    """Wide enough for per-group int4 with group 64 at tp 2 (hidden and widths multiples of 128)."""
    return make_hf_model("Phi3ForCausalLM", tmp_path_factory.mktemp("hf-phi3-wide"), seed=23, pad_token_id=0,
                         hidden_size=128, intermediate_size=256)


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_fused_projections_are_split_per_rank_value_by_value(phi3, tmp_path):
    cfg = convert_checkpoint(phi3, tmp_path, tp=2, pp=1, dtype="float32", target="cpu")
    assert cfg["architecture"] == "Phi3ForCausalLM"
    assert (cfg["hidden_act"], cfg["rotary_pct"], cfg["rotary_scaling"]) == ("swiglu", 1.0, None)
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and "longrope_scaling_short_factors" not in cfg
    hf = load_file(str(phi3 / "model.safetensors"))
    qkv, gate_up = hf["model.layers.1.self_attn.qkv_proj.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 32, 32])  # 4 heads and 2 KV heads of 16
    gate, up = gate_up.chunk(2)  # HF Phi3MLP: gate first, up second
    for r in range(2):
        rank = load_file(str(tmp_path / f"rank{r}.safetensors"))
        assert "transformer.layers.1.mlp.gate.weight" not in rank
        want_qkv = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(rank["transformer.layers.1.attention.qkv.weight"], want_qkv)
        # swiglu = silu(second half) * first half: [up_r; gate_r] pairs every up row with its own gate row
        want_fc = torch.cat([up.chunk(2)[r], gate.chunk(2)[r]])
        assert torch.equal(rank["transformer.layers.1.mlp.fc.weight"], want_fc)
        assert torch.equal(rank["transformer.layers.1.mlp.proj.weight"],
                           hf["model.layers.1.mlp.down_proj.weight"].chunk(2, dim=1)[r])


def test_gated_fc_at_tp1_is_upstreams_swapped_halves():
    t = torch.arange(8.0).reshape(4, 2)  # [gate; up], I = 2
    (fc,) = sharding.split_gated_fc(t, 1)
    assert torch.equal(fc, torch.cat([t[2:], t[:2]]))  # convert.py: torch.cat((second_half, first_half))


def test_longrope_config_is_what_phi3config_writes(phi3_longrope, tmp_path):
    cfg = convert_checkpoint(phi3_longrope, tmp_path, tp=1, pp=1, dtype="float32", target="cpu")
    assert cfg["position_embedding_type"] == "long_rope" and cfg["rotary_scaling"] is None
    assert cfg["original_max_position_embeddings"] == ORIGINAL and cfg["max_position_embeddings"] == 131072
    assert cfg["longrope_scaling_short_factors"] == SHORT and cfg["longrope_scaling_long_factors"] == LONG


def test_longrope_tables_differ_past_the_original_length():
    rot = Rotary(16, 10000.0, {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                               "original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 131072})
    pos = torch.tensor([5, 5])
    cos, _ = rot.tables(pos, torch.tensor([ORIGINAL, ORIGINAL + 1]))
    assert not torch.allclose(cos[0], cos[1])  # same position, short vs long table
    assert rot.scale == pytest.approx((1 + torch.log(torch.tensor(131072 / ORIGINAL)).item()
                                       / torch.log(torch.tensor(float(ORIGINAL))).item()) ** 0.5)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_longrope_matches_transformers(tmp_path_factory, phi3_longrope, tp, pp):
    engine = load_engine(tmp_path_factory, phi3_longrope, tp, pp, dtype="auto")
    assert engine.dims.rotary_scaling["type"] == "longrope"
    ref = _hf(phi3_longrope)
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        torch.testing.assert_close(engine.forward_logits(prompt), hf_logits(ref, prompt), atol=1e-4, rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW)) == hf_greedy(ref, prompt, NEW)
    assert len(SHORT_PROMPT) + NEW <= ORIGINAL < len(LONG_PROMPT)


def _as_llama(phi3: Path, out: Path) -> Path:
    """The same weights as a LlamaForCausalLM checkpoint: q/k/v and gate/up unfused."""
    cfg = json.loads((phi3 / "config.json").read_text())
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = hidden // heads
    tensors = {}
    for name, t in load_file(str(phi3 / "model.safetensors")).items():
        if name.endswith("qkv_proj.weight"):
            for part, piece in zip("qkv", t.split([heads * hd, kv * hd, kv * hd]), strict=True):
                tensors[name.replace("qkv_proj", f"{part}_proj")] = piece.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            tensors[name] = t
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    llama = {k: v for k, v in cfg.items() if k not in ("sliding_window", "original_max_position_embeddings",
                                                        "resid_pdrop", "embd_pdrop", "attention_dropout")}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (out / "config.json").write_text(json.dumps(llama))
    return out


@pytest.mark.parametrize("method", ["fp8", "awq", "smoothquant", "int8_wo", "int4_wo"])
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_phi3_runs_as_the_same_weights_as_llama(phi3_wide, tmp_path, method, tp):
    phi3 = phi3_wide
    llama = _as_llama(phi3, tmp_path / "llama")
    recipe = Quantization(method=method, group_size=64)
    calibration = [torch.randint(0, 250, (32,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    engines = []
    for name, hf in (("phi3", phi3), ("llama", llama)):
        ckpt, engine = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-engine"
        ckpt.mkdir()
        engine.mkdir()
        cfg = convert_checkpoint(hf, ckpt, tp=tp, pp=1, dtype="float32", target="cpu", quantization=recipe,
                                 calibration=calibration)
        build = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 128,
                 "max_beam_width": 1}
        (engine / "config.json").write_text(json.dumps({"version": "test", "target": "cpu",
                                                        "pretrained_config": cfg, "build_config": build}))
        for r in range(tp):
            (engine / f"rank{r}.safetensors").write_bytes((ckpt / f"rank{r}.safetensors").read_bytes())
        engines.append(CpuEngine.load(engine))
    assert engines[0].config["pretrained_config"]["quantization"]["quant_algo"] == \
        engines[1].config["pretrained_config"]["quantization"]["quant_algo"]
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        torch.testing.assert_close(engines[0].forward_logits(prompt), engines[1].forward_logits(prompt),
                                   atol=1e-4, rtol=0)
        assert engines[0].generate(prompt, SamplingParams(max_new_tokens=8)) == \
            engines[1].generate(prompt, SamplingParams(max_new_tokens=8))


def _cfg(**over) -> dict:
    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 250, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "hidden_act": "silu"}
    return {**base, **over}


@pytest.mark.parametrize("over,message", [
    (dict(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG}), "only from 128000"),
    (dict(max_position_embeddings=131072, rope_scaling={"type": "longrope", "short_factor": SHORT[:3],
                                                        "long_factor": LONG}), "list of 8 positive"),
    (dict(max_position_embeddings=131072, rope_scaling={"type": "longrope", "short_factor": SHORT,
                                                        "long_factor": LONG, "attention_factor": 1.2}),
     "attention_factor"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear'"),
    (dict(hidden_act="gelu"), "swiglu"),
    (dict(partial_rotary_factor=0.75), "partial_rotary_factor"),
])
def test_refused_in_one_line(over, message):
    with pytest.raises(ToolchainError, match=message) as err:
        load_params(_cfg(**over))
    assert "\n" not in str(err.value.args[0])


@pytest.mark.parametrize("window,expected", [(None, None), (2047, 2047), (262144, None)])
def test_sliding_window_travels_as_the_attention_window(window, expected):
    _, params = load_params(_cfg(sliding_window=window))
    assert params.sliding_window == expected


def test_llmapi_path_refuses_tp2_and_quantization():
    family, params = load_params(_cfg())
    assert family.llmapi_refusal(params, 1, False) is None
    assert "tp 2" in family.llmapi_refusal(params, 2, False)
    assert "quantized on the LLM-API path" in family.llmapi_refusal(params, 1, True)


def test_prequantized_phi3_is_refused_in_one_line(phi3, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    cfg = json.loads((phi3 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64}
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").write_bytes((phi3 / "model.safetensors").read_bytes())
    (tmp_path / "ck").mkdir()
    with pytest.raises(ToolchainError, match="pre-quantized Phi3ForCausalLM checkpoint"):
        convert_checkpoint(src, tmp_path / "ck", tp=1, pp=1, dtype="float32", target="cpu")


def test_llmapi_cpu_stand_in_serves_phi3_at_tp1_with_transformers_tokens(phi3_longrope, tmp_path):
    """The LLM-API path takes the HF checkpoint as it is; its CPU stand-in (CpuLLM) runs Phi-3 with longrope."""
    import shutil
    import threading

    from triton_helpers import make_tiny_tokenizer

    from toolchain.llmapi.cpu_llm import CpuLLM
    from toolchain.llmapi.cpu_llm import SamplingParams as LlmParams

    hf = tmp_path / "hf"
    shutil.copytree(phi3_longrope, hf)
    make_tiny_tokenizer(hf)
    with CpuLLM(model=str(hf), backend="pytorch", tensor_parallel_size=1, max_batch_size=2, max_seq_len=128,
                max_num_tokens=128, kv_cache_config={"max_tokens": 512}, work_dir=tmp_path / "work") as llm:
        for prompt in (SHORT_PROMPT, LONG_PROMPT):
            text = " ".join(llm.tokenizer.decode([t]) for t in prompt[1:])
            ids = llm.encode(text)
            done, seen = threading.Event(), []

            def on_output(out, seen=seen, done=done):
                if out.finished:
                    seen.append(list(out.outputs[0].token_ids))
                    done.set()

            llm.generate_async(text, LlmParams.from_kwargs({"max_tokens": NEW, "ignore_eos": True, "top_k": 1}),
                               False, on_output=on_output)
            assert done.wait(60)
            assert seen[0] == hf_greedy(_hf(phi3_longrope), ids, NEW)
