"""Pre-quantized Hugging Face checkpoints for the LLM-API path (toolchain.checkpoint.hf_quant):
the layouts of NVIDIA ModelOpt's export_hf_checkpoint (/work/shared/reference/layouts-hf), the
numerics of what is stored, the way back onto the engine checkpoint the CPU engine runs, and the
methods the PyTorch backend cannot load refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_model
from test_engine_cpu_util import make_engine_dir
from toolchain.checkpoint.hf_quant import (export_hf_quantized, hf_quant_problem, hf_quantized_to_engine_tensors,
                                           read_hf_quantized)
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.engine.cpu.qlinear import Int4Grouped
from toolchain.errors import ToolchainError
from toolchain.quant.int_quant import pack_int4, unpack_int4
from toolchain.quant.view import Quantization
from toolchain.spec import QuantizationSection

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "layouts-hf"
if not ORACLE.is_dir():
    ORACLE = Path("/work/shared/reference/layouts-hf")
ST = {torch.float16: "F16", torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.uint8: "U8",
      torch.float8_e4m3fn: "F8_E4M3"}
MODELS = ["llama-gqa", "qwen2-bias"]
SECTIONS = {"fp8": dict(method="fp8"), "int4_awq": dict(method="awq"), "fp8_kv": dict(method="fp8", kv_cache="fp8"),
            "nvfp4": dict(method="nvfp4")}
# Keys that say who wrote the file, not what it holds: the producer (tool and version; the oracle's is
# nvidia-modelopt 0.47.0) and the transformers version that saved config.json.
RUN_SPECIFIC = {"producer", "transformers_version"}
pytestmark = pytest.mark.skipif(not ORACLE.is_dir(), reason="HF-format golden layouts not available")


def oracle(model: str, fmt: str) -> dict:
    return json.loads((ORACLE / f"{model}-{fmt}.json").read_text())


def calib(vocab: int, n: int = 4, length: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


def section(fmt: str) -> QuantizationSection:
    return QuantizationSection(**SECTIONS[fmt], calibration={"samples": 4, "seq_len": 32})


def stored(directory: Path) -> dict[str, tuple[list[int], str]]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({n: (list(fh.get_slice(n).get_shape()), ST[fh.get_tensor(n).dtype]) for n in fh.keys()})
    return out


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    with HFCheckpoint(directory) as ckpt:
        return {n: ckpt.load(n) for n in ckpt.names()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}
    for model in MODELS:
        data = oracle(model, "fp8")
        cfg = dict(data["hf_config"])
        dtype = getattr(torch, cfg.pop("dtype"))  # the oracle's source models were float32
        made[model] = make_hf_model(data["hf_architecture"], tmp_path_factory.mktemp(model), dtype=dtype, **cfg)
    return made


_EXPORTS: dict = {}


@pytest.fixture(scope="module")
def export(models, tmp_path_factory):
    """(model, fmt) -> (source dir, exported dir, summary), each exported once per module."""
    def get(model: str, fmt: str):
        if (model, fmt) not in _EXPORTS:
            src = models[model]
            out = tmp_path_factory.mktemp(f"{model}-{fmt}")
            vocab = json.loads((src / "config.json").read_text())["vocab_size"]
            summary = export_hf_quantized(src, out, section(fmt), "float16", calibration=calib(vocab))
            _EXPORTS[(model, fmt)] = (src, out, summary)
        return _EXPORTS[(model, fmt)]
    return get


# -- (a) the oracle's layouts ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "int4_awq"])
@pytest.mark.parametrize("model", MODELS)
def test_layout_matches_modelopt_export(export, model, fmt):
    want = oracle(model, fmt)
    _src, out, summary = export(model, fmt)
    got = stored(out)
    expected = {n: (list(s), d) for n, (s, d) in want["tensors"].items()}
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    assert {n: got[n] for n in got if got[n] != expected[n]} == {}
    assert sorted(p.name for p in out.iterdir()) == sorted(want["files"]) == summary["files"]
    assert summary["format"] == fmt and summary["tensors"] == len(expected)
    config = json.loads((out / "config.json").read_text())
    qc, want_qc = config.pop("quantization_config"), want["exported_config"]["quantization_config"]
    assert {k: v for k, v in qc.items() if k not in RUN_SPECIFIC} == \
        {k: v for k, v in want_qc.items() if k not in RUN_SPECIFIC}
    assert list(qc) == list(want_qc)  # same key order as the exporter's
    rest = {k: v for k, v in want["exported_config"].items() if k != "quantization_config"}
    assert {k: v for k, v in config.items() if k not in RUN_SPECIFIC} == \
        {k: v for k, v in rest.items() if k not in RUN_SPECIFIC}
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert set(hq) == set(want["hf_quant_config"])
    assert hq["quantization"] == want["hf_quant_config"]["quantization"]
    assert list(hq["quantization"]) == list(want["hf_quant_config"]["quantization"])


def test_fp8_kv_cache_scales(export):
    _src, out, summary = export("llama-gqa", "fp8_kv")
    got = stored(out)
    for layer in range(2):
        at = f"model.layers.{layer}.self_attn"
        for name in (f"{at}.k_proj.k_scale", f"{at}.v_proj.v_scale"):
            assert got.pop(name) == ([], "F32")
    assert got == {n: (list(s), d) for n, (s, d) in oracle("llama-gqa", "fp8")["tensors"].items()}
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["kv_cache_quant_algo"] == "FP8" and summary["kv_cache_quant_algo"] == "FP8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert list(qc) == ["config_groups", "ignore", "quant_algo", "kv_cache_scheme", "producer", "quant_method"]


# -- (b) numerics -------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_fp8_dequantizes_to_the_weights(export, model):
    src, out, _ = export(model, "fp8")
    orig, got = tensors(src), tensors(out)
    linears = [n[: -len(".weight")] for n, t in got.items() if t.dtype == torch.float8_e4m3fn]
    assert len(linears) == 14
    for p in linears:
        w, s = orig[p + ".weight"].float(), got[p + ".weight_scale"]
        assert s.shape == () and float(s) == pytest.approx(float(w.abs().max()) / 448, rel=1e-6)
        err = (got[p + ".weight"].float() * s - w).abs()
        # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, 2^-10 * s for subnormals.
        assert bool((err <= w.abs() * 2 ** -4 + float(s) * 2 ** -10 + 1e-12).all()), p
        assert got[p + ".input_scale"].shape == () and float(got[p + ".input_scale"]) > 0


@pytest.mark.parametrize("model", MODELS)
def test_awq_dequantizes_to_the_weights(export, model):
    src, out, _ = export(model, "int4_awq")
    orig, got = tensors(src), tensors(out)
    stored_q = dict(read_hf_quantized(out))
    assert len(stored_q) == 14
    for p, t in stored_q.items():
        base, module = p.rsplit(".", 2)[0], p.rsplit(".", 1)[1]
        lin = Int4Grouped(t["weight"], t["weights_scaling_factor"], 128,
                          prequant=t.get("prequant_scaling_factor"))
        if "prequant_scaling_factor" in t:
            prequant = t["prequant_scaling_factor"].float()
        else:  # folded into the norm feeding q/k/v or gate/up: recover it as the gain's ratio
            norm = "input_layernorm" if module.endswith(("q_proj", "k_proj", "v_proj")) else "post_attention_layernorm"
            key = f"{base}.{norm}.weight"
            prequant = got[key].float() / orig[key].float()
        w = orig[p + ".weight"].float()
        w_hat = lin.dequantized() * prequant[None, :]
        assert float((w_hat - w).norm() / w.norm()) < 0.2, p  # int4 per group of 128 (RTN alone is ~0.11)
        s = t["weights_scaling_factor"]
        assert s.dtype == torch.float32 and bool((s > 0).all())


def test_int4_packing_round_trips(export):
    q = torch.tensor([[-8, 7], [3, -1], [0, 5], [-2, 6]], dtype=torch.int8)
    packed = pack_int4(q).view(torch.uint8)
    # ModelOpt pack_int4_in_uint8: byte [j, k] = row 2j in the low nibble, row 2j+1 in the high one.
    assert packed.tolist() == [[(-8 & 0xF) | ((3 & 0xF) << 4), 7 | ((-1 & 0xF) << 4)],
                               [0 | ((-2 & 0xF) << 4), 5 | (6 << 4)]]
    _src, out, _ = export("qwen2-bias", "int4_awq")
    for p, t in read_hf_quantized(out):
        q = unpack_int4(t["weight"])
        assert q.shape == (t["weight"].shape[0] * 2, t["weight"].shape[1])
        assert torch.equal(pack_int4(q), t["weight"]), p


# -- (c) back onto the engine checkpoint ---------------------------------------------------------

def _engine_dir(root: Path, tensors_: dict, config: dict) -> Path:
    from safetensors.torch import save_file

    from test_engine_cpu_util import BUILD

    root.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors_.items()}, str(root / "rank0.safetensors"))
    (root / "config.json").write_text(json.dumps({"version": "test", "target": "cpu", "pretrained_config": config,
                                                  "build_config": {**BUILD, "max_beam_width": 1}}))
    return root


def _logits(engine_dir: Path, prompts) -> list[torch.Tensor]:
    from toolchain.engine.cpu import CpuEngine

    engine = CpuEngine.load(engine_dir)
    return [engine.forward_logits(p) for p in prompts]


@pytest.mark.parametrize("fmt", ["fp8_kv", "int4_awq", "nvfp4"])
@pytest.mark.parametrize("model", MODELS)
def test_engine_tensors_match_the_engine_path(export, tmp_path, model, fmt):
    src, out, _ = export(model, fmt)
    ours, config = hf_quantized_to_engine_tensors(out)
    vocab = config["vocab_size"]
    recipe = Quantization(**SECTIONS[fmt])
    ref_dir = make_engine_dir(src, tmp_path / "ref", dtype="float16",
                              convert_kwargs={"quantization": recipe, "calibration": calib(vocab)})
    ref_config = json.loads((ref_dir / "config.json").read_text())["pretrained_config"]
    assert config["quantization"] == ref_config["quantization"]
    assert config == ref_config
    ref = tensors_of(ref_dir / "rank0.safetensors")
    assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))
    assert {n: (ours[n].shape, ours[n].dtype) for n in ours} == {n: (ref[n].shape, ref[n].dtype) for n in ref}
    differ = sorted(n for n in ref if not torch.equal(ours[n].view(torch.uint8) if ours[n].dtype.itemsize == 1
                                                      else ours[n], ref[n].view(torch.uint8)
                                                      if ref[n].dtype.itemsize == 1 else ref[n]))
    if fmt == "nvfp4":
        # Both share one global weight scale and one input scale per fused group and compute the block scales
        # against it (quant/fp4.py quantize_nvfp4): every byte is the engine path's.
        allowed = set()
    elif fmt == "int4_awq":
        # Every int4 payload and scale is bitwise the engine path's. What differs is where the shared
        # q/k/v and gate/up prequant vector lives: the HF format folds it into the norm (ones on the linear).
        allowed = {f"transformer.layers.{i}.{n}" for i in range(2) for n in (
            "input_layernorm.weight", "post_layernorm.weight", "attention.qkv.prequant_scaling_factor",
            "mlp.fc.prequant_scaling_factor", "mlp.gate.prequant_scaling_factor")}
    else:
        # The HF format scales q, k, v (and gate, up) separately; re-quantizing to the shared scale
        # rounds twice, so a part below the max scale may differ by one e4m3 step.
        allowed = {f"transformer.layers.{i}.{n}" for i in range(2)
                   for n in ("attention.qkv.weight", "mlp.fc.weight", "mlp.gate.weight")}
        for n in differ:
            step = (ours[n].float() - ref[n].float()).abs()
            assert bool((step <= ref[n].float().abs() * 2 ** -3 + 2 ** -9).all()), n
        # ... but the part already at the shared (max) scale keeps its bytes.
        hf = tensors(out)
        for i in range(2):
            at = f"model.layers.{i}"
            sizes = [hf[f"{at}.self_attn.{m}_proj.weight"].shape[0] for m in "qkv"]
            scales = torch.stack([hf[f"{at}.self_attn.{m}_proj.weight_scale"] for m in "qkv"])
            k = int(scales.argmax())
            name = f"transformer.layers.{i}.attention.qkv.weight"
            rows = slice(sum(sizes[:k]), sum(sizes[:k + 1]))
            assert torch.equal(ours[name][rows].view(torch.uint8), ref[name][rows].view(torch.uint8))
            mlp = [hf[f"{at}.mlp.{m}_proj.weight_scale"] for m in ("gate", "up")]
            name = f"transformer.layers.{i}.mlp.{'fc' if mlp[0] >= mlp[1] else 'gate'}.weight"
            assert torch.equal(ours[name].view(torch.uint8), ref[name].view(torch.uint8))
    assert set(differ) <= allowed, sorted(set(differ) - allowed)
    assert not any(n.endswith(("proj.weight", "dense.weight", "weights_scaling_factor", "activation_scaling_factor",
                              "kv_cache_scaling_factor")) for n in differ)
    if fmt == "int4_awq":  # what each norm-then-linear pair computes is the same up to fp16 rounding
        for i in range(2):
            for norm, mod in (("input_layernorm", "attention.qkv"), ("post_layernorm", "mlp.fc")):
                at = f"transformer.layers.{i}"
                eff = [t[f"{at}.{norm}.weight"].float() * t[f"{at}.{mod}.prequant_scaling_factor"].float()
                       for t in (ours, ref)]
                assert float(((eff[0] - eff[1]).abs() / eff[1].abs()).max()) < 2 ** -9
    prompts = [[1, 5, 9, 33, 200, 7], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6]]
    got = _logits(_engine_dir(tmp_path / "ours", ours, config), prompts)
    want = _logits(ref_dir, prompts)
    fp = _logits(make_engine_dir(src, tmp_path / "fp", dtype="float16"), prompts)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())
    for a, b, f in zip(got, want, fp):
        if fmt == "nvfp4":
            assert torch.equal(a, b)
        elif fmt == "int4_awq":
            assert rel(a, b) < 3e-2
            assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.8
        else:
            # These random models (weights x4) amplify any perturbation: FP8 itself moves their logits by
            # ~20-26%, and the double-rounded parts move them by as much again. Ours is no farther from
            # the unquantized model than the engine path's own FP8 is, within half of that error.
            assert rel(a, f) <= 1.5 * rel(b, f)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {n: fh.get_tensor(n) for n in fh.keys()}


# -- (d) refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method,kv,refused", [
    ("int8_wo", "none", "int8_wo"), ("int4_wo", "fp8", "int4_wo"), ("smoothquant", "none", "smoothquant"),
    ("fp8", "int8", "kv_cache int8"), ("awq", "int8", "kv_cache int8"), ("none", "none", "nothing"),
    ("fp8", "none", None), ("awq", "none", None), ("awq", "fp8", None), ("none", "fp8", None)])
def test_refusal_rule(method, kv, refused):
    problem = hf_quant_problem(QuantizationSection(method=method, kv_cache=kv))
    if refused is None:
        assert problem is None
    else:
        assert refused in problem and "\n" not in problem
        assert any(alt in problem for alt in ("awq", "fp8", "none"))


@pytest.mark.parametrize("method,kv", [("smoothquant", "none"), ("int4_wo", "none"), ("fp8", "int8")])
def test_refused_before_anything_is_read(tmp_path, method, kv):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ToolchainError) as err:  # a missing source proves no file was opened first
        export_hf_quantized(tmp_path / "missing", out, QuantizationSection(method=method, kv_cache=kv))
    assert "PyTorch backend" in str(err.value) or "Hugging Face" in str(err.value)
    assert err.value.hint and "awq" in err.value.hint
    assert list(out.iterdir()) == []


def test_float32_and_partial_exclusion_refused(models, tmp_path):
    src = models["llama-gqa"]
    with pytest.raises(ToolchainError, match="float16 or bfloat16"):
        export_hf_quantized(src, tmp_path, section("fp8"), "float32", calibration=calib(1024))
    q = QuantizationSection(method="fp8", exclude_modules=["transformer.layers.0.mlp.fc"],
                            calibration={"samples": 4, "seq_len": 32})
    with pytest.raises(ToolchainError, match="only part of"):
        export_hf_quantized(src, tmp_path, q, "float16", calibration=calib(1024))


def test_excluded_linears_stay_fp16_and_are_listed(models, tmp_path):
    q = QuantizationSection(method="fp8", exclude_modules=["transformer.layers.1.attention.*"],
                            calibration={"samples": 4, "seq_len": 32})
    export_hf_quantized(models["llama-gqa"], tmp_path, q, "float16", calibration=calib(1024))
    got = stored(tmp_path)
    assert got["model.layers.1.self_attn.q_proj.weight"] == ([512, 512], "F16")
    assert got["model.layers.1.self_attn.o_proj.weight"] == ([512, 512], "F16")
    assert "model.layers.1.self_attn.o_proj.weight_scale" not in got
    assert got["model.layers.0.self_attn.o_proj.weight"] == ([512, 512], "F8_E4M3")
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert "model.layers.1.self_attn.o_proj" in hq["exclude_modules"]
    _, config = hf_quantized_to_engine_tensors(tmp_path)
    assert "transformer.layers.1.attention.dense" in config["quantization"]["exclude_modules"]
