"""LoRA in `toolchain plan`: the lora.adapters check refusing each bad adapter or base in one line, the adapter
caches per rank against a hand computation of PeftCacheManager's page geometry (plan/lora.py), and the performance
model's added work (perf/lora.py) against its formula.

The adapters are made by PEFT on the tiny Llama of tests/test_lora_format.py; the bases are config-only
directories (the plan reads config.json alone)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from test_lora_format import EVERY, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, make_adapter

from toolchain.checks.preflight import FAIL, PASS, build_context, run_checks
from toolchain.errors import ToolchainError
from toolchain.plan.model import load_model
from toolchain.plan.perf import deployment, gpu_step_time, predict_spec, stage_cost
from toolchain.plan.perf.lora import lora_load
from toolchain.plan.perf.step import generation_work
from toolchain.quant.view import Quantization
from toolchain.spec import load_spec
from toolchain.spec_lora import LoraSection

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": 64, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32", "eos_token_id": 2}
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Adapters (attn: q/v rank 4; every: all seven modules rank 4; big: q/v rank 8), bad adapter directories and
    config-only bases: the adapters' own tiny Llama, and one twice as wide (another base)."""
    root = tmp_path_factory.mktemp("plan-lora")
    out = {}
    for name, targets, rank in (("attn", ["q_proj", "v_proj"], 4), ("every", EVERY, 4), ("big", ["q_proj", "v_proj"], 8)):
        make_adapter(root / name, targets, r=rank, lora_alpha=2 * rank)
        out[name] = root / name
    (root / "empty").mkdir()  # no adapter files at all
    out["empty"] = root / "empty"
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((out["attn"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    out["broken"] = broken
    for name, cfg in (("tiny", TINY), ("wide", {**TINY, "hidden_size": 2 * HIDDEN})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = root / name
    return out


def spec_of(tmp_path: Path, made: dict[str, Path], adapters: dict[str, str] | None = None, **change):
    """A spec on the tiny base serving `adapters` (name -> made adapter), target cpu in float32 unless changed."""
    data = {"name": "lora", "target": "cpu", "model": {"checkpoint": str(made["tiny"]), "dtype": "float32"},
            "limits": LIMITS, "serving": {"http_port": 0, "grpc_port": 0, "metrics_port": 0},
            "lora": {"adapters": {n: str(made[a]) for n, a in (adapters or {}).items()}}}
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def checks(spec) -> dict:
    return {r.id: r for r in run_checks(build_context(spec, "plan"))}


def refused(spec, check_id: str = "lora.adapters") -> str:
    result = checks(spec)[check_id]
    assert result.status == FAIL and "\n" not in result.message, result.message
    return result.message


# ------------------------------------------------------------------------------------------- lora.adapters


def test_good_adapters_pass(tmp_path, made):
    result = checks(spec_of(tmp_path, made, {"attn": "attn", "every": "every"}))["lora.adapters"]
    assert result.status == PASS and "attn r4, every r4" in result.message, result.message
    assert "attn_q attn_k attn_v attn_dense mlp_h_to_4h mlp_4h_to_h mlp_gate" in result.message


def test_rank_above_max_lora_rank(tmp_path, made):
    spec = spec_of(tmp_path, made, {"big": "big"}, lora={"adapters": {"big": str(made["big"])}, "max_lora_rank": 4})
    assert "LoRA adapter 'big' has rank 8, above lora.max_lora_rank 4" in refused(spec)


def test_module_the_engine_leaves_out(tmp_path, made):
    spec = spec_of(tmp_path, made, lora={"adapters": {"every": str(made["every"])}, "target_modules": ["attn_q"]})
    assert "LoRA adapter 'every' trains ['attn_dense', 'mlp_h_to_4h', 'mlp_4h_to_h', 'mlp_gate']" in refused(spec)


def test_adapter_of_another_base(tmp_path, made):
    spec = spec_of(tmp_path, made, {"attn": "attn"}, model={"checkpoint": str(made["wide"]), "dtype": "float32"})
    assert "layer 0 attn_q is 32 -> 32 but the base model's is 64 -> 64: it was trained for another base" in refused(spec)


def test_tp_that_does_not_split_the_adapter(tmp_path, made):
    spec = spec_of(tmp_path, made, {"attn": "attn"}, parallelism={"tp": 3})
    assert "LoRA adapter 'attn' attn_q: its out dim 32 does not split over tp 3" in refused(spec)


def test_each_bad_adapter_refused_in_its_own_words(tmp_path, made):
    """Both bad adapters are named, each with lora_setup's reason, in the one line."""
    message = refused(spec_of(tmp_path, made, {"empty": "empty", "ok": "attn", "broken": "broken"}))
    assert "LoRA adapter 'empty':" in message and "LoRA adapter 'broken':" in message
    assert "adapter_model.safetensors is not readable" in message and "'ok'" not in message


def test_bfloat16_engine_path_is_refused(tmp_path, made):
    spec = spec_of(tmp_path, made, {"attn": "attn"}, model={"checkpoint": str(made["tiny"]), "dtype": "bfloat16"})
    assert "LoRA on the engine path with a bfloat16 engine" in refused(spec)
    llmapi = spec_of(tmp_path, made, {"attn": "attn"}, target="llmapi-cpu",
                     model={"checkpoint": str(made["tiny"]), "dtype": "bfloat16"})
    assert checks(llmapi)["lora.adapters"].status == PASS  # the LLM API reads PEFT directories in any dtype


def test_no_target_modules(tmp_path, made):
    spec = spec_of(tmp_path, made, lora={"target_modules": [], "max_lora_rank": 8})
    assert "lora.target_modules is empty" in refused(spec)
    assert all(r.lora is None for r in build_context(spec, "plan").memory.ranks)


def test_adapter_named_as_the_served_model(tmp_path, made):
    assert "LoRA adapter 'lora' has the served model's name" in refused(spec_of(tmp_path, made, {"lora": "attn"}))


def test_workload_class_naming_an_unknown_adapter(tmp_path, made):
    classes = [{"name": "base", "share": 1.0}, {"name": "sql", "share": 1.0, "adapter": "sql"}]
    for adapters, known in (({"attn": "attn"}, "attn"), (None, "none")):
        with pytest.raises(ToolchainError) as err:
            spec_of(tmp_path, made, adapters, validation={"workload": {"classes": classes}})
        assert f"names adapter 'sql', which lora.adapters does not hold ({known})" in str(err.value)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("config,says", [
    ("mixtral-8x7b-v0.1", "LoRA on MixtralForCausalLM: a mixture-of-experts model"),
    ("deepseek-r1", "LoRA on DeepseekV3ForCausalLM: a mixture-of-experts model"),
    ("phi-3-mini-128k-instruct", "LoRA on Phi3ForCausalLM: its decoder layers have no separate q_proj, k_proj, "
                                 "v_proj, gate_proj, up_proj"),
])
def test_families_without_llama_style_modules(tmp_path, made, config, says):
    spec = spec_of(tmp_path, made, target="trtllm", model={"checkpoint": str(CONFIGS / config), "dtype": "float16"},
                   gpu={"name": "H200 141GB"}, lora={"target_modules": ["attn_q"], "max_lora_rank": 8})
    assert says in refused(spec)


# ------------------------------------------------------------------------------------------- the caches


def _llama8b(tmp_path, made, **lora):
    return spec_of(tmp_path, made, target="trtllm", model={"checkpoint": str(CONFIGS / "llama-3-8b-instruct"),
                                                           "dtype": "float16"},
                   gpu={"name": "H100 80GB"}, parallelism={"tp": 2},
                   limits={"max_batch_size": 8, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 4096},
                   lora={"target_modules": ["attn_q", "attn_dense", "mlp_4h_to_h"], "max_lora_rank": 64, **lora})


def test_cache_pages_by_hand(tmp_path, made):
    """Llama-3-8B (hidden 4096, MLP 14336, 32 heads, 8 KV heads of 128, 32 layers) at tp 2 in float16, modules
    attn_q (+ k, v), attn_dense, mlp_4h_to_h at max rank 64, the default caches: getPageManagerConfig by hand."""
    ctx = build_context(_llama8b(tmp_path, made), "plan")
    q, kv, dense, down = 4096 + 4096 // 2, 4096 + 1024 // 2, 4096 // 2 + 4096, 14336 // 2 + 4096
    one_d = [q, kv, kv, dense, down]
    width = min(one_d)
    assert width == 4608
    slots_per_page = max(8 * sum(math.ceil(d / width) for d in one_d) * 32, math.ceil(64 * max(one_d) / width))
    max_lora = 64 * sum(one_d) * 32  # elements of one rank-64 adapter on the rank
    host_slots = (1 << 30) // (width * 2)
    host_pages = math.ceil(host_slots / slots_per_page)
    for r in ctx.memory.ranks:
        c = r.lora
        assert (c.geometry.page_width, c.geometry.slots_per_page) == (width, slots_per_page)
        assert c.max_adapter_bytes == max_lora * 2 == 128 << 20
        assert (c.host.slots, c.host.pages) == (host_slots, host_pages)
        assert c.host.nbytes == host_pages * slots_per_page * width * 2
        assert c.host.adapters == host_pages * slots_per_page * width // max_lora == 8
        # the device pool: 0.05 of what the KV cache's whole blocks leave (the KV cache is taken first)
        after_kv = r.free_bytes - r.kv_tokens_capacity * r.kv_bytes_per_token
        assert c.after_kv_bytes == after_kv
        assert c.device.slots == int(0.05 * after_kv) // (width * 2)
        assert c.device.nbytes == math.ceil(c.device.slots / slots_per_page) * slots_per_page * width * 2
    without = build_context(_llama8b(tmp_path, made).model_copy(update={"lora": LoraSection()}), "plan")
    assert without.memory.kv_tokens_capacity == ctx.memory.kv_tokens_capacity  # LoRA takes no KV memory
    assert checks(_llama8b(tmp_path, made))["lora.cache"].status == PASS


def test_llmapi_max_loras_sizes_the_pools(tmp_path, made):
    """max_loras / max_cpu_loras: max_lora_rank x layers x modules x adapters module layers of max1dModSize
    elements, in whole slots (_util.py create_py_executor_instance)."""
    spec = _llama8b(tmp_path, made, cache={"max_loras": 2, "max_cpu_loras": 3}).model_copy(update={"target": "llmapi"})
    c = build_context(spec, "plan").memory.ranks[0].lora
    width, max1d = 4608, 14336 // 2 + 4096
    module_layers = 64 * 32 * 5
    assert c.device.slots == math.ceil(module_layers * 2 * max1d / width)
    assert c.host.slots == math.ceil(module_layers * 3 * max1d / width)
    assert c.device.adapters >= 2 and c.host.adapters >= 3


def test_adapter_bytes_per_rank(tmp_path, made):
    """The 'every' adapter at tp 2 in float32: per layer r x (localIn + localOut) x 4 bytes over its seven
    modules (column modules split their out dim, attn_dense and mlp_4h_to_h their in dim)."""
    spec = spec_of(tmp_path, made, {"every": "every"}, parallelism={"tp": 2})
    kv = KV_HEADS * HIDDEN // HEADS
    per_layer = ((HIDDEN + HIDDEN // 2) + 2 * (HIDDEN + kv // 2) + (HIDDEN // 2 + HIDDEN)
                 + 2 * (HIDDEN + INTER // 2) + (INTER // 2 + HIDDEN))
    for r in build_context(spec, "plan").memory.ranks:
        assert dict(r.lora.adapter_bytes) == {"every": 4 * per_layer * LAYERS * 4}
        assert r.lora.device is None  # the CPU engine keeps adapters in host memory only


@pytest.mark.parametrize("cache,says", [
    ({"host_memory_bytes": 1 << 20},
     "rank 0: Not enough space allocated to host LoRA cache to hold 1 max sized LoRA 113 < 14564"),
    ({"gpu_memory_fraction": 1e-6}, "Not enough space allocated to device LoRA cache to hold 1 max sized LoRA"),
])
def test_cache_too_small(tmp_path, made, cache, says):
    message = refused(_llama8b(tmp_path, made, cache=cache), "lora.cache")
    assert says in message and "raise lora.cache." in message


# ------------------------------------------------------------------------------------------- performance


def test_lora_work_follows_the_formula(tmp_path, made):
    """The rank's added FLOPs per token are 2 x r x (localIn + localOut) over its modules and layers, weighed by
    the classes' adapter shares; a step reads each distinct adapter once; the step's memory and compute times
    grow by exactly those bytes and FLOPs over the card's rates."""
    classes = [{"name": "base", "share": 3.0}, {"name": "every", "share": 1.0, "adapter": "every"}]
    spec = spec_of(tmp_path, made, {"every": "every"}, target="trtllm", gpu={"name": "H100 80GB"},
                   validation={"workload": {"classes": classes}})
    model = load_model(made["tiny"])
    p = model.params
    load, note = lora_load(spec, p, range(LAYERS), 1, 4)
    kv = KV_HEADS * HIDDEN // HEADS
    flops = 2 * 4 * LAYERS * (2 * HIDDEN + 2 * (HIDDEN + kv) + 2 * HIDDEN + 3 * (HIDDEN + INTER))
    assert note is None and load.flops_per_token == pytest.approx(flops / 4)
    assert load.bytes_read(4) == pytest.approx((1 - 0.75 ** 4) * flops / 2 * 4)

    dep, _ = deployment(spec, model, Quantization(), build_context(spec, "plan").device)
    with_lora = dep.stages[0]
    base = stage_cost(p, tp=1, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=4, kv_bytes=4)
    assert with_lora.lora is not None and with_lora.gemm_flops == base.gemm_flops
    work = generation_work(4, 32)
    t_lora, t_base = gpu_step_time(with_lora, dep.gpu, work, eff=dep.eff), gpu_step_time(base, dep.gpu, work, eff=dep.eff)
    bandwidth = dep.gpu.bandwidth_gb_s * 1e9 * dep.eff.bandwidth
    half = dep.gpu.peak("fp16") * 1e12 * dep.eff.compute
    assert t_lora.memory_s - t_base.memory_s == pytest.approx(load.bytes_read(4) / bandwidth)
    assert t_lora.compute_s - t_base.compute_s == pytest.approx(4 * load.flops_per_token / half)


def test_prediction_with_adapters_is_slower(tmp_path, made):
    """Llama-3-8B with rank-64 adapters sent per request: no class names one, so every request is predicted with
    the largest (said in the notes). A generation step is memory-bound, so TPOT grows by the adapter's bytes over
    the bandwidth, once per step (its FLOPs hide under the reads)."""
    spec = _llama8b(tmp_path, made)
    plain = predict_spec(spec.model_copy(update={"lora": LoraSection()}))
    lora = predict_spec(spec)
    assert any("every request is predicted with a rank-64 LoRA adapter" in n for n in lora["notes"])
    assert lora["tpot_ms"] > plain["tpot_ms"] and lora["max_output_tokens_per_s"] < plain["max_output_tokens_per_s"]
    dep, _ = deployment(spec, load_model(CONFIGS / "llama-3-8b-instruct"), Quantization(),
                        build_context(spec, "plan").device)
    per_step_ms = dep.stages[0].lora.bytes_read(1) / (dep.gpu.bandwidth_gb_s * 1e9 * dep.eff.bandwidth) * 1e3
    assert per_step_ms > 0.01  # well above the 3-decimal rounding of tpot_ms
    assert lora["tpot_ms"] - plain["tpot_ms"] == pytest.approx(per_step_ms, abs=1.5e-3)


def test_plan_report_shows_the_caches_per_rank(tmp_path, made):
    """`toolchain plan --json` carries each rank's caches; the text report a line per rank."""
    from toolchain.checks.render import report_dict, render_text

    ctx = build_context(_llama8b(tmp_path, made), "plan")
    report = report_dict(ctx, run_checks(ctx))
    lora = [r["lora"] for r in report["ranks"]]
    assert len(lora) == 2 and all(c["host_cache"]["max_size_adapters"] == 8 and c["max_adapter_bytes"] == 128 << 20
                                  for c in lora)
    assert lora[0]["device_cache"]["bytes"] == ctx.memory.ranks[0].lora.device.nbytes
    text = render_text(report)
    assert "LoRA caches per rank (the device cache out of what the KV cache leaves):" in text
    assert "  rank 1: host 1.01 GiB holds 8, device " in text
