"""The convert stage: manifest, reuse when current, rebuild on change, CLI output."""

from __future__ import annotations

import json
import shutil

from conftest import read_json, write_spec
from toolchain.checkpoint.stage import run_convert
from toolchain.fingerprint import input_hash
from toolchain.cli import main
from toolchain.manifest import Manifest
from toolchain.spec import load_spec
from toolchain.workspace import Workspace


def test_run_convert_writes_then_reuses_then_rebuilds(tmp_path, hf_llama):
    hf = shutil.copytree(hf_llama, tmp_path / "hf")
    ws = Workspace(tmp_path / "root")
    spec_path = write_spec(tmp_path / "s.yaml", hf, parallelism={"tp": 2})
    spec = load_spec(spec_path)
    out = ws.checkpoint_dir(spec)

    first = run_convert(spec, ws)
    assert first.stage == "convert" and set(first.inputs) == {"config.json", "model.safetensors"}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json", "rank0.safetensors",
                                                     "rank1.safetensors"]
    assert first.outputs["world_size"] == 2 and first.outputs["bytes"] > 0
    assert Manifest.read(out).key() == first.key()

    said = []
    again = run_convert(spec, ws, echo=said.append)
    assert again.created == first.created and "reusing" in said[0]

    forced = run_convert(spec, ws, force=True)
    assert forced.created > first.created

    # A different conversion setting changes the hash and rebuilds.
    spec4 = load_spec(spec_path, ["parallelism.tp=4"])
    rebuilt = run_convert(spec4, ws)
    assert rebuilt.spec_hash != first.spec_hash and read_json(out / "config.json")["mapping"]["tp_size"] == 4
    assert sorted(p.name for p in out.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(4)]

    # A changed input file rebuilds too; serving-only spec fields do not.
    cfg = read_json(hf / "config.json")
    cfg["rms_norm_eps"] = 1e-5
    (hf / "config.json").write_text(json.dumps(cfg))
    changed = run_convert(spec4, ws)
    assert changed.created > rebuilt.created and read_json(out / "config.json")["norm_epsilon"] == 1e-5
    serving = load_spec(spec_path, ["parallelism.tp=4", "serving.http_port=9000"])
    assert run_convert(serving, ws).created == changed.created
    assert [p.name for p in out.parent.iterdir()] == ["checkpoint"]  # no temp or old dirs


def test_input_hash_fingerprints_big_files(tmp_path, monkeypatch):
    import toolchain.fingerprint as stage

    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 4096)
    assert input_hash(path).startswith("sha256:")
    monkeypatch.setattr(stage, "FULL_HASH_LIMIT", 1024)
    monkeypatch.setattr(stage, "EDGE", 512)
    before = input_hash(path)
    assert before.startswith("fingerprint:")
    path.write_bytes(b"b" + b"a" * 4095)
    assert input_hash(path) != before


def test_cli_convert_and_dry_run(tmp_path, capsys, hf_llama):
    spec = write_spec(tmp_path / "s.yaml", hf_llama, name="cli-model", parallelism={"tp": 2, "pp": 1})
    root = tmp_path / "root"
    assert main(["--root", str(root), "convert", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rank0.safetensors" in out and "rank1.safetensors" in out and "lm_head.weight" in out
    assert "125x64" in out  # 250-row lm_head over 2 ranks
    assert not root.exists()

    assert main(["--root", str(root), "convert", str(spec)]) == 0
    out = capsys.readouterr().out
    ckpt = root / "engines" / "cli-model" / "checkpoint"
    assert f"wrote {ckpt}" in out and "2 rank(s)" in out
    assert main(["--root", str(root), "convert", str(spec)]) == 0
    assert "reusing" in capsys.readouterr().out
    assert main(["--root", str(root), "convert", str(spec), "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
