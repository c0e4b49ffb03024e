"""Parity matrix: every registered family x (tp, pp) x checkpoint dtype, run
rank by rank by the CPU engine, against Hugging Face transformers.

Each case converts a tiny random HF checkpoint stored in that dtype (as real
checkpoints ship) and compares
- logits with HF computing in float32 over the same stored weights: the CPU
  engine computes in float32, so any difference is a layout or numerics bug;
  tolerance FP32_REF_ATOL for every dtype, and greedy tokens must be equal;
- logits with HF computing in the checkpoint dtype itself (what an HF user
  runs): the gap is HF's half-precision rounding, bounded per dtype by
  NATIVE_ATOL (measured worst cases: fp16 3.4e-3, bf16 3.4e-2 on logits of
  magnitude ~2.7).

The models cover: KV heads fewer than tp (2 KV heads at tp 4, and MQA),
vocabularies not divisible by tp (250, 251), tied (Qwen2, Llama 3.2) and
untied (Mistral, Qwen3) embeddings, q/k/v biases (Qwen2), q/k norms and
head_dim != hidden/heads (Qwen3), llama3 RoPE (Llama 3.2), a sliding
window shorter than the prompts (Mistral) and a mixture of experts (Mixtral;
expert parallelism has its own matrix in test_moe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DEEPSEEK_V3_TINY, make_hf_model
from test_engine_cpu_util import _one_thread, hf_greedy, hf_logits, load_engine  # noqa: F401

from toolchain.archs import supported
from toolchain.engine.cpu import CpuEngine, SamplingParams

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP32_REF_ATOL = 1e-4
NATIVE_ATOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
NEW = 16
# 6 and 20 tokens: the second, and every generated token, lies past Mistral's 8-token window.
PROMPTS = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7, 8, 9, 10, 11, 12, 13]]

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# Gemma 2: 8-token window on layer 0 (HF's default layer_types), soft-caps small enough to bite, a
# query_pre_attn_scalar other than head_dim (tests/test_gemma.py proves each one matters).
GEMMA2 = dict(seed=16, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
              final_logit_softcapping=3.0)
# Gemma 3: layers 0, 1 and 3 local (pattern 3) with an 8-token window and their own rope base (100, the
# global layers 10000, so the two tables differ within 20 tokens), q/k norms (tests/test_gemma3.py).
GEMMA3 = dict(seed=18, head_dim=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=3,
              query_pre_attn_scalar=24,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# Llama 4: layers 0, 1 and 3 rotate and attend in 4-token chunks with the weightless q/k norm, layer 2 is NoPE with
# temperature tuning from position 1 (floor_scale 2); layers 1 and 3 are mixtures of 4 experts with the shared
# expert, 0 and 2 dense MLPs 96 wide (tests/test_llama4.py proves each mechanism matters).
LLAMA4 = dict(seed=19, num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
              num_local_experts=4, interleave_moe_layer_step=2, attention_chunk_size=4, no_rope_layers=[1, 1, 0, 1],
              floor_scale=2)
# One tiny model per family; the keys double as test ids.
FAMILIES = {
    # MLA with its latent cache, a dense layer then two mixtures with grouped routing (tests/test_deepseek_v3.py)
    "deepseek-v3-mla": ("DeepseekV3ForCausalLM", dict(seed=19, **{**DEEPSEEK_V3_TINY, "num_hidden_layers": 3})),
    "gemma2-window-softcap": ("Gemma2ForCausalLM", GEMMA2),
    "gemma3-local-rope": ("Gemma3ForCausalLM", GEMMA3),
    # gpt-oss: sinks, an 8-token window on layer 0, YaRN, biased clamped-SwiGLU experts (tests/test_gpt_oss.py proves
    # each mechanism matters and runs expert parallelism)
    "gpt-oss-sinks-moe": ("GptOssForCausalLM", dict(seed=19, head_dim=16, intermediate_size=48, num_local_experts=4,
                                                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=2.0)),
    "llama32-tied": ("LlamaForCausalLM", dict(seed=14, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama4-chunked-nope-moe": ("Llama4ForCausalLM", LLAMA4),
    # the text part of a multimodal checkpoint, its vision tower skipped
    "llama4-multimodal-text": ("Llama4ForConditionalGeneration", LLAMA4),
    "mistral-window": ("MistralForCausalLM", dict(seed=11, sliding_window=8)),
    # 4 experts, top-2: at tp 4 every expert's width splits over moe_tp 4 (the default Mapping derives)
    "mixtral-moe": ("MixtralForCausalLM", dict(seed=15, num_local_experts=4, num_experts_per_tok=2)),
    "phi3-fused": ("Phi3ForCausalLM", dict(seed=16, pad_token_id=0, vocab_size=251)),  # longrope: test_phi3.py
    "qwen2-bias-tied": ("Qwen2ForCausalLM", dict(seed=12, vocab_size=251, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3ForCausalLM", dict(seed=13, head_dim=32)),
    "qwen2-moe-shared": ("Qwen2MoeForCausalLM", dict(seed=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96)),
    "qwen3-moe-qknorm": ("Qwen3MoeForCausalLM", dict(seed=17, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)),
}

# Families whose HF half-precision forward is not within a tolerance of float32: top-k routing is
# discontinuous, and HF's bf16 rounding flips an expert choice at some position (measured: 0.54 on one
# logit row of the tiny Mixtral), so only the float32 reference over the same stored weights bounds them.
DISCRETE_ROUTING = {"deepseek-v3-mla", "mixtral-moe", "qwen2-moe-shared", "qwen3-moe-qknorm", "gpt-oss-sinks-moe",
                    "llama4-chunked-nope-moe", "llama4-multimodal-text"}
# Gemma 2's HF half-precision forward rounds more steps (the embedding scale, four norms a layer, two soft-caps)
# than the float32 engine: measured worst 0.070 in bfloat16 on logits capped at 3 (float32 reference: 1e-4).
# Gemma 3 has no final soft-cap and twice the layers: measured worst 0.31 in bfloat16 on logits up to 4.9
# (float32 reference over the same weights: 0.0).
NATIVE_ATOL_BY_FAMILY = {"gemma2-window-softcap": {**NATIVE_ATOL, "bfloat16": 1e-1},
                         "gemma3-local-rope": {**NATIVE_ATOL, "bfloat16": 4e-1}}

# The layouts each family runs; families added since the matrix reached make test's time budget run the
# three that matter (tp 1, tp 2, pp 2) in float32 and their checkpoint's native bfloat16.
# Families run later in the matrix: tp 1, tp 2 and pp 2 only, in the dtypes named; gpt-oss not at pp 2 (TensorRT-LLM's
# gpt-oss refuses pipeline parallelism, archs/gpt_oss.py).
LATER = {"gemma3-local-rope": ("bfloat16", "float32"), "deepseek-v3-mla": ("bfloat16", "float32"),
         "gpt-oss-sinks-moe": ("bfloat16", "float32"), "llama4-chunked-nope-moe": ("bfloat16", "float32"),
         "llama4-multimodal-text": ("float32",)}
NO_PP = {"gpt-oss-sinks-moe"}
CASES = [(f, tp, pp, dt) for f in sorted(FAMILIES) for tp, pp in LAYOUTS for dt in sorted(DTYPES)
         if f not in LATER or ((tp, pp) in ((1, 1), (2, 1), (1, 2)) and dt in LATER[f] and (pp == 1 or f not in NO_PP))]

_MODELS: dict = {}


def hf_dir(factory, family: str, dtype: str, **extra) -> Path:
    key = (family, dtype, json.dumps(extra, sort_keys=True))
    if key not in _MODELS:
        arch, kw = FAMILIES[family]
        _MODELS[key] = make_hf_model(arch, factory.mktemp(f"hf-{family}-{dtype}"), dtype=DTYPES[dtype],
                                     **{**kw, **extra})
    return _MODELS[key]


def reference(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    key = ("ref", str(path), str(dtype))
    if key not in _MODELS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        model.generation_config.eos_token_id = None  # the engine runs with end_id -1
        if dtype == torch.float32:
            round_gemma_norms(model, path)
        _MODELS[key] = model
    return _MODELS[key]


def round_gemma_norms(model, path: Path) -> None:
    """Gemma's norms are stored as 1 + w in the checkpoint dtype (archs/gemma.py, as upstream's converter
    does), so in a half-precision checkpoint they are rounded once more than HF's own float32 (1 + w).
    The float32 reference then computes over the weights as converted: w := round(1 + w) - 1, exact in
    float32, so the engine's only difference stays its arithmetic."""
    cfg = json.loads((path / "config.json").read_text())
    stored = DTYPES.get(cfg.get("dtype") or cfg.get("torch_dtype") or "float32", torch.float32)
    if cfg.get("model_type") not in ("gemma2", "gemma3_text") or stored == torch.float32:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_((1.0 + param).to(stored).float() - 1.0)


