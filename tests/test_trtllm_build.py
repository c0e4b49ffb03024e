"""build-engine for target trtllm against a fake `trtllm-build` on PATH
(tests/fake_trtllm_build): the fake checks every argument against the 1.2
flag table as the reference documents it, records the call and writes an
engine directory; here we check what was called, the logs, the manifest, the
version gate, the post-build check and the draft-target second build."""

from __future__ import annotations

import json
import os
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_spec
from toolchain.cli import main
from toolchain.engine import trtllm
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "fake_trtllm_build"


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """PATH with the fake trtllm-build first and its tensorrt_llm 1.2.1 metadata importable."""
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(FAKE / "site"))
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_BUILD_RECORD", str(record))
    return record


def calls(record: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in record.read_text().splitlines()] if record.exists() else []


def build(tmp_path, spec, *args) -> int:
    return main(["--root", str(tmp_path / "ws"), "build-engine", str(spec), *args])


def trt_spec(tmp_path, hf, **sections):
    sections.setdefault("build", {}).setdefault("mpi", "never")
    return write_spec(tmp_path / "s.yaml", hf, target="trtllm", **sections)


def fake_module() -> dict:
    return runpy.run_path(str(FAKE / "trtllm-build"), run_name="fake")


def test_build_runs_trtllm_build_with_the_table_flags(tmp_path, hf_llama, fake_build, capsys):
    # --workers one per rank as build.host_memory_gib allows (unset: 1, whatever this machine has)
    spec = trt_spec(tmp_path, hf_llama, parallelism={"tp": 2}, build={"host_memory_gib": 64},
                    limits={"max_batch_size": 4, "max_input_len": 100, "max_seq_len": 200, "max_num_tokens": 300})
    assert build(tmp_path, spec) == 0, capsys.readouterr().err
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"
    assert sorted(p.name for p in engine.glob("rank*.engine")) == ["rank0.engine", "rank1.engine"]
    assert (engine / "logs" / "build.log").read_text().startswith("$ ")
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["inputs"]["tensorrt_llm"] == "1.2.1" and manifest["outputs"]["ranks"] == 2
    [argv] = calls(fake_build)
    args = trtllm.validate(argv)
    assert args["--max_batch_size"] == 4 and args["--max_num_tokens"] == 300 and args["--workers"] == 2
    assert args["--use_paged_context_fmha"] == "enable" and args["--kv_cache_type"] == "paged"
    assert Path(args["--checkpoint_dir"]) == engine.parent / "checkpoint"
    # The recorded command is the manifest's, except that the real run wrote to the temporary directory.
    assert shlex.split(manifest["outputs"]["command"])[1:] == [
        a if a != args["--output_dir"] else str(engine) for a in argv]
    capsys.readouterr()
    assert build(tmp_path, spec) == 0 and "reused" in capsys.readouterr().out and len(calls(fake_build)) == 1
    assert build(tmp_path, spec, "--force") == 0 and len(calls(fake_build)) == 2


def test_every_spec_flag_is_in_the_fakes_table(tmp_path):
    fake = fake_module()
    for name, flag in trtllm.FLAGS.items():
        assert name in fake["TABLE"], name
        theirs = fake["TABLE"][name]
        if flag.kind in ("choice", "choices"):
            assert set(flag.values) <= theirs, name
        else:
            # upstream's argparse takes paths as type=str
            assert theirs == {"path": "str", "int": "int", "switch": "switch", "str": "str"}[flag.kind], name
    assert {n for n, f in trtllm.FLAGS.items() if f.kind == "choices"} <= fake["MANY"]


@pytest.mark.parametrize("example", ["llama3-8b-awq-h100", "llama3-70b-sq-tp4pp2", "mistral-7b-fp8-l40s",
                                     "qwen2.5-7b-draft-target", "tiny-llama"])
def test_example_commands_pass_the_fake(tmp_path, example):
    fake = fake_module()
    spec = load_spec(REPO / "build" / f"{example}.yaml", ["target=trtllm"])
    for draft in ([False, True] if spec.speculative.mode == "draft_target" else [False]):
        argv = trtllm.build_command(spec, tmp_path / "ckpt", tmp_path / "out", draft=draft)
        args = fake["parse"](argv[1:])
        fake["check_combinations"](args)  # exits on a rejected combination


