"""gpt-oss as released: experts in MXFP4 (config.json `quantization_config: {quant_method: mxfp4}`, e2m1 blocks with
one E8M0 scale per 32), attention, router, embeddings and lm_head in bfloat16. The stored format is recognised once
(quant/view.py stored_format), covers the experts alone (Quantization.covers), and the planner counts the experts at
4 bits plus a byte per 32 and everything else in the model dtype; the algorithm is named per GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
