"""ModelOpt Hugging Face-format checkpoints (toolchain/checkpoint/hf_quant.py: FP8, W4A16_AWQ, FP8 KV
scales) imported by the converter as stored, at any TP/PP: each rank file holds what the engine path
writes for the same model and recipe (bitwise, where the two formats store the same numbers), the CPU
engine runs it with the same greedy output at tp 2 as at tp 1, and the LLM-API CPU stand-in loads
it. What cannot be imported is refused in one line, before anything is written."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_model
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.checkpoint.hf_quant import export_hf_quantized, hf_quantized_to_engine_tensors
from toolchain.errors import ToolchainError
from toolchain.quant.view import Quantization
from toolchain.spec import QuantizationSection

# hidden 256 and 4 heads of 64 split into whole int4 groups of 128 at tp 2; intermediate 384 is padded
# to 512 there (and not at tp 1), so the per-group MLP padding runs on imported tensors too.
DIMS = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, vocab_size=250,
            max_position_embeddings=256)
MODELS = {"llama": ("LlamaForCausalLM", {}),
          "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True})}  # q/k/v biases, tied lm_head
FORMATS = {"fp8_kv": dict(method="fp8", kv_cache="fp8"), "int4_awq": dict(method="awq")}
LAYERS = 2


def calib(n: int = 4, length: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, DIMS["vocab_size"], (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from triton_helpers import make_tiny_tokenizer

    made = {}
    for name, (arch, extra) in MODELS.items():
        src = make_hf_model(arch, tmp_path_factory.mktemp(name), seed=3, **DIMS, **extra)
        make_tiny_tokenizer(src, DIMS["vocab_size"])  # copied by the exporter: CpuLLM reads it
        made[name] = src
    return made


_EXPORTS: dict = {}


@pytest.fixture(scope="module")
def export(sources, tmp_path_factory):
    """(model, fmt) -> (source dir, exported ModelOpt-format dir), each exported once per module."""
    def get(model: str, fmt: str):
        if (model, fmt) not in _EXPORTS:
            out = tmp_path_factory.mktemp(f"{model}-{fmt}")
            q = QuantizationSection(**FORMATS[fmt], calibration={"samples": 4, "seq_len": 32})
            export_hf_quantized(sources[model], out, q, "float16", calibration=calib())
            _EXPORTS[(model, fmt)] = (sources[model], out)
        return _EXPORTS[(model, fmt)]
    return get


def convert(src: Path, out: Path, tp: int, pp: int = 1, **kw) -> dict:
    out.mkdir(parents=True)
    return convert_checkpoint(src, out, tp=tp, pp=pp, dtype="float16", target="cpu", **kw)


def rank_tensors(ckpt: Path, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / f"rank{rank}.safetensors"), framework="pt") as fh:
        return {n: fh.get_tensor(n) for n in fh.keys()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable bitwise: e4m3 and int8 payloads as bytes (torch.equal has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# Where the HF format stores other numbers than the engine path (test_hf_quant_export established it):
# AWQ folds the shared q/k/v and gate/up prequant vector into the norm (ones on the linear); FP8 scales
# q, k, v (and gate, up) separately, so the fused linear re-quantizes all but the largest-scale part.
ALLOWED = {"int4_awq": ("input_layernorm.weight", "post_layernorm.weight", "attention.qkv.prequant_scaling_factor",
                        "mlp.fc.prequant_scaling_factor", "mlp.gate.prequant_scaling_factor"),
           "fp8_kv": ("attention.qkv.weight", "mlp.fc.weight", "mlp.gate.weight")}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("model", list(MODELS))
def test_tp1_import_is_the_format_read_back(export, tmp_path, model, fmt):
    """At tp 1 the sharder writes exactly hf_quantized_to_engine_tensors' engine checkpoint."""
    _src, hf = export(model, fmt)
    config = convert(hf, tmp_path / "ckpt", tp=1)
    want, want_config = hf_quantized_to_engine_tensors(hf)
    assert config == want_config
    got = rank_tensors(tmp_path / "ckpt", 0)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    assert [n for n in got if got[n].dtype != want[n].dtype or not torch.equal(bits(got[n]), bits(want[n]))] == []


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("model", list(MODELS))
def test_ranks_match_the_engine_paths_conversion(export, tmp_path, model, fmt, tp, pp):
    src, hf = export(model, fmt)
    ours_cfg = convert(hf, tmp_path / "ours", tp=tp, pp=pp)
    ref_cfg = convert(src, tmp_path / "ref", tp=tp, pp=pp, quantization=Quantization(**FORMATS[fmt]), calibration=calib())
    assert ours_cfg == ref_cfg  # mapping, quantization block (algo, KV, group, exclusions), padded sizes
    for rank in range(tp * pp):
        ours, ref = rank_tensors(tmp_path / "ours", rank), rank_tensors(tmp_path / "ref", rank)
        assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in ref.items()}
        differ = sorted(n for n in ref if not torch.equal(bits(ours[n]), bits(ref[n])))
        allowed = {f"transformer.layers.{i}.{n}" for i in range(LAYERS) for n in ALLOWED[fmt]}
        assert set(differ) <= allowed, sorted(set(differ) - allowed)
        # Every int4 payload, every scale and every KV-cache scale is bitwise the engine path's.
        assert not any(n.endswith(("proj.weight", "dense.weight", "scaling_factor")) and "prequant" not in n
                       for n in differ), differ
        for n in differ if fmt == "fp8_kv" else ():
            # re-quantized to the shared scale: at most one e4m3 step away
            step = (ours[n].float() - ref[n].float()).abs()
            assert bool((step <= ref[n].float().abs() * 2 ** -3 + 2 ** -9).all()), n
        if fmt == "int4_awq":  # each norm-then-linear pair computes the same up to fp16 rounding
            for i in range(len(pp_layers(rank, tp, pp))):
                for norm, mod in (("input_layernorm", "attention.qkv"), ("post_layernorm", "mlp.fc")):
                    at = f"transformer.layers.{i}"
                    eff = [t[f"{at}.{norm}.weight"].float() * t[f"{at}.{mod}.prequant_scaling_factor"].float()
                           for t in (ours, ref)]
                    assert float(((eff[0] - eff[1]).abs() / eff[1].abs()).max()) < 2 ** -9


