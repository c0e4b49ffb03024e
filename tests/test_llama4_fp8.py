"""Llama 4 in FP8 on the LLM-API path (checkpoint/stacked_fp8.py, quant/calibration_llama4.py): the export writes each
MoE layer's experts as ModelOpt's HF export writes Llama4TextExperts and TensorRT-LLM's FUSED_GATE_UP_PROJ loader reads
them (gate_up_proj / down_proj e4m3 stacks in transformers' [E, in, out] layout, one scalar weight_scale and
input_scale a stack; archs/llama4.py's docstring gives the sources), attention, the shared expert and the dense MLPs
as FP8 linears, the router bfloat16 and excluded. The CPU stand-in imports it as stored and runs it at tp 1, tp 2 and
tp 2 / moe_ep 2 with the logits of transformers on the dequantized weights, every FP8 GEMM's input rounded through
e4m3 at its activation scale (the expert's input after the router score scales it, as apply_router_weight_on_input
does). The plan counts what convert writes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, hf_logits  # noqa: F401
from test_parity_families import LLAMA4

from toolchain.checkpoint.convert import convert_checkpoint, plan_checkpoint
from toolchain.checkpoint.hf_quant import export_hf_quantized
from toolchain.errors import ToolchainError
from toolchain.quant import fp8 as fp8q
from toolchain.quant.view import Quantization
from toolchain.targets import LLMAPI

PROMPTS = ([1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], [5, 9, 200, 31, 77, 2, 130])
FF = "model.layers.{}.feed_forward"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from triton_helpers import make_tiny_tokenizer

    src = make_hf_model("Llama4ForCausalLM", tmp_path_factory.mktemp("l4-bf16"), dtype=torch.bfloat16, **LLAMA4)
    make_tiny_tokenizer(src, json.loads((src / "config.json").read_text())["vocab_size"])
    return src


def calibration() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (16,), generator=g) for _ in range(4)]


@pytest.fixture(scope="module")
def fp8(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("l4-fp8")
    export_hf_quantized(source, out, Quantization(method="fp8"), "bfloat16", calibration=calibration())
    return out


def test_the_export_writes_the_stacked_experts_as_modelopt_does(source, fp8):
    src, got = load_file(str(source / "model.safetensors")), load_file(str(fp8 / "model.safetensors"))
    hq = json.loads((fp8 / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] is None
    assert hq["exclude_modules"] == ["lm_head", "model.embed_tokens", FF.format(1) + ".router", FF.format(3) + ".router"]
    for layer in (1, 3):
        e = FF.format(layer) + ".experts"
        for name, shape in (("gate_up_proj", (4, 64, 64)), ("down_proj", (4, 32, 64))):
            w, s, a = got[f"{e}.{name}"], got[f"{e}.{name}_weight_scale"], got[f"{e}.{name}_input_scale"]
            assert (w.dtype, tuple(w.shape)) == (torch.float8_e4m3fn, shape)  # transformers' [E, in, out] kept
            assert s.shape == a.shape == () and s.dtype == a.dtype == torch.float32 and float(a) > 0
            whole = src[f"{e}.{name}"].float()
            assert torch.equal(s.reshape(1), fp8q.fp8_scale(whole.abs().max()))  # one scale over every expert
            assert torch.equal(w.view(torch.uint8), fp8q.to_fp8(whole, s).view(torch.uint8))
        assert got[FF.format(layer) + ".router.weight"].dtype == torch.bfloat16
        assert got[FF.format(layer) + ".shared_expert.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert got[FF.format(0) + ".gate_proj.weight"].dtype == torch.float8_e4m3fn  # a dense layer's MLP
    # the shared expert's gate and up share their input and so its scale, as q, k and v do
    assert torch.equal(got[FF.format(1) + ".shared_expert.gate_proj.input_scale"],
                       got[FF.format(1) + ".shared_expert.up_proj.input_scale"])


def test_convert_cuts_the_stored_bytes_over_the_experts_ranks(fp8, tmp_path):
    hf = load_file(str(fp8 / "model.safetensors"))
    convert_checkpoint(fp8, tmp_path, tp=2, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI, moe_ep=2)
    e, t = FF.format(1) + ".experts", "transformer.layers.1.mlp"
    for r in range(2):
        rank = load_file(str(tmp_path / f"rank{r}.safetensors"))
        mine = slice(2 * r, 2 * r + 2)  # moe_ep 2: experts 0, 1 on rank 0 and 2, 3 on rank 1, whole
        gate, up = hf[f"{e}.gate_up_proj"][mine].view(torch.uint8).transpose(1, 2).chunk(2, dim=1)
        assert torch.equal(rank[f"{t}.fc.weight"].view(torch.uint8), torch.cat([up, gate], dim=1))
        assert torch.equal(rank[f"{t}.proj.weight"].view(torch.uint8),
                           hf[f"{e}.down_proj"][mine].view(torch.uint8).transpose(1, 2))
        assert torch.equal(rank[f"{t}.fc.weights_scaling_factor"], hf[f"{e}.gate_up_proj_weight_scale"].expand(2, 1))
        assert torch.equal(rank[f"{t}.proj.activation_scaling_factor"], hf[f"{e}.down_proj_input_scale"].reshape(1))
        assert rank[f"{t}.router.weight"].dtype == torch.float32
        written = sum(v.numel() * v.element_size() for v in rank.values())
        assert written == plan_checkpoint(fp8, tp=2, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI,
                                          moe_ep=2).rank_bytes(r)


# -- the CPU stand-in against transformers -------------------------------------------------------------------------

def reference(fp8: Path, out: Path):
    """transformers in float32 on the weights the import runs (q/k/v, and each gate/up pair, brought to their
    group's larger weight scale as TensorRT-LLM's fused FP8 loaders do: hf_quant.fuse_group), and the activation
    scale of every FP8 linear's weight storage."""
    from transformers import AutoModelForCausalLM

    state = load_file(str(fp8 / "model.safetensors"))
    groups = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("feed_forward.gate_proj", "feed_forward.up_proj"), ("feed_forward.down_proj",),
              ("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
              ("feed_forward.shared_expert.down_proj",)]
    plain = {n: t.float() for n, t in state.items() if t.dtype != torch.float8_e4m3fn and not n.endswith("_scale")}
    acts: dict[str, torch.Tensor] = {}
    for layer in range(4):
        for members in groups:
            names = [f"model.layers.{layer}.{m}" for m in members]
            if names[0] + ".weight" not in state:
                continue
            top = torch.stack([state[n + ".weight_scale"] for n in names]).max()
            for n in names:
                w = fp8q.from_fp8(state[n + ".weight"], state[n + ".weight_scale"])
                plain[n + ".weight"] = fp8q.from_fp8(fp8q.to_fp8(w, top), top)
                acts[n + ".weight"] = torch.stack([state[m + ".input_scale"] for m in names]).max()
        for name in ("gate_up_proj", "down_proj"):
            n = FF.format(layer) + ".experts." + name
            if n in state:
                plain[n] = fp8q.from_fp8(state[n], state[n + "_weight_scale"])
                acts[n] = state[n + "_input_scale"]
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    scales = {p.untyped_storage().data_ptr(): acts[n] for n, p in model.named_parameters() if n in acts}
    assert len(scales) == 4 * 4 + 2 * 3 + 2 * (2 + 3)  # attention everywhere; dense MLPs; experts and shared
    return model, scales


