"""Llama 4 text (archs/llama4.py, engine/cpu/llama4.py): Scout planned from its config.json, the tiny model run by
the CPU engine at tp 1, tp 2 and moe_ep 2 against transformers' Llama4ForCausalLM in float32, each mechanism shown
to matter in transformers itself (so the parity could not hold with it missing), and the refusals. The
family's rows in the parity matrix (tp 1, tp 2, pp 2; bfloat16; the multimodal checkpoint's text part) are in
test_parity_families.py."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest
import torch
import yaml
from test_engine_cpu_util import _one_thread, hf_logits, load_engine  # noqa: F401
from test_parity_families import FP32_REF_ATOL, LLAMA4, NEW, PROMPTS, greedy, hf_dir, reference

from toolchain.archs import load_params
from toolchain.checkpoint.convert import plan_any, plan_checkpoint
from toolchain.cli import main
from toolchain.engine.cpu import SamplingParams
from toolchain.errors import ToolchainError
from toolchain.plan import memory as mem
from toolchain.quant.view import Quantization

FAMILY = "llama4-chunked-nope-moe"
# 11 tokens: three 4-token chunks, and positions up to 10 where the NoPE layer's query scale has grown to
# log1p(floor(11 / 2)) * 0.1 + 1 = 1.18
TEN = [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6]
assert len(TEN) > 2 * LLAMA4["attention_chunk_size"] and LLAMA4["no_rope_layers"].count(0) == 1

# Llama-4-Scout-17B-16E's text model as released (its text_config): 48 layers, every one a mixture of 16 experts
# (interleave_moe_layer_step 1) with the shared expert, every fourth layer NoPE, the others in 8192-token chunks.
SCOUT = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 5120,
         "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048, "num_local_experts": 16,
         "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
         "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)], "use_qk_norm": True, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": 10485760, "hidden_act": "silu",
         "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192},
         "torch_dtype": "bfloat16", "tie_word_embeddings": False, "eos_token_id": [200001, 200007, 200008]}
SCOUT_TOTAL, SCOUT_ACTIVE = 109e9, 17e9  # Llama-4-Scout-17B-16E's model card: 17B active, 109B total


# ---- plan ---------------------------------------------------------------------------------------------------------

def test_scout_parameters_match_the_published_size():
    _, p = load_params(SCOUT)
    assert p.is_moe and p.moe_layers == tuple(range(48)) and not p.has_dense_mlp
    assert (p.intermediate_size, p.expert_size, p.shared_expert_size) == (16384, 8192, 8192)
    weights = mem.rank_weights(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2)
    router_extra = 48 * 16 * 5120 * (mem.ROUTER_BYTES - 2)  # the router is planned float32
    total = (weights.total - router_extra) / 2
    idle_experts = 48 * (16 - 1) * 3 * 5120 * 8192  # all but the one routed expert per layer
    assert abs(total / SCOUT_TOTAL - 1) < 0.02, total
    assert abs((total - idle_experts) / SCOUT_ACTIVE - 1) < 0.02, total - idle_experts


def test_maverick_interleaves_dense_and_mixture_layers_in_the_plan():
    """Llama-4-Maverick-17B-128E (its text model as the notes describe it: 128 experts on every second layer,
    interleave_moe_layer_step 2, dense layers intermediate_size_mlp wide; the model card: 17B active, 400B total):
    the planner and the performance model count each layer as what it is."""
    from toolchain.plan.perf.step import stage_cost

    _, p = load_params({**SCOUT, "num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False})
    assert p.moe_layers == tuple(range(1, 48, 2)) and p.has_dense_mlp
    weights = mem.rank_weights(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2)
    total = (weights.total - 24 * 128 * 5120 * (mem.ROUTER_BYTES - 2)) / 2
    expert = 3 * 5120 * 8192
    assert abs(total / 400e9 - 1) < 0.02 and abs((total - 24 * 127 * expert) / 17e9 - 1) < 0.02, total
    cost = stage_cost(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2, kv_bytes=2)
    assert cost.experts == 128 and cost.expert_bytes == 24 * expert * 2
    attention = 2 * 5120 * 5120 + 2 * 5120 * 1024
    assert cost.gemm_flops == 2.0 * (48 * attention + 24 * 3 * 5120 * 16384  # the dense layers
                                     + 24 * (expert + 128 * 5120)  # one routed expert and the router
                                     + 24 * expert)  # the shared expert, ungated


def _scout_dir(tmp_path: Path, cfg: dict = SCOUT) -> Path:
    out = tmp_path / "scout"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_scout_plan_from_config_json_at_tp4(tmp_path, capsys):
    """`toolchain plan` from config.json alone on the LLM-API path: each rank's weights as convert would lay them
    out, and the KV cache of every layer at full length (2 x 48 layers x 2 KV heads x 128 x 2 bytes)."""
    spec = tmp_path / "scout.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "scout", "target": "llmapi", "model": {"checkpoint": str(_scout_dir(tmp_path)), "dtype": "bfloat16"},
        "gpu": {"name": "H100 80GB"}, "parallelism": {"tp": 4},
        "limits": {"max_batch_size": 8, "max_input_len": 8192, "max_seq_len": 16384, "max_num_tokens": 8192}}))
    main(["--root", str(tmp_path / "ws"), "plan", str(spec), "--json"])
    report = json.loads(capsys.readouterr().out)
    ranks = report["ranks"]
    assert [r["kv_bytes_per_token"] for r in ranks] == [2 * 48 * 2 * 128 * 2] * 4
    planned = plan_any(_scout_dir(tmp_path), tp=4, pp=1, dtype="bfloat16", target="cpu")
    assert [r["checkpoint_bytes"] for r in ranks] == [planned.rank_bytes(r) for r in range(4)]
    checks = {c["id"]: c["status"] for c in report["checks"]}
    assert checks["llmapi.architecture"] == "pass" and checks["memory.fits"] == "pass"


def test_scout_with_expert_parallelism_holds_a_quarter_of_the_experts(tmp_path):
    dense = plan_any(_scout_dir(tmp_path), tp=4, pp=1, dtype="bfloat16", target="cpu")
    ep = plan_any(_scout_dir(tmp_path), tp=4, pp=1, dtype="bfloat16", target="cpu", moe_tp=1, moe_ep=4)
    fc = {t.name: t.shape for t in ep.ranks[0]}["transformer.layers.0.mlp.fc.weight"]
    assert fc == (4, 2 * 8192, 5120)  # 4 of 16 experts, whole
    assert ep.rank_bytes(0) == dense.rank_bytes(0)  # the same bytes, cut the other way


def test_multimodal_config_plans_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration config.json nests the text model in text_config: planned the same."""
    outer = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
             "text_config": {k: v for k, v in SCOUT.items() if k not in ("architectures", "torch_dtype")},
             "vision_config": {"hidden_size": 1408}}
    causal = plan_any(_scout_dir(tmp_path), tp=2, pp=1, dtype="auto", target="cpu")
    mm_dir = tmp_path / "mm"
    mm_dir.mkdir()
    (mm_dir / "config.json").write_text(json.dumps(outer))
    multimodal = plan_any(mm_dir, tp=2, pp=1, dtype="auto", target="cpu")
    assert multimodal.params.dtype == "bfloat16"
    assert [multimodal.rank_bytes(r) for r in range(2)] == [causal.rank_bytes(r) for r in range(2)]


