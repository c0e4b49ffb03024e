"""Architecture registry, HF config normalisation and the Llama name table."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import DEEPSEEK_V3_TINY

from toolchain.archs import family_for_config, get_family, load_params, supported
from toolchain.archs.common import Family, NameTable, Row, Shard, Stage
from toolchain.archs.params import normalize_rope
from toolchain.errors import ToolchainError


def hf_cfg(**over):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 250, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 512, "hidden_act": "silu", "dtype": "bfloat16",
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_registry_lists_and_resolves_llama():
    assert "LlamaForCausalLM" in supported()
    family = get_family("LlamaForCausalLM")
    assert family.name == "llama" and "LlamaForCausalLM" in family.architectures


def test_unknown_architecture_lists_supported():
    with pytest.raises(ToolchainError) as err:
        get_family("GPT2LMHeadModel")
    assert "GPT2LMHeadModel" in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_missing_architectures_key():
    with pytest.raises(ToolchainError, match="architectures"):
        family_for_config({"hidden_size": 8})


def test_registry_imports_family_modules_lazily():
    code = ("import sys, toolchain.archs; print(any(m in sys.modules for m in "
            "('toolchain.archs.llama', 'toolchain.archs.mistral', 'toolchain.archs.mixtral', 'toolchain.archs.qwen', "
            "'toolchain.archs.gemma', 'toolchain.archs.gemma3', 'toolchain.archs.phi3', 'toolchain.archs.gpt_oss', "
            "'toolchain.archs.llama4', 'toolchain.archs.deepseek_v3')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_transformers5_spellings():
    _, p = load_params(hf_cfg())
    assert (p.vocab_size, p.hidden_size, p.intermediate_size, p.num_hidden_layers) == (250, 64, 128, 2)
    assert (p.num_attention_heads, p.num_key_value_heads, p.head_size) == (4, 2, 16)
    assert p.dtype == "bfloat16" and p.rope_theta == 10000.0 and p.rotary_scaling is None
    assert p.rms_norm_eps == 1e-5 and p.hidden_act == "silu"


def test_transformers4_spellings():
    cfg = hf_cfg(dtype=None, rope_parameters=None, torch_dtype="float16", rope_theta=500000.0, rope_scaling=None)
    _, p = load_params(cfg)
    assert p.dtype == "float16" and p.rope_theta == 500000.0 and p.rotary_scaling is None


def test_aliases_for_other_spellings():
    cfg = {"architectures": ["LlamaForCausalLM"], "n_vocab": 100, "n_embd": 32, "ffn_hidden_size": 64,
           "n_layer": 3, "n_head": 4, "layer_norm_epsilon": 1e-6, "n_positions": 128}
    _, p = load_params(cfg)
    assert (p.vocab_size, p.hidden_size, p.intermediate_size, p.num_hidden_layers) == (100, 32, 64, 3)
    assert p.num_key_value_heads == 4  # absent -> MHA
    assert p.head_size == 8 and p.max_position_embeddings == 128 and p.rms_norm_eps == 1e-6
    # Llama defaults fill what the file omits, as transformers' LlamaConfig would.
    assert p.hidden_act == "silu" and p.rope_theta == 10000.0 and p.dtype is None
    assert not (p.tie_word_embeddings or p.attention_bias or p.mlp_bias)


def test_head_dim_wins_over_hidden_over_heads():
    _, p = load_params(hf_cfg(head_dim=32))
    assert p.head_size == 32


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field_is_named(field):
    cfg = hf_cfg()
    del cfg[field]
    with pytest.raises(ToolchainError, match=field):
        load_params(cfg)


def test_bad_field_values():
    with pytest.raises(ToolchainError, match="hidden_size"):
        load_params(hf_cfg(hidden_size="64"))
    with pytest.raises(ToolchainError, match="num_key_value_heads"):
        load_params(hf_cfg(num_key_value_heads=3))
    with pytest.raises(ToolchainError, match="dtype"):
        load_params(hf_cfg(dtype="int8"))


@pytest.mark.parametrize("cfg", [
    {"rope_theta": 1e4},
    {"rope_theta": 1e4, "rope_scaling": None},
    {"rope_theta": 1e4, "rope_scaling": {"type": "default"}},
    {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},
])
def test_rope_default_becomes_null(cfg):
    assert normalize_rope(cfg) == (1e4, None)


def test_rope_llama3_complete_with_both_type_keys():
    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta, scaling = normalize_rope({"rope_parameters": params})
    assert theta == 500000.0
    assert scaling == {"type": "llama3", "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # transformers 4.x spelling gives the same result.
    old = {k: v for k, v in params.items() if k != "rope_theta"}
    assert normalize_rope({"rope_theta": 500000.0, "rope_scaling": old}) == (theta, scaling)


def test_rope_linear_old_type_key_gets_rope_type():
    _, scaling = normalize_rope({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert scaling == {"type": "linear", "rope_type": "linear", "factor": 2.0}


def test_rope_errors():
    with pytest.raises(ToolchainError, match="unsupported rope type 'magic'"):
        normalize_rope({"rope_scaling": {"rope_type": "magic", "factor": 2.0}})
    with pytest.raises(ToolchainError, match="low_freq_factor"):
        normalize_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}})
    with pytest.raises(ToolchainError, match="factor"):
        normalize_rope({"rope_scaling": {"type": "linear"}})


def test_params_carry_normalised_rope_and_stay_immutable():
    cfg = hf_cfg(rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 4.0})
    _, p = load_params(cfg)
    scaling = p.rotary_scaling
    scaling["factor"] = 99.0
    assert p.rotary_scaling["factor"] == 4.0
    with pytest.raises(AttributeError):
        p.hidden_size = 1


def test_llama_table_naming_trap_and_matching():
    family, p = load_params(hf_cfg())
    table = NameTable(family, p)
    fc = table.match("model.layers.1.mlp.gate_proj.weight")
    gate = table.match("model.layers.1.mlp.up_proj.weight")
    assert fc.row.trt == "transformer.layers.{layer}.mlp.fc.weight" and fc.layer == 1
    assert gate.row.trt == "transformer.layers.{layer}.mlp.gate.weight"
    assert table.match("model.layers.2.mlp.up_proj.weight") is None  # past num_hidden_layers
    assert table.match("model.layers.0.self_attn.q_proj.bias") is None  # attention_bias false
    assert table.match("model.layers.0.self_attn.rotary_emb.inv_freq").row.shard is Shard.DROP
    names = [n for n, _ in table.expected()]
    assert "lm_head.weight" in names and len(names) == len(set(names)) == 2 * 9 + 3


def test_bias_rows_follow_config_flags():
    family, p = load_params(hf_cfg(attention_bias=True, mlp_bias=True))
    table = NameTable(family, p)
    assert table.match("model.layers.0.self_attn.k_proj.bias").row.part == "k"
    assert table.match("model.layers.0.self_attn.o_proj.bias").row.shard is Shard.REPLICATE
    assert table.match("model.layers.0.mlp.down_proj.bias").row.shard is Shard.REPLICATE
    assert table.match("model.layers.0.mlp.up_proj.bias").row.shard is Shard.COLUMN


def test_family_rejects_malformed_rows():
    with pytest.raises(ValueError, match="part"):
        Family("x", ("X",), (Row("a.{layer}.q", "b.{layer}.qkv", Shard.QKV),))
    with pytest.raises(ValueError, match="stage"):
        Family("x", ("X",), (Row("norm", "ln_f", Shard.REPLICATE),))
    with pytest.raises(ValueError, match="transform"):
        Family("x", ("X",), (Row("norm", "ln_f", Shard.REPLICATE, stage=Stage.LAST, transform="nope"),))


# One tiny random checkpoint maker per registered architecture (style anchor 13):
# registering an arch without adding it here fails the test below.
def _llama(out):
    from conftest import make_hf_llama

    return make_hf_llama(out, num_hidden_layers=1)


def _family(arch, **kw):
    def make(out):
        from conftest import make_hf_model

        return make_hf_model(arch, out, num_hidden_layers=1, **kw)
    return make


ARCH_FIXTURES = {
    "DeepseekV3ForCausalLM": _family("DeepseekV3ForCausalLM", **{**DEEPSEEK_V3_TINY, "first_k_dense_replace": 0}),
    "Gemma2ForCausalLM": _family("Gemma2ForCausalLM", head_dim=16, sliding_window=8),
    "Gemma3ForCausalLM": _family("Gemma3ForCausalLM", head_dim=16, sliding_window=8),
    "GptOssForCausalLM": _family("GptOssForCausalLM", head_dim=16, intermediate_size=48, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=8),
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _family("MistralForCausalLM", sliding_window=8),
    "MixtralForCausalLM": _family("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "Phi3ForCausalLM": _family("Phi3ForCausalLM", pad_token_id=0),
    "Qwen2ForCausalLM": _family("Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": _family("Qwen3ForCausalLM", head_dim=32),
    "Qwen2MoeForCausalLM": _family("Qwen2MoeForCausalLM", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=96),
    "Qwen3MoeForCausalLM": _family("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # one mixture-of-experts layer with its shared expert (dense layers between mixtures: tests/test_llama4.py)
    "Llama4ForCausalLM": _family("Llama4ForCausalLM", head_dim=16, intermediate_size=32, num_local_experts=4),
    "Llama4ForConditionalGeneration": _family("Llama4ForConditionalGeneration", head_dim=16, intermediate_size=32,
                                              num_local_experts=4),
}


@pytest.mark.parametrize("arch", supported())
def test_every_registered_arch_has_a_tiny_checkpoint_that_converts(arch, tmp_path):
    from toolchain.checkpoint.convert import convert_checkpoint

    assert arch in ARCH_FIXTURES, f"add a tiny checkpoint maker for {arch} to ARCH_FIXTURES"
    hf = ARCH_FIXTURES[arch](tmp_path / "hf")
    (tmp_path / "ck").mkdir()
    config = convert_checkpoint(hf, tmp_path / "ck", tp=2, pp=1, dtype="float32")
    assert config["architecture"] == arch


@pytest.mark.parametrize("arch", supported())
def test_every_registered_arch_parses_in_the_cpu_engine(arch, tmp_path):
    """docs/architecture.md's "How to add": a registered family runs on the CPU engine with no edit there. Its
    checkpoint config passes the engine's dimension parsing, and the traits the engine reads from the family's
    decoder agree with the rows the converter writes."""
    import json

    from toolchain.checkpoint.config import build_config
    from toolchain.engine.cpu.config import parse_dims

    family, params = load_params(json.loads((ARCH_FIXTURES[arch](tmp_path / "hf") / "config.json").read_text()))
    dims = parse_dims(build_config(family, params, dtype="float32", tp=2, pp=1), "config.json")
    written = {r.trt for r in NameTable(family, params).rows if r.trt}
    assert (dims.architecture, dims.tp, dims.num_layers, dims.is_moe) == (arch, 2, 1, params.is_moe)
    assert dims.attn_bias == any(t.endswith("attention.qkv.bias") for t in written)
    assert dims.dense_bias == any(t.endswith("attention.dense.bias") for t in written)
    assert dims.qk_layernorm == any(t.endswith("attention.q_layernorm.weight") for t in written)
    assert dims.inter_layernorms == any(t.endswith("pre_feedforward_layernorm.weight") for t in written)
    if not dims.is_moe:  # a fused fc [up; gate] is the only MLP with no mlp.gate
        assert dims.fused_mlp == ("transformer.layers.{layer}.mlp.gate.weight" not in written)


def test_cpu_engine_runs_the_registry_and_its_aliases():
    """The engine's architectures are the registry's, TensorRT-LLM's aliases of them and Medusa over one; an alias
    and a Medusa base get their family's decoder (QWen's attention output projection unbiased)."""
    from toolchain.archs import CHECKPOINT_ALIASES, checkpoint_architectures
    from toolchain.engine.cpu.config import ARCHITECTURES, parse_dims

    assert ARCHITECTURES == {*supported(), *CHECKPOINT_ALIASES, "MedusaForCausalLM"}
    assert checkpoint_architectures() == sorted([*supported(), "QWenForCausalLM"])
    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 64, "hidden_act": "silu", "attn_bias": True, "num_medusa_heads": 2}
    for arch, model_type, dense in [("QWenForCausalLM", None, False), ("LlamaForCausalLM", None, True),
                                    ("MedusaForCausalLM", "qwen2", False), ("MedusaForCausalLM", "llama", True)]:
        dims = parse_dims({**base, "architecture": arch, "model_type": model_type}, "config.json")
        assert (dims.attn_bias, dims.dense_bias) == (True, dense), arch
    with pytest.raises(ToolchainError, match="architecture 'GPTForCausalLM' is not supported by the CPU engine"):
        parse_dims({**base, "architecture": "GPTForCausalLM"}, "config.json")


def test_partial_rotary_rejected():
    with pytest.raises(ToolchainError, match="partial_rotary_factor"):
        normalize_rope({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}})


def test_registry_lists_every_family():
    assert supported() == ["DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
                           "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "LlamaForCausalLM",
                           "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
    assert [get_family(a).name for a in supported()] == ["deepseek_v3", "gemma2", "gemma3", "gpt_oss", "llama4",
                                                         "llama4", "llama", "mistral", "mixtral", "phi3", "qwen2",
                                                         "qwen2_moe", "qwen3", "qwen3_moe"]


def test_cli_archs_lists_them(capsys):
    from toolchain.cli import main

    assert main(["archs"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in rows] == supported()
    assert [row[1] for row in rows] == [get_family(a).name for a in supported()]
    served = {row[0]: row[2:] for row in rows}
    # engine_refusal: 1.2.1's trtllm-build has no Qwen3-MoE; llmapi_refusal of every model: no Gemma 2 on the
    # PyTorch backend; a refusal that depends on the model (Phi-3 at tp > 1) leaves the path listed.
    assert served["Qwen3MoeForCausalLM"] == ["llmapi"] and served["Gemma2ForCausalLM"] == ["engine"]
    assert served["LlamaForCausalLM"] == served["Phi3ForCausalLM"] == ["engine", "llmapi"]
    for name in supported():
        family = get_family(name)
        assert ("engine" in served[name]) == (family.engine_refusal is None), name


@pytest.mark.parametrize("over,window", [({}, 4096), ({"sliding_window": None}, None), ({"sliding_window": 512}, 512)])
def test_mistral_window(over, window):
    cfg = hf_cfg(architectures=["MistralForCausalLM"], **over)
    if "sliding_window" in over and over["sliding_window"] is None:
        cfg["sliding_window"] = None  # explicit null: no window (Mistral 7B v0.2+)
    _, p = load_params(cfg)
    assert p.sliding_window == window and not p.qk_layernorm


def test_qwen2_biases_forced_and_window_rules():
    family, p = load_params(hf_cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=64))
    assert p.attention_bias and p.sliding_window is None
    table = NameTable(family, p)
    assert table.match("model.layers.0.self_attn.v_proj.bias").row.part == "v"
    assert table.match("model.layers.0.self_attn.o_proj.bias") is None  # TRT-LLM Qwen: no dense bias
    _, p = load_params(hf_cfg(architectures=["Qwen2ForCausalLM"], sliding_window=64,
                              layer_types=["sliding_attention", "sliding_attention"]))
    assert p.sliding_window == 64
    _, p = load_params(hf_cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                              max_window_layers=0))
    assert p.sliding_window == 64
    with pytest.raises(ToolchainError, match="1 of 2 layers"):
        load_params(hf_cfg(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                           max_window_layers=1))


def test_qwen3_qk_norm_rows_and_head_dim():
    family, p = load_params(hf_cfg(architectures=["Qwen3ForCausalLM"], head_dim=32, attention_bias=False))
    assert p.qk_layernorm and p.head_size == 32 and not p.attention_bias
    row = NameTable(family, p).match("model.layers.1.self_attn.k_norm.weight").row
    assert row.trt == "transformer.layers.{layer}.attention.k_layernorm.weight" and row.shard is Shard.REPLICATE
    assert family.config_extra(p) == {"qwen_type": "qwen3", "seq_length": 512}