@contextlib.contextmanager
def fp8_activations(scales: dict[int, torch.Tensor]):
    """Every FP8 GEMM's input rounded through e4m3 at its activation scale: the linears' (F.linear) and the experts'
    (Llama4TextExperts.forward's two bmm: the routed input, then the down projection's)."""
    from transformers.models.llama4 import modeling_llama4 as m4

    linear, experts_forward = torch.nn.functional.linear, m4.Llama4TextExperts.forward

    def fp8_linear(x, weight, bias=None):
        a = scales.get(weight.untyped_storage().data_ptr())
        return linear(x if a is None else fp8q.fake_fp8(x, a), weight, bias)

    def fp8_experts(self, hidden_states):
        a_fc = scales[self.gate_up_proj.untyped_storage().data_ptr()]
        a_proj = scales[self.down_proj.untyped_storage().data_ptr()]
        x = fp8q.fake_fp8(hidden_states.view(self.num_experts, -1, self.hidden_size), a_fc)
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        y = fp8q.fake_fp8(up * self.act_fn(gate), a_proj)
        return torch.bmm(y, self.down_proj).view(-1, self.hidden_size)

    torch.nn.functional.linear, m4.Llama4TextExperts.forward = fp8_linear, fp8_experts
    try:
        yield
    finally:
        torch.nn.functional.linear, m4.Llama4TextExperts.forward = linear, experts_forward


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)], ids=["tp1", "tp2", "tp2-ep2"])
def test_the_cpu_stand_in_runs_it_as_transformers_on_the_dequantized_weights(fp8, tmp_path, tp, ep):
    from toolchain.llmapi.cpu_llm import CpuLLM

    (tmp_path / "ref").mkdir()
    model, scales = reference(fp8, tmp_path / "ref")
    with CpuLLM(model=str(fp8), backend="pytorch", tensor_parallel_size=tp, moe_expert_parallel_size=ep,
                max_batch_size=2, max_seq_len=64, max_num_tokens=128,
                kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 1024}, work_dir=tmp_path / "llm") as llm:
        assert (llm.engine.dims.quant_algo, llm.engine.dims.tp, llm.engine.dims.moe_ep) == ("FP8", tp, ep)
        for prompt in PROMPTS:
            got = llm.engine.forward_logits(prompt)
            with fp8_activations(scales):
                want = hf_logits(model, prompt)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # measured: 7e-7 at most
            assert float((hf_logits(model, prompt) - got).abs().max()) > 1e-2  # the rounding is what must match


