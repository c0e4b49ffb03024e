"""`toolchain init`: a starting spec from a Hugging Face directory that `toolchain plan` accepts,
never written over without --force, refusing unknown names with the valid ones; the hub path's
one-line error when the hub cannot be reached (this machine is offline)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolchain.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-llama"
CONFIGS = REPO / "build" / "configs"


def init(root: Path, *args: str) -> int:
    return main(["--root", str(root), "init", *map(str, args)])


def plan(root: Path, spec: Path) -> int:
    return main(["--root", str(root), "plan", str(spec)])


def test_local_model_directory_gives_a_spec_that_plans(tmp_path, capsys):
    assert init(tmp_path, TINY) == 0, capsys.readouterr().err
    spec_path = tmp_path / "build" / "tiny-llama.yaml"
    data = yaml.safe_load(spec_path.read_text())
    assert data["name"] == "tiny-llama" and data["target"] == "cpu" and data["parallelism"]["tp"] == 1
    # relative to the spec file, as load_spec resolves it
    assert (spec_path.parent / data["model"]["checkpoint"]).resolve() == TINY
    assert data["limits"]["max_seq_len"] == 1024  # the model's max_position_embeddings
    capsys.readouterr()
    assert plan(tmp_path, spec_path) == 0, capsys.readouterr().out


def test_config_only_directory_with_gpu_and_quant_plans(tmp_path, capsys):
    """int8_wo has no HF format the PyTorch backend loads: the GPU's default target gives way to trtllm, saying
    why."""
    spec_path = tmp_path / "q.yaml"
    assert init(tmp_path, CONFIGS / "qwen2.5-0.5b-instruct", "--gpu", "l4", "--quant", "int8_wo",
                "--out", spec_path) == 0, capsys.readouterr().err
    data = yaml.safe_load(spec_path.read_text())
    assert data["target"] == "trtllm" and data["gpu"] == {"name": "L4"}
    assert data["quantization"] == {"method": "int8_wo"}
    assert data["limits"]["max_seq_len"] == 8192  # capped below the model's 32k context
    out = capsys.readouterr().out
    assert "target trtllm, tp 1" in out and "note: target trtllm: the LLM-API path refuses this spec " \
        "(llmapi.quantization: quantization.method int8_wo" in out
    assert "# note: target trtllm: the LLM-API path refuses" in spec_path.read_text()
    assert plan(tmp_path, spec_path) == 0, capsys.readouterr().out


def test_a_gpu_defaults_to_the_llmapi_target(tmp_path, capsys):
    """README's advice for new deployments; --target trtllm still picks the engine path."""
    spec_path = tmp_path / "q.yaml"
    assert init(tmp_path, CONFIGS / "qwen2.5-0.5b-instruct", "--gpu", "l4", "--out", spec_path) == 0
    assert yaml.safe_load(spec_path.read_text())["target"] == "llmapi"
    assert "target llmapi, tp 1 on L4" in capsys.readouterr().out and "note:" not in spec_path.read_text()
    assert plan(tmp_path, spec_path) == 0, capsys.readouterr().out
    assert init(tmp_path, CONFIGS / "qwen2.5-0.5b-instruct", "--gpu", "l4", "--target", "trtllm",
                "--out", spec_path, "--force") == 0
    assert yaml.safe_load(spec_path.read_text())["target"] == "trtllm"


