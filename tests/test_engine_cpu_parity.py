"""The CPU engine over every rank's shard reproduces Hugging Face transformers:
greedy tokens and fp32 logits, at several TP x PP layouts, tied embeddings,
parallel embeddings, bf16 storage and scaled RoPE."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_TRAINED, make_hf_llama
from test_engine_cpu_util import PROMPTS, _one_thread, hf_greedy, hf_logits, hf_model, load_engine  # noqa: F401

from toolchain.engine.cpu import SamplingParams
from toolchain.engine.cpu.rope import inverse_frequencies

NEW = 24


def assert_parity(engine, model, prompts=PROMPTS, new=NEW, atol=1e-4):
    for prompt in prompts:
        got = engine.forward_logits(prompt)
        want = hf_logits(model, prompt)
        assert got.shape == (len(prompt), engine.vocab_size)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=new)) == hf_greedy(model, prompt, new)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_matches_hf_across_layouts(tmp_path_factory, hf_llama, tp, pp):
    # tp 4 > 2 KV heads: every rank holds one duplicated KV head; vocab 250 pads to 252.
    engine = load_engine(tmp_path_factory, hf_llama, tp, pp)
    assert engine.dims.tp == tp and engine.dims.pp == pp
    assert engine.vocab_size == 250
    assert_parity(engine, hf_model(hf_llama))


def test_ranks_are_not_merged(tmp_path_factory, hf_llama):
    engine = load_engine(tmp_path_factory, hf_llama, 2, 2)
    stages = engine.model.stages
    assert [[s.rank for s in stage] for stage in stages] == [[0, 1], [2, 3]]
    qkv = stages[0][1].layers[0].qkv.weight
    assert qkv.shape == ((4 // 2 + 2 * 1) * 16, 64)  # [q_r; k_r; v_r] of rank 1 only
    assert stages[1][0].lm_head.weight.shape == (125, 64)
    assert stages[0][0].lm_head is None and stages[1][0].embedding is None


def test_tied_embeddings(tmp_path_factory, hf_llama_tied):
    assert_parity(load_engine(tmp_path_factory, hf_llama_tied, 2, 1), hf_model(hf_llama_tied), PROMPTS[:2])


@pytest.mark.parametrize("sharding_dim", [0, 1])
def test_parallel_embedding(tmp_path_factory, hf_llama, sharding_dim):
    engine = load_engine(tmp_path_factory, hf_llama, 2, 1, convert_kwargs={
        "use_parallel_embedding": True, "embedding_sharding_dim": sharding_dim})
    assert engine.dims.use_parallel_embedding
    assert_parity(engine, hf_model(hf_llama), PROMPTS[:2])


def test_bfloat16_storage_is_upcast(tmp_path_factory, hf_llama):
    engine = load_engine(tmp_path_factory, hf_llama, 2, 1, dtype="bfloat16")
    assert engine.config["pretrained_config"]["dtype"] == "bfloat16"
    assert engine.model.stages[0][0].layers[0].qkv.weight.dtype == torch.float32
    # Same rounding as the stored weights, computed in fp32 on both sides.
    assert_parity(engine, hf_model(hf_llama, round_to=torch.bfloat16), PROMPTS[:2])


ROPE_CASES = {
    # original_max_position_embeddings small enough that head_size 16 has high, medium and low bands.
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_scaled_rope_frequencies_match_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = ROPE_CASES[kind]
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(params))
    want, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    got = inverse_frequencies(16, params["rope_theta"], {**params, "type": kind})
    assert attention_factor == 1.0
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    unscaled = inverse_frequencies(16, params["rope_theta"], None)
    assert not torch.equal(got, unscaled)
    if kind == "llama3":  # highest frequencies kept, lowest divided by the factor
        assert got[0] == unscaled[0] and math.isclose(got[-1], unscaled[-1] / 8.0, rel_tol=1e-6)


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_scaled_rope_model(tmp_path_factory, kind):
    hf_dir = make_hf_llama(tmp_path_factory.mktemp(f"hf-{kind}"), seed=3, rope_parameters=dict(ROPE_CASES[kind]))
    engine = load_engine(tmp_path_factory, hf_dir, 2, 1)
    assert engine.dims.rotary_scaling["type"] == kind
    # Positions past original_max_position_embeddings exercise the scaled bands.
    long_prompt = [(11 * i) % 249 + 1 for i in range(60)]
    assert_parity(engine, hf_model(hf_dir), [PROMPTS[1], long_prompt], new=30)


@pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="models/tiny-llama not built")
def test_trained_tiny_llama(tmp_path_factory):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(TINY_TRAINED).vocab_size
    engine = load_engine(tmp_path_factory, TINY_TRAINED, 2, 1)
    model = hf_model(TINY_TRAINED)
    prompts = [[(13 * i + 7 * j) % (vocab - 3) + 3 for j in range(8 + 5 * i)] for i in range(3)]
    assert_parity(engine, model, prompts, new=32, atol=2e-4)


def test_biases_split_and_added_once(tmp_path_factory):
    """attention_bias + mlp_bias: column-parallel biases split per rank, row-parallel
    (dense, proj) biases added once after the partial sums."""
    from transformers import LlamaForCausalLM

    hf_dir = make_hf_llama(tmp_path_factory.mktemp("hf-bias"), seed=5, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM.from_pretrained(hf_dir)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)  # HF initialises biases to zero, which would prove nothing
    model.save_pretrained(hf_dir)
    engine = load_engine(tmp_path_factory, hf_dir, 2, 2)
    assert engine.dims.attn_bias and engine.dims.dense_bias and engine.dims.mlp_bias
    assert_parity(engine, hf_model(hf_dir), PROMPTS[:2])