# -- the plan ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["bf16-source", "export", "export-config-only"])
def test_plan_counts_what_convert_writes(source, fp8, tmp_path, capsys, what):
    """`toolchain plan` of an FP8 spec on the bf16 source (as build/llama4-scout-4xh100.yaml plans Scout), of the
    export, and of the export's config.json alone: each rank at the bytes convert writes importing the export."""
    import shutil

    from test_plan_agrees_with_convert import plan_json, spec_file

    from toolchain.checkpoint.convert import plan_any

    ckpt, quant = (source, {"method": "fp8"}) if what == "bf16-source" else (fp8, {})
    if what == "export-config-only":
        ckpt = tmp_path / "config-only"
        ckpt.mkdir()
        for f in fp8.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy2(f, ckpt / f.name)
    rc, report = plan_json(tmp_path, spec_file(tmp_path, ckpt, target="llmapi", parallelism={"tp": 2, "moe_ep": 2},
                                               model={"dtype": "bfloat16"}, quantization=quant), capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    dry = plan_any(fp8, tp=2, pp=1, dtype="bfloat16", target="trtllm", path=LLMAPI, moe_ep=2)
    assert dry.quant is not None and dry.quant.quant_algo == "FP8"
    assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(2)]


def test_an_fp8_kv_cache_rides_along(source, tmp_path):
    """kv_cache fp8 beside the FP8 weights: the k/v scales as the export writes them for every family (k_proj.k_scale,
    v_proj.v_scale), and the CPU stand-in runs its FP8 cache with them, greedy the same at tp 2 / moe_ep 2 as at tp 1."""
    from test_modelopt_import import generate

    from toolchain.llmapi.cpu_llm import CpuLLM

    out = tmp_path / "fp8-kv"
    out.mkdir()
    export_hf_quantized(source, out, Quantization(method="fp8", kv_cache="fp8"), "bfloat16", calibration=calibration())
    got = load_file(str(out / "model.safetensors"))
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert all(got[f"model.layers.{i}.self_attn.{p}_proj.{p}_scale"].shape == () for i in range(4) for p in "kv")
    outputs, logits = {}, {}
    for tp in (1, 2):
        with CpuLLM(model=str(out), backend="pytorch", tensor_parallel_size=tp, moe_expert_parallel_size=tp,
                    max_batch_size=2, max_seq_len=64, max_num_tokens=128, work_dir=tmp_path / f"llm-{tp}",
                    kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 1024, "dtype": "fp8"}) as llm:
            assert (llm.engine.dims.quant_algo, llm.engine.dims.kv_cache_quant_algo) == ("FP8", "FP8")
            outputs[tp] = [generate(llm, p) for p in PROMPTS]
            logits[tp] = llm.engine.forward_logits(PROMPTS[0])
    assert outputs[2] == outputs[1] and all(len(o) == 12 for o in outputs[1])
    assert float((logits[2] - logits[1]).abs().max()) < 1e-3 * float(logits[1].abs().max())


# -- refusals ------------------------------------------------------------------------------------------------------