def test_tensor_parallel_size_whose_kv_cache_holds_the_batch(tmp_path, capsys):
    """Llama-3-70B in fp16 fits two H100s, but their KV cache holds 7 sequences of 8192 tokens where
    max_batch_size is 32; four hold all 32. The build host's RAM is set with --set."""
    spec_path = tmp_path / "big.yaml"
    assert init(tmp_path, CONFIGS / "llama-3-70b", "--gpu", "H100", "--out", spec_path,
                "--set", "build.host_memory_gib=2048") == 0, capsys.readouterr().err
    data = yaml.safe_load(spec_path.read_text())
    assert data["parallelism"]["tp"] == 4 and data["build"]["host_memory_gib"] == 2048
    capsys.readouterr()
    assert main(["--root", str(tmp_path), "plan", str(spec_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["concurrency"] >= data["limits"]["max_batch_size"] == 32
    assert report["sequence_tokens"] == data["limits"]["max_seq_len"] == 8192


def test_no_tp_holds_the_batch_falls_back_to_the_smallest_that_fits_with_a_note(tmp_path, capsys):
    spec_path = tmp_path / "big.yaml"
    assert init(tmp_path, CONFIGS / "llama-3-70b", "--gpu", "H100", "--out", spec_path,
                "--set", "build.host_memory_gib=2048", "--set", "limits.max_batch_size=512") == 0
    assert yaml.safe_load(spec_path.read_text())["parallelism"]["tp"] == 2
    note = ("tp 2: its KV cache holds 7 sequences of 8192 tokens, below limits.max_batch_size 512, and no tp up "
            "to 8 holds them all")
    assert f"note: {note}" in capsys.readouterr().out and f"# note: {note}" in spec_path.read_text()
    assert plan(tmp_path, spec_path) == 0


def test_no_spec_when_nothing_passes_the_plan(tmp_path, capsys):
    spec_path = tmp_path / "fp8.yaml"
    assert init(tmp_path, CONFIGS / "mistral-7b-instruct-v0.3", "--gpu", "A100", "--quant", "fp8",
                "--out", spec_path) == 2
    err = capsys.readouterr().err
    assert "quant.fp8-needs-sm89" in err and len(err.strip().splitlines()) == 1
    assert not spec_path.exists()


def test_existing_spec_is_kept_without_force(tmp_path, capsys):
    spec_path = tmp_path / "mine.yaml"
    spec_path.write_text("# my edits\nname: mine\n")
    assert init(tmp_path, TINY, "--out", spec_path) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "pass --force" in err
    assert spec_path.read_text() == "# my edits\nname: mine\n"
    assert init(tmp_path, TINY, "--out", spec_path, "--force") == 0
    assert yaml.safe_load(spec_path.read_text())["name"] == "tiny-llama"


@pytest.mark.parametrize("args, wrong, valid", [
    (["--gpu", "GB300"], "unknown --gpu 'GB300'", "H100 80GB, H100 PCIe, H200 141GB"),
    (["--quant", "int3"], "unknown --quant 'int3'", "none, int8_wo, int4_wo, awq, smoothquant, fp8"),
    (["--target", "tpu"], "unknown --target 'tpu'", "cpu, trtllm, llmapi, llmapi-cpu"),
    (["--target", "trtllm"], "target trtllm runs on GPUs", "--gpu with one of H100 80GB"),
    (["--target", "cpu", "--gpu", "L4"], "--gpu applies to targets trtllm, llmapi",
     "drop --gpu, or pass --target llmapi"),
    (["--name", "../x"], "invalid 'name'", "pattern"),
])
def test_unknown_names_are_refused_with_the_valid_choices(tmp_path, capsys, args, wrong, valid):
    assert init(tmp_path, TINY, *args) == 2
    err = capsys.readouterr().err
    assert wrong in err and valid in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "build").exists()


def test_source_that_is_neither_directory_nor_hub_id(tmp_path, capsys):
    assert init(tmp_path, tmp_path / "missing" / "model") == 2
    assert "no model directory" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


def test_unreachable_hub_is_one_line_and_leaves_nothing(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(REPO)}
    cli = "import sys; from toolchain.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "--root", str(tmp_path), "init",
                           "Qwen/Qwen2.5-0.5B-Instruct", "--gpu", "L4"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: cannot fetch 'Qwen/Qwen2.5-0.5B-Instruct' from the Hugging Face Hub")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "build" / "qwen2.5-0.5b-instruct.yaml").exists()
    assert not (tmp_path / "build" / "configs" / "qwen2.5-0.5b-instruct").exists()


def test_gemma3_on_the_llmapi_default_starts_with_kv_reuse_off(tmp_path, capsys):
    """The PyTorch backend serves Gemma 3 without KV block reuse (llmapi.kv-reuse): the starting spec on the GPU's
    default target says so, and plans, instead of falling back to the engine path."""
    spec_path = tmp_path / "g.yaml"
    assert init(tmp_path, CONFIGS / "gemma-3-1b-it", "--gpu", "H100", "--out", spec_path) == 0, \
        capsys.readouterr().err
    data = yaml.safe_load(spec_path.read_text())
    assert data["target"] == "llmapi" and data["build"] == {"kv_cache_reuse": False}
    capsys.readouterr()
    assert plan(tmp_path, spec_path) == 0, capsys.readouterr().out
