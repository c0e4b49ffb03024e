"""Shared fixtures: small random Hugging Face Llama checkpoints made locally
(no download), and spec files pointing at them."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch
import yaml

from toolchain.engine.cpu import native

REPO = Path(__file__).resolve().parents[1]
TINY_TRAINED = REPO / "models" / "tiny-llama"
_KERNELS = native.cache_dir()  # where `make setup` built them, read before any test moves $XDG_CACHE_HOME


@pytest.fixture(autouse=True)
def _no_host_profile(tmp_path_factory, monkeypatch):
    """Tests never read the developer's cached `toolchain probe-host` profile (hostprofile.cache_dir: under
    $XDG_CACHE_HOME): with one, CPU plans, bench reports and tune would predict where a clean CI machine does not.
    A test that wants a profile makes one in its own cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    # The CPU engine's compiled kernels are no profile: every test (and the servers and ranks it starts) loads the
    # ones `make setup` built instead of compiling its own under the temporary cache.
    monkeypatch.setenv(native.DIR_VARIABLE, str(_KERNELS))


# -- test tiers ------------------------------------------------------------------------
# `make test-fast` runs `pytest -m "not server and not extras and not slow and not perf"` (the markers are
# registered in pyproject.toml): the unit tests, which need only `make setup`. `make test` runs them all.
# A test falls in its tier by what it uses: an `e2e` test starts tritonserver, so it is a `server` test too,
# and a test that uses a fixture decorated below (directly or through other fixtures) gets that fixture's
# marker at collection, so a new test on an existing server fixture needs no marker of its own.
SERVER = "server"  # starts tritonserver, the OpenAI server, Dynamo, AIPerf or mpirun ranks
EXTRAS = "extras"  # needs what `make test` installs beyond `make setup` (AIPerf, lm-eval, Dynamo, SmolLM2)


def _tier(marker: str):
    def decorate(fixture_function):
        fixture_function.tier_markers = (*getattr(fixture_function, "tier_markers", ()), marker)
        return fixture_function
    return decorate


starts_server = _tier(SERVER)  # under @pytest.fixture, on a fixture that starts a server
needs_extras = _tier(EXTRAS)  # under @pytest.fixture, on a fixture that needs `make test`'s extra installs


# Unit tests that start no server but take seconds each, by node id (fnmatch): the AWQ scale search and training a
# tiny model. Measured with --durations on 2 cores (2026-12-03): 5 to 21 s each, about 100 s together, a third of
# the unit tests' time. Every AWQ test of a module goes, not only the slow ones: test_hf_quant_export caches each
# export for the module, so the first test to ask for one pays for it. `make test` runs them; `make test-fast`
# leaves them out as `slow`.
SLOW_UNIT_TESTS = (
    "tests/test_checkpoint_quant.py::*awq*",
    "tests/test_checkpoint_quant.py::test_kv_cache_scales_per_layer",
    "tests/test_hf_quant_export.py::*awq*",
    "tests/test_tinymodel.py::test_quick_run_is_a_loadable_gqa_llama",
    "tests/test_tinymodel.py::test_same_seed_gives_same_weights",
    "tests/test_tinymodel.py::test_draft_of_shares_the_models_tokenizer",
    "tests/test_tune.py::test_cost_ranking_flips_with_price",
    "tests/test_tune.py::test_an_slo_only_one_layout_meets_picks_that_layout",
    # Measured with --durations=0 on 2 cores under load (2026-12-06), 8 to 90 s each, about 550 s together: more
    # than half of the unit tier. The export and import of int4 AWQ (the scale search again), tune's searches that
    # run the CPU engine or write and re-plan every candidate, re-measuring the host, Medusa's trained heads and
    # the MoE formats' calibrated conversions.
    "tests/test_hf_quant_export.py::test_int4_packing_round_trips",
    "tests/test_modelopt_import.py::*int4_awq*",
    "tests/test_checkpoint_quant.py::test_per_group_mlp_padding",
    "tests/test_moe_quant.py::test_awq_*",
    "tests/test_moe_quant.py::test_fp8_experts_layout_and_logits*",
    "tests/test_moe_quant.py::test_kv_cache_on_moe*",
    "tests/test_probe_host.py::test_force_measures_again_and_caches",
    "tests/test_medusa.py::test_medusa_output_is_plain_decoding*",
    "tests/test_medusa.py::test_medusa_heads_command_trains_heads_the_converter_reads",
    "tests/test_tune.py::test_cpu_engine_threads_are_searched_where_a_profile_has_them",
    "tests/test_tune.py::test_cpu_target_with_a_profile_ranks_by_the_prediction",
    "tests/test_tune.py::test_cross_check_*",
    "tests/test_tune.py::test_written_specs_*",
    "tests/test_tune.py::test_a_tuned_spec_launches_its_replicas",
    "tests/test_tune.py::test_a_mean_slo_is_not_said_to_stand_for_a_percentile",
    "tests/test_tune.py::test_pareto_labels_do_not_overlap",
    "tests/test_tune.py::test_speculative_decoding_is_searched_on_and_off_only_where_the_spec_has_a_draft",
    # Measured on 2 shared cores (2026-12-07): 16 and 22 s, ten reports' refit of three multipliers (calibrate).
    "tests/test_calibrate.py::test_fitting_half_the_mixes_cuts_the_error_on_the_other_half*",
)


