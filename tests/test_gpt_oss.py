"""gpt-oss (GptOssForCausalLM, archs/gpt_oss.py): its config normalised from both spellings, its refusals, the
planner's bytes for gpt-oss-120b, and the CPU stand-in's logits and greedy tokens against transformers float32 at
tp 1, tp 2 and moe_ep 2. Each mechanism is shown to matter: with the sinks zeroed, the clamp limit raised, the
window removed or YaRN dropped, transformers' own logits move by more than the parity tolerance, so parity could
not pass with the mechanism missing from the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, make_engine_dir  # noqa: F401

from toolchain.archs import get_family, load_params
from toolchain.archs.common import NameTable, Shard
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.errors import ToolchainError

ATOL = 1e-4
NEW = 12
# 11 and 14 tokens: both cross the 4-token window of layer 0; the second repeats tokens so a missing sink or
# window shows on attention spread over equal keys too.
PROMPTS = [[1, 5, 9, 33, 200, 7, 8, 100, 3, 44, 12], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7]]
EXPERTS, TOP_K, WIDTH, WINDOW, LIMIT = 4, 2, 48, 4, 1.0
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}  # x 8 = max_position_embeddings
CONFIGS = Path(__file__).resolve().parents[1] / "build" / "configs"


def make_gpt_oss(out: Path, seed: int = 21, **over) -> Path:
    """A tiny random GptOssForCausalLM in float32: hidden 64, expert width 48 (not hidden / 2, so a [E, H, 2I] vs
    [E, 2I, H] mix-up shows), 4 experts top-2, 2 layers (0 sliding with a 4-token window, 1 full), GQA 4/2 of
    head_dim 16, swiglu_limit 1.0 so the clamp bites. The sinks and every bias are randomised: transformers
    initialises the expert biases to zeros and the sinks from torch.empty / a 0.02 normal."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{
        "vocab_size": 250, "hidden_size": 64, "intermediate_size": WIDTH, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "sliding_window": WINDOW, "swiglu_limit": LIMIT, "rope_parameters": YARN,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, **over})
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
            elif param.dim() >= 2:
                param.mul_(4.0)
            else:  # RMSNorm weights
                param.copy_(1.0 + 0.25 * torch.randn_like(param))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    return make_gpt_oss(tmp_path_factory.mktemp("hf-gpt-oss"))


@pytest.fixture(scope="module")
def reference(hf_gpt_oss):
    return _reference(hf_gpt_oss)


def _reference(path: Path, **config_over):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for key, value in config_over.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with end_id -1
    return model


def released_cfg(**over) -> dict:
    """gpt-oss-120b's config.json as released (rope_scaling / rope_theta, transformers 4.55), less its MXFP4
    quantization_config (issue 35): build/configs/gpt-oss-120b."""
    cfg = json.loads((CONFIGS / "gpt-oss-120b" / "config.json").read_text())
    cfg.pop("quantization_config")  # its MXFP4 experts: tests/test_gpt_oss_mxfp4.py
    return {k: v for k, v in {**cfg, **over}.items() if v is not None}


def bf16_120b(tmp_path: Path) -> Path:
    """A config-only gpt-oss-120b in bfloat16: the released config.json less its quantization_config."""
    out = tmp_path / "gpt-oss-120b-bf16"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(released_cfg(torch_dtype="bfloat16")))
    return out


# -- the table and its parameters ---------------------------------------------------------------------------