def greedy(path: Path, prompt: list[int]) -> list[int]:
    key = ("greedy", str(path), tuple(prompt))
    if key not in _MODELS:
        _MODELS[key] = hf_greedy(reference(path, torch.float32), prompt, NEW)
    return _MODELS[key]


def check(engine: CpuEngine, path: Path, dtype: str, prompts=PROMPTS, native_too: bool = True,
          native_atol: dict = NATIVE_ATOL) -> None:
    fp32, native = reference(path, torch.float32), reference(path, DTYPES[dtype])
    for prompt in prompts:
        got = engine.forward_logits(prompt)
        torch.testing.assert_close(got, hf_logits(fp32, prompt), atol=FP32_REF_ATOL, rtol=0)
        if native_too:
            torch.testing.assert_close(got, hf_logits(native, prompt), atol=native_atol[dtype], rtol=0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW)) == greedy(path, prompt)


def test_matrix_covers_every_registered_architecture():
    assert {arch for arch, _ in FAMILIES.values()} == set(supported())


@pytest.mark.parametrize("family,tp,pp,dtype", CASES)
def test_parity(tmp_path_factory, family, tp, pp, dtype):
    path = hf_dir(tmp_path_factory, family, dtype)
    engine = load_engine(tmp_path_factory, path, tp, pp, dtype="auto")
    assert engine.config["pretrained_config"]["dtype"] == dtype
    assert (engine.dims.tp, engine.dims.pp) == (tp, pp)
    check(engine, path, dtype, native_too=family not in DISCRETE_ROUTING,
          native_atol=NATIVE_ATOL_BY_FAMILY.get(family, NATIVE_ATOL))


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_mqa_biases_duplicated_on_every_rank(tmp_path_factory, tp):
    # One KV head: every rank holds a copy of it, bias included (models/convert_utils.py dup_kv_weight).
    path = hf_dir(tmp_path_factory, "qwen2-bias-tied", "float32", num_key_value_heads=1)
    engine = load_engine(tmp_path_factory, path, tp, 1, dtype="auto")
    assert engine.dims.kv_heads_per_rank == 1
    biases = [s.layers[0].qkv.bias for s in engine.model.stages[0]]
    hd = engine.dims.head_size
    kv = [b[-2 * hd:] for b in biases]  # [k; v] rows at the end of each rank's qkv
    assert all(torch.equal(kv[0], other) for other in kv[1:])
    check(engine, path, "float32")


