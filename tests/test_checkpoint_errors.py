"""Bad input through `toolchain convert`: exit status 2, one line on stderr,
no traceback, and nothing left under engines/ (no checkpoint, no temp dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_spec
from toolchain.cli import main

NAME = "bad-model"


def copy_hf(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(hf: Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg))


def edit_weights(hf: Path, fn) -> None:
    w = load_file(str(hf / "model.safetensors"))
    fn(w)
    save_file(w, str(hf / "model.safetensors"), metadata={"format": "pt"})


def run_convert(tmp_path: Path, capsys, spec: Path | str) -> str:
    root = tmp_path / "root"
    rc = main(["--root", str(root), "convert", str(spec)])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, captured
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    # Nothing that could pass for output, and no temporary directories.
    assert not (root / "engines" / NAME).exists()
    leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name] if root.exists() else []
    assert leftovers == []
    return err


def spec_for(tmp_path: Path, checkpoint: Path, **sections) -> Path:
    return write_spec(tmp_path / "spec.yaml", checkpoint, name=NAME, **sections)


def test_missing_spec(tmp_path, capsys):
    err = run_convert(tmp_path, capsys, tmp_path / "nope.yaml")
    assert "spec file not found" in err


def test_unknown_spec_key(tmp_path, capsys, hf_llama):
    spec = spec_for(tmp_path, hf_llama, modle={"x": 1})
    assert "unknown key 'modle'" in run_convert(tmp_path, capsys, spec)


def test_missing_checkpoint_dir(tmp_path, capsys):
    spec = spec_for(tmp_path, tmp_path / "nowhere")
    assert "not found" in run_convert(tmp_path, capsys, spec)


def test_checkpoint_without_weights(tmp_path, capsys, hf_llama):
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(hf_llama / "config.json", hf / "config.json")
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "no *.safetensors" in err and str(hf) in err


def test_truncated_safetensors(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    path = hf / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "truncated" in err and str(path) in err


def test_garbage_safetensors(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "corrupt safetensors" in err and "model.safetensors" in err


def test_index_names_missing_shard(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    names = load_file(str(hf / "model.safetensors")).keys()
    weight_map = {n: "model-00002-of-00002.safetensors" for n in names}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "model-00002-of-00002.safetensors" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_unsupported_architecture(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, architectures=["GPT2LMHeadModel"])
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "unsupported architecture 'GPT2LMHeadModel'" in err and "LlamaForCausalLM" in err


def test_missing_config_field(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, intermediate_size=None)
    assert "intermediate_size" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


@pytest.mark.parametrize("tp,needle", [
    (3, "tp=3 does not divide num_attention_heads=4"),
    (8, "tp=8 does not divide num_attention_heads=4"),
])
def test_tp_not_dividing_heads(tmp_path, capsys, hf_llama, tp, needle):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_llama, parallelism={"tp": tp}))
    assert needle in err and "tp 1, 2 or 4" in err


def test_pp_exceeds_layers(tmp_path, capsys, hf_llama):
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf_llama, parallelism={"pp": 3}))
    assert "pp=3 exceeds num_hidden_layers=2" in err


def test_missing_required_tensor(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    assert "model.layers.1.mlp.up_proj.weight is missing" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_untied_model_without_lm_head(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w.pop("lm_head.weight"))
    assert "lm_head.weight is missing" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_unexpected_tensor(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w.update({"model.layers.5.mlp.up_proj.weight": torch.zeros(2, 2),
                                         "model.extra.weight": torch.zeros(2)}))
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "2 tensor(s) match no llama table row" in err and "model.extra.weight" in err


def test_bias_without_config_flag(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    assert "q_proj.bias" in run_convert(tmp_path, capsys, spec_for(tmp_path, hf))


def test_float16_overflow_mid_write_leaves_nothing(tmp_path, capsys, hf_llama):
    # Found only while writing: the temporary directory must still vanish.
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w["model.layers.1.mlp.down_proj.weight"].mul_(1e6))
    spec = spec_for(tmp_path, hf, model={"dtype": "float16"})
    assert "overflows float16" in run_convert(tmp_path, capsys, spec)


def test_dropped_rope_buffer_is_accepted(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_weights(hf, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    root = tmp_path / "root"
    assert main(["--root", str(root), "convert", str(spec_for(tmp_path, hf))]) == 0
    assert (root / "engines" / NAME / "checkpoint" / "rank0.safetensors").is_file()


def test_weight_shape_disagrees_with_config(tmp_path, capsys, hf_llama):
    hf = copy_hf(hf_llama, tmp_path / "hf")
    edit_config(hf, num_key_value_heads=4)  # weights hold 2 KV heads
    err = run_convert(tmp_path, capsys, spec_for(tmp_path, hf))
    assert "k_proj.weight has shape [32, 64] but config.json implies [64, 64]" in err
