"""Parallelism and family problems through `toolchain convert`: exit 2, one
line naming the numbers and a configuration that works, nothing written."""

from __future__ import annotations

import json

import pytest
from conftest import make_hf_llama, make_hf_model
from test_checkpoint_errors import copy_hf, edit_config, run_convert, spec_for


@pytest.fixture(scope="module")
def hf_heads12(tmp_path_factory):
    """12 heads, 6 KV heads, intermediate 192: tp 1, 2, 3, 6 and 12 work."""
    return make_hf_llama(tmp_path_factory.mktemp("h12"), hidden_size=96, num_attention_heads=12,
                         num_key_value_heads=6, intermediate_size=192, num_hidden_layers=1)


def test_ranks_exceed_gpus(tmp_path, capsys, hf_llama):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_llama, parallelism={"tp": 2, "pp": 2, "gpus": 2}))
    assert "tp x pp = 2 x 2 = 4 ranks but only 2 GPUs are declared" in err and "parallelism.gpus" in err


def test_pp_exceeds_layers_names_a_working_pp(tmp_path, capsys, hf_llama):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_llama, parallelism={"pp": 5}))
    assert "pp=5 exceeds num_hidden_layers=2" in err and "use parallelism.pp <= 2" in err


def test_tp_not_dividing_kv_heads(tmp_path, capsys, hf_heads12):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_heads12, parallelism={"tp": 4}))
    assert "tp=4 does not divide num_key_value_heads=6" in err and "use parallelism.tp 1, 2, 3, 6 or 12" in err


def test_kv_heads_not_duplicable(tmp_path, capsys):
    # tp 4 > 3 KV heads, and 4 is not a multiple of 3: a rank would need a fraction of a head.
    hf = make_hf_llama(tmp_path / "hf", hidden_size=96, num_attention_heads=12, num_key_value_heads=3,
                       intermediate_size=192, num_hidden_layers=1)
    capsys.readouterr()  # drop transformers' save progress from the captured stderr
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf, parallelism={"tp": 4}))
    assert "tp=4 is not a multiple of num_key_value_heads=3" in err and "use parallelism.tp 1, 3, 6 or 12" in err


def test_intermediate_size_not_divisible(tmp_path, capsys):
    hf = make_hf_llama(tmp_path / "hf", intermediate_size=130, num_hidden_layers=1)
    capsys.readouterr()  # drop transformers' save progress from the captured stderr
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf, parallelism={"tp": 4}))
    assert "tp=4 does not divide intermediate_size=130" in err and "use parallelism.tp 1 or 2" in err


def test_heads_not_divisible_at_gqa_duplication(tmp_path, capsys, hf_heads12):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_heads12, parallelism={"tp": 8}))
    assert "tp=8 does not divide num_attention_heads=12" in err and "use parallelism.tp 1, 2, 3, 6 or 12" in err


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"])
def test_missing_required_config_field(tmp_path, capsys, hf_llama, field):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, **{field: None})
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert f"lacks {field}" in err and "add it to config.json" in err


def test_unknown_rope_type(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, rope_parameters={"rope_theta": 10000.0, "rope_type": "magic", "factor": 2.0})
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    # Worded by the converter or, first, by the preflight check rope.unknown-type.
    assert "rope type 'magic'" in err and "llama3" in err


def test_llama3_rope_missing_key(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert "rope type 'llama3' lacks low_freq_factor" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_qwen3_with_attention_bias(tmp_path, capsys):
    hf = make_hf_model("Qwen3ForCausalLM", tmp_path / "hf", num_hidden_layers=1, head_dim=16)
    capsys.readouterr()  # drop transformers' save progress from the captured stderr
    edit_config(hf, attention_bias=True)
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "Qwen3 with attention_bias=true" in err and "attention_bias=false" in err


def test_qwen2_mixed_sliding_layers(tmp_path, capsys):
    hf = make_hf_model("Qwen2ForCausalLM", tmp_path / "hf")
    capsys.readouterr()  # drop transformers' save progress from the captured stderr
    edit_config(hf, layer_types=["full_attention", "sliding_attention"], sliding_window=8, use_sliding_window=True)
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "1 of 2 layers use a sliding window" in err


def test_llama_with_a_sliding_window_is_refused(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, sliding_window=16)
    assert "MistralForCausalLM" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_unsupported_architecture_lists_every_family(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, architectures=["GemmaForCausalLM"])
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in err
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["GemmaForCausalLM"]
