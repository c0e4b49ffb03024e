"""DeepSeek-V3 / R1 as released: FP8 with 128x128 block scales (config.json quantization_config quant_method "fp8",
weight_block_size [128, 128]; each quantized linear an e4m3 weight with its float32 weight_scale_inv grid), imported
as stored on the LLM-API path. A tiny DeepSeek quantized by the toolchain's own quant/fp8_block.py math in that
on-disk layout, with widths of whole and partial tiles (hidden 256, experts 256 wide, q_lora 192, the latent 128 +
64): the import keeps every tile as stored (the MLA projections, the dense MLP, the routed and shared experts) and
what is stored unquantized so (the router, its bias, norms, embedding, lm_head, and one layer's kv_b_proj, which
TensorRT-LLM's TRTLLM MoE backend also excludes); the plan counts it at the bytes convert writes; the CPU engine runs
it at tp 1 and tp 2 with the logits of transformers on the dequantized weights with every quantized linear's input
rounded per 1x128 as TensorRT-LLM's fp8_quantize_1x128 rounds it (the FP8 block-scale GEMM's activations, which the
engine emulates: engine/cpu/qlinear.py Fp8BlockScales). Against transformers without that rounding the logits differ
by far more, so the rounding is what the reference must include."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, hf_logits  # noqa: F401

from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.errors import ToolchainError
from toolchain.quant.fp8_block import dequantize_fp8_block, fake_quantize_fp8_per_1x128, quantize_fp8_block
from toolchain.quant.view import Quantization
from toolchain.targets import LLMAPI

ARCH = "DeepseekV3ForCausalLM"
# Per-rank widths at tp 2 in whole tiles where a split or a concatenation meets them (q_b 2 heads x 128 rows, kv_b
# 2 x (64 + 64), o_proj's input 2 x 64, the dense MLP 256, each expert 128 per moe_tp rank, the shared expert 128);
# partial edge tiles where nothing cuts (q_a 192 rows, kv_a 128 + 64 rows, q_b's 192 input columns).
DIMS = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
            q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
            max_position_embeddings=256)
QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
KEPT_BF16 = "model.layers.0.self_attn.kv_b_proj.weight"  # stored unquantized: the import must keep it so
PROMPTS = [[1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], [1, 5, 9, 33, 200, 7, 7, 7, 8, 9, 10, 11, 12, 13]]

_CACHE: dict = {}


def quantized(name: str, t: torch.Tensor) -> bool:
    """The linears a DeepSeek-V3 checkpoint stores in FP8: every decoder projection but the router."""
    return (t.dim() == 2 and name.startswith("model.layers.") and name != KEPT_BF16
            and name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight")))


def make_bf16(out: Path) -> Path:
    """The bf16 DeepSeek the FP8 one is quantized from, with a tokenizer whose token i is the word w<i>."""
    from triton_helpers import make_tiny_tokenizer

    src = make_hf_model(ARCH, out, seed=31, dtype=torch.bfloat16, **DIMS)
    make_tiny_tokenizer(src, DIMS["vocab_size"])
    return src


def write_fp8(source: Path, out: Path) -> Path:
    """The bf16 model in DeepSeek's on-disk FP8 layout: weight e4m3, weight_scale_inv float32 [ceil(out/128),
    ceil(in/128)] per quantized linear (quantize_fp8_block), the rest bf16, config.json's quantization_config as
    the released checkpoints carry it."""
    state = load_file(str(source / "model.safetensors"))
    for name in [n for n, t in state.items() if quantized(n, t)]:
        prefix = name.removesuffix(".weight")
        state[name], state[prefix + ".weight_scale_inv"] = quantize_fp8_block(state[name].float())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": QC}))
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, out / f.name)
    return out


def dequantized_model(fp8: Path, out: Path):
    """(transformers in float32 on the dequantized weights, the storages of its FP8 weights)."""
    from transformers import AutoModelForCausalLM

    state = load_file(str(fp8 / "model.safetensors"))
    plain = {}
    for name, t in state.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = state.get(name.removesuffix(".weight") + ".weight_scale_inv")
        plain[name] = dequantize_fp8_block(t, scale) if scale is not None else t.float()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    # the eager experts, whose per-expert F.linear calls `fp8_activations` sees (not the grouped kernels)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager").eval()
    assert model.config._experts_implementation == "eager"
    fp8_weights = {n for n, t in state.items() if t.dtype == torch.float8_e4m3fn}
    storages = set()
    for name, param in model.named_parameters():
        # transformers 5 holds a layer's experts as gate_up_proj / down_proj stacks: every expert is FP8 here
        if name in fp8_weights or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            storages.add(param.untyped_storage().data_ptr())
    assert len(storages) == (4 + 3) + (5 + 2 + 3)  # layer 0: MLA but kv_b, the MLP; 1: MLA, expert stacks, shared
    return model, storages


@contextlib.contextmanager
def fp8_activations(storages: set[int]):
    """transformers with the input of every FP8 linear (its weight in `storages`) rounded per token and 128 columns
    through e4m3 (fp8_quantize_1x128's `scale_1x128_kernel`, quant/fp8_block.py), as the block-scale GEMM takes it."""
    linear = torch.nn.functional.linear

    def fp8_linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            x = fake_quantize_fp8_per_1x128(x)
        return linear(x, weight, bias)

    torch.nn.functional.linear = fp8_linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def rounded_logits(model, storages: set[int], prompt: list[int]) -> torch.Tensor:
    with fp8_activations(storages):
        return hf_logits(model, prompt)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_bf16(tmp_path_factory.mktemp("dsv3-bf16"))


@pytest.fixture(scope="module")
def fp8(source, tmp_path_factory) -> Path:
    return write_fp8(source, tmp_path_factory.mktemp("dsv3-fp8"))


@pytest.fixture(scope="module")
def reference(fp8, tmp_path_factory):
    return dequantized_model(fp8, tmp_path_factory.mktemp("dsv3-dequantized"))


def cpu_llm(fp8: Path, work: Path, tp: int, ep: int):
    from toolchain.llmapi.cpu_llm import CpuLLM

    return CpuLLM(model=str(fp8), backend="pytorch", tensor_parallel_size=tp, moe_expert_parallel_size=ep,
                  max_batch_size=2, max_seq_len=64, max_num_tokens=128,
                  kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 1024}, work_dir=work)


