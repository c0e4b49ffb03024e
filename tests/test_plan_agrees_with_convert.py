"""The plan is the promise (issue 23, items 1-6 and the build line of item 8): what `toolchain
plan` says each rank's checkpoint holds is what `convert --dry-run` plans to write, for per-group
int4 with MLP padding, for AutoAWQ checkpoints stored quantized and for an explicit float32; the
suggestions a verdict prints apply as printed; the advice fits the spec; and the GPU-host lines do
not depend on the machine that plans."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from toolchain.checkpoint.convert import plan_any
from toolchain.cli import main
from toolchain.quant.view import Quantization

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "build" / "configs"

# Qwen2.5-72B-Instruct's config.json (the MLP width 29568 is 231 groups of 128, 57.75 per rank at tp 4).
QWEN72 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
          "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
          "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
          "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": 131072,
          "use_sliding_window": False, "max_window_layers": 70, "bos_token_id": 151643, "eos_token_id": 151645}
# Qwen2.5-72B-Instruct-AWQ: AutoAWQ GEMM int4, its MLP already padded to 29696 by the publisher.
QWEN72_AWQ = {**QWEN72, "intermediate_size": 29696, "torch_dtype": "float16",
              "quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                                      "quant_method": "awq", "version": "gemm", "zero_point": True}}


def model_dir(tmp_path: Path, name: str, cfg: dict) -> Path:
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def spec_file(tmp_path: Path, checkpoint: Path, **sections) -> Path:
    data = {"name": "agree", "target": "trtllm", "model": {"checkpoint": str(checkpoint), "dtype": "float16"},
            "gpu": {"name": "H100 80GB"}, "build": {"host_memory_gib": 256},
            "limits": {"max_batch_size": 8, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 4096}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plan_json(tmp_path: Path, spec: Path, *args: str, capsys) -> tuple[int, dict]:
    rc = main(["--root", str(tmp_path / "ws"), "plan", str(spec), *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def statuses(report: dict) -> dict:
    return {c["id"]: (c["status"], c["message"]) for c in report["checks"]}


CASES = {
    # item 1: AWQ at tp 4 pads the MLP to 29696 (7424 per rank) with float32 group scales
    "qwen72-awq-tp4": (QWEN72, {"parallelism": {"tp": 4}, "quantization": {"method": "awq"}}, Quantization(method="awq")),
    # item 2: the AutoAWQ checkpoint under method none is W4A16 with zero points, not fp16
    "qwen72-autoawq-tp4": (QWEN72_AWQ, {"parallelism": {"tp": 4}}, Quantization()),
    # item 4: an explicit float32 is what convert writes on target trtllm (only "auto" narrows fp32)
    "llama8b-fp32-tp2": (json.loads((CONFIGS / "llama-3-8b-instruct" / "config.json").read_text()),
                         {"parallelism": {"tp": 2}, "model": {"dtype": "float32"}}, Quantization()),
    # issue 35: NVFP4 on a B200, packed e2m1 with e4m3 scales per 16 and two float32 scalars per linear
    "llama8b-nvfp4-tp2": (json.loads((CONFIGS / "llama-3-8b-instruct" / "config.json").read_text()),
                          {"parallelism": {"tp": 2}, "gpu": {"name": "B200"}, "quantization": {"method": "nvfp4"}},
                          Quantization(method="nvfp4")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_checkpoint_bytes_equal_convert_dry_run(tmp_path, capsys, case):
    cfg, sections, recipe = CASES[case]
    ckpt = model_dir(tmp_path, case, cfg)
    spec = spec_file(tmp_path, ckpt, **sections)
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    assert rc == 0, (report["failed_checks"], report["verdict"])
    tp = sections["parallelism"]["tp"]
    dry = plan_any(ckpt, tp=tp, pp=1, dtype=sections.get("model", {}).get("dtype", "float16"), target="trtllm",
                   quantization=recipe)
    assert [r["checkpoint_bytes"] for r in report["ranks"]] == [dry.rank_bytes(r) for r in range(tp)]
    assert report["weight_dtype"] == dry.options.dtype
    assert report["weight_format"].startswith(dry.config.get("quantization", {}).get("quant_algo") or "no weight")


def test_awq_mlp_padding_passes_with_a_note_where_convert_pads(tmp_path, capsys):
    spec = spec_file(tmp_path, model_dir(tmp_path, "q72", QWEN72), parallelism={"tp": 4},
                     quantization={"method": "awq"})
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    status, message = statuses(report)["quant.group-padding"]
    assert rc == 0 and status == "pass"
    assert "29696" in message and "7424 per rank" in message
    # convert --dry-run agrees: it plans the padded MLP instead of refusing
    assert main(["--root", str(tmp_path / "ws"), "convert", str(spec), "--dry-run"]) == 0


def test_awq_padding_the_converter_refuses_fails_plan_alike(tmp_path, capsys):
    # Qwen2.5-0.5B's hidden_size 896 is no multiple of 128 x 2: the converter refuses (attention dims
    # are never padded), and so does plan, naming what would work.
    spec = spec_file(tmp_path, CONFIGS / "qwen2.5-0.5b-instruct", parallelism={"tp": 2},
                     quantization={"method": "awq"})
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    status, message = statuses(report)["quant.group-padding"]
    assert rc == 1 and status == "fail"
    assert "hidden_size (896)" in message and message.endswith("use tp 1 or quantization.group_size=64")
    assert main(["--root", str(tmp_path / "ws"), "convert", str(spec), "--dry-run"]) == 2
    assert "hidden_size (896)" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["llmapi", "llmapi-cpu"])
def test_llmapi_path_refuses_a_group_remainder_per_rank_in_plan_and_convert(tmp_path, capsys, target):
    """The PyTorch backend pads nothing: 29568 / 4 = 7392 input channels of down_proj per rank are
    57.75 groups. Plan and convert refuse alike, with a fix a 72B model can use; the publisher's
    padded AWQ checkpoint (29696) loads."""
    extra = {} if target == "llmapi" else {"gpu": {"name": None}}
    spec = spec_file(tmp_path, model_dir(tmp_path, "q72", QWEN72), target=target, parallelism={"tp": 4},
                     quantization={"method": "awq"}, **extra)
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    status, message = statuses(report)["quant.group-padding"]
    assert rc == 1 and status == "fail"
    assert "intermediate_size per rank 7392" in message and "target trtllm" in message and "29696" in message
    # convert refuses through the same check, and on its own when the check is skipped
    for skip in (["memory.fits"], ["memory.fits", "quant.group-padding"]):
        args = [a for s in skip for a in ("--skip-check", s)]
        assert main(["--root", str(tmp_path / "ws"), "convert", str(spec), *args]) == 2
        err = capsys.readouterr().err
        assert "intermediate_size per rank 7392" in err and len(err.strip().splitlines()) == 1
    stored = spec_file(tmp_path, model_dir(tmp_path, "q72awq", QWEN72_AWQ), target=target,
                       parallelism={"tp": 4}, **extra)
    _, report = plan_json(tmp_path, stored, capsys=capsys)
    assert statuses(report)["quant.group-padding"][0] == "pass"


def test_llmapi_plans_an_autoawq_checkpoint_at_its_stored_size(tmp_path, capsys):
    spec = spec_file(tmp_path, model_dir(tmp_path, "q72awq", QWEN72_AWQ), target="llmapi", parallelism={"tp": 4})
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    assert rc == 0, report["failed_checks"]
    assert report["weight_format"].startswith("W4A16_AWQ")
    assert all(r["weights_bytes"] < 13 * 1024**3 for r in report["ranks"])  # 35.7 GiB as fp16


def test_autoawq_checkpoint_passes_host_ram_at_its_stored_size(tmp_path, capsys):
    spec = spec_file(tmp_path, model_dir(tmp_path, "q72awq", QWEN72_AWQ), parallelism={"tp": 4},
                     build={"host_memory_gib": 64, "mpi": "never", "workers": 1})
    rc, report = plan_json(tmp_path, spec, capsys=capsys)
    status, message = statuses(report)["build.host-ram"]
    assert rc == 0 and status == "pass", message  # one worker holds 2 x 11.9 GiB, not 2 x 35.7


def _suggestions(report: dict) -> list[list[str]]:
    """Each alternative of the verdict's "would fit with --set A or --set B", as a shell reads it."""
    verdict = report["verdict"]
    assert "; would fit with " in verdict, verdict
    return [shlex.split(alt) for alt in verdict.split("; would fit with ", 1)[1].split(" or ")]


