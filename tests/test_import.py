"""`toolchain import`: repositories filled from upstream's templates with the parameter sets of upstream's docs
(tests/upstream_templates.py) read into a spec, rendered back by model-repo, compared parameter by parameter,
and the spec's trtllm-build flags compared with the engine's config.json."""

from __future__ import annotations

import json
import re
import shlex
import string
from pathlib import Path

import pytest
import yaml

from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.engine.trtllm import validate
from toolchain.importer.engine import read_engine, recorded_flags
from toolchain.importer.repo import DRAFT_TARGET, PLAIN, WITH_BLS, read_repository, templates, unset
from toolchain.importer.roundtrip import EQUAL, MISMATCH, round_trip
from toolchain.importer.to_spec import read_deployment, spec_dict
from toolchain.spec import load_spec, spec_from_dict
from upstream_templates import (draft_target_set, fill, plain_set, streaming_set, template_text, write_engine_config,
                                write_repository)


def _import(tmp_path: Path, params: dict[str, str], *args: str) -> tuple[dict, dict]:
    repo = write_repository(tmp_path / "repo", params)
    out, report = tmp_path / "build" / "imported.yaml", tmp_path / "report.json"
    assert main(["import", str(repo), "--out", str(out), "--report", str(report), *args]) == 0
    return yaml.safe_load(out.read_text()), json.loads(report.read_text())


def _rows(report: dict, where: str) -> dict[str, dict]:
    return {r["field"]: r for r in report["rows"] if r["where"] == where}


# ---- the test helper against upstream's rule and facts ---------------------------------------------------------
def test_fill_follows_fill_template_rule():
    text = 'a: "${x}" b: "${y}" c: ${max_queue_size} d: "${untouched}"'
    # The escape is consumed by the first split (on ','), so it keeps a comma in a value (gpu_device_ids:0\,1).
    filled = fill(text, r"x:0\,1,y:b")
    assert filled == 'a: "0,1" b: "b" c: 0 d: "${untouched}"'  # the default, and safe_substitute's leftover
    with pytest.raises(AssertionError, match="key 'zz' does not exist"):
        fill(text, "zz:1")
    with pytest.raises(ValueError):  # upstream docs' missing comma: three parts for one key
        fill(text, "x:Truelogits_datatype:TYPE_FP32")
    assert fill(text, "x:").startswith('a: "" ')  # an empty value is filled as ""


@pytest.mark.parametrize("model", list(templates()))
def test_rebuilt_template_holds_every_placeholder_of_the_facts(model):
    facts = templates()[model]
    text = template_text(model)
    found = set(re.findall(r"\$\{(\w+)\}", text))
    wanted = {p["placeholder"] for p in facts["placeholders"]}
    wanted |= {t["data_type"][2:-1] for k in ("inputs", "outputs") for t in facts[k] if t["data_type"].startswith("${")}
    wanted |= {m for e in facts["parameters"].values() for m in re.findall(r"\$\{(\w+)\}", e["value"])}
    if facts["backend"] and facts["backend"].startswith("${"):
        wanted.add(facts["backend"][2:-1])
    assert found == wanted
    assert string.Template(text).get_identifiers()  # placeholders a fill would see


def test_unset_rule():
    assert unset(None) and unset("") and unset("${engine_dir}")
    assert not unset("0") and not unset("false")


# ---- round trips ----------------------------------------------------------------------------------------------
@pytest.fixture()
def plain_engine(tmp_path):
    return write_engine_config(tmp_path / "engine", max_batch_size=64)


