"""A stage reuses only what it wrote: each manifest records a fingerprint of every file its stage wrote, and a
changed, removed or added file is named in one line and written again, or kept with --keep-edits and recorded
as edited by hand; serve refuses an engine or repository whose files differ (issue 27)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import TINY_TRAINED
from toolchain import pipeline
from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.fingerprint import output_hash
from toolchain.manifest import Manifest, diff_files, output_problem
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

pytestmark = pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="embedded model missing")

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "build" / "tiny-llama.yaml"
BLS = "tensorrt_llm_bls/1/model.py"


def _cli(root: Path, *argv: str, spec: Path = TINY) -> int:
    command, *rest = argv
    return main(["--root", str(root), command, str(spec), *rest])


def _truncate(path: Path) -> None:
    """Cut a tensors file in half in place, as a full disk or an interrupted copy leaves it."""
    os.truncate(path, path.stat().st_size // 2)


def _workspace(root: Path, spec_path: Path = TINY):
    spec = load_spec(spec_path)
    return spec, Workspace(root)


def test_a_hand_edited_repository_file_is_rendered_again_and_named(tmp_path, capsys):
    spec, ws = _workspace(tmp_path / "ws")
    assert _cli(ws.root, "model-repo") == 0
    repo = ws.model_repo_dir(spec)
    ours = (repo / BLS).read_text()
    (repo / BLS).write_text("# NVIDIA's BLS, copied over by hand\n")
    capsys.readouterr()
    assert _cli(ws.root, "model-repo") == 0
    out = capsys.readouterr().out
    assert f"{repo / BLS} changed since model-repo wrote it; rendering again (--keep-edits keeps hand edits)" in out
    assert "rendered" in out and "up to date" not in out
    assert (repo / BLS).read_text() == ours
    assert _cli(ws.root, "model-repo") == 0  # now it is what the stage wrote
    assert "up to date, reused" in capsys.readouterr().out


def test_keep_edits_keeps_the_file_and_the_manifest_says_edited_by_hand(tmp_path, capsys):
    spec, ws = _workspace(tmp_path / "ws")
    assert _cli(ws.root, "model-repo") == 0
    repo = ws.model_repo_dir(spec)
    edited = "# NVIDIA's BLS, copied over by hand\n"
    (repo / BLS).write_text(edited)
    capsys.readouterr()
    assert _cli(ws.root, "model-repo", "--keep-edits") == 0
    out = capsys.readouterr().out
    assert f"{repo}: keeping hand edits (--keep-edits); edited by hand: {BLS}" in out
    assert (repo / BLS).read_text() == edited
    manifest = Manifest.read(repo)
    assert manifest is not None and manifest.edited_by_hand == [BLS]
    assert manifest.files is not None and manifest.files[BLS] == output_hash(repo / BLS)
    assert not diff_files(repo, manifest)
    assert output_problem(repo) is None  # serve accepts a kept edit

    assert _cli(ws.root, "model-repo", "--keep-edits") == 0  # kept again, still named
    assert f"edited by hand: {BLS}" in capsys.readouterr().out and (repo / BLS).read_text() == edited
    # Without the option the kept edit is not reused silently: it is named and rendered again.
    assert _cli(ws.root, "model-repo") == 0
    out = capsys.readouterr().out
    assert f"{repo / BLS} was kept as a hand edit; rendering again" in out
    assert (repo / BLS).read_text() != edited and Manifest.read(repo).edited_by_hand == []


def test_an_added_and_a_removed_file_are_noticed(tmp_path):
    from toolchain.triton.repo import run_model_repo

    spec, ws = _workspace(tmp_path / "ws")
    first = run_model_repo(spec, ws)
    repo = ws.model_repo_dir(spec)
    (repo / "extra_model" / "1").mkdir(parents=True)
    (repo / "extra_model" / "config.pbtxt").write_text('name: "extra_model"\n')
    (repo / "postprocessing" / "config.pbtxt").unlink()
    said: list[str] = []
    again = run_model_repo(spec, ws, echo=said.append)
    assert len(said) == 1 and said[0].startswith(f"{repo / 'postprocessing/config.pbtxt'} removed, "
                                                 f"{repo / 'extra_model/config.pbtxt'} added since model-repo wrote it")
    assert again.created > first.created
    assert not (repo / "extra_model").exists() and (repo / "postprocessing" / "config.pbtxt").is_file()
    # What Python and editors leave beside the files is not an addition.
    (repo / BLS).with_name("__pycache__").mkdir()
    (repo / BLS).with_name("__pycache__").joinpath("model.cpython-312.pyc").write_bytes(b"x")
    (repo / BLS).with_name(".model.py.swp").write_bytes(b"x")
    assert run_model_repo(spec, ws, echo=said.append).created == again.created and len(said) == 1


def test_a_truncated_checkpoint_file_is_converted_again(tmp_path):
    from toolchain.checkpoint.stage import run_convert

    spec, ws = _workspace(tmp_path / "ws")
    first = run_convert(spec, ws)
    ckpt = ws.checkpoint_dir(spec)
    assert first.files is not None and set(first.files) == {"config.json", "rank0.safetensors", "rank1.safetensors"}
    size = (ckpt / "rank0.safetensors").stat().st_size
    _truncate(ckpt / "rank0.safetensors")
    said: list[str] = []
    again = run_convert(spec, ws, echo=said.append)
    assert said[0] == (f"{ckpt / 'rank0.safetensors'} changed since convert wrote it; converting again "
                       "(--keep-edits keeps hand edits)")
    assert again.created > first.created and (ckpt / "rank0.safetensors").stat().st_size == size
    assert again.files == first.files  # the same bytes again: the engine's input is unchanged


def test_a_truncated_engine_file_is_refused_by_serve_and_built_again(tmp_path, capsys):
    spec, ws = _workspace(tmp_path / "ws")
    for command in ("convert", "build-engine", "model-repo"):
        assert _cli(ws.root, command) == 0
    engine = ws.engine_dir(spec)
    _truncate(engine / "rank1.safetensors")
    capsys.readouterr()
    assert _cli(ws.root, "serve") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {engine / 'rank1.safetensors'} changed since build-engine wrote it; "
                          "refusing to serve it (run `toolchain build-engine")
    assert len(err.strip().splitlines()) == 1
    assert not pipeline.server_log(spec, ws).exists()  # caught before any server started

    assert _cli(ws.root, "build-engine") == 0
    out = capsys.readouterr().out
    assert f"{engine / 'rank1.safetensors'} changed since build-engine wrote it; building again" in out
    assert "built in" in out
    pipeline.check_served_outputs(spec, ws)  # whole again: serve would start


def test_serve_refusing_a_hand_edit_suggests_only_commands_that_exist(tmp_path, capsys):
    """Issue 33: serve has no --keep-edits, so its refusal must not tell the user to add it there; both ways out
    it names run as printed, and the second makes serve accept the edit."""
    spec, ws = _workspace(tmp_path / "ws")
    for command in ("build-engine", "model-repo"):
        assert _cli(ws.root, command) == 0
    repo = ws.model_repo_dir(spec)
    (repo / BLS).write_text("# NVIDIA's BLS, copied over by hand\n")
    capsys.readouterr()
    free = ("--set", "serving.http_port=0", "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0")
    assert _cli(ws.root, "serve", *free) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "refusing to serve it" in err
    suggested = re.findall(r"`toolchain ([^`]+)`", err)
    assert suggested == [f"model-repo {TINY}", f"model-repo {TINY} --keep-edits"], err
    assert "serve" not in " ".join(suggested)
    assert main(["--root", str(ws.root), *suggested[1].split()]) == 0  # runs as printed
    pipeline.check_served_outputs(spec, ws)  # and serve now accepts the kept edit


def test_an_engine_kept_with_keep_edits_serves_until_a_file_breaks(tmp_path, capsys):
    spec, ws = _workspace(tmp_path / "ws")
    for command in ("build-engine", "model-repo"):
        assert _cli(ws.root, command) == 0
    engine = ws.engine_dir(spec)
    config = json.loads((engine / "config.json").read_text())
    config["build_config"]["max_batch_size"] = 4  # a hand edit of the engine's config
    (engine / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with pytest.raises(ToolchainError, match="config.json changed since build-engine wrote it; refusing to serve"):
        pipeline.check_served_outputs(spec, ws)
    capsys.readouterr()
    assert _cli(ws.root, "build-engine", "--keep-edits") == 0
    out = capsys.readouterr().out
    assert f"{engine}: keeping hand edits (--keep-edits); edited by hand: config.json" in out and "reused" in out
    assert json.loads((engine / "config.json").read_text())["build_config"]["max_batch_size"] == 4
    pipeline.check_served_outputs(spec, ws)  # a kept edit serves
    assert pipeline.kept_edits(spec, ws) == {"build-engine": [str(engine / "config.json")]}
    _truncate(engine / "rank0.safetensors")
    with pytest.raises(ToolchainError, match="rank0.safetensors changed since build-engine wrote it"):
        pipeline.check_served_outputs(spec, ws)


def test_a_manifest_from_before_files_were_recorded_rebuilds_once(tmp_path):
    from toolchain.checkpoint.stage import run_convert

    spec, ws = _workspace(tmp_path / "ws")
    first = run_convert(spec, ws)
    path = ws.checkpoint_dir(spec) / "manifest.json"
    old = json.loads(path.read_text())
    del old["files"], old["edited_by_hand"]
    path.write_text(json.dumps(old))
    assert "records no list of its files" in (output_problem(ws.checkpoint_dir(spec)) or "")
    said: list[str] = []
    again = run_convert(spec, ws, echo=said.append)
    assert said[0].endswith("records no list of its files (written by an older toolchain); converting again")
    assert again.created > first.created
    assert run_convert(spec, ws).created == again.created


def test_the_llmapi_repository_is_checked_too(tmp_path, capsys):
    spec_path = REPO / "build" / "tiny-llama-llmapi.yaml"
    spec, ws = _workspace(tmp_path / "ws", spec_path)
    assert _cli(ws.root, "model-repo", spec=spec_path) == 0
    model_yaml = ws.model_repo_dir(spec) / "tensorrt_llm" / "1" / "model.yaml"
    model_yaml.write_text(model_yaml.read_text() + "# tuned by hand\n")
    capsys.readouterr()
    assert _cli(ws.root, "model-repo", spec=spec_path) == 0
    assert f"{model_yaml} changed since model-repo wrote it; rendering again" in capsys.readouterr().out
    assert "tuned by hand" not in model_yaml.read_text()


def test_output_hash_reads_the_edges_of_a_big_file_and_ignores_its_mtime(tmp_path, monkeypatch):
    import toolchain.fingerprint as fingerprint

    path = tmp_path / "rank0.safetensors"
    path.write_bytes(b"h" * 512 + b"w" * 3072 + b"t" * 512)
    assert output_hash(path).startswith("sha256:")
    monkeypatch.setattr(fingerprint, "FULL_HASH_LIMIT", 1024)
    monkeypatch.setattr(fingerprint, "EDGE", 512)
    before = output_hash(path)
    assert before.startswith("edges:")
    os.utime(path, (1, 1))  # copied or moved: the same file
    assert output_hash(path) == before
    path.write_bytes(b"H" + b"h" * 511 + b"w" * 3072 + b"t" * 512)  # the header
    assert output_hash(path) != before
    path.write_bytes(b"h" * 512 + b"w" * 3072 + b"t" * 512)
    _truncate(path)
    assert output_hash(path) != before


FREE_PORTS = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0"]
SMALL_BENCH = ["validation.workload.num_requests=4", "validation.workload.warmup_requests=1",
               "validation.workload.output_tokens=4", "validation.workload.input_tokens=8"]


@pytest.mark.e2e
@pytest.mark.slow
def test_deploy_keeps_a_hand_edited_bls_with_keep_edits_and_reports_it(tmp_path, capsys):
    """The issue's case: the BLS of a rendered repository replaced by hand, then deploy. With --keep-edits the
    edited BLS is served and benched, and report.json says it was edited by hand."""
    spec, ws = _workspace(tmp_path / "ws")
    for command in ("build-engine", "model-repo"):
        assert _cli(ws.root, command) == 0
    bls = ws.model_repo_dir(spec) / BLS
    bls.write_text(bls.read_text() + "\n# edited by hand\n")
    sets = [arg for item in FREE_PORTS + SMALL_BENCH for arg in ("--set", item)]
    capsys.readouterr()
    assert _cli(ws.root, "deploy", "--keep-edits", *sets) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "keeping hand edits (--keep-edits); edited by hand: " + BLS in err
    assert f"edited by hand (model-repo kept them with --keep-edits): {bls}" in out
    report = json.loads((ws.report_dir(spec) / "report.json").read_text())
    assert report["edited_by_hand"] == {"model-repo": [str(bls)]}
    assert report["num_requests"] == 4 and report["errors"] == 0
    assert bls.read_text().endswith("# edited by hand\n")
    # Serving wrote nothing the checks count (the Python backend's __pycache__): a second serve would start.
    pipeline.check_served_outputs(spec, ws)


def test_hand_edits_replaced_for_changed_settings_are_named(tmp_path):
    from toolchain.triton.repo import run_model_repo

    spec, ws = _workspace(tmp_path / "ws")
    run_model_repo(spec, ws)
    bls = ws.model_repo_dir(spec) / BLS
    bls.write_text("# edited by hand\n")
    said: list[str] = []
    run_model_repo(load_spec(TINY, ["limits.max_batch_size=4"]), ws, keep_edits=True, echo=said.append)
    assert said == [f"rendering again for changed settings or inputs replaces hand edits: {bls}"]
    assert bls.read_text() != "# edited by hand\n"