# (arguments, our message, whether trtllm-build itself rejects it): the last case is
# our own stricter rule (a draft-target engine without a draft length builds, but is useless).
@pytest.mark.parametrize("argv, fragment, tool_rejects", [
    (["--use_paged_context_fmha", "maybe"], "takes one of enable, disable", True),
    (["--use_embedding_sharing"], "removed in 1.x", True),
    (["--multiple_profiles", "enable", "--opt_num_tokens", "64"], "an error in trtllm-build", True),
    (["--gather_context_logits", "--max_draft_len", "4"], "an error in trtllm-build", True),
    (["--tokens_per_block", "48"], "power of 2", True),
    (["--user_buffer", "enable"], "needs --reduce_fusion enable", True),
    (["--max_batch_size", "many"], "takes an integer", True),
    (["--speculative_decoding_mode", "draft_tokens_external"], "needs --max_draft_len", False),
    (["--weight_streaming", "--gemm_plugin", "float16"], "needs --gemm_plugin disable", False),
])
def test_table_rejects_what_trtllm_build_rejects(tmp_path, argv, fragment, tool_rejects):
    full = ["--checkpoint_dir", "ckpt", *argv]
    with pytest.raises(trtllm.FlagError, match=fragment):
        trtllm.validate(full)
    if tool_rejects:
        proc = subprocess.run([sys.executable, str(FAKE / "trtllm-build"), *full], capture_output=True, text=True,
                              cwd=tmp_path)
        assert proc.returncode == 2 and "error" in proc.stderr  # the fake agrees


def test_an_unset_gemm_plugin_counts_as_off():
    """trtllm-build's --gemm_plugin has no default (PluginConfig maps unset and "disable" to None),
    so weight streaming needs no explicit --gemm_plugin disable."""
    assert trtllm.validate(["--checkpoint_dir", "ckpt", "--weight_streaming"])["--weight_streaming"] is True
    assert trtllm.validate(["--checkpoint_dir", "ckpt", "--weight_streaming", "--gemm_plugin", "disable"])