def test_both_config_spellings_normalise_alike(hf_gpt_oss):
    """transformers 5's save_pretrained (rope_parameters with rope_theta inside, layer_types, swiglu_limit) and the
    released form (rope_scaling and rope_theta, experts_per_token) give the same parameters."""
    tf5 = json.loads((hf_gpt_oss / "config.json").read_text())
    assert "rope_parameters" in tf5 and "rope_scaling" not in tf5
    rope = {k: v for k, v in tf5["rope_parameters"].items() if k != "rope_theta"}
    released = {k: v for k, v in tf5.items() if k not in ("rope_parameters", "layer_types")}
    released.update(rope_scaling=rope, rope_theta=150000, experts_per_token=TOP_K)
    del released["num_experts_per_tok"]
    family, p = load_params(tf5)
    assert load_params(released)[1] == p
    assert family.name == "gpt_oss"
    assert (p.num_experts, p.top_k, p.expert_size, p.moe_normalization) == (EXPERTS, TOP_K, WIDTH, "renormalize")
    assert p.attention_bias and p.sliding_window is None and p.layer_windows == (WINDOW, 512)
    assert p.rotary_scaling == {"type": "yarn", "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
    assert json.loads(p.extras_json)["swiglu_limit"] == LIMIT


def test_released_120b_config():
    """gpt-oss-120b: 128 experts top-4 of width 2880, even layers sliding over 128 tokens, YaRN x32 from 4096."""
    _, p = load_params(released_cfg())
    assert (p.num_experts, p.top_k, p.expert_size, p.num_hidden_layers, p.num_key_value_heads) == (128, 4, 2880, 36, 8)
    assert p.layer_windows == (128, 131072) * 18 and p.rope_theta == 150000
    assert p.rotary_scaling["factor"] == 32.0 and p.rotary_scaling["truncate"] is False
    extras = json.loads(p.extras_json)
    assert (extras["swiglu_alpha"], extras["swiglu_limit"]) == (1.702, 7.0)


def test_rows_read_fused_experts_and_sinks(hf_gpt_oss):
    family, p = load_params(json.loads((hf_gpt_oss / "config.json").read_text()))
    table = NameTable(family, p)
    shards = {n: m.row.shard for n, m in table.expected()}
    assert shards["model.layers.1.mlp.experts.gate_up_proj"] is Shard.STACKED_GATE_UP
    assert shards["model.layers.1.mlp.experts.down_proj_bias"] is Shard.STACKED_DOWN
    assert table.match("model.layers.0.self_attn.sinks").row.dtype == "float32"
    assert table.match("model.layers.0.mlp.router.bias").row.dtype == "float32"
    # per layer: q/k/v/o weights and biases, sinks, 2 norms, router weight and bias, 4 expert tensors
    assert len(table.expected()) == 2 * (8 + 1 + 2 + 2 + 4) + 3


@pytest.mark.parametrize("over,message", [
    ({"layer_types": ["full_attention", "sliding_attention"] * 18}, "layer_types other than sliding on even layers"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types must list"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "with rope scaling"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok 200 exceeds num_local_experts 128"),
    ({"swiglu_limit": -1}, "swiglu_limit must be a positive number"),
])
def test_config_refusals(over, message):
    with pytest.raises(ToolchainError, match=message):
        load_params(released_cfg(**over))


def test_null_window_is_refused():
    """transformers cannot run sliding layers without a window; neither is it guessed here."""
    cfg = released_cfg()
    cfg["sliding_window"] = None
    with pytest.raises(ToolchainError, match="sliding_window null"):
        load_params(cfg)


# -- refusals, one line each --------------------------------------------------------------------------------

def _checks(tmp_path, target, parallelism):
    from conftest import write_spec

    from toolchain.checks.preflight import build_context, run_checks
    from toolchain.spec import load_spec

    spec = load_spec(write_spec(tmp_path / "spec.yaml", CONFIGS / "gpt-oss-120b", target=target,
                                gpu={"name": "H200"}, parallelism=parallelism))
    return {r.id: r for r in run_checks(build_context(spec, "plan"))}


@pytest.mark.parametrize("target,parallelism,check,fragment", [
    ("trtllm", {"tp": 8}, "arch.engine-path", "has no GptOssForCausalLM"),
    ("llmapi", {"tp": 4, "pp": 2}, "llmapi.architecture", "asserts mapping.pp_size == 1"),
    ("llmapi", {"tp": 16}, "llmapi.architecture", "tp above num_key_value_heads 8"),
])
def test_refused_in_one_line(tmp_path, target, parallelism, check, fragment):
    got = _checks(tmp_path, target, parallelism)[check]
    assert got.status == "fail" and fragment in got.message and "\n" not in got.message, got
    if check == "arch.engine-path":
        assert "set target: llmapi to serve GptOssForCausalLM" in got.message


def test_llmapi_accepts_it_at_tp_8(tmp_path):
    got = _checks(tmp_path, "llmapi", {"tp": 8})["llmapi.architecture"]
    assert got.status == "pass", got


def test_the_cpu_stand_in_refuses_what_llm_refuses(hf_gpt_oss, tmp_path):
    """CpuLLM converts for the LLM-API path, so its convert refuses pp 2 and tp above the KV heads in one line;
    swiglu constants other than upstream's hard-coded ones too (this tiny model's limit is 1.0)."""
    from toolchain.checkpoint.convert import plan_checkpoint

    for kw, fragment in (({"tp": 1, "pp": 2}, "asserts mapping.pp_size == 1"),
                         ({"tp": 4, "pp": 1}, "tp above num_key_value_heads 2"),
                         ({"tp": 1, "pp": 1}, "hard-codes alpha 1.702 and limit 7.0")):
        with pytest.raises(ToolchainError, match=fragment) as err:
            plan_checkpoint(hf_gpt_oss, dtype="float32", path="llmapi", **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(ToolchainError, match="quantization fp8 on GptOssForCausalLM is not supported"):
        plan_checkpoint(hf_gpt_oss, tp=1, pp=1, dtype="float32", quantization=_fp8())


def _fp8():
    from toolchain.quant.view import Quantization

    return Quantization(method="fp8")


# -- the planner -------------------------------------------------------------------------------------------

def test_plan_of_gpt_oss_120b_from_config_alone(tmp_path, capsys):
    """bf16 weights within 2% of the published ~117B parameters x 2 bytes, byte for byte what convert's dry run
    plans at tp 4 / moe_ep 4; the KV per token as the PyTorch backend's KV manager allocates sliding layers (one
    pool per window, memory.window_share): 18 layers of min(128, length) and 18 of the full length."""
    from test_plan_agrees_with_convert import plan_json, spec_file

    from toolchain.checkpoint.convert import plan_any

    ckpt = bf16_120b(tmp_path)
    limits = {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192, "max_num_tokens": 8192}
    for par in ({"tp": 1}, {"tp": 4, "moe_ep": 4}):
        spec = spec_file(tmp_path, ckpt, target="llmapi", parallelism=par, gpu={"name": "H200"}, limits=limits,
                         model={"dtype": "bfloat16"})
        rc, report = plan_json(tmp_path, spec, capsys=capsys)
        tp = par["tp"]
        dry = plan_any(ckpt, tp=tp, pp=1, dtype="bfloat16", target="cpu", moe_ep=par.get("moe_ep"), path="llmapi")
        assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(tp)]
        full = 2 * 36 * (8 // tp) * 64 * 2
        assert report["ranks"][0]["kv_bytes_per_token"] == full * (18 * 128 + 18 * 8192) // (36 * 8192)
        if tp == 1:
            assert abs(report["ranks"][0]["weights_bytes"] / 2 / 117e9 - 1) < 0.02
            assert rc == 1 and "quantization.method" not in report["verdict"]  # bf16 needs 219 GiB; no fp8 offer
        else:
            assert rc == 0, report["verdict"]
    sinks = [t for t in dry.ranks[0] if t.name == "transformer.layers.0.attention.sinks"]
    assert [(t.shape, t.dtype) for t in sinks] == [((16,), torch.float32)]


# -- parity with transformers -------------------------------------------------------------------------------

LAYOUTS = {"tp1": (1, {}), "tp2": (2, {}), "ep2": (2, {"moe_tp": 1, "moe_ep": 2})}
_ENGINES: dict = {}


def engine(tmp_path_factory, hf_dir: Path, layout: str) -> CpuEngine:
    key = (str(hf_dir), layout)
    if key not in _ENGINES:
        tp, kw = LAYOUTS[layout]
        _ENGINES[key] = CpuEngine.load(make_engine_dir(hf_dir, tmp_path_factory.mktemp(f"gpt-oss-{layout}"), tp,
                                                       convert_kwargs=kw))
    return _ENGINES[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_transformers(tmp_path_factory, hf_gpt_oss, reference, layout):
    e = engine(tmp_path_factory, hf_gpt_oss, layout)
    tp, kw = LAYOUTS[layout]
    assert (e.dims.tp, e.dims.moe_ep, e.dims.attention_sinks, e.dims.swiglu_limit) == (tp, kw.get("moe_ep", 1),
                                                                                         True, LIMIT)
    assert e.dims.attention_windows == (WINDOW, 512)
    for prompt in PROMPTS:
        torch.testing.assert_close(e.forward_logits(prompt), hf_logits(reference, prompt), atol=ATOL, rtol=0)
        assert e.generate(prompt, SamplingParams(max_new_tokens=NEW)) == hf_greedy(reference, prompt, NEW)


def test_sinks_are_split_with_the_q_heads(tmp_path_factory, hf_gpt_oss):
    """Rank r holds sinks[heads_r * r : heads_r * (r + 1)] (upstream's load), float32; the expert proj bias is added
    by moe_tp slice 0 only."""
    from safetensors.torch import load_file

    hf = load_file(str(hf_gpt_oss / "model.safetensors"))
    e = engine(tmp_path_factory, hf_gpt_oss, "tp2")
    for r, shard in enumerate(e.model.stages[0]):
        assert torch.equal(shard.layers[1].sinks, hf["model.layers.1.self_attn.sinks"][2 * r:2 * (r + 1)])
        assert shard.layers[1].experts.proj_bias == (r == 0)


@pytest.mark.parametrize("mechanism,config_over,weights", [
    ("sinks", {}, {"sinks": 0.0}),
    ("clamp", {"swiglu_limit": 1e4}, {}),
    ("window", {"sliding_window": 512}, {}),
    ("yarn", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, {}),
])
def test_each_mechanism_moves_the_logits_past_the_tolerance(hf_gpt_oss, reference, mechanism, config_over, weights):
    """Without the mechanism transformers' own logits differ from the model's by more than the parity tolerance,
    so the parity above could not pass with it missing from the engine."""
    changed = _reference(hf_gpt_oss, **config_over)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            for suffix, value in weights.items():
                if name.endswith(suffix):
                    param.fill_(value)
    prompt = PROMPTS[0]
    assert (hf_logits(changed, prompt) - hf_logits(reference, prompt)).abs().max() > 100 * ATOL


def test_engine_refuses_a_config_without_its_swiglu_limit(tmp_path, hf_gpt_oss):
    from toolchain.engine.cpu.config import read_engine_config

    e = make_engine_dir(hf_gpt_oss, tmp_path, 1)
    cfg = json.loads((e / "config.json").read_text())
    del cfg["pretrained_config"]["swiglu_limit"]
    (e / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ToolchainError, match="needs swiglu_limit"):
        read_engine_config(e)


def test_family_declares_its_paths():
    family = get_family("GptOssForCausalLM")
    assert family.engine_refusal and family.pipeline_refusal and family.decoder.attention_sinks