def test_linears_the_export_kept_fp16_stay_unquantized_at_tp2(sources, tmp_path):
    q = QuantizationSection(method="fp8", exclude_modules=["transformer.layers.1.attention.*"],
                            calibration={"samples": 4, "seq_len": 32})
    hf = tmp_path / "hf"
    hf.mkdir()
    export_hf_quantized(sources["llama"], hf, q, "float16", calibration=calib())
    config = convert(hf, tmp_path / "ours", tp=2)
    assert config["quantization"] == hf_quantized_to_engine_tensors(hf)[1]["quantization"]
    assert config["quantization"]["exclude_modules"] == ["lm_head", "transformer.vocab_embedding",
                                                         "transformer.layers.1.attention.qkv",
                                                         "transformer.layers.1.attention.dense"]
    convert(sources["llama"], tmp_path / "ref", tp=2, quantization=Quantization(method="fp8", exclude_modules=tuple(
        q.exclude_modules)), calibration=calib())
    for rank in range(2):
        ours, ref = rank_tensors(tmp_path / "ours", rank), rank_tensors(tmp_path / "ref", rank)
        assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in ref.items()}
        for n in ("attention.qkv.weight", "attention.dense.weight"):
            assert ours[f"transformer.layers.1.{n}"].dtype == torch.float16
            assert torch.equal(ours[f"transformer.layers.1.{n}"], ref[f"transformer.layers.1.{n}"])