def test_lora_builds_the_plugin_for_per_request_adapters(tmp_path, hf_llama, fake_build, capsys):
    """lora.adapters: --lora_plugin in the model dtype, --max_lora_rank the largest rank, --lora_target_modules the
    adapters' modules with q/k/v completed (tensorrtllm_backend docs/lora.md's build line); no --lora_dir, since
    adapters come per request or from the lora_prefetch_dir convert writes."""
    from lora_helpers import make_peft_adapter

    from toolchain.checkpoint.lora import LORA_MODULE_IDS

    assert trtllm.LORA_MODULES == tuple(LORA_MODULE_IDS)
    attn = make_peft_adapter(hf_llama, tmp_path / "attn", ["q_proj", "v_proj"], r=4)
    mlp = make_peft_adapter(hf_llama, tmp_path / "mlp", ["down_proj"], r=8)
    spec = trt_spec(tmp_path, hf_llama, model={"checkpoint": str(hf_llama), "dtype": "float16"},
                    lora={"adapters": {"attn": str(attn), "mlp": str(mlp)}})
    assert build(tmp_path, spec, "--dry-run") == 0
    printed = capsys.readouterr().out
    want = "--lora_plugin float16 --max_lora_rank 8 --lora_target_modules attn_q attn_k attn_v mlp_4h_to_h --workers"
    assert want in printed and "--lora_dir" not in printed
    assert build(tmp_path, spec) == 0, capsys.readouterr().err
    [argv] = calls(fake_build)
    args = trtllm.validate(argv)
    assert args["--lora_target_modules"] == ("attn_q", "attn_k", "attn_v", "mlp_4h_to_h")
    assert args["--lora_plugin"] == "float16" and args["--max_lora_rank"] == 8 and "--lora_dir" not in args
    engine = json.loads((tmp_path / "ws" / "engines" / "test-model" / "engine" / "config.json").read_text())
    assert engine["build_config"]["lora_config"]["lora_target_modules"] == list(args["--lora_target_modules"])
    # An unknown module is refused as argparse refuses it.
    with pytest.raises(trtllm.FlagError, match="takes some of"):
        trtllm.validate(["--checkpoint_dir", "c", "--lora_target_modules", "attn_q", "q_proj"])
    proc = subprocess.run([sys.executable, str(FAKE / "trtllm-build"), "--checkpoint_dir", "c", "--lora_target_modules",
                           "attn_q", "q_proj"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice 'q_proj'" in proc.stderr


def test_wrong_version_is_refused_before_building(tmp_path, hf_llama, fake_build, monkeypatch, capsys):
    site = tmp_path / "site" / "tensorrt_llm-1.1.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    assert build(tmp_path, trt_spec(tmp_path, hf_llama)) == 2
    err = capsys.readouterr().err
    assert "runs TensorRT-LLM 1.1.0, not the 1.2 line" in err and not calls(fake_build)


def test_failed_build_keeps_the_logs(tmp_path, hf_llama, fake_build, capsys):
    broken = tmp_path / "bin" / "trtllm-build"
    broken.parent.mkdir()
    broken.write_text("#!/usr/bin/env python3\nimport sys\nprint('[TRT-LLM] [E] Error: out of memory', "
                      "file=sys.stderr)\nsys.exit(3)\n")
    broken.chmod(0o755)
    spec = trt_spec(tmp_path, hf_llama, build={"trtllm_build": str(broken), "mpi": "never"})
    assert build(tmp_path, spec) == 2
    err = capsys.readouterr().err
    assert "trtllm-build failed with exit status 3: [TRT-LLM] [E] Error: out of memory" in err
    kept = tmp_path / "ws" / "engines" / "test-model" / "build-logs.failed" / "build.log"
    assert "out of memory" in kept.read_text()
    assert not (tmp_path / "ws" / "engines" / "test-model" / "engine").exists()


def test_engine_check_names_each_disagreement(tmp_path, hf_llama):
    spec = load_spec(trt_spec(tmp_path, hf_llama, parallelism={"tp": 2}, limits={"max_batch_size": 8}))
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "rank0.engine").write_bytes(b"x")
    (engine / "config.json").write_text(json.dumps({
        "version": "1.1.0", "pretrained_config": {"mapping": {"world_size": 2}},
        "build_config": {"max_batch_size": 4, "max_input_len": spec.limits.max_input_len,
                         "max_seq_len": spec.limits.max_seq_len, "max_num_tokens": spec.limits.max_num_tokens,
                         "plugin_config": {"use_paged_context_fmha": False, "tokens_per_block": 64}}}))
    problems = " | ".join(trtllm.check_engine(spec, engine))
    for fragment in ("version '1.1.0'", "missing rank1.engine", "max_batch_size 4 != 8",
                     "use_paged_context_fmha False != True", "tokens_per_block 64 != 32"):
        assert fragment in problems
    # Its quantization is the one convert wrote into the checkpoint it was built from (the resolved view's).
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}))
    problems = trtllm.check_engine(spec, engine, checkpoint_dir=ckpt)
    assert "quantization.quant_algo None != FP8" in problems
    assert not any("kv_cache_quant_algo" in p for p in problems)


def test_mpi_build_writes_one_log_per_rank(tmp_path, hf_llama, fake_build, monkeypatch, capsys):
    # A stand-in mpirun: runs the command once per rank with the rank in the environment.
    mpirun = tmp_path / "mpi" / "mpirun"
    mpirun.parent.mkdir()
    mpirun.write_text(
        "#!/usr/bin/env python3\nimport os, subprocess, sys\nargs = sys.argv[1:]\n"
        "args.remove('--allow-run-as-root')\nn = int(args[args.index('-n') + 1])\ncmd = args[args.index('-n') + 2:]\n"
        "rc = 0\nfor r in range(n):\n"
        "    rc |= subprocess.call(cmd, env={**os.environ, 'OMPI_COMM_WORLD_RANK': str(r)})\nsys.exit(rc)\n")
    mpirun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{mpirun.parent}{os.pathsep}{os.environ['PATH']}")
    spec = trt_spec(tmp_path, hf_llama, parallelism={"tp": 2}, build={"mpi": "auto"})
    assert build(tmp_path, spec) == 0, capsys.readouterr().err
    logs = tmp_path / "ws" / "engines" / "test-model" / "engine" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["mpirun.log", "rank0.log", "rank1.log"]
    assert "fake build" in (logs / "rank1.log").read_text()
    assert all(trtllm.validate(a)["--workers"] == 1 for a in calls(fake_build))