def test_computing_fp8_off_the_llmapi_export_is_refused_in_one_line(source, tmp_path):
    """The experts' FP8 is written by the HF-format export only (the engine path has no Llama 4): refused by the plan,
    before convert writes anything."""
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError, match="Llama 4's stacked experts are quantized by the LLM-API path's FP8 "
                                             "export only") as err:
        convert_checkpoint(source, out, tp=1, pp=1, target="cpu", quantization=Quantization(method="fp8"))
    assert "\n" not in str(err.value) and list(out.iterdir()) == []


@pytest.mark.parametrize("family,method,kv,what", [
    ("llama4-chunked-nope-moe", "awq", "none", "quantization awq of Llama4ForCausalLM"),
])
def test_what_is_not_written_is_refused_in_one_line(tmp_path_factory, tmp_path, family, method, kv, what):
    from test_parity_families import hf_dir

    with pytest.raises(ToolchainError, match=f"{what} is not supported yet") as err:
        export_hf_quantized(hf_dir(tmp_path_factory, family, "float32"), tmp_path,
                            Quantization(method=method, kv_cache=kv), "bfloat16")
    assert "\n" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_the_multimodal_checkpoint_exports_its_text_model_and_keeps_the_vision_tower(tmp_path_factory, tmp_path):
    """Llama4ForConditionalGeneration, as Scout is released: the text model under language_model. quantized as the
    text-only checkpoint is (the converted ranks equal, bit for bit, those of its text model exported alone), the
    vision tower written as stored (bfloat16, in exclude_modules) for the backend that builds the whole model; the
    CPU stand-in skips the tower and runs the text model."""
    from test_parity_families import hf_dir
    from triton_helpers import make_tiny_tokenizer

    from toolchain.llmapi.cpu_llm import CpuLLM

    src = hf_dir(tmp_path_factory, "llama4-multimodal-text", "float32")
    config = json.loads((src / "config.json").read_text())
    if not (src / "tokenizer.json").is_file():
        make_tiny_tokenizer(src, config["text_config"]["vocab_size"])
    text = tmp_path / "text"  # its text model alone, as a Llama4ForCausalLM checkpoint
    text.mkdir()
    state = load_file(str(src / "model.safetensors"))
    save_file({n.removeprefix("language_model."): t for n, t in state.items() if n.startswith("language_model.")},
              str(text / "model.safetensors"), metadata={"format": "pt"})
    (text / "config.json").write_text(json.dumps({**config["text_config"], "architectures": ["Llama4ForCausalLM"],
                                                  "dtype": "float32"}))
    ranks = {}
    for name, ckpt in (("multimodal", src), ("text", text)):
        out = tmp_path / f"fp8-{name}"
        out.mkdir()
        export_hf_quantized(ckpt, out, Quantization(method="fp8"), "bfloat16", calibration=calibration())
        (tmp_path / f"ckpt-{name}").mkdir()
        convert_checkpoint(out, tmp_path / f"ckpt-{name}", tp=2, pp=1, dtype="bfloat16", target="cpu", path=LLMAPI,
                           moe_ep=2)
        ranks[name] = [load_file(str(tmp_path / f"ckpt-{name}" / f"rank{r}.safetensors")) for r in range(2)]
        if name == "multimodal":
            got = load_file(str(out / "model.safetensors"))
            e = "language_model." + FF.format(1) + ".experts"
            assert got[e + ".gate_up_proj"].dtype == torch.float8_e4m3fn
            vision = [n for n in got if n.startswith(("vision_model.", "multi_modal_projector."))]
            assert vision and all(got[n].dtype == torch.bfloat16 for n in vision)
            excluded = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
            assert {"vision_model*", "multi_modal_projector*", "language_model.lm_head",
                    "language_model." + FF.format(1) + ".router"} <= set(excluded)
            with CpuLLM(model=str(out), backend="pytorch", tensor_parallel_size=2, moe_expert_parallel_size=2,
                        max_batch_size=2, max_seq_len=64, max_num_tokens=128, work_dir=tmp_path / "llm",
                        kv_cache_config={"free_gpu_memory_fraction": 0.5, "max_tokens": 1024}) as llm:
                assert llm.engine.dims.quant_algo == "FP8"
                assert torch.isfinite(llm.engine.forward_logits(PROMPTS[0])).all()
    for mine, alone in zip(ranks["multimodal"], ranks["text"], strict=True):
        assert set(mine) == set(alone)
        for n, t in mine.items():
            assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                               alone[n].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else alone[n]), n