@pytest.mark.parametrize("spec, args", [
    ("llama3-8b-awq-h100.yaml", ["--set", "model.checkpoint=configs/llama-3-70b", "--set", "quantization.method=none"]),
    ("llama3-70b-tp4pp2.yaml", ["--set", "gpu.name=L4", "--set", "serving.kv_cache_free_gpu_mem_fraction=0.01"]),
    ("mistral-7b-fp8-l40s.yaml", ["--set", "limits.max_batch_size=64", "--set", "limits.max_seq_len=32768",
                                  "--set", "limits.max_input_len=16384", "--set", "limits.max_num_tokens=16384",
                                  "--set", "serving.kv_cache_free_gpu_mem_fraction=0.05"]),
])
def test_every_suggestion_applied_as_printed_fits(tmp_path, capsys, spec, args):
    rc, report = plan_json(tmp_path, REPO / "build" / spec, *args, capsys=capsys)
    assert rc == 1 and statuses(report)["memory.fits"][0] == "fail" or not report["fits"]
    alternatives = _suggestions(report)
    assert alternatives
    for alt in alternatives:
        assert alt[0] == "--set"
        rc, fixed = plan_json(tmp_path, REPO / "build" / spec, *args, *alt, capsys=capsys)
        assert fixed["fits"] and statuses(fixed)["memory.fits"][0] == "pass", (alt, fixed["verdict"])