def test_draft_target_builds_the_draft_too(tmp_path, hf_llama, hf_llama_tied, fake_build, capsys):
    spec = trt_spec(tmp_path, hf_llama, speculative={"mode": "draft_target", "max_draft_len": 4,
                                                     "draft_model": str(hf_llama_tied)},
                    serving={"streaming": False})
    assert build(tmp_path, spec) == 0, capsys.readouterr().err
    target, draft = calls(fake_build)
    assert trtllm.validate(target)["--speculative_decoding_mode"] == "draft_tokens_external"
    assert trtllm.validate(target)["--max_draft_len"] == 4
    assert "--speculative_decoding_mode" not in draft and trtllm.validate(draft)["--workers"] == 1
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"
    assert (engine / "draft" / "engine" / "rank0.engine").is_file()
    assert not (engine / "draft" / "checkpoint").exists()  # converted, built, then dropped
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["outputs"]["draft"]["ranks"] == 1


def test_use_draft_logits_builds_the_draft_with_gather_generation_logits(tmp_path, hf_llama, hf_llama_tied,
                                                                        fake_build, capsys):
    spec = trt_spec(tmp_path, hf_llama, speculative={"mode": "draft_target", "max_draft_len": 4,
                                                     "draft_model": str(hf_llama_tied), "use_draft_logits": True},
                    serving={"streaming": False})
    assert build(tmp_path, spec) == 0, capsys.readouterr().err
    target, draft = calls(fake_build)
    assert trtllm.validate(draft)["--gather_generation_logits"] is True  # upstream's DTM README: the draft only
    assert "--gather_generation_logits" not in target
    loaded = load_spec(spec)
    assert ("--gather_generation_logits", True) in trtllm.build_flags(loaded, draft=True)
    off = load_spec(spec, ["speculative.use_draft_logits=false"])
    assert ("--gather_generation_logits", True) not in trtllm.build_flags(off, draft=True)
    # The post-build check reads it back from the draft engine's build_config.
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine" / "draft" / "engine"
    config = json.loads((engine / "config.json").read_text())
    assert config["build_config"]["gather_generation_logits"] is True
    config["build_config"]["gather_generation_logits"] = False
    (engine / "config.json").write_text(json.dumps(config))
    assert trtllm.check_engine(loaded, engine, draft=True) == ["build_config.gather_generation_logits False != True"]


def test_dry_run_prints_even_when_a_check_fails(tmp_path, hf_llama, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    spec = trt_spec(tmp_path, hf_llama, build={"multiple_profiles": False, "kv_cache_reuse": True,
                                               "use_paged_context_fmha": False, "mpi": "never"})
    assert build(tmp_path, spec, "--dry-run") == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("trtllm-build --checkpoint_dir")
    assert "warning: check kv.paged-context-fmha fails" in captured.err
    assert build(tmp_path, spec) == 2
    err = capsys.readouterr().err
    assert "preflight check kv.paged-context-fmha failed" in err and "--skip-check kv.paged-context-fmha" in err


def test_flag_table_is_upstreams():
    """Our trtllm-build flag table against the flags parse_arguments and add_plugin_argument
    define (facts/trtllm_build.json, from TensorRT-LLM tensorrt_llm/commands/build.py and
    plugin/plugin.py): every flag exists, with the same kind, values among upstream's
    choices and the same default; no removed flag is still there."""
    from toolchain.upstream import facts

    upstream = facts("trtllm_build")["flags"]
    assert not set(trtllm.REMOVED) & set(upstream)
    kinds = {"path": "str", "str": "str", "int": "int", "switch": "switch", "choice": "choice", "choices": "choice"}
    for name, flag in trtllm.FLAGS.items():
        assert name in upstream, f"{name} is not a trtllm-build flag"
        up = upstream[name]
        where = f"{name} ({up['path']}:{up['line']})"
        if up["kind"] != "other":
            assert kinds[flag.kind] == up["kind"], where
        assert (flag.kind == "choices") == (up.get("nargs") == "+" and up["kind"] == "choice"), where
        if flag.kind == "choice" and up["choices"] is not None:
            assert set(flag.values) <= set(up["choices"]), (where, sorted(set(flag.values) - set(up["choices"])))
        if flag.default is not None and up.get("default_expr") is None and flag.kind != "switch":
            assert flag.default == up["default"], (where, flag.default, up["default"])