def pytest_collection_modifyitems(items):
    for item in items:
        fixturedefs = item._fixtureinfo.name2fixturedefs  # every fixture the test uses, transitively
        wanted = {m for defs in fixturedefs.values() for d in defs for m in getattr(d.func, "tier_markers", ())}
        if item.get_closest_marker("e2e"):
            wanted.add(SERVER)
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in SLOW_UNIT_TESTS):
            wanted.add("slow")
        for marker in sorted(wanted - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)
    _longest_files_first(items)


def _longest_files_first(items) -> None:
    """Files with the most server or slow tests first, each file's tests kept together and in order: `make test`
    hands whole files to two xdist workers in this order, so the long ones start early and the short unit files
    even out the end, rather than one worker finishing a long server file alone (longest job first)."""
    weight: dict = {}
    for item in items:
        heavy = item.get_closest_marker(SERVER) is not None or item.get_closest_marker("slow") is not None
        weight[item.path] = weight.get(item.path, 0) + heavy
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-weight[item.path], first_seen[item.path]))


def make_hf_llama(out: Path, *, vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, seed=0,
                  dtype=torch.float32, **extra) -> Path:
    """Write a random LlamaForCausalLM (config.json + model.safetensors) to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, **extra)
    model = LlamaForCausalLM(config).to(dtype).eval()
    # Random init gives near-uniform logits; scale weights up so greedy decoding
    # is decisive and parity tests are meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    """GQA Llama (4 heads, 2 KV heads), vocab 250 (not divisible by 4), untied."""
    return make_hf_llama(tmp_path_factory.mktemp("hf-llama"))


@pytest.fixture(scope="session")
def hf_llama_words(tmp_path_factory) -> Path:
    """hf_llama's model with a WordLevel tokenizer (token i is the word `w<i>`), for tests that send text."""
    from triton_helpers import make_tiny_tokenizer

    out = make_hf_llama(tmp_path_factory.mktemp("hf-llama-words"))
    make_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def hf_llama_chars(tmp_path_factory) -> Path:
    """hf_llama's model with a character tokenizer (every printable ASCII character a token), for guided decoding."""
    from triton_helpers import make_char_tokenizer

    out = make_hf_llama(tmp_path_factory.mktemp("hf-llama-chars"))
    make_char_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def hf_llama_tied(tmp_path_factory) -> Path:
    return make_hf_llama(tmp_path_factory.mktemp("hf-llama-tied"), tie_word_embeddings=True, seed=1)


def write_spec(path: Path, checkpoint: Path, **sections) -> Path:
    """Write a spec YAML for `checkpoint`; keyword arguments are top-level sections."""
    data = {"name": sections.pop("name", "test-model"), "model": {"checkpoint": str(checkpoint), "dtype": "float32"}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# -- every registered family: Mistral, Qwen2, Qwen3 (and Llama variants) -------------

TINY_DIMS = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
HF_CLASSES = {
    "Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("Phi3Config", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "Llama4ForCausalLM": ("Llama4TextConfig", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("Llama4Config", "Llama4ForConditionalGeneration"),
}
# A tiny DeepSeek-V3 (notes i36 §5): MLA ranks unlike each other and the hidden size, 8 experts in 4 groups of
# which 2 are chosen, one dense layer before the mixtures, and a shared expert.
DEEPSEEK_V3_TINY = dict(num_key_value_heads=4, intermediate_size=80, moe_intermediate_size=24, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12)
# Multimodal checkpoints whose text model's keys nest in text_config, with the smallest vision tower transformers
# builds (its tensors are what the text path skips).
TINY_VISION = {"Llama4ForConditionalGeneration": dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=32,
    projector_input_dim=32, projector_output_dim=32, image_size=28, patch_size=14)}