# -- the import --------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("tp", [1, 2])
def test_convert_keeps_every_tile_as_stored(fp8, tmp_path, tp):
    hf = load_file(str(fp8 / "model.safetensors"))
    config = convert_checkpoint(fp8, tmp_path, tp=tp, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI)
    assert config["quantization"] == {
        "quant_algo": "FP8_BLOCK_SCALES", "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "transformer.vocab_embedding", "*router", "*shared_expert_gate",
                            "*shared_expert_gate.weight", "transformer.layers.0.attention.kv_b_proj"]}
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(tp)]
    a, t = "model.layers.1.self_attn", "transformer.layers.1"
    for r, rank in enumerate(ranks):
        def rows(name, n=tp, r=r):
            return hf[name].chunk(n)[r]
        # q_b split by head rows, its grid by whole tiles; q_a whole (replicated), o_proj's columns and grid columns
        assert torch.equal(bits(rank[f"{t}.attention.q_b_proj.weight"]), bits(rows(f"{a}.q_b_proj.weight")))
        assert torch.equal(rank[f"{t}.attention.q_b_proj.weights_scaling_factor"], rows(f"{a}.q_b_proj.weight_scale_inv"))
        assert torch.equal(rank[f"{t}.attention.q_a_proj.weights_scaling_factor"], hf[f"{a}.q_a_proj.weight_scale_inv"])
        assert rank[f"{t}.attention.q_a_proj.weights_scaling_factor"].shape == (2, 2)  # 192 x 256: a partial row tile
        assert torch.equal(rank[f"{t}.attention.dense.weights_scaling_factor"],
                           hf[f"{a}.o_proj.weight_scale_inv"].chunk(tp, dim=1)[r])
        # the stacked experts: rank r's fc is [w3_e; w1_e] of each expert's moe_tp slice, grids likewise
        e = "model.layers.1.mlp.experts"
        fc = rank[f"{t}.mlp.fc.weights_scaling_factor"]
        assert fc.shape == (8, 2 * 2 // tp, 2)
        assert torch.equal(fc[3], torch.cat([rows(f"{e}.3.up_proj.weight_scale_inv"),
                                             rows(f"{e}.3.gate_proj.weight_scale_inv")]))
        assert torch.equal(bits(rank[f"{t}.mlp.proj.weight"][5]),
                           bits(hf[f"{e}.5.down_proj.weight"].chunk(tp, dim=1)[r]))
        shared = rank[f"{t}.mlp.shared_expert.fc.weight"]
        assert torch.equal(bits(shared), bits(torch.cat([rows("model.layers.1.mlp.shared_experts.up_proj.weight"),
                                                         rows("model.layers.1.mlp.shared_experts.gate_proj.weight")])))
        # kept as stored: the router float32 as every MoE family's, layer 0's kv_b_proj and the norms bf16
        assert rank[f"{t}.mlp.router.weight"].dtype == torch.float32
        assert rank[f"{t}.mlp.router.e_score_correction_bias"].dtype == torch.float32
        assert rank["transformer.layers.0.attention.kv_b_proj.weight"].dtype == torch.bfloat16
        assert "transformer.layers.0.attention.kv_b_proj.weights_scaling_factor" not in rank
        assert rank["transformer.layers.0.mlp.fc.weight"].dtype == torch.float8_e4m3fn
        assert rank["lm_head.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2-ep2"])
