"""Planning a conversion from config.json alone (`convert --dry-run` before
the weights are downloaded): the same plan as from the real checkpoint, and
the shipped Llama-3-70B tp 4 x pp 2 spec accepted up to the point it needs
weights."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO, make_hf_model, write_spec

from toolchain.checkpoint.convert import plan_any
from toolchain.cli import main

SPEC_70B = REPO / "build" / "llama3-70b-tp4pp2.yaml"


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("MistralForCausalLM", {"sliding_window": 8}),
    ("Qwen2ForCausalLM", {"vocab_size": 251}),
    ("Qwen3ForCausalLM", {"head_dim": 32}),
])
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 2)])
def test_config_only_plan_equals_weights_plan(tmp_path, arch, extra, tp, pp):
    import torch

    full = make_hf_model(arch, tmp_path / "full", dtype=torch.bfloat16, num_hidden_layers=3, **extra)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(full / "config.json", bare / "config.json")
    options = {"tp": tp, "pp": pp, "dtype": "auto", "target": "trtllm"}
    a, b = plan_any(full, **options), plan_any(bare, **options)
    assert not a.config_only and b.config_only
    assert a.describe() == b.describe() and a.config == b.config
    assert b.options.dtype == "bfloat16"


def test_70b_spec_dry_run_from_config_alone(tmp_path, capsys):
    root = tmp_path / "root"
    assert main(["--root", str(root), "convert", str(SPEC_70B), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM -> 8 rank(s) (tp 4 x pp 2), dtype bfloat16" in out
    assert "planned from config.json alone" in out
    ranks = out.split("\nrank")[1:]
    assert len(ranks) == 8
    for r, block in enumerate(ranks):
        stage = r // 4
        assert block.startswith(f"{r}.safetensors  pp {stage} tp {r % 4}  layers {'0-39' if stage == 0 else '40-79'}")
        # (64/4 + 2 * 8/4) * 128 = 2560 fused q/k/v rows; 28672/4 MLP columns; 128256/4 vocab rows.
        assert "transformer.layers.39.attention.qkv.weight" in block and "layers.40." not in block
        assert "2560x8192" in block and "7168x8192" in block and "8192x2048" in block
        assert ("128256x8192" in block) == (stage == 0)          # embedding on the first stage only
        assert ("lm_head.weight" in block) == (stage == 1) and ("32064x8192" in block) == (stage == 1)
    assert not root.exists()


def test_70b_spec_summary_and_real_convert_needs_weights(tmp_path, capsys):
    root = tmp_path / "root"
    assert main(["--root", str(root), "convert", str(SPEC_70B), "--dry-run", "--summary"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("rank")]) == 8
    assert "transformer.layers" not in out and "137.3 GiB" in out
    assert main(["--root", str(root), "convert", str(SPEC_70B)]) == 2
    err = capsys.readouterr().err
    assert "no *.safetensors weights" in err and "llama-3-70b" in err
    assert not root.exists()


def test_dry_run_still_validates_parallelism(tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(REPO / "build" / "configs" / "llama-3-70b" / "config.json", bare / "config.json")
    spec = write_spec(tmp_path / "s.yaml", bare, name="x", parallelism={"tp": 12})
    assert main(["--root", str(tmp_path / "root"), "convert", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "tp=12 does not divide num_attention_heads=64" in err and "use parallelism.tp 1, 2, 4, 8, 16, 32 or 64" in err


def test_summary_requires_dry_run(tmp_path, capsys):
    assert main(["--root", str(tmp_path), "convert", str(SPEC_70B), "--summary"]) == 2
    assert "--summary only applies with --dry-run" in capsys.readouterr().err
