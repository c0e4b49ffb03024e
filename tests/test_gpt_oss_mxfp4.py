"""gpt-oss as released: experts in MXFP4 (config.json `quantization_config: {quant_method: mxfp4}`, e2m1 blocks with
one E8M0 scale per 32), attention, router, embeddings and lm_head in bfloat16. The stored format is recognised once
(quant/view.py stored_format), covers the experts alone (Quantization.covers), and the planner counts the experts at
4 bits plus a byte per 32 and everything else in the model dtype; the algorithm is named per GPU. Convert imports the
stored blocks and scales (de-interleaved, split over moe_ep and moe_tp) and the CPU engine runs them: logits equal to
transformers' on the same MXFP4 checkpoint at tp 1, tp 2 and moe_ep 2, and served on target llmapi-cpu. The config-only
example build/gpt-oss-120b-h100.yaml plans and tunes; release/1.2's published points are held as transcribed
(tests/test_perf_calibration.py checks the model against them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.quant.view import Quantization, quantization_of

CONFIGS = Path(__file__).resolve().parents[1] / "build" / "configs"
GPT_OSS_120B = CONFIGS / "gpt-oss-120b"


def released() -> dict:
    return json.loads((GPT_OSS_120B / "config.json").read_text())


def test_the_published_config_is_mxfp4():
    qc = released()["quantization_config"]
    assert qc == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def test_the_view_covers_the_experts_alone():
    q = quantization_of(Quantization(), released())
    assert (q.method, q.modelopt, q.format) == ("mxfp4", True, formats.MXFP4)
    assert [k for k in ("attention", "mlp", "experts", "shared_expert") if q.covers(k)] == ["experts"]
    assert q.on("attention") == Quantization() and q.on("experts") is q
    assert q.describe(90) == "W4A16_MXFP4 on the experts" and q.describe(100) == "W4A8_MXFP4_MXFP8 on the experts"
    # the row: 4 bits a weight plus one uint8 scale per 32, whatever the group size passed
    assert formats.tensor_bytes(formats.MXFP4.stored, 64, 64, 128, 2) == 64 * 64 / 2 + 64 * 2
    assert formats.BY_ALGO["W4A8_MXFP4_MXFP8"] is formats.MXFP4 and "mxfp4" not in formats.METHODS


@pytest.mark.parametrize("ignore,fragment", [
    (["model.layers.*.mlp.experts"], "names the experts of layer 0"),
    (["model.layers.3"], "names the experts of layer 3"),
    ("lm_head", "must be a list of module names"),
])
def test_an_exclude_list_that_names_experts_is_refused(ignore, fragment):
    """TensorRT-LLM reads the experts as MXFP4 whatever modules_to_not_convert says (its own exclude list), so a
    checkpoint with bf16 experts under quant_method mxfp4 is refused in one line; transformers' matching rule
    ("model.layers.3" skips layer 3, not 30-35)."""
    cfg = released()
    cfg["quantization_config"]["modules_to_not_convert"] = ignore
    with pytest.raises(ToolchainError, match=fragment) as err:
        quantization_of(Quantization(), cfg)
    assert "\n" not in str(err.value)


def test_asking_to_quantize_it_again_is_refused():
    with pytest.raises(ToolchainError, match="already quantized"):
        quantization_of(Quantization(method="fp8"), released())


def expected_weight_bytes() -> int:
    """gpt-oss-120b at tp 1 from its shapes: experts at 4 bits + 1 byte per 32, the rest bf16 (router and sinks
    float32, as convert writes them)."""
    c = released()
    layers, h, e, i, v = c["num_hidden_layers"], c["hidden_size"], c["num_local_experts"], c["intermediate_size"], \
        c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    bf16 = 2
    attention = ((q + 2 * kv) * h + h * q) * bf16 + (q + 2 * kv + h) * bf16 + c["num_attention_heads"] * 4
    router = (e * h + e) * 4
    experts = e * (2 * i * h + h * i) * (4 / 8 + 1 / 32)
    expert_bias = e * (2 * i + h) * bf16
    norms = 2 * h * bf16
    return int(layers * (attention + router + experts + expert_bias + norms) + 2 * v * h * bf16 + h * bf16)


def test_plan_fits_one_h100(tmp_path, capsys):
    """The published "fits on a single 80GB GPU": about 61 GiB of weights, exactly what the shapes give, and
    KV for 16 sequences of 8192 tokens; the algorithm the PyTorch backend picks there is W4A16_MXFP4."""
    from test_plan_agrees_with_convert import plan_json, spec_file, statuses

    limits = {"max_batch_size": 16, "max_input_len": 4096, "max_seq_len": 8192, "max_num_tokens": 8192}
    spec = spec_file(tmp_path, GPT_OSS_120B, target="llmapi", gpu={"name": "H100 80GB"}, limits=limits,
                     model={"dtype": "bfloat16"})
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    assert rc == 0, report["verdict"]
    weights = report["ranks"][0]["weights_bytes"]
    assert weights == expected_weight_bytes() and 60.5 < weights / 2**30 < 61.5
    assert report["concurrency"] >= 16 and report["weight_format"] == "W4A16_MXFP4 on the experts"
    checks = statuses(report)
    assert checks["quant.device"] == ("pass", "the formats run on SM 90, the weights as W4A16_MXFP4")
    assert checks["llmapi.quantization"][0] == "pass"
    # in bf16 it would need about 3.6 times as much
    bf16 = {k: v for k, v in released().items() if k != "quantization_config"}
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(bf16))
    rc, plain = plan_json(tmp_path, spec_file(tmp_path, tmp_path / "bf16", target="llmapi", limits=limits,
                                              model={"dtype": "bfloat16"}), capsys=capsys)
    assert rc == 1 and plain["ranks"][0]["weights_bytes"] > 3.5 * weights


@pytest.mark.parametrize("gpu,parallelism,check,status,fragment", [
    ("B200", {"tp": 1}, "quant.device", "pass", "the weights as W4A8_MXFP4_MXFP8"),
    ("A100 80GB", {"tp": 2}, "quant.device", "fail", "runs on Hopper (SM 90) and Blackwell only"),
    # 2880 / moe_tp 2 = 1440 = 45 blocks of 32; / 4 = 720 is not
    ("H100 80GB", {"tp": 2}, "quant.group-padding", "pass", "whole blocks of 32"),
    ("H100 80GB", {"tp": 4}, "quant.group-padding", "fail", "(2880 / moe_tp 4 = 720) is not whole blocks of 32"),
    ("H100 80GB", {"tp": 4, "moe_ep": 2}, "quant.group-padding", "pass", "whole blocks of 32"),
])
def test_plan_checks_per_gpu_and_layout(tmp_path, capsys, gpu, parallelism, check, status, fragment):
    from test_plan_agrees_with_convert import plan_json, spec_file, statuses

    spec = spec_file(tmp_path, GPT_OSS_120B, target="llmapi", gpu={"name": gpu}, parallelism=parallelism,
                     model={"dtype": "bfloat16"})
    got = statuses(plan_json(tmp_path, spec, capsys=capsys)[1])[check]
    assert got[0] == status and fragment in got[1] and "\n" not in got[1], got


# -- the config-only GPU example ------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "build" / "gpt-oss-120b-h100.yaml"


def test_the_example_plans_on_one_h100(tmp_path, capsys):
    from toolchain.cli import main

    assert main(["--root", str(tmp_path), "plan", str(EXAMPLE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"][0]["weights_bytes"] == expected_weight_bytes()
    assert report["concurrency"] >= 32 and report["weight_format"] == "W4A16_MXFP4 on the experts"
    assert report["performance"]["predicted"] and report["performance"]["max_output_tokens_per_s"] > 0


def test_tune_searches_the_example_keeping_its_stored_format(tmp_path):
    """tune proposes no format to quantize the stored checkpoint to (each would be refused as quantizing it
    twice), nor a KV-cache format that would need calibration on it."""
    from test_tune_search import tune

    doc = tune(tmp_path, EXAMPLE, "--gpus", "1")
    assert doc["candidates"]
    every = doc["candidates"] + doc["dropped_candidates"]
    assert {(c["quantization"], c["kv_cache"]) for c in every} == {("none", "none")}
    assert not [c for c in doc["dropped_candidates"] if any("quantize" in f for f in c.get("failed_checks", []))]


# -- import and run on the CPU stand-in ------------------------------------------------------------------------

ATOL = 1e-4
PROMPTS = [[1, 5, 9, 33, 200, 7, 8, 100, 3, 44, 12], [1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6, 7, 7, 7]]
LAYOUTS = {"tp1": (1, {}), "tp2": (2, {}), "ep2": (2, {"moe_tp": 1, "moe_ep": 2})}
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def make_mxfp4_gpt_oss(root: Path) -> tuple[Path, Path]:
    """A tiny gpt-oss (hidden 64, expert width 64: whole blocks of 32; 4 experts top-2, 2 layers, window 4) saved
    twice: as transformers writes it in float32 ("fp32"), and as released ("mxfp4"): each expert stack transposed
    from GptOssExperts' [E, in, out] to the rows [E, out, in] and quantized by ModelOpt's MXFP4 rounding
    (quant/fp4.py quantize_mxfp4) into `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32], with the
    published quantization_config. The swiglu constants are upstream's (the LLM-API stand-in refuses others)."""
    import transformers
    from safetensors.torch import load_file, save_file

    from test_gpt_oss import make_gpt_oss

    from toolchain.quant.fp4 import quantize_mxfp4

    fp32 = make_gpt_oss(root / "fp32", seed=5, intermediate_size=64, swiglu_limit=7.0)
    out = root / "mxfp4"
    transformers.GptOssForCausalLM.from_pretrained(fp32).save_pretrained(out, safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(EXPERT_TENSORS)]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = released()["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp32, out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers 5.25 loads the MXFP4 checkpoint itself on the CPU, dequantizing the experts (without Triton:
    "We will default to dequantizing the model"), so the parity is against that."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[1], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


_ENGINES: dict = {}


def mxfp4_engine(tmp_path_factory, hf_dir: Path, layout: str):
    from test_engine_cpu_util import make_engine_dir

    from toolchain.engine.cpu import CpuEngine

    if layout not in _ENGINES:
        tp, kw = LAYOUTS[layout]
        _ENGINES[layout] = CpuEngine.load(make_engine_dir(hf_dir, tmp_path_factory.mktemp(f"mxfp4-{layout}"), tp,
                                                          convert_kwargs={"path": "llmapi", **kw}))
    return _ENGINES[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_transformers_on_the_mxfp4_checkpoint(tmp_path_factory, tiny, reference, layout):
    from test_engine_cpu_util import hf_greedy, hf_logits

    from toolchain.engine.cpu import SamplingParams
    from toolchain.engine.cpu.qlinear import Mxfp4

    e = mxfp4_engine(tmp_path_factory, tiny[1], layout)
    experts = e.model.stages[0][0].layers[0].experts
    assert all(isinstance(lin, Mxfp4) and lin.weight.dtype == torch.uint8 for lin in experts.fc + experts.proj)
    for prompt in PROMPTS:
        torch.testing.assert_close(e.forward_logits(prompt), hf_logits(reference, prompt), atol=ATOL, rtol=0)
        assert e.generate(prompt, SamplingParams(max_new_tokens=8)) == hf_greedy(reference, prompt, 8)


def test_the_rounding_matters(tiny, reference):
    """The float32 model the MXFP4 one was rounded from gives other logits by far more than the tolerance, so the
    parity above shows the engine computing with the stored MXFP4 values."""
    from test_engine_cpu_util import hf_logits
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    assert (hf_logits(fp32, PROMPTS[0]) - hf_logits(reference, PROMPTS[0])).abs().max() > 100 * ATOL


def test_rank_files_hold_the_stored_bytes_de_interleaved(tmp_path_factory, tiny):
    """Rank r of tp 2 (moe_tp 2) holds, per expert, [up; gate] rows of its half of the width (the checkpoint's odd
    rows, then its even ones, TensorRT-LLM's de-interleave), the blocks flattened to bytes, the scales alike; its
    proj the matching 32-column block of down_proj."""
    from safetensors.torch import load_file

    mxfp4_engine(tmp_path_factory, tiny[1], "tp2")
    hf = load_file(str(tiny[1] / "model.safetensors"))
    blocks, scales = hf["model.layers.1.mlp.experts.gate_up_proj_blocks"], hf["model.layers.1.mlp.experts.gate_up_proj_scales"]
    down = hf["model.layers.1.mlp.experts.down_proj_blocks"]
    ckpt = next(p for p in tmp_path_factory.getbasetemp().glob("mxfp4-tp2*/checkpoint"))
    for r in range(2):
        rank = load_file(str(ckpt / f"rank{r}.safetensors"))
        rows = slice(32 * r, 32 * (r + 1))
        gate, up = blocks[:, 0::2][:, rows], blocks[:, 1::2][:, rows]
        assert torch.equal(rank["transformer.layers.1.mlp.fc.weight"], torch.cat([up, gate], dim=1).flatten(2))
        assert torch.equal(rank["transformer.layers.1.mlp.fc.weights_scaling_factor"],
                           torch.cat([scales[:, 1::2][:, rows], scales[:, 0::2][:, rows]], dim=1))
        assert torch.equal(rank["transformer.layers.1.mlp.proj.weight"], down[:, :, r:r + 1].flatten(2))
    config = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (config["quant_algo"], config["group_size"]) == ("W4A16_MXFP4", 32)


@pytest.mark.parametrize("tp,moe_ep", [(1, None), (2, None), (4, 4)])
def test_planned_bytes_are_what_convert_writes(tp, moe_ep):
    """The planner's stored bytes of gpt-oss-120b equal convert's dry run from config.json alone, rank 0."""
    from toolchain.archs import load_params
    from toolchain.checkpoint.convert import plan_any
    from toolchain.plan import memory as mem

    dry = plan_any(GPT_OSS_120B, tp=tp, pp=1, dtype="bfloat16", target="cpu", moe_ep=moe_ep, path="llmapi")
    _, p = load_params({**released(), "torch_dtype": "bfloat16"})
    q = quantization_of(Quantization(), released())
    planned = mem.rank_weights(p, tp=tp, pp_rank=0, pp=1, quant=q, dt_bytes=2, stored=True, moe_ep=moe_ep,
                               qkv_bias=True, dense_bias=True)
    assert dry.rank_bytes(0) == planned.total


@pytest.mark.parametrize("kw,fragment", [
    ({"tp": 4, "path": "llmapi"}, "(2880 / moe_tp 4 = 720) is not whole blocks of 32"),
    ({"tp": 1}, "has no engine path in TensorRT-LLM 1.2"),
])
def test_convert_refuses_in_one_line(kw, fragment):
    from toolchain.checkpoint.convert import plan_any

    with pytest.raises(ToolchainError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as err:
        plan_any(GPT_OSS_120B, pp=1, dtype="bfloat16", target="cpu", **kw)
    assert "\n" not in str(err.value)


# -- release/1.2's published gpt-oss-120b points (plan/data/published_moe_families.json) ----------------------

def test_the_published_gpt_oss_points_are_transcribed_whole():
    """19 points: B200 and H200 at DEP2 (attention DP over tp 2, the experts over both: moe_ep 2), B300 and GB200 at
    TP1, every card a GPU row here and every point the released MXFP4 checkpoint; spot values as perf-overview.md
    gives them. tests/test_perf_calibration.py checks the model against them."""
    from toolchain import gpus
    from toolchain.plan.calibration import PUBLISHED_MOE_FAMILIES

    doc = json.loads(PUBLISHED_MOE_FAMILIES.read_text())
    rows = [r for r in (dict(zip(doc["columns"], r, strict=True)) for r in doc["rows"]) if r["model"] == "gpt-oss-120b"]
    assert len(rows) == 19 and {r["method"] for r in rows} == {"mxfp4"} and "mxfp4" in formats.STORED_ONLY
    assert all(gpus.lookup(r["gpu"]).name == r["gpu"] for r in rows)
    layouts = {(r["gpu"], r["tp"], r["attention_dp"]) for r in rows}
    assert layouts == {("B200 180GB", 2, True), ("H200 141GB", 2, True), ("B300 288GB", 1, False),
                       ("GB200 186GB", 1, False)}
    value = {(r["gpu"], r["isl"], r["osl"]): r["output_tokens_per_s"] for r in rows}
    assert value[("B200 180GB", 1024, 1024)] == 29061 and value[("H200 141GB", 32768, 1024)] == 500
    assert ("H200 141GB", 1024, 32768) not in value  # the published table's empty cell
    assert {r["kv_cache"] for r in rows if r["gpu"].startswith("H")} == {"none"}


# -- deployed on target llmapi-cpu ----------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_llmapi_cpu_serves_the_mxfp4_checkpoint(tmp_path_factory):
    """The released form deployed on the LLM-API path's CPU stand-in at tp 2 / moe_ep 2 (convert imports the stored
    experts, the OpenAI server from the deployment's LLM() arguments runs them) answers the greedy tokens of
    transformers running the same MXFP4 checkpoint."""
    import urllib.request

    from llmapi_helpers import deploy_llmapi_cpu
    from test_engine_cpu_util import hf_greedy
    from test_gpt_oss_e2e import DEPLOYMENT, PROMPT, _words
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from triton_helpers import make_tiny_tokenizer

    from toolchain.pipeline import openai_server

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4-e2e")
    _, hf = make_mxfp4_gpt_oss(root)
    make_tiny_tokenizer(hf)
    spec, ws = deploy_llmapi_cpu(root, hf, name="tiny-gpt-oss-mxfp4", **DEPLOYMENT)
    prompt = AutoTokenizer.from_pretrained(hf)(_words(PROMPT))["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    expected = hf_greedy(model, prompt, 8)
    assert min(expected) >= 3, "a special token in the greedy output; pick another seed"
    with openai_server(spec, ws, ws.root / "openai.log") as api:
        body = json.dumps({"model": api.served_model_name, "prompt": _words(PROMPT), "max_tokens": 8,
                           "top_k": 1}).encode()
        req = urllib.request.Request(f"{api.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
    assert answer["choices"][0]["text"].strip() == _words(expected)