def test_the_cpu_engine_runs_it_as_transformers_on_the_dequantized_weights(fp8, reference, tmp_path, tp, ep):
    """What target llmapi-cpu serves (CpuLLM: the import, then the CPU engine's FP8 block-scale linears for the MLA
    projections, the dense MLP and both kinds of experts) against transformers on the same values: at tp 2 each
    expert's width over moe_tp 2, or (ep 2) the experts whole over moe_ep 2."""
    model, storages = reference
    with cpu_llm(fp8, tmp_path / "llm", tp, ep) as llm:
        assert (llm.engine.dims.quant_algo, llm.engine.dims.tp, llm.engine.dims.moe_ep) == ("FP8_BLOCK_SCALES", tp, ep)
        layer = llm.engine.model.stages[0][0].layers[1]
        assert type(layer.mla.q_b).__name__ == type(layer.experts.fc[0]).__name__ == "Fp8BlockScales"
        assert type(llm.engine.model.stages[0][0].layers[0].mla.kv_b).__name__ == "Linear"
        for prompt in PROMPTS:
            got = llm.engine.forward_logits(prompt)
            want = rounded_logits(model, storages, prompt)
            if tp == 1:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # measured: bit-equal
            else:
                # the ranks' partial sums added in another order (measured 1e-6 to 3e-6); a last-bit difference can
                # flip one e4m3 rounding of a 1x128 activation group, which moved one position of the second prompt
                # by 5.2e-3 (1e-3 of the largest logit, measured): at most one position per prompt, argmax the same
                diff = (got - want).abs().amax(dim=-1)
                assert int((diff > 1e-4).sum()) <= 1 and float(diff.max()) < 2e-3 * float(want.abs().max())
                assert torch.equal(got.argmax(-1), want.argmax(-1))
            # without the activation rounding the logits are far off: the reference needs it
            assert float((hf_logits(model, prompt) - got).abs().max()) > 1e-2