def pp_layers(rank: int, tp: int, pp: int) -> list[int]:
    from toolchain.checkpoint.sharding import pp_layers as split

    return split(LAYERS, pp)[rank // tp]


def generate(llm, prompt: list[int], n: int = 12) -> list[int]:
    from toolchain.llmapi.cpu_llm import SamplingParams

    done, result = threading.Event(), {}

    def on_output(out):
        if out.finished:
            result["ids"] = list(out.outputs[0].token_ids)
            done.set()

    llm.generate_async(prompt, SamplingParams(max_tokens=n, ignore_eos=True, top_k=1), on_output=on_output)
    assert done.wait(120)
    return result["ids"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cpu_llm_runs_the_import_with_tp2_greedy_equal_to_tp1(export, tmp_path, fmt):
    from toolchain.llmapi.cpu_llm import CpuLLM
    from toolchain.manifest import Manifest
    from toolchain.workspace import Workspace

    _src, hf = export("llama", fmt)
    kv = {"free_gpu_memory_fraction": 0.5, "max_tokens": 2048}
    if fmt == "fp8_kv":
        kv["dtype"] = "fp8"  # allowed: the checkpoint carries the k/v scales
    prompts = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6]]
    outputs, logits = {}, {}
    for tp in (1, 2):
        work = tmp_path / f"tp{tp}"
        with CpuLLM(model=str(hf), backend="pytorch", tensor_parallel_size=tp, max_batch_size=2, max_seq_len=128,
                    max_num_tokens=256, kv_cache_config=kv, work_dir=work) as llm:
            assert llm.engine.dims.quant_algo == {"fp8_kv": "FP8", "int4_awq": "W4A16_AWQ"}[fmt]
            assert llm.engine.dims.kv_cache_quant_algo == ("FP8" if fmt == "fp8_kv" else None)
            outputs[tp] = [generate(llm, p) for p in prompts]
            logits[tp] = llm.engine.forward_logits(prompts[1])
            manifest = Manifest.read(Workspace(work).checkpoint_dir(llm.spec))
            assert "hf_quant_config.json" in manifest.inputs
    assert outputs[2] == outputs[1]
    assert all(len(o) == 12 for o in outputs[1])
    assert float((logits[2] - logits[1]).abs().max()) < 1e-2 * float(logits[1].abs().max())


def test_cpu_llm_quantizes_an_fp8_kv_cache_with_unit_scales_as_the_pytorch_backend(export, tmp_path, monkeypatch):
    """TensorRT-LLM 1.2.1's PyTorch backend keeps kv_cache_scaling_factor at 1.0 for an FP8 KV cache; the
    checkpoint's calibrated k_scale / v_scale load only with TRTLLM_LOAD_KV_SCALES=1, and then only an NVFP4
    KV cache uses them. The CPU stand-in of LLM() does the same, so its output predicts the GPU's."""
    from toolchain.llmapi.cpu_llm import CpuLLM
    from toolchain.workspace import Workspace

    import shutil

    from safetensors.torch import load_file, save_file

    _src, exported = export("llama", "fp8_kv")
    # Activations past FP8's range (amax > 448) calibrate scales above 1; the tiny model's stay at 1.
    hf = shutil.copytree(exported, tmp_path / "hf")
    for f in hf.glob("*.safetensors"):
        state = load_file(str(f))
        save_file({n: torch.full_like(t, 3.0) if n.endswith(("k_scale", "v_scale")) else t for n, t in state.items()},
                  str(f), metadata={"format": "pt"})
    kv = {"free_gpu_memory_fraction": 0.5, "max_tokens": 1024, "dtype": "fp8"}
    for env in (None, "1"):
        if env is None:
            monkeypatch.delenv("TRTLLM_LOAD_KV_SCALES", raising=False)
        else:
            monkeypatch.setenv("TRTLLM_LOAD_KV_SCALES", env)
        work = tmp_path / f"env-{env}"
        with CpuLLM(model=str(hf), backend="pytorch", max_batch_size=2, max_seq_len=64, max_num_tokens=128,
                    kv_cache_config=kv, work_dir=work) as llm:
            calibrated = rank_tensors(Workspace(work).checkpoint_dir(llm.spec), 0)
            stored = [float(t) for n, t in calibrated.items() if n.endswith("attention.kv_cache_scaling_factor")]
            assert stored == [3.0] * LAYERS  # the engine path's checkpoint keeps the calibrated scales
            used = llm.engine.model.kv_scales
            assert len(used) == LAYERS and all(float(s) == 1.0 for s in used.values())


