"""Quantized checkpoints: every method's tensors against the reference tables
(TensorRT-LLM quantization/layers.py, models/modeling_utils.py), conformance with NVIDIA's exporter rank by rank (the golden
layouts, TP 1 and 2), KV scales, exclusions, padding, and bad input rejected
before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_hf_model
from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.checkpoint.hf_reader import HFCheckpoint
from toolchain.errors import ToolchainError
from toolchain.quant.view import Quantization

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "reference" / "layouts"
if not GOLDEN.is_dir():
    GOLDEN = Path("/work/shared/reference/layouts")
ST = {torch.float16: "F16", torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8",
      torch.float8_e4m3fn: "F8_E4M3"}
FORMATS = {"fp16": Quantization(), "int4_awq": Quantization(method="awq"), "int8_sq": Quantization(method="smoothquant"),
           "fp8": Quantization(method="fp8")}
ARCH = {"LlamaForCausalLM": "LlamaForCausalLM", "Qwen2ForCausalLM": "Qwen2ForCausalLM"}


def calib(vocab: int, n: int = 4, length: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


def layout(ckpt: Path) -> list[dict[str, tuple[list[int], str]]]:
    cfg = json.loads((ckpt / "config.json").read_text())
    out = []
    for r in range(cfg["mapping"]["world_size"]):
        with safe_open(str(ckpt / f"rank{r}.safetensors"), framework="pt") as fh:
            out.append({n: (list(fh.get_slice(n).get_shape()), ST[fh.get_tensor(n).dtype]) for n in fh.keys()})
    return out


def convert(hf: Path, out: Path, recipe: Quantization, tp: int = 1, **kw) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    return convert_checkpoint(hf, out, tp=tp, pp=1, dtype=kw.pop("dtype", "float16"), target="cpu",
                              quantization=recipe, calibration=calib(vocab), **kw)


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    made = {}
    for path in sorted(GOLDEN.glob("*-fp16-tp1.json")):
        data = json.loads(path.read_text())
        hf_cfg = dict(data["hf_config"])
        arch = data["hf_architecture"]
        made[path.name.split("-fp16")[0]] = make_hf_model(arch, tmp_path_factory.mktemp(path.stem), **hf_cfg)
    return made


@pytest.mark.skipif(not GOLDEN.is_dir(), reason="golden layouts not available")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias"])
def test_conformance_with_modelopt_export(golden_models, tmp_path, model, fmt, tp):
    golden = json.loads((GOLDEN / f"{model}-{fmt}-tp{tp}.json").read_text())
    # NVIDIA's exporter shards the embedding over the vocab; write the same to compare shapes (README of layouts).
    cfg = convert(golden_models[model], tmp_path / "ckpt", FORMATS[fmt], tp=tp, use_parallel_embedding=True)
    ours = layout(tmp_path / "ckpt")
    for rank, (want, got) in enumerate(zip(golden["ranks"], ours)):
        want = {n: (list(s), d) for n, (s, d) in want.items()}
        assert set(got) == set(want), (rank, sorted(set(got) ^ set(want)))
        diffs = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
        assert not diffs, (rank, diffs)
    gq, q = golden["checkpoint_config"]["quantization"], cfg["quantization"]
    for key in set(gq) - {"exclude_modules"}:
        assert q.get(key) == gq[key], key
    # The exclude list replaces TensorRT-LLM's default, so ours also names the embedding (models/modeling_utils.py QuantConfig);
    # the exporter's formats never quantize embeddings and write only lm_head.
    assert set(gq.get("exclude_modules") or []) <= set(q.get("exclude_modules") or [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny-q"), hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_only_is_option_a(tiny, tmp_path, tp):
    for method, algo in (("int8_wo", "W8A16"), ("int4_wo", "W4A16")):
        cfg = convert(tiny, tmp_path / method, Quantization(method=method), tp=tp)
        assert cfg["quantization"] == {"quant_algo": algo, "kv_cache_quant_algo": None,
                                       "exclude_modules": ["lm_head", "transformer.vocab_embedding"]}
        ranks = layout(tmp_path / method)
        assert all(d == "F16" for r in ranks for _, d in r.values())  # the build quantizes (models/convert_utils.py weight_only_quantize_dict)


def test_kv_cache_scales_per_layer(tiny, tmp_path):
    cfg = convert(tiny, tmp_path / "kv", Quantization(method="awq", kv_cache="int8"), tp=2)
    assert cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    for rank in layout(tmp_path / "kv"):
        for i in range(2):
            assert rank[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] == ([1], "F32")
    with safe_open(str(tmp_path / "kv" / "rank1.safetensors"), framework="pt") as fh:
        assert float(fh.get_tensor("transformer.layers.0.attention.kv_cache_scaling_factor")) > 0
    cfg = convert(tiny, tmp_path / "kvfp8", Quantization(kv_cache="fp8"))
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8"}


def test_exclude_modules_keep_fp_and_are_written(tiny, tmp_path):
    cfg = convert(tiny, tmp_path / "x", Quantization(method="smoothquant", exclude_modules=("transformer.layers.1.*",
                                                                                      "*.mlp.proj")))
    assert cfg["quantization"]["exclude_modules"] == ["lm_head", "transformer.vocab_embedding",
                                                      "transformer.layers.1.*", "*.mlp.proj"]
    (rank,) = layout(tmp_path / "x")
    assert rank["transformer.layers.0.attention.qkv.weight"][1] == "I8"
    assert rank["transformer.layers.0.mlp.proj.weight"][1] == "F16"
    assert "transformer.layers.0.mlp.proj.weights_scaling_factor" not in rank
    assert rank["transformer.layers.1.mlp.fc.weight"][1] == "F16"


def test_per_group_mlp_padding(tmp_path):
    hf = make_hf_model("LlamaForCausalLM", tmp_path / "hf", hidden_size=256, intermediate_size=640, vocab_size=300)
    convert(hf, tmp_path / "ckpt", Quantization(method="awq"), tp=2)
    rank = layout(tmp_path / "ckpt")[1]  # I = 640 -> 768 (multiple of 128 x 2): 384 per rank
    assert rank["transformer.layers.0.mlp.fc.weight"] == ([192, 256], "I8")
    assert rank["transformer.layers.0.mlp.proj.weight"] == ([128, 384], "I8")
    assert rank["transformer.layers.0.mlp.proj.weights_scaling_factor"] == ([256, 3], "F32")


def test_bad_input_fails_before_weights_are_read(tiny, tmp_path, monkeypatch):
    def no_reads(*_a, **_k):
        raise AssertionError("a weight was read")
    monkeypatch.setattr(HFCheckpoint, "load", no_reads)
    cases = [(Quantization(method="awq", calibration_seq_len=4096), "calibration.seq_len"),
             (Quantization(method="fp8", calibration_dataset=str(tmp_path / "missing.txt")), "no such file")]
    for i, (recipe, fragment) in enumerate(cases):
        out = tmp_path / f"o{i}"
        out.mkdir()
        with pytest.raises(ToolchainError, match=fragment):
            convert_checkpoint(tiny, out, tp=1, pp=1, dtype="float16", target="cpu", quantization=recipe)
    out = tmp_path / "gpu"
    out.mkdir()
    with pytest.raises(ToolchainError, match="Ada or Hopper"):
        convert_checkpoint(tiny, out, tp=1, pp=1, dtype="float16", target="trtllm", quantization=Quantization(method="fp8"),
                           gpu=("A100 80GB", 80))


@pytest.mark.parametrize("recipe", [Quantization(), Quantization(method="int8_wo"), Quantization(method="int4_wo"),
                                    Quantization(method="awq"), Quantization(method="smoothquant", kv_cache="int8"),
                                    Quantization(method="fp8", kv_cache="fp8")], ids=lambda r: f"{r.method}-{r.kv_cache}")
def test_config_json_is_what_tensorrt_llm_reads(tiny, tmp_path, recipe):
    """config.json against TensorRT-LLM's own classes (facts/checkpoint_config.json,
    from tensorrt_llm/models/modeling_utils.py): QuantConfig.from_dict is cls(**config),
    so every `quantization` key must be a field; PretrainedConfig.__init__'s
    parameters without a default must be present."""
    from toolchain.upstream import facts

    up = facts("checkpoint_config")
    cfg = convert(tiny, tmp_path / "c", recipe)
    fields = set(up["quant_config"]["fields"])
    assert set(cfg["quantization"]) <= fields, sorted(set(cfg["quantization"]) - fields)
    required = {k for k, v in up["pretrained_config"]["init_params"].items() if v["required"]}
    assert required <= set(cfg), sorted(required - set(cfg))
    written = json.loads((tmp_path / "c" / "config.json").read_text())
    assert written == cfg


# Which TensorRT-LLM layer each linear becomes (quantization/quantize.py maps ColumnLinear
# and RowLinear), and its full (in, out) in the `tiny` model: hidden 256, MLP 512, 4 heads
# and 2 KV heads of 64.
LAYER_OF = {"attention.qkv": ("column", 256, 512), "attention.dense": ("row", 256, 256),
            "mlp.fc": ("column", 256, 512), "mlp.gate": ("column", 256, 512), "mlp.proj": ("row", 512, 256)}
LAYER_CLASSES = {"W4A16_AWQ": ("WeightOnlyGroupwiseQuantLinear", "WeightOnlyGroupwiseQuantRowLinear"),
                 "FP8": ("FP8Linear", "FP8RowLinear")}


def declared(layer: dict, kind: str, full_in: int, full_out: int, tp: int, group: int) -> dict:
    """name -> shape of a layer's parameters on one rank, evaluated from the facts. Layers on
    Linear / RowLinear take per-rank features from that base (layers/linear.py)."""
    env = {"in_features": full_in, "out_features": full_out, "tp_size": tp}
    feats = {k: eval(expr, {}, env) for k, expr in layer["features"].items()}  # noqa: S307 - upstream's own arithmetic
    feats.setdefault("in_features", full_in // tp if kind == "row" else full_in)
    feats.setdefault("out_features", full_out // tp if kind == "column" else full_out)
    scope = {**feats, "group_size": group}
    return {name: tuple(eval(p["shape"], {}, scope)) for name, p in layer["parameters"].items()}  # noqa: S307


def after_preprocess(algo: str, suffix: str, t: torch.Tensor, rules: dict) -> tuple[int, ...]:
    """The tensor's shape once trtllm-build's preprocess_perlayer_weights has run on it."""
    done = {r["suffix"] for r in rules.get(algo, [])}
    if suffix not in done:
        return tuple(t.shape)
    if suffix == "weight":  # packed int4 (out/2, in) int8 -> transposed, viewed as 16-bit: (in, out/4)
        return (t.shape[1], t.shape[0] // 2)
    if suffix == "weights_scaling_factor":
        return tuple(reversed(t.shape))
    return (1, t.numel())  # prequant_scaling_factor


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("method, algo", [("awq", "W4A16_AWQ"), ("fp8", "FP8")])
def test_tensors_fit_the_layers_trtllm_build_loads_them_into(tiny, tmp_path, tp, method, algo):
    """Every quantized tensor, after trtllm-build's own preprocessing, has the shape its
    TensorRT-LLM layer declares (facts/quantized_layers.json, from quantization/layers.py
    and models/modeling_utils.py), and each layer parameter is present."""
    from toolchain.upstream import facts

    up = facts("quantized_layers")
    cfg = convert(tiny, tmp_path / "c", Quantization(method=method), tp=tp)
    assert cfg["quantization"]["quant_algo"] == algo
    column, row = (up["layers"][c] for c in LAYER_CLASSES[algo])
    group = cfg["quantization"].get("group_size", 128)
    with safe_open(str(tmp_path / "c" / "rank0.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        for module, (kind, full_in, full_out) in LAYER_OF.items():
            prefix = f"transformer.layers.0.{module}"
            want = declared(column if kind == "column" else row, kind, full_in, full_out, tp, group)
            for name, shape in want.items():
                if name in ("weight", "bias") and algo == "FP8":
                    continue  # the base Linear's weight: checked by the unquantized layout tests
                if name in ("bias", "zero") or (name == "prequant_scaling_factor" and method != "awq"):
                    assert f"{prefix}.{name}" not in names  # not declared by this config
                    continue
                got = after_preprocess(algo, name, fh.get_tensor(f"{prefix}.{name}"), up["preprocess"])
                assert got == shape, (prefix, name, got, shape)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_mapping_is_what_tensorrt_llm_reads(tiny, tmp_path, tp, pp):
    """config.json `mapping` against tensorrt_llm/mapping.py (facts/mapping.json): from_dict
    is cls(**mapping), so every key must be a Mapping.__init__ parameter; world_size must be
    tp x pp; the layer split of every stage file is Mapping.pp_layers' tensor_split."""
    from toolchain.checkpoint.sharding import pp_layers
    from toolchain.archs.layout import Layout
    from toolchain.upstream import facts

    up = facts("mapping")
    assert up["rules"]["pp_layers"]["quote"].startswith("return torch.tensor_split(torch.arange(num_layers)")
    out = tmp_path / "c"
    out.mkdir()
    cfg = convert_checkpoint(tiny, out, tp=tp, pp=pp, dtype="float16", target="trtllm")
    mapping = cfg["mapping"]
    assert set(mapping) <= set(up["init_params"]), sorted(set(mapping) - set(up["init_params"]))
    assert mapping["world_size"] == mapping["tp_size"] * mapping["pp_size"] == tp * pp
    for layers in (2, 5, 7):
        upstream = [chunk.tolist() for chunk in torch.tensor_split(torch.arange(layers), pp)]
        assert pp_layers(layers, pp) == upstream
        assert [list(r) for r in Layout(pp=pp).stage_layers(layers)] == upstream