def make_hf_model(arch: str, out: Path, *, seed=0, dtype=torch.float32, **overrides) -> Path:
    """Write a random `arch` checkpoint (config.json + model.safetensors) to `out`.

    Like make_hf_llama, 2-D weights are scaled up so greedy decoding is
    decisive; in addition biases and norm weights are randomised, because HF
    initialises them to zeros and ones, which would hide a bias or norm that
    is dropped, swapped between ranks or applied twice."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[arch])
    torch.manual_seed(seed)
    kwargs = {**TINY_DIMS, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    vision = TINY_VISION.get(arch)
    config = config_cls(text_config=kwargs, vision_config=vision) if vision else config_cls(**kwargs)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # transformers 5 holds a layer's experts as one 3-D parameter (Mixtral)
                param.mul_(4.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            else:  # RMSNorm weights (input, post-attention, final, q/k norms)
                param.copy_(1.0 + 0.25 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zeros at init
                buffer.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def hf_mistral(tmp_path_factory) -> Path:
    """Mistral with an 8-token sliding window, so 20-token prompts exercise it."""
    return make_hf_model("MistralForCausalLM", tmp_path_factory.mktemp("hf-mistral"), seed=11, sliding_window=8)


@pytest.fixture(scope="session")
def hf_qwen2(tmp_path_factory) -> Path:
    """Qwen2 with q/k/v biases, tied embeddings (like Qwen2 0.5B/1.5B), vocab 251."""
    return make_hf_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("hf-qwen2"), seed=12, vocab_size=251,
                         tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm, head_dim 32 (not hidden / heads = 16)."""
    return make_hf_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("hf-qwen3"), seed=13, head_dim=32)


@pytest.fixture(scope="session")
def hf_llama32(tmp_path_factory) -> Path:
    """Llama 3.2 style: llama3 RoPE scaling and tied embeddings."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return make_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("hf-llama32"), seed=14,
                         tie_word_embeddings=True, rope_parameters=rope)


MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def write_medusa_heads(out: Path, hf_dir: Path, *, num_heads=3, num_layers=1, choices=MEDUSA_TREE, seed=0,
                       scale=0.02) -> Path:
    """Heads in Medusa's layout for the model at hf_dir: small random residual layers and each
    head's lm_head a copy of the model's (so the heads' guesses are plausible tokens)."""
    from safetensors.torch import load_file, save_file

    from toolchain.upstream import facts

    names = facts("medusa")["names"]

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(next(hf_dir.glob("*.safetensors")))
    lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    state = {}
    for i in range(num_heads):
        for layer in range(num_layers):
            state[names["hf_linear"].format(h=i, l=layer, part="weight")] = torch.randn(h, h, generator=g) * scale
            state[names["hf_linear"].format(h=i, l=layer, part="bias")] = torch.randn(h, generator=g) * scale
        state[names["hf_lm_head"].format(h=i, L=num_layers)] = lm.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "medusa_lm_head.safetensors"))
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                                                 "medusa_choices": choices}))
    return out


def write_eagle_draft(out: Path, hf_dir: Path, *, layers=1, with_embed=True, prefix="", seed=0) -> Path:
    """An EAGLE-1 draft for the model at hf_dir in the layout EAGLE's trainer publishes (re-saved as
    safetensors): fc [H, 2H] + bias, `layers.{l}.*` in HF Llama names without the first layer's
    input_layernorm, optionally the shared embedding; small random weights."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    state = {"fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h)}
    for layer in range(layers):
        p = f"{prefix}layers.{layer}."
        state.update({p + "self_attn.q_proj.weight": rnd(nh * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
                      p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nh * hd),
                      p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                      p + "mlp.down_proj.weight": rnd(h, inter), p + "post_attention_layernorm.weight": 1 + rnd(h)})
        if layer > 0:
            state[p + "input_layernorm.weight"] = 1 + rnd(h)
    if with_embed:
        state[prefix + "embed_tokens.weight"] = load_file(next(hf_dir.glob("*.safetensors")))[
            "model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "max_position_embeddings", "hidden_act")
    config = {k: cfg[k] for k in keep if k in cfg}
    config.update(architectures=["LlamaForCausalLM"], num_hidden_layers=layers, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config))
    return out