# -- refusals ------------------------------------------------------------------------------------

def test_quantizing_an_imported_checkpoint_again_is_refused(export, tmp_path):
    _src, hf = export("llama", "int4_awq")
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError) as err:
        convert_checkpoint(hf, out, tp=1, pp=1, target="cpu", quantization=Quantization(method="awq"), calibration=calib())
    assert "already quantized (ModelOpt W4A16_AWQ)" in err.value.message and "\n" not in str(err.value)
    assert "quantization.method none" in err.value.hint
    assert list(out.iterdir()) == []
    # An FP8 KV cache needs the checkpoint's own scales: this one has none, and calibration cannot run on it.
    with pytest.raises(ToolchainError, match="no FP8 KV-cache scales"):
        convert_checkpoint(hf, out, tp=1, pp=1, target="cpu", quantization=Quantization(kv_cache="fp8"))
    assert list(out.iterdir()) == []


def test_kv_cache_fp8_asks_the_checkpoint_for_its_scales(export):
    from toolchain.llmapi.cpu_llm import LlmArgsError, engine_spec

    _src, awq = export("llama", "int4_awq")
    with pytest.raises(LlmArgsError, match="k_scale"):
        engine_spec({"model": str(awq), "kv_cache_config": {"dtype": "fp8"}})
    _src, fp8 = export("llama", "fp8_kv")
    assert engine_spec({"model": str(fp8), "kv_cache_config": {"dtype": "fp8"}}).target == "cpu"


@pytest.mark.parametrize("edit, fragment", [
    (lambda hq, qc: hq["quantization"].update(quant_algo="W4A8_AWQ"), "quant_algo W4A8_AWQ cannot be imported"),
    (lambda hq, qc: hq["quantization"].update(kv_cache_quant_algo="INT8"), "kv_cache_quant_algo INT8"),
    (lambda hq, qc: hq["quantization"].update(group_size=32), "group_size 32"),
])
def test_formats_the_cpu_engine_lacks_are_refused(export, tmp_path, edit, fragment):
    import shutil

    _src, hf = export("llama", "int4_awq")
    bad = tmp_path / "bad"
    shutil.copytree(hf, bad)
    hq, cfg = json.loads((bad / "hf_quant_config.json").read_text()), json.loads((bad / "config.json").read_text())
    edit(hq, cfg["quantization_config"])
    (bad / "hf_quant_config.json").write_text(json.dumps(hq))
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError, match=fragment) as err:
        convert_checkpoint(bad, out, tp=1, pp=1, target="cpu")
    assert "\n" not in str(err.value) and err.value.hint
    assert list(out.iterdir()) == []


def test_partly_quantized_shared_input_is_refused(export, tmp_path):
    """q/k/v (and gate/up) run as one GEMM on one (folded) input: all quantized, or none."""
    from safetensors.torch import load_file, save_file

    src, hf = export("llama", "fp8_kv")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    p = "model.layers.0.self_attn.k_proj"
    tensors[p + ".weight"] = load_file(str(src / "model.safetensors"))[p + ".weight"]
    for leaf in ("weight_scale", "input_scale"):
        del tensors[f"{p}.{leaf}"]
    save_file(tensors, str(bad / "model.safetensors"))
    out = tmp_path / "ckpt"
    out.mkdir()
    with pytest.raises(ToolchainError, match="only part of"):
        convert_checkpoint(bad, out, tp=2, pp=1, target="cpu")
    assert list(out.iterdir()) == []


def test_plan_check_lets_llmapi_cpu_run_quantized_specs(tmp_path, sources):
    from conftest import write_spec
    from toolchain.checks.preflight import build_context, run_checks
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    spec = load_spec(write_spec(tmp_path / "spec.yaml", sources["llama"], target="llmapi-cpu",
                                model={"dtype": "float16"}, quantization={"method": "awq"},
                                limits={"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128,
                                        "max_num_tokens": 256},
                                serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0}))
    results = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}
    assert results["llmapi.quantization"].status == "pass", results["llmapi.quantization"]