# ---- the CPU engine against transformers ----------------------------------------------------------------------------

@pytest.mark.parametrize("tp,moe_ep", [(1, None), (2, None), (2, 2)])
def test_parity_at_tp_and_expert_parallelism(tmp_path_factory, tp, moe_ep):
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    kw = {"convert_kwargs": {"moe_ep": moe_ep}} if moe_ep else {}
    engine = load_engine(tmp_path_factory, path, tp, 1, dtype="auto", **kw)
    d = engine.dims
    assert (d.tp, d.moe_ep, d.moe_layers, d.rope_interleaved) == (tp, moe_ep or 1, (1, 3), True)
    assert d.llama4 is not None and (d.llama4.chunk, d.llama4.rope_layers) == (4, (1, 1, 0, 1))
    held = [len(s.layers[1].experts.fc) for s in engine.model.stages[0]]
    assert held == [4 // (moe_ep or 1)] * tp and all(s.layers[0].experts is None for s in engine.model.stages[0])
    fp32 = reference(path, torch.float32)
    for prompt in (TEN, *PROMPTS):
        torch.testing.assert_close(engine.forward_logits(prompt), hf_logits(fp32, prompt), atol=FP32_REF_ATOL, rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW)) == greedy(path, prompt)


def _variant(model, edit) -> torch.Tensor:
    """transformers' logits of TEN with `edit` applied to a copy of the reference model."""
    other = copy.deepcopy(model)
    edit(other)
    return hf_logits(other, TEN)


def _attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def _no_chunks(model) -> None:
    model.config.layer_types = ["full_attention"] * len(model.model.layers)


def _no_tuning(model) -> None:
    for attn in _attentions(model):
        attn.attn_temperature_tuning = False


def _rotate_nope_layers(model) -> None:
    _no_tuning(model)  # transformers tunes only NoPE layers: compared against the untuned model below
    for attn in _attentions(model):
        attn.use_rope = 1


def _no_qk_norm(model) -> None:
    for attn in _attentions(model):
        if hasattr(attn, "qk_norm"):
            del attn.qk_norm


