"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): the family table and its refusals, the plan of the released model
(the MLA latent as its KV cache, 671B parameters), and the CPU engine (target llmapi-cpu's stand-in) against
transformers 5.25 in float32 at tp 1, tp 2, moe_ep 2 and pp 2, with the mechanisms each shown to matter: grouped
routing, the correction bias, YaRN's mscale, the interleaved rope and the latent cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import DEEPSEEK_V3_TINY, make_hf_model
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, make_engine_dir  # noqa: F401

from toolchain.archs import load_params
from toolchain.archs.common import NameTable
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError

ARCH = "DeepseekV3ForCausalLM"
# DeepSeek-V3's released config.json (the fields this toolchain reads; transformers 4 spelling: rope_theta beside a
# yarn rope_scaling), without its FP8 quantization_config.
RELEASED = {
    "architectures": [ARCH], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}
# The same in transformers 5's spelling (rope_parameters with the theta inside, dtype).
RELEASED_TF5 = {**{k: v for k, v in RELEASED.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")},
                "dtype": "bfloat16",
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1,
                                    "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "original_max_position_embeddings": 4096}}

# 3 layers: one dense, two mixtures of 8 experts in 4 groups (2 chosen), top-2; YaRN with mscale unlike
# mscale_all_dim so both its cos/sin factor and its softmax factor differ from 1.
TINY = {**DEEPSEEK_V3_TINY, "num_hidden_layers": 3}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.5, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
PROMPTS = [[1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], [1, 5, 9, 33, 200, 7, 7, 7, 8, 9, 10, 11, 12, 13]]
NEW = 10
# tp 4 with moe_ep 2: one head per rank, each expert's width over moe_tp 2, the shared expert over all 4
LAYOUTS = [(1, 1, {}), (2, 1, {}), (2, 1, {"moe_ep": 2}), (4, 1, {"moe_ep": 2}), (1, 2, {})]

_MODELS: dict = {}


def tiny(factory, name: str = "plain", **over) -> Path:
    key = ("hf", name)
    if key not in _MODELS:
        _MODELS[key] = make_hf_model(ARCH, factory.mktemp(f"hf-dsv3-{name}"), seed=21, **{**TINY, **over})
    return _MODELS[key]


def reference(path: Path):
    from transformers import AutoModelForCausalLM

    key = ("ref", str(path))
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # the engine runs with end_id -1
        _MODELS[key] = model
    return _MODELS[key]


def engine(factory, path: Path, tp: int = 1, pp: int = 1, **convert) -> CpuEngine:
    key = ("engine", str(path), tp, pp, json.dumps(convert, sort_keys=True))
    if key not in _MODELS:
        out = factory.mktemp(f"engine-dsv3-tp{tp}-pp{pp}")
        _MODELS[key] = CpuEngine.load(make_engine_dir(path, out, tp, pp, convert_kwargs=convert))
    return _MODELS[key]


# -- the family table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [RELEASED, RELEASED_TF5], ids=["rope_scaling", "rope_parameters"])
def test_released_config_normalises_in_both_spellings(cfg):
    family, p = load_params(copy.deepcopy(cfg))
    assert family.name == "deepseek_v3" and family.decoder.mla
    assert p.mla == {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128}
    assert (p.num_experts, p.top_k, p.expert_size, p.shared_expert_size, p.moe_normalization) == (
        256, 8, 2048, 2048, "renormalize")
    assert (p.head_size, p.num_key_value_heads, p.rope_theta) == (192, 128, 10000.0)
    assert p.rotary_scaling == {"type": "yarn", "rope_type": "yarn", "beta_fast": 32, "beta_slow": 1, "factor": 40,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    assert [p.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    extras = json.loads(p.extras_json or "{}")
    assert (extras["n_group"], extras["topk_group"], extras["routed_scaling_factor"], extras["rope_interleave"],
            extras["num_nextn_predict_layers"]) == (8, 4, 2.5, True, 1)


@pytest.mark.parametrize("over, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"q_lora_rank": None}, "q_lora_rank null"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"num_key_value_heads": 16}, "num_key_value_heads 16"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"n_group": 3}, "n_group 3"),
])
def test_what_the_family_refuses_in_one_line(over, message):
    with pytest.raises(ToolchainError, match=message) as err:
        load_params({**copy.deepcopy(RELEASED), **over})
    assert "\n" not in str(err.value)


def test_rows_follow_the_dense_and_moe_layers():
    _, p = load_params(copy.deepcopy(RELEASED))
    names = {n for n, _ in NameTable(load_params(RELEASED)[0], p).expected()}
    assert "model.layers.2.mlp.gate_proj.weight" in names and "model.layers.3.mlp.gate_proj.weight" not in names
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.2.mlp.gate.weight" not in names and "model.layers.60.mlp.experts.255.down_proj.weight" in names
    table = NameTable(load_params(RELEASED)[0], p)
    assert table.match("model.layers.3.mlp.gate_proj.weight") is None  # a dense MLP in a mixture layer
    # the multi-token-prediction layer (index num_hidden_layers) is dropped, a layer past it is not ours
    assert table.match("model.layers.61.eh_proj.weight").row.shard.value == "drop"
    assert table.match("model.layers.61.mlp.experts.3.up_proj.weight").row.trt is None
    assert table.match("model.layers.62.eh_proj.weight") is None


def test_quantization_and_the_engine_path_are_refused(tmp_path):
    from conftest import write_spec

    from toolchain.checks.preflight import build_context, run_checks
    from toolchain.spec import load_spec

    family, p = load_params(copy.deepcopy(RELEASED))
    assert family.quantization_refusal(p, "none", "none") is None
    assert "fp8" in family.quantization_refusal(p, "fp8", "none").why
    ckpt = tmp_path / "dsv3"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(RELEASED))
    for target, status in (("trtllm", "fail"), ("llmapi", None)):
        spec = load_spec(write_spec(tmp_path / f"{target}.yaml", ckpt, target=target, gpu={"name": "H200"},
                                    parallelism={"tp": 8, "moe_ep": 8}))
        results = {r.id: r for r in run_checks(build_context(spec, "plan"))}
        if status is None:
            assert "arch.engine-path" not in results
            continue
        got = results["arch.engine-path"]
        assert got.status == "fail" and "\n" not in got.message
        assert "set target: llmapi to serve DeepseekV3ForCausalLM" in got.message and "MODEL_MAP" in got.message


def test_convert_drops_the_mtp_layer(tmp_path_factory, tmp_path):
    """A checkpoint with its multi-token-prediction layer (as released: model.layers.{num_hidden_layers}.*) converts
    without it; a tensor of a layer past that is refused in one line."""
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(tiny(tmp_path_factory), hf)
    weights = load_file(hf / "model.safetensors")
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
           "model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(24, 64)}
    save_file({**weights, **mtp}, hf / "model.safetensors")
    (tmp_path / "ck").mkdir()
    config = convert_checkpoint(hf, tmp_path / "ck", tp=1, pp=1, dtype="float32", target="cpu")
    assert config["deepseek_v3"]["first_k_dense_replace"] == 1
    written = load_file(tmp_path / "ck" / "rank0.safetensors")
    assert not any(".layers.3." in n for n in written)
    assert written["transformer.layers.1.mlp.router.e_score_correction_bias"].dtype == torch.float32
    save_file({**weights, "model.layers.4.enorm.weight": torch.ones(64)}, hf / "model.safetensors")
    (tmp_path / "ck2").mkdir()
    with pytest.raises(ToolchainError, match="model.layers.4.enorm.weight"):
        convert_checkpoint(hf, tmp_path / "ck2", tp=1, pp=1, dtype="float32", target="cpu")


# -- the plan ------------------------------------------------------------------------------------------------


def released_dir(tmp_path: Path) -> Path:
    out = tmp_path / "deepseek-v3"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(RELEASED))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return out


@pytest.mark.parametrize("kv_cache, kv_bytes", [("none", 2), ("fp8", 1)])
def test_plan_kv_is_one_latent_per_layer_per_token_on_every_rank(tmp_path, kv_cache, kv_bytes):
    """DeepSeek-V3 at tp 8 on H200: (512 + 64) values x KV bytes x 61 layers per token on each rank, not heads x
    head_dim x 2 and not divided by tp (the PyTorch backend's SELFKONLY cache of one latent head)."""
    from test_plan_memory import plan, spec_for

    from toolchain.quant.view import Quantization

    spec = spec_for(tmp_path, released_dir(tmp_path), target="llmapi", gpu={"name": "H200"},
                    model={"dtype": "bfloat16"}, parallelism={"tp": 8, "moe_ep": 8})
    result = plan(spec, Quantization(kv_cache=kv_cache))
    assert [r.kv_bytes_per_token for r in result.ranks] == [(512 + 64) * kv_bytes * 61] * 8
    assert result.ranks[0].kv_bytes_per_token == {2: 70272, 1: 35136}[kv_bytes]


def test_plan_counts_671b_parameters():
    """The main model (MTP layer excluded: DeepSeek publishes 671B for it, 685B with the 14B MTP module): one
    byte per parameter at tp 1 counts them, less the float32 router and correction bias (4 bytes each)."""
    from toolchain.plan.memory import rank_weights
    from toolchain.quant.view import Quantization

    _, p = load_params(copy.deepcopy(RELEASED))
    total = rank_weights(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=1).total
    routers = 58 * (256 * 7168 + 256)
    params = total - 3 * routers
    attention = 1536 * 7168 + 128 * 192 * 1536 + 576 * 7168 + 128 * 256 * 512 + 7168 * 128 * 128 + 1536 + 512
    experts = (256 + 1) * 3 * 2048 * 7168
    expected = (61 * (attention + 2 * 7168) + 3 * 3 * 18432 * 7168 + 58 * (experts + 256 * 7168 + 256)
                + 2 * 129280 * 7168 + 7168)
    assert params == expected
    assert abs(params / 671e9 - 1) < 0.02, params


def test_plan_weights_per_rank_at_tp8_ep8():
    """Each of 8 ranks (moe_ep 8, so moe_tp 1): the latent projections whole, a sixteenth of q_b/kv_b/o_proj's heads,
    an eighth of the 3 dense MLPs, 32 of the 256 experts whole and an eighth of the shared expert in the 58 mixture
    layers, the float32 router and bias whole; the embedding whole and an eighth of the lm_head; bf16."""
    from toolchain.plan.memory import rank_weights
    from toolchain.quant.view import Quantization

    _, p = load_params(copy.deepcopy(RELEASED))
    w = rank_weights(p, tp=8, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=2, moe_ep=8)
    heads = 128 // 8
    attention = 1536 * 7168 + heads * 192 * 1536 + 576 * 7168 + heads * 256 * 512 + 7168 * heads * 128
    mixture = 2 * (32 * 3 * 2048 * 7168 + 3 * (2048 // 8) * 7168) + 4 * (256 * 7168 + 256)
    assert w.layers == 61 * 2 * attention + 3 * 2 * 3 * (18432 // 8) * 7168 + 58 * mixture
    assert w.norms == 2 * (61 * (2 * 7168 + 1536 + 512) + 7168)
    assert (w.embedding, w.lm_head) == (2 * 129280 * 7168, 2 * 129280 // 8 * 7168)


@pytest.mark.parametrize("par", [{"tp": 2}, {"tp": 2, "moe_ep": 2}, {"tp": 2, "pp": 2}])
def test_plan_bytes_are_what_convert_writes(tmp_path, capsys, par):
    """Each rank's checkpoint bytes in `toolchain plan` equal convert's dry run of the tiny model's config."""
    from test_plan_agrees_with_convert import model_dir, plan_json, spec_file

    from toolchain.checkpoint.convert import plan_any

    cfg = {"architectures": [ARCH], "vocab_size": 250, "hidden_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "max_position_embeddings": 512, "torch_dtype": "float16",
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **TINY, "num_hidden_layers": 4}
    ckpt = model_dir(tmp_path, "dsv3", cfg)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    rc, report = plan_json(tmp_path, spec_file(tmp_path, ckpt, target="llmapi", parallelism=par,
                                               gpu={"name": "H200"}), capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    tp, pp = par["tp"], par.get("pp", 1)
    dry = plan_any(ckpt, tp=tp, pp=pp, dtype="float16", target="trtllm", moe_ep=par.get("moe_ep"))
    assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(tp * pp)]


# -- the CPU engine against transformers ----------------------------------------------------------------------


def check(eng: CpuEngine, path: Path) -> None:
    ref = reference(path)
    for prompt in PROMPTS:
        torch.testing.assert_close(eng.forward_logits(prompt), hf_logits(ref, prompt), atol=1e-4, rtol=0)
        assert eng.generate(prompt, SamplingParams(max_new_tokens=NEW)) == hf_greedy(ref, prompt, NEW)


@pytest.mark.parametrize("tp, pp, convert", LAYOUTS, ids=["tp1", "tp2", "ep2", "tp4-ep2", "pp2"])
@pytest.mark.parametrize("name, over", [("plain", {}), ("yarn", {"rope_parameters": YARN, "max_position_embeddings": 512})],
                         ids=["rope", "yarn"])
def test_engine_matches_transformers(tmp_path_factory, tp, pp, convert, name, over):
    path = tiny(tmp_path_factory, name, **over)
    eng = engine(tmp_path_factory, path, tp, pp, **convert)
    assert (eng.dims.tp, eng.dims.pp, eng.dims.moe_ep) == (tp, pp, convert.get("moe_ep", 1))
    assert [layer.experts is not None for stage in eng.model.stages for layer in stage[0].layers] == [
        False, True, True]
    check(eng, path)


def test_rope_without_interleave(tmp_path_factory):
    path = tiny(tmp_path_factory, "halves", rope_interleave=False)
    check(engine(tmp_path_factory, path, 2, 1), path)


def test_the_kv_pool_holds_the_latent(tmp_path_factory):
    """One entry of kv_lora_rank + qk_rope_head_dim values per token, layer and rank, no V, not heads x head_dim x 2;
    and what it holds after a prompt is transformers' own cache: the normed latent and the rotated shared key."""
    path = tiny(tmp_path_factory)
    eng = engine(tmp_path_factory, path, 2, 1)
    m = eng.dims.mla
    latent = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    assert m is not None and m.latent_width == latent == 24
    assert eng.kv.k.shape[2:] == (eng.kv.capacity_tokens, 1, latent) and eng.kv.v.shape[-1] == 0
    assert eng.kv.bytes_per_token == 3 * 2 * latent * 4  # layers x tp ranks x latent x float32
    assert 2 * eng.dims.heads_per_rank * eng.dims.head_size == 96  # what per-head K and V would take

    from toolchain.engine.cpu.kv_cache import BlockTable

    prompt = PROMPTS[0]
    table = BlockTable()
    eng.kv.add_sequence(table, prompt, reuse=False)
    try:
        from toolchain.engine.cpu.model import Chunk

        with torch.no_grad():
            eng.model.forward([Chunk(table, prompt, logits=1)], eng.kv)
        slots = eng.kv.slots(table, 0, len(prompt))
        with torch.no_grad():
            cache = reference(path)(torch.tensor([prompt]), use_cache=True).past_key_values
        for layer in range(3):
            want = torch.cat([cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]], dim=-1)
            for rank in range(2):
                torch.testing.assert_close(eng.kv.k[layer, rank, slots, 0], want, atol=1e-5, rtol=0)
    finally:
        eng.kv.release(table)


# -- each mechanism matters -----------------------------------------------------------------------------------


def _max_logit_change(path: Path, change) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = torch.cat([hf_logits(model, p) for p in PROMPTS])
    with torch.no_grad():
        change(model)
    return float((torch.cat([hf_logits(model, p) for p in PROMPTS]) - base).abs().max())


def _routers(model):
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")
            and hasattr(layer.mlp.gate, "e_score_correction_bias")]


def test_grouped_routing_and_its_bias_matter(tmp_path_factory):
    """Transformers' own logits move far beyond the parity tolerance when the groups become one (plain top-k over
    every expert) or the correction bias is zeroed, so the engine's agreement above needs both."""
    path = tiny(tmp_path_factory)

    def plain_topk(model):
        for router in _routers(model):
            router.num_group, router.topk_group = 1, 1

    def no_bias(model):
        for router in _routers(model):
            router.e_score_correction_bias.zero_()

    assert _max_logit_change(path, plain_topk) > 1e-2
    assert _max_logit_change(path, no_bias) > 1e-2


def test_yarn_mscale_and_interleave_matter(tmp_path_factory):
    """The softmax factor YaRN's mscale_all_dim adds and the interleaved rope both change transformers' logits."""
    path = tiny(tmp_path_factory, "yarn", rope_parameters=YARN, max_position_embeddings=512)

    def no_softmax_factor(model):
        for layer in model.model.layers:
            layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5

    def halves(model):
        model.config.rope_interleave = False

    assert _max_logit_change(path, no_softmax_factor) > 1e-2
    assert _max_logit_change(path, halves) > 1e-2


def test_engine_refusals(tmp_path_factory, tmp_path):
    from toolchain.engine.cpu.config import read_engine_config

    path = tiny(tmp_path_factory)
    out = make_engine_dir(path, tmp_path, 2, 1)
    cfg = json.loads((out / "config.json").read_text())
    for edit, message in ((lambda c: c.pop("deepseek_v3"), "needs its 'deepseek_v3' section"),
                          (lambda c: c["quantization"].update(kv_cache_quant_algo="FP8"), "latent cache in float32"),
                          (lambda c: c.update(rotary_scaling={"type": "linear", "factor": 2.0}),
                           "rotary_scaling type 'linear'")):
        broken = copy.deepcopy(cfg)
        edit(broken["pretrained_config"])
        (out / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ToolchainError, match=message) as err:
            read_engine_config(out)
        assert "\n" not in str(err.value)


def test_the_llmapi_cpu_stand_in_serves_it(tmp_path_factory, tmp_path):
    """target llmapi-cpu's LLM(): convert and load with the LLM API's tensor and expert parallelism."""
    from toolchain.llmapi.cpu_llm import load_engine

    path = tiny(tmp_path_factory)
    eng, _, spec = load_engine({"model": str(path), "tensor_parallel_size": 2, "moe_expert_parallel_size": 2,
                                "max_batch_size": 2, "max_seq_len": 128}, tmp_path / "llm")
    assert (eng.dims.moe_tp, eng.dims.moe_ep, spec.target) == (1, 2, "cpu")
    assert eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=8)) == hf_greedy(reference(path), PROMPTS[1], 8)
