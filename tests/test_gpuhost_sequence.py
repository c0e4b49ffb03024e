"""The README's GPU-host sequence on CPU: the spec points at a config-only directory (config.json and
tokenizer, as planned on a laptop), the weights are given once, to `convert --set
model.checkpoint=DIR`, and every later stage runs with the plain spec, taking the weights and the
tokenizer that convert recorded (toolchain/weights_source.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import write_spec
from test_trtllm_build import calls, fake_build  # noqa: F401  (fake_build: the fake trtllm-build 1.2.1 on PATH)
from toolchain.cli import main

FREE_PORTS = {"http_port": 0, "grpc_port": 0, "metrics_port": 0}
LIMITS = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256}


def _config_only(weights: Path, out: Path) -> Path:
    """What a laptop holds before the download: every JSON file of the checkpoint, no safetensors."""
    out.mkdir()
    for path in weights.glob("*.json"):
        if path.name != "model.safetensors.index.json":
            shutil.copyfile(path, out / path.name)
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))
    return out


def _toolchain(root: Path, *argv, capsys=None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one CLI run; the streams only when `capsys` is given."""
    rc = main(["--root", str(root), *map(str, argv)])
    got = capsys.readouterr() if capsys is not None else None
    return rc, got.out if got else "", got.err if got else ""


def _setup(tmp_path: Path, weights: Path, target: str) -> tuple[Path, Path]:
    planned = _config_only(weights, tmp_path / "planned")
    spec = write_spec(tmp_path / "spec.yaml", planned, name="gpuhost", target=target, limits=LIMITS,
                      serving=dict(FREE_PORTS))
    return spec, planned


def test_engine_path_takes_the_weights_convert_read(tmp_path, hf_llama_words, capsys):
    root = tmp_path / "ws"
    spec, planned = _setup(tmp_path, hf_llama_words, "cpu")
    assert _toolchain(root, "convert", spec, "--set", f"model.checkpoint={hf_llama_words}")[0] == 0
    source = json.loads((root / "engines/gpuhost/checkpoint/manifest.json").read_text())["outputs"]["source"]
    assert source == {"checkpoint": str(hf_llama_words.resolve()), "tokenizer": str(hf_llama_words.resolve())}
    capsys.readouterr()

    # Before: build-engine reconverted from model.checkpoint and stopped on "no *.safetensors weights".
    rc, _, err = _toolchain(root, "build-engine", spec, capsys=capsys)
    assert rc == 0, err
    assert f"{planned} holds no weights; using {hf_llama_words.resolve()}" in err
    assert (root / "engines/gpuhost/engine/config.json").is_file()
    rc, _, err = _toolchain(root, "model-repo", spec, capsys=capsys)
    assert rc == 0, err
    pre = (root / "model_repo/gpuhost/preprocessing/config.pbtxt").read_text()
    assert str(hf_llama_words.resolve()) in pre and str(planned) not in pre  # the tokenizer convert used
    # The stages stay current: a second run reuses the engine rather than rebuilding it.
    rc, out, _ = _toolchain(root, "build-engine", spec, capsys=capsys)
    assert rc == 0 and "up to date, reused" in out, out


def test_gpu_target_sequence_as_the_readme_runs_it(tmp_path, hf_llama_words, fake_build, capsys):  # noqa: F811
    """target trtllm, as on the GPU host: trtllm-build reads the converted checkpoint, and the printed launch
    lines mount the directory convert read (the tokenizer), not the config-only one."""
    root = tmp_path / "ws"
    planned = _config_only(hf_llama_words, tmp_path / "planned")
    spec = write_spec(tmp_path / "spec.yaml", planned, name="gpuhost", target="trtllm", limits=LIMITS,
                      build={"mpi": "never"}, gpu={"name": "H100 80GB"})
    assert _toolchain(root, "convert", spec, "--set", f"model.checkpoint={hf_llama_words}")[0] == 0
    capsys.readouterr()
    for stage in ("build-engine", "model-repo"):
        rc, _, err = _toolchain(root, stage, spec, capsys=capsys)
        assert rc == 0, (stage, err)
    [argv] = calls(fake_build)
    assert argv[argv.index("--checkpoint_dir") + 1] == str(root / "engines/gpuhost/checkpoint")
    rc, out, err = _toolchain(root, "serve", spec, "--print", capsys=capsys)
    assert rc == 0, err
    docker = next(line for line in out.splitlines() if line.startswith("docker run"))
    assert f"-v {hf_llama_words.resolve()}:" in docker and f"-v {planned}:" not in docker


@pytest.mark.e2e
@pytest.mark.slow
def test_engine_path_serves_a_request_after_convert_elsewhere(tmp_path, hf_llama_words):
    from toolchain.spec import load_spec
    from toolchain.triton.server import TritonServer
    from toolchain.weights_source import with_converted_source
    from toolchain.workspace import Workspace
    from triton_helpers import stream, text_request

    root = tmp_path / "ws"
    spec_path, _ = _setup(tmp_path, hf_llama_words, "cpu")
    assert _toolchain(root, "convert", spec_path, "--set", f"model.checkpoint={hf_llama_words}")[0] == 0
    for stage in ("build-engine", "model-repo"):
        assert _toolchain(root, stage, spec_path)[0] == 0
    spec, _ = with_converted_source(load_spec(spec_path), Workspace(root))
    with TritonServer.from_spec(spec, root / "model_repo/gpuhost", log_path=tmp_path / "server.log") as server:
        got = stream(server.grpc_url, "ensemble", text_request("w5 w6 w7", 6, stream=False))
    assert not got.errors, got.errors
    assert len(got.texts()) == 1 and got.texts()[0].split(), got.texts()


def test_llmapi_path_serves_the_checkpoint_convert_read(tmp_path, hf_llama_words, capsys):
    root = tmp_path / "ws"
    spec, _ = _setup(tmp_path, hf_llama_words, "llmapi-cpu")
    assert _toolchain(root, "convert", spec, "--set", f"model.checkpoint={hf_llama_words}")[0] == 0
    capsys.readouterr()
    rc, _, err = _toolchain(root, "model-repo", spec, capsys=capsys)
    assert rc == 0, err
    model_yaml = yaml.safe_load((root / "model_repo/gpuhost/tensorrt_llm/1/model.yaml").read_text())
    # Before: model.yaml named the config-only directory, which the backend cannot load.
    assert model_yaml["model"] == str(hf_llama_words.resolve())


def test_the_spec_own_weights_win(tmp_path, hf_llama_words, hf_llama_tied):
    """A spec whose directory holds weights is used as written, whatever convert read last."""
    from toolchain.spec import load_spec
    from toolchain.weights_source import with_converted_source
    from toolchain.workspace import Workspace

    root = tmp_path / "ws"
    spec_path = write_spec(tmp_path / "spec.yaml", hf_llama_tied, name="gpuhost", target="cpu", limits=LIMITS)
    assert _toolchain(root, "convert", spec_path, "--set", f"model.checkpoint={hf_llama_words}")[0] == 0
    spec = load_spec(spec_path)
    same, note = with_converted_source(spec, Workspace(root))
    assert same is spec and note is None


def test_no_weights_and_nothing_converted_says_what_to_run(tmp_path, hf_llama_words, capsys):
    root = tmp_path / "ws"
    spec, planned = _setup(tmp_path, hf_llama_words, "cpu")
    rc, _, err = _toolchain(root, "build-engine", spec, capsys=capsys)
    assert rc != 0
    line = err.strip()
    assert "\n" not in line and f"no *.safetensors weights in {planned}" in line
    assert "toolchain convert SPEC --set model.checkpoint=DIR" in line