def test_docs_tp2_example_plans(tmp_path, capsys):
    # docs/planning.md: `toolchain plan build/llama3-8b-awq-h100.yaml --set parallelism.tp=2`
    rc, report = plan_json(tmp_path, REPO / "build" / "llama3-8b-awq-h100.yaml", "--set", "parallelism.tp=2",
                           capsys=capsys)
    assert rc == 0 and report["parallelism"]["world_size"] == 2


def test_kv_advice_fits_the_spec(tmp_path, capsys):
    crowded = ["--set", "limits.max_batch_size=256", "--set", "serving.kv_cache_free_gpu_mem_fraction=0.1"]
    spec = REPO / "build" / "mistral-7b-fp8-l40s.yaml"
    _, report = plan_json(tmp_path, spec, *crowded, capsys=capsys)
    status, message = statuses(report)["kv.batch-concurrency"]
    assert status == "warn" and "quantization.kv_cache" not in message and "max_batch_size to" in message
    _, report = plan_json(tmp_path, spec, *crowded, "--set", "quantization.kv_cache=none", capsys=capsys)
    status, message = statuses(report)["kv.batch-concurrency"]
    assert status == "warn" and "set quantization.kv_cache=fp8" in message  # L40S is SM 89


def _printed(tmp_path: Path, spec: Path, capsys) -> tuple[list[str], str]:
    _, report = plan_json(tmp_path, spec, capsys=capsys)
    return report["build_commands"], statuses(report)["build.host-ram"]


def test_gpu_host_lines_do_not_depend_on_this_machine(tmp_path, capsys, monkeypatch):
    """Same spec, same lines: whether mpirun is on this PATH and how much RAM this machine has
    change nothing, with build.host_memory_gib unset as with it set."""
    from toolchain import gpus

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text("#!/bin/sh\nexit 0\n")
    (fake / "mpirun").chmod(0o755)
    bare = os.environ["PATH"].split(os.pathsep)
    bare = os.pathsep.join(d for d in bare if not (Path(d) / "mpirun").exists())
    for spec in (REPO / "build" / "llama3-70b-tp4pp2.yaml",
                 spec_file(tmp_path, CONFIGS / "llama-3-70b", parallelism={"tp": 8}, build={"host_memory_gib": None})):
        seen = []
        for path, ram in ((bare, 16 * 1024**3), (f"{fake}{os.pathsep}{bare}", 4096 * 1024**3)):
            monkeypatch.setenv("PATH", path)
            monkeypatch.setattr(gpus, "host_memory_bytes", lambda ram=ram: ram)
            seen.append(_printed(tmp_path, spec, capsys))
        assert seen[0] == seen[1], spec
        assert shlex.split(seen[0][0][0])[0] == "mpirun"  # a multi-rank build, one process per rank
    assert seen[0][1][0] == "warn" and "build.host_memory_gib" in seen[0][1][1]


@pytest.mark.parametrize("with_mpirun", [False, True])
def test_readme_70b_build_line_is_what_plan_prints(tmp_path, capsys, monkeypatch, with_mpirun):
    """On a laptop with or without mpirun (make demo installs one for the CPU ranks)."""
    if with_mpirun:
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "mpirun").write_text("#!/bin/sh\nexit 0\n")
        (fake / "mpirun").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("$ toolchain plan build/llama3-70b-tp4pp2.yaml"):]
    line = block.split("\nbuild:\n", 1)[1].splitlines()[0].strip()
    pattern = ".*?".join(re.escape(part) for part in line.split("..."))
    assert main(["--root", str(tmp_path / "ws"), "plan", str(REPO / "build" / "llama3-70b-tp4pp2.yaml")]) == 0
    printed = capsys.readouterr().out.split("\nbuild:\n", 1)[1].splitlines()[0].strip()
    assert re.fullmatch(pattern, printed), (line, printed)


def test_mpirun_build_line_creates_its_log_directory(tmp_path, capsys):
    """Item 8: pasted on a fresh GPU host, the printed mpirun line's per-rank shell writes its log into
    a directory nothing has created yet. Run one rank of it as mpirun would (rank in the environment),
    with `true` standing in for trtllm-build."""
    _, report = plan_json(tmp_path, REPO / "build" / "llama3-70b-tp4pp2.yaml", "--set", "name=fresh", capsys=capsys)
    argv = shlex.split(report["build_commands"][0])
    assert argv[0] == "mpirun" and subprocess.run(["bash", "-n", "-c", report["build_commands"][0]]).returncode == 0
    rank_cmd = argv[argv.index("bash"):]
    rank_cmd[rank_cmd.index("trtllm-build")] = "true"
    logs = tmp_path / "ws" / "engines" / "fresh" / "engine" / "logs"
    assert not logs.exists()
    proc = subprocess.run(rank_cmd, env={**os.environ, "OMPI_COMM_WORLD_RANK": "3"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (logs / "rank3.log").is_file()