@pytest.mark.parametrize("family,dim", [("qwen2-bias-tied", 0), ("mistral-window", 1), ("qwen3-qknorm", 0)])
def test_parallel_embedding(tmp_path_factory, family, dim):
    path = hf_dir(tmp_path_factory, family, "float32")
    engine = load_engine(tmp_path_factory, path, 2, 2, dtype="auto",
                         convert_kwargs={"use_parallel_embedding": True, "embedding_sharding_dim": dim})
    assert engine.dims.use_parallel_embedding and engine.dims.embedding_sharding_dim == dim
    check(engine, path, "float32")


@pytest.mark.parametrize("layers,tp,pp", [(3, 1, 2), (3, 2, 2), (5, 1, 4), (5, 2, 4)])
def test_uneven_pipeline_split(tmp_path_factory, layers, tp, pp):
    # torch.tensor_split: L=3, P=2 -> [2, 1]; L=5, P=4 -> [2, 1, 1, 1].
    path = hf_dir(tmp_path_factory, "qwen3-qknorm", "float32", num_hidden_layers=layers)
    engine = load_engine(tmp_path_factory, path, tp, pp, dtype="auto")
    expected = [len(t) for t in torch.tensor_split(torch.arange(layers), pp)]
    assert [len(stage[0].layers) for stage in engine.model.stages] == expected
    assert [[s.rank for s in stage] for stage in engine.model.stages] == [
        [p * tp + t for t in range(tp)] for p in range(pp)]
    check(engine, path, "float32")


def test_sliding_window_is_applied(tmp_path_factory, tmp_path):
    """Without the window the engine must disagree with HF on prompts longer
    than it, so the Mistral rows of the matrix prove the window is applied."""
    import shutil

    path = hf_dir(tmp_path_factory, "mistral-window", "float32")
    engine = load_engine(tmp_path_factory, path, 2, 1, dtype="auto")
    assert engine.config["pretrained_config"]["runtime_defaults"] == {"max_attention_window": [8]}
    no_window = tmp_path / "engine"
    shutil.copytree(engine_path(tmp_path_factory, path), no_window)
    cfg = json.loads((no_window / "config.json").read_text())
    del cfg["pretrained_config"]["runtime_defaults"]
    (no_window / "config.json").write_text(json.dumps(cfg))
    full = CpuEngine.load(no_window)
    long_prompt = PROMPTS[1]
    want = hf_logits(reference(path, torch.float32), long_prompt)
    torch.testing.assert_close(engine.forward_logits(long_prompt), want, atol=FP32_REF_ATOL, rtol=0)
    diff = (full.forward_logits(long_prompt) - want).abs()
    assert diff[:8].max() < FP32_REF_ATOL  # within the window both agree
    assert diff[8:].max() > 1e-2


def engine_path(factory, path: Path) -> Path:
    from test_engine_cpu_util import engine_dir

    return engine_dir(factory, path, 2, 1, dtype="auto")