def _scores_on_output(model) -> None:
    """Llama4TextMoe with the router's scores applied to each expert's output instead of its input."""
    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(h)
        routed = self.experts(h.repeat(scores.shape[1], 1)).reshape(scores.shape[1], h.shape[0], -1)
        return self.shared_expert(h) + (routed * scores.transpose(0, 1)[..., None]).sum(dim=0), logits

    for layer in model.model.layers:
        if layer.is_moe_layer:
            layer.feed_forward.forward = types.MethodType(forward, layer.feed_forward)


@pytest.mark.parametrize("edit,base", [
    (_no_chunks, None),             # rope layers attending across chunks
    (_no_tuning, None),             # the NoPE layer's query left unscaled
    (_rotate_nope_layers, _no_tuning),  # the NoPE layer rotated (both without tuning, which only NoPE layers get)
    (_no_qk_norm, None),            # the rope layers' weightless q/k norm dropped
    (_scores_on_output, None),      # the router's sigmoid scaling the experts' output, not their input
], ids=["chunk-mask", "temperature-tuning", "nope-layers", "qk-norm", "router-on-input"])
def test_each_mechanism_moves_transformers_logits(tmp_path_factory, edit, base):
    """Parity at FP32_REF_ATOL could not hold with the mechanism missing: transformers' own logits move by more."""
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    model = reference(path, torch.float32)
    want = _variant(model, base) if base is not None else hf_logits(model, TEN)
    moved = (_variant(model, lambda m: edit(m)) - want).abs().max().item()
    assert moved > 100 * FP32_REF_ATOL, moved


def test_the_chunk_mask_is_what_the_engine_applies(tmp_path_factory, tmp_path):
    """The engine's rope layers see their own chunk only: its config without the chunk agrees with transformers
    without it, not with the chunked model."""
    import shutil

    from test_parity_families import engine_path

    from toolchain.engine.cpu import CpuEngine

    # (engine_path: the tp 2 engine of the parity matrix)
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    unchunked = tmp_path / "engine"
    shutil.copytree(engine_path(tmp_path_factory, path), unchunked)
    cfg = json.loads((unchunked / "config.json").read_text())
    cfg["pretrained_config"]["attention_chunk_size"] = None
    (unchunked / "config.json").write_text(json.dumps(cfg))
    got = CpuEngine.load(unchunked).forward_logits(TEN)
    model = reference(path, torch.float32)
    torch.testing.assert_close(got, _variant(model, _no_chunks), atol=FP32_REF_ATOL, rtol=0)
    assert (got - hf_logits(model, TEN)).abs().max().item() > 100 * FP32_REF_ATOL


# ---- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["trtllm", "cpu"])
def test_engine_path_refuses_in_one_line(tmp_path, capsys, target):
    spec = tmp_path / "scout.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "scout", "target": target, "model": {"checkpoint": str(_scout_dir(tmp_path)), "dtype": "bfloat16"},
        "parallelism": {"tp": 4}, **({"gpu": {"name": "H100 80GB"}} if target == "trtllm" else {}),
        "limits": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 2048}}))
    assert main(["--root", str(tmp_path / "ws"), "plan", str(spec), "--json"]) != 0
    check = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["id"] == "arch.engine-path")
    assert check["status"] == "fail" and "\n" not in check["message"]
    assert "no Llama 4 model" in check["message"] and check["message"].endswith("to serve Llama4ForCausalLM")
    assert ("set target: llmapi" if target == "trtllm" else "set target: llmapi-cpu") in check["message"]


@pytest.mark.parametrize("over,message", [
    ({"num_experts_per_tok": 2}, "num_experts_per_tok 2"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must hold 0 or 1 for each of the 48 layers"),
    ({"moe_layers": [0, 48]}, "moe_layers [0, 48] must name distinct layers"),
    ({"layer_types": ["full_attention"] * 48}, "layer_types"),
    ({"attention_chunk_size": 0}, "attention_chunk_size must be an integer >= 1"),
])
def test_config_refusals_are_one_line(over, message):
    with pytest.raises(ToolchainError) as err:
        load_params({**SCOUT, **over})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_quantization_refused_at_convert(tmp_path_factory):
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    with pytest.raises(ToolchainError, match=r"quantization int8_wo of Llama4ForCausalLM is not "
                                             r"supported yet") as err:
        plan_checkpoint(path, tp=1, pp=1, quantization=Quantization(method="int8_wo"))
    assert "\n" not in str(err.value)


def test_multimodal_checkpoint_skips_the_vision_tower(tmp_path_factory):
    path = hf_dir(tmp_path_factory, "llama4-multimodal-text", "float32")
    plan = plan_checkpoint(path, tp=2, pp=1)
    assert plan.dropped and all(n.startswith(("vision_model.", "multi_modal_projector.")) for n in plan.dropped)
    text = plan_checkpoint(hf_dir(tmp_path_factory, FAMILY, "float32"), tp=2, pp=1)
    assert [t.name for t in plan.ranks[1]] == [t.name for t in text.ranks[1]]