def test_plain_ensemble_round_trips_every_parameter(tmp_path, hf_llama_words, plain_engine):
    params = plain_set(hf_llama_words, plain_engine)
    del params["tensorrt_llm_bls"]
    spec, report = _import(tmp_path, params)
    assert report["layout"] == PLAIN
    assert report["mismatches"] == [] and report["inexpressible"] == []
    assert spec["serving"]["kv_cache_free_gpu_mem_fraction"] == 0.5
    assert spec["serving"]["max_tokens_in_paged_kv_cache"] == 2560
    assert spec["serving"]["streaming"] is False and spec["serving"]["exclude_input_in_output"] is True
    assert spec["build"]["kv_cache_reuse"] is False and spec["limits"]["max_batch_size"] == 64
    rows = _rows(report, "tensorrt_llm")
    assert rows["kv_cache_free_gpu_mem_fraction"]["status"] == EQUAL
    assert rows["max_attention_window_size"]["status"] == "default"  # 2560 = the engine's max_seq_len
    assert rows["gpt_model_path"]["status"] == "relocated"
    assert rows["gpt_model_path"]["rendered"] == "engines/imported/engine"  # where the user's workspace has it
    assert "tensorrt_llm_bls" in {r["where"] for r in report["rows"] if r["status"] == "added"}
    flags = _rows(report, "engine")
    assert {r["status"] for f, r in flags.items() if f.startswith("--")} == {EQUAL}


def test_bls_layout_round_trips_every_parameter(tmp_path, hf_llama_words, plain_engine):
    spec, report = _import(tmp_path, plain_set(hf_llama_words, plain_engine))
    assert load_spec(tmp_path / "build" / "imported.yaml").target == "trtllm"
    assert report["layout"] == WITH_BLS
    assert report["mismatches"] == [] and report["inexpressible"] == []
    bls = _rows(report, "tensorrt_llm_bls")
    assert bls["decoupled"]["status"] == EQUAL and bls["accumulate_tokens"]["status"] == EQUAL


def test_streaming_set_round_trips_every_parameter(tmp_path, hf_llama_words, plain_engine):
    """docs/llama.md's streaming set: decoupled models and a BLS that accumulates the text (serving.accumulate_tokens)."""
    spec, report = _import(tmp_path, streaming_set(hf_llama_words, plain_engine))
    assert spec["serving"]["streaming"] is True and spec["serving"]["accumulate_tokens"] is True
    assert report["mismatches"] == [] and report["inexpressible"] == []
    assert _rows(report, "tensorrt_llm_bls")["accumulate_tokens"]["status"] == EQUAL
    assert _rows(report, "tensorrt_llm")["gpt_model_type"]["status"] == "equivalent"


def test_draft_target_round_trip(tmp_path, hf_llama_words):
    engine = write_engine_config(tmp_path / "engine", max_batch_size=4, max_draft_len=4, speculative_mode=2)
    draft = write_engine_config(tmp_path / "draft", max_batch_size=4)
    spec, report = _import(tmp_path, draft_target_set(hf_llama_words, engine, draft), "--draft-hf",
                           str(hf_llama_words))
    assert report["layout"] == DRAFT_TARGET
    assert spec["speculative"]["draft_model"] == str(hf_llama_words)
    assert report["mismatches"] == [] and report["inexpressible"] == []
    sp = spec["speculative"]
    # The doc puts the target on GPU 1 and the draft on GPU 0 (the toolchain's default for the draft).
    assert sp["target_gpu_device_ids"] == [1] and "draft_gpu_device_ids" not in sp
    assert _rows(report, "tensorrt_llm")["gpu_device_ids"]["status"] == EQUAL
    assert sp["mode"] == "draft_target" and sp["max_draft_len"] == 4
    assert sp["draft_kv_cache_free_gpu_mem_fraction"] == 0.8
    assert spec["build"]["kv_cache_reuse"] is True and spec["serving"]["exclude_input_in_output"] is False
    assert {r["status"] for r in _rows(report, "draft engine").values()} == {EQUAL}
    assert _rows(report, "tensorrt_llm_draft")["gpu_device_ids"]["status"] == EQUAL


def test_draft_on_another_gpu_round_trips(tmp_path, hf_llama_words):
    engine = write_engine_config(tmp_path / "engine", max_batch_size=4, max_draft_len=4, speculative_mode=2)
    draft = write_engine_config(tmp_path / "draft", max_batch_size=4)
    spec, report = _import(tmp_path, draft_target_set(hf_llama_words, engine, draft, gpus=("0", "1")))
    assert report["mismatches"] == [] and report["inexpressible"] == []
    assert spec["speculative"]["draft_gpu_device_ids"] == [1] and "target_gpu_device_ids" not in spec["speculative"]


