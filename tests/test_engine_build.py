"""build-engine (target cpu): engine config, manifest, reuse and rebuild."""

from __future__ import annotations

import json
import shlex

from conftest import write_spec
from toolchain.cli import main
from toolchain.engine import trtllm
from toolchain.spec import load_spec


def _build(tmp_path, spec_path, *extra):
    return main(["--root", str(tmp_path / "ws"), "build-engine", str(spec_path), *extra])


def test_cpu_engine_dir_carries_limits_and_ranks(tmp_path, hf_llama, capsys):
    spec = write_spec(tmp_path / "s.yaml", hf_llama, parallelism={"tp": 2},
                      limits={"max_batch_size": 3, "max_input_len": 100, "max_seq_len": 200, "max_num_tokens": 300})
    assert _build(tmp_path, spec) == 0
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"
    config = json.loads((engine / "config.json").read_text())
    assert config["build_config"]["max_batch_size"] == 3
    assert config["build_config"]["max_seq_len"] == 200
    assert config["pretrained_config"]["mapping"]["tp_size"] == 2
    assert sorted(p.name for p in engine.glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["stage"] == "build-engine" and "torch" in manifest["tools"]
    assert "built" in capsys.readouterr().out


def test_unchanged_is_reused_changed_is_rebuilt(tmp_path, hf_llama, capsys):
    spec = write_spec(tmp_path / "s.yaml", hf_llama)
    assert _build(tmp_path, spec) == 0
    capsys.readouterr()
    assert _build(tmp_path, spec) == 0
    assert "reused" in capsys.readouterr().out
    assert _build(tmp_path, spec, "--set", "limits.max_batch_size=5") == 0
    assert "built" in capsys.readouterr().out
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"
    assert json.loads((engine / "config.json").read_text())["build_config"]["max_batch_size"] == 5
    # No temporary or stale directories are left next to the outputs.
    assert sorted(p.name for p in engine.parent.iterdir()) == ["checkpoint", "engine"]


def test_serving_slo_and_workload_changes_reuse_the_engine(tmp_path, hf_llama, capsys):
    """The build's key is the settings it reads: a port, an SLO or a workload change reuses the engine."""
    spec = write_spec(tmp_path / "s.yaml", hf_llama)
    assert _build(tmp_path, spec) == 0
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"
    manifest = (engine / "manifest.json").read_text()
    for change in ("serving.http_port=9100", "validation.slo.e2e_p99_ms=1234",
                   "validation.workload.num_requests=7", "serving.max_queue_size=3"):
        capsys.readouterr()
        assert _build(tmp_path, spec, "--set", change) == 0, capsys.readouterr().err
        assert "reused" in capsys.readouterr().out, change
    assert (engine / "manifest.json").read_text() == manifest
    assert _build(tmp_path, spec, "--set", "build.tokens_per_block=64") == 0
    assert "built" in capsys.readouterr().out


def test_max_seq_len_beyond_positions_warns_like_trtllm_build(tmp_path, hf_llama, capsys):
    spec = write_spec(tmp_path / "s.yaml", hf_llama, limits={"max_input_len": 100, "max_seq_len": 4096})
    assert _build(tmp_path, spec) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: limits.max_seq_len (4096)") and "(512)" in err


def test_trtllm_target_without_trtllm_build_names_the_command(tmp_path, hf_llama, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    spec = write_spec(tmp_path / "s.yaml", hf_llama, target="trtllm", parallelism={"tp": 2})
    assert _build(tmp_path, spec) == 2
    err = capsys.readouterr().err
    assert "trtllm-build not found" in err and "--checkpoint_dir" in err and "--max_seq_len" in err


def test_dry_run_prints_trtllm_build_flags(tmp_path, hf_llama, capsys):
    spec_path = write_spec(tmp_path / "s.yaml", hf_llama, target="trtllm", limits={"max_num_tokens": 777})
    assert _build(tmp_path, spec_path, "--dry-run") == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[0] == "trtllm-build"
    assert argv[argv.index("--max_num_tokens") + 1] == "777"
    spec = load_spec(spec_path)
    assert argv == trtllm.build_command(spec, tmp_path / "ws" / "engines" / "test-model" / "checkpoint",
                                        tmp_path / "ws" / "engines" / "test-model" / "engine")


def test_cpu_draft_gathers_generation_logits_with_use_draft_logits(tmp_path, hf_llama, capsys):
    """As trtllm-build --gather_generation_logits records it: the tensorrt_llm model returns the
    draft's generation logits (for the BLS's draft_logits) only from such an engine."""
    spec = write_spec(tmp_path / "s.yaml", hf_llama, serving={"streaming": False},
                      speculative={"mode": "draft_target", "max_draft_len": 4, "draft_model": str(hf_llama)})
    engine = tmp_path / "ws" / "engines" / "test-model" / "engine"

    def build_config(path):
        return json.loads((path / "config.json").read_text())["build_config"]

    assert _build(tmp_path, spec) == 0, capsys.readouterr().err
    assert build_config(engine / "draft" / "engine")["gather_generation_logits"] is False
    assert _build(tmp_path, spec, "--set", "speculative.use_draft_logits=true") == 0, capsys.readouterr().err
    draft = build_config(engine / "draft" / "engine")
    assert draft["gather_generation_logits"] is True and draft["max_draft_len"] == 0
    assert not build_config(engine).get("gather_generation_logits")  # the target's logits stay ungathered


def test_draft_converts_in_convert_and_build_only_builds(tmp_path, hf_llama, capsys):
    """draft_target: convert writes the draft's checkpoint (tp 1) with its own manifest; build-engine
    links its weights into engine/draft/engine and records that manifest as its input."""
    spec = write_spec(tmp_path / "s.yaml", hf_llama, serving={"streaming": False},
                      speculative={"mode": "draft_target", "max_draft_len": 4, "draft_model": str(hf_llama)})
    root = tmp_path / "ws" / "engines" / "test-model"
    assert main(["--root", str(tmp_path / "ws"), "convert", str(spec)]) == 0, capsys.readouterr().err
    draft = json.loads((root / "draft-checkpoint" / "manifest.json").read_text())
    assert draft["stage"] == "convert-draft" and draft["outputs"]["world_size"] == 1
    assert not (root / "engine").exists()
    assert _build(tmp_path, spec) == 0, capsys.readouterr().err
    engine = json.loads((root / "engine" / "manifest.json").read_text())
    assert engine["inputs"]["draft_checkpoint"] != "missing"
    weights = (root / "draft-checkpoint" / "rank0.safetensors").read_bytes()
    assert (root / "engine" / "draft" / "engine" / "rank0.safetensors").read_bytes() == weights
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint", "draft-checkpoint", "engine"]