# -- the plan ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [True, False], ids=["checkpoint", "config-only"])
def test_plan_counts_it_at_the_bytes_convert_writes(fp8, tmp_path, capsys, weights):
    """`toolchain plan` of the FP8 checkpoint's config.json alone (as build/deepseek-r1-fp8-8xh200.yaml plans the
    released one) counts each rank at convert's bytes: e4m3 weights plus float32 tiles; of the checkpoint itself,
    but for the linear it stores unquantized."""
    from test_plan_agrees_with_convert import plan_json, spec_file

    from toolchain.checkpoint.convert import plan_any

    ckpt = fp8
    if not weights:
        ckpt = tmp_path / "config-only"
        ckpt.mkdir()
        for f in fp8.iterdir():
            if f.name != "model.safetensors":
                shutil.copy2(f, ckpt / f.name)
    rc, report = plan_json(tmp_path, spec_file(tmp_path, ckpt, target="llmapi", parallelism={"tp": 2},
                                               gpu={"name": "H200"}, model={"dtype": "bfloat16"}), capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    dry = plan_any(ckpt, tp=2, pp=1, dtype="bfloat16", target="trtllm", path=LLMAPI)
    assert dry.quant is not None and dry.quant.quant_algo == "FP8_BLOCK_SCALES"
    planned = [r["checkpoint_bytes"] for r in report["ranks"]]
    # The plan counts every decoder linear in the checkpoint's format (plan/memory.py reads no per-module list), so
    # the checkpoint's one linear stored bf16 (layer 0's kv_b_proj, 256 x 128 a rank) is counted as e4m3 and tiles.
    kept = 256 * 128 * 2 - (256 * 128 + 2 * 1 * 4) if weights else 0
    assert [p + kept for p in planned] == [dry.rank_bytes(r) for r in range(2)]


# -- refusals ----------------------------------------------------------------------------------------------------


def test_computing_fp8_block_on_the_bf16_model_is_refused_in_one_line(source, tmp_path):
    with pytest.raises(ToolchainError) as err:
        convert_checkpoint(source, tmp_path, tp=1, pp=1, target="cpu", path=LLMAPI,
                           quantization=Quantization(method="fp8_block"))
    assert "quantization fp8_block on DeepseekV3ForCausalLM" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_split_that_cuts_a_tile_is_refused_in_one_line_by_plan_and_convert(fp8, tmp_path, capsys):
    """At tp 4 a rank's o_proj input is one head's 64 values, part of a 128x128 tile whose one scale covers it whole:
    refused before anything is written, by plan's check as by convert. Experts cut by moe_tp likewise."""
    from test_plan_agrees_with_convert import plan_json, spec_file, statuses

    from toolchain.archs import load_params, moe

    rc, report = plan_json(tmp_path, spec_file(tmp_path, fp8, target="llmapi", parallelism={"tp": 4},
                                               gpu={"name": "H200"}, model={"dtype": "bfloat16"}), capsys=capsys)
    status, message = statuses(report)["quant.group-padding"]
    assert rc != 0 and status == "fail" and "o_proj's input per rank (heads / tp x v_head_dim) 64" in message
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError) as err:
        convert_checkpoint(fp8, out, tp=4, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI)
    assert "o_proj's input per rank" in str(err.value) and "\n" not in str(err.value)
    assert not any(out.iterdir())
    _, params = load_params(json.loads((fp8 / "config.json").read_text()))
    assert moe.tile_problem(params, 128, 4, 4) == ("FP8 block-scale experts: the expert moe_intermediate_size per rank "
                                                   "(256 / moe_tp 4 = 64) is not whole 128x128 tiles")
    assert "the shared expert's width per rank (256 / tp 4 = 64)" in str(moe.tile_problem(params, 128, 4, 2))
    assert moe.tile_problem(params, 128, 2, 2) is None and moe.tile_problem(params, 128, 2, 1) is None


def test_the_mtp_layer_is_dropped_with_its_fp8_tensors(fp8, tmp_path):
    """The released checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}.*) is stored in FP8
    too; convert drops it, quantized weights and scale grids alike, and writes what it writes without it."""
    hf = tmp_path / "hf"
    shutil.copytree(fp8, hf)
    state = load_file(str(hf / "model.safetensors"))
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(256, 512), "model.layers.2.self_attn.q_a_proj.weight":
           torch.randn(192, 256), "model.layers.2.mlp.experts.0.up_proj.weight": torch.randn(256, 256)}
    for name, w in mtp.items():
        state[name], state[name.removesuffix(".weight") + ".weight_scale_inv"] = quantize_fp8_block(w)
    state["model.layers.2.enorm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    for src, out in ((fp8, tmp_path / "without"), (hf, tmp_path / "with")):
        out.mkdir()
        convert_checkpoint(src, out, tp=1, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI)
    want, got = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("without", "with"))
    assert sorted(got) == sorted(want) and all(torch.equal(bits(got[n]), bits(want[n])) for n in want)