@pytest.mark.parametrize("speculative, words", [
    ({"mode": "none", "target_gpu_device_ids": [1]}, "not none on trtllm"),
    ({"mode": "draft_target", "target_gpu_device_ids": [1, 2]}, "list 1 distinct GPU indices"),
    ({"mode": "draft_target", "draft_gpu_device_ids": [-1]}, "list 1 distinct GPU indices"),
])
def test_gpu_placement_is_checked(tmp_path, speculative, words):
    with pytest.raises(ToolchainError, match=words):
        spec_from_dict({"target": "trtllm", "speculative": speculative}, tmp_path)


def test_engine_settings_reach_the_spec_and_back(tmp_path, hf_llama_words):
    """Non-default build settings: bf16 with the GEMM plugin off, tokens_per_block 64, no paged context FMHA,
    beam width 2, an explicit opt_num_tokens; each flag the config records comes back equal."""
    engine = write_engine_config(tmp_path / "engine", max_batch_size=64, dtype="bfloat16", max_beam_width=2,
                                 opt_num_tokens=100,
                                 plugin={"gemm_plugin": None, "tokens_per_block": 64, "use_paged_context_fmha": False})
    params = plain_set(hf_llama_words, engine)
    params["tensorrt_llm"] = (params["tensorrt_llm"].replace("max_beam_width:1", "max_beam_width:2")
                              .replace("max_tokens_in_paged_kv_cache:2560", "max_tokens_in_paged_kv_cache:"))
    spec, report = _import(tmp_path, params)
    assert report["mismatches"] == [] and report["inexpressible"] == []
    b = spec["build"]
    assert (b["gemm_plugin"], b["tokens_per_block"], b["use_paged_context_fmha"]) == ("disable", 64, False)
    assert (b["max_beam_width"], b["opt_num_tokens"], spec["model"]["dtype"]) == (2, 100, "bfloat16")
    assert "max_tokens_in_paged_kv_cache" not in spec["serving"]
    assert _rows(report, "tensorrt_llm")["decoding_mode"]["status"] == "default"  # beam_search either way


LORA = {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 8, "lora_target_modules": ["attn_q", "attn_k", "attn_v"],
        "trtllm_modules_to_hf_modules": {}, "max_loras": None, "max_cpu_loras": None}


@pytest.mark.parametrize("variant", ["fp8", "lora", "tp2"])
def test_engine_variants_round_trip(variant, tmp_path, hf_llama_words):
    """The format, LoRA limits and split config.json records come back through the spec."""
    extra: dict = {"fp8": {}, "lora": {"plugin": {"lora_plugin": "float16"}, "lora_config": LORA}, "tp2": {"tp": 2}}
    engine = write_engine_config(tmp_path / "engine", max_batch_size=64, **extra[variant])
    if variant == "fp8":
        cfg = json.loads((engine / "config.json").read_text())
        cfg["pretrained_config"]["quantization"].update(quant_algo="FP8", kv_cache_quant_algo="FP8")
        (engine / "config.json").write_text(json.dumps(cfg))
    params = plain_set(hf_llama_words, engine)
    if variant == "lora":
        params["tensorrt_llm"] += ",lora_cache_max_adapter_size:32"
    spec, report = _import(tmp_path, params, "--hf", str(hf_llama_words))
    assert report["mismatches"] == [] and report["inexpressible"] == []
    engine_rows = _rows(report, "engine")
    if variant == "fp8":
        assert spec["quantization"] == {"method": "fp8", "kv_cache": "fp8"}
        assert engine_rows["pretrained_config.quantization.quant_algo"]["status"] == EQUAL
    if variant == "lora":
        assert spec["lora"]["max_lora_rank"] == 8 and spec["lora"]["cache"]["max_adapter_size"] == 32
        assert engine_rows["--lora_target_modules"]["status"] == EQUAL
        assert _rows(report, "tensorrt_llm")["lora_cache_max_adapter_size"]["status"] == EQUAL
    if variant == "tp2":
        assert spec["parallelism"]["tp"] == 2 and engine_rows["pretrained_config.mapping.tp_size"]["status"] == EQUAL


def test_tokenizer_elsewhere_still_imports_and_says_why_not_rendered(tmp_path, plain_engine, capsys):
    """Paths of the GPU host the repository came from: the spec is written, the repository is not rendered here
    (said in the report), the flags are still compared."""
    spec, report = _import(tmp_path, plain_set(Path("/gpu-host/llama"), plain_engine))
    assert "tokenizer directory not found: /gpu-host/llama" in report["skipped"]
    assert spec["model"]["checkpoint"] == "/gpu-host/llama"
    assert {r["status"] for r in _rows(report, "engine").values()} == {EQUAL}
    assert "repository not rendered" in capsys.readouterr().out


def test_imported_spec_renders_and_prints_the_recorded_flags(tmp_path, hf_llama_words, plain_engine, capsys):
    """The one end-to-end check: `toolchain model-repo` of the imported spec renders, and `toolchain build-engine
    --dry-run` prints trtllm-build flags equal to those the engine's config.json records."""
    _import(tmp_path, plain_set(hf_llama_words, plain_engine))
    spec_path = tmp_path / "build" / "imported.yaml"
    root = tmp_path / "ws"
    assert main(["--root", str(root), "model-repo", str(spec_path)]) == 0
    assert read_repository(root / "model_repo" / "imported", strict=False)["tensorrt_llm"].config.max_batch_size == 64
    capsys.readouterr()
    assert main(["--root", str(root), "build-engine", "--dry-run", str(spec_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trtllm-build "))
    printed = validate(shlex.split(line)[1:])
    recorded = recorded_flags(read_engine(plain_engine))
    for flag, value in printed.items():
        if flag in recorded:
            want = recorded[flag]
            assert (value if value != "auto" else "float16") == want, flag


def test_sources_may_name_the_engine_and_checkpoint(tmp_path, hf_llama_words, plain_engine):
    """`toolchain import REPO ENGINE HF`: the directories are told apart by what they hold."""
    repo = write_repository(tmp_path / "repo", plain_set(hf_llama_words, Path("/elsewhere/engine")))
    out = tmp_path / "s.yaml"
    assert main(["import", str(repo), str(plain_engine), str(hf_llama_words), "--out", str(out)]) == 0
    assert load_spec(out).model.checkpoint == hf_llama_words.resolve()


def test_library_path_matches_the_command(tmp_path, hf_llama_words, plain_engine):
    repo = read_repository(write_repository(tmp_path / "repo", plain_set(hf_llama_words, plain_engine)))
    dep = read_deployment(repo)
    spec = spec_from_dict(spec_dict(dep, "lib"), tmp_path)
    report = round_trip(dep, spec)
    assert not report.of(MISMATCH) and report.skipped is None


def test_llmapi_target_writes_the_moved_spec_lists_losses_and_plans_both(tmp_path, hf_llama_words, capsys):
    """`--target llmapi`: the spec written is the LLM-API one; an INT8 KV cache, which the PyTorch backend does not
    load, is one line with its nearest choice; both deployments are planned side by side."""
    engine = write_engine_config(tmp_path / "engine", max_batch_size=64)
    cfg = json.loads((engine / "config.json").read_text())
    cfg["pretrained_config"]["quantization"].update(kv_cache_quant_algo="INT8")
    (engine / "config.json").write_text(json.dumps(cfg))
    spec, report = _import(tmp_path, plain_set(hf_llama_words, engine), "--hf", str(hf_llama_words),
                           "--target", "llmapi", "--gpu", "H100 80GB")
    out = capsys.readouterr().out
    assert spec["target"] == "llmapi" and report["target"] == "llmapi"
    assert spec["quantization"].get("kv_cache") != "int8"
    kv_lines = [line for line in out.splitlines() if line.startswith("quantization.kv_cache=int8")]
    assert len(kv_lines) == 1 and "nearest" in kv_lines[0], out
    assert any(line.startswith("quantization.kv_cache=int8") for line in report["losses"])
    header = next(line for line in out.splitlines() if line.split()[:2] == ["trtllm", "llmapi"])
    assert header and "max output tok/s" in out and "llmapi predicted from:" in out, out
    assert spec["gpu"] == {"name": "H100 80GB"}
    load_spec(tmp_path / "build" / "imported.yaml")  # the moved spec loads as it was written
