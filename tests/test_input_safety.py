"""Inputs that must never run code or write outside the workspace (issue 14, item 3).

Every case uses real files: a pickle made by torch.save whose unpickling would create a
marker file, a tokenizer directory whose auto_map names a module that creates a marker on
import, safetensors files whose headers lie, and symlinked workspace directories. Each
refusal is one line, and the marker files / outside directories stay untouched.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
import sys
import tracemalloc
import types
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_hf_llama, write_spec
from toolchain.checkpoint.hf_reader import MAX_HEADER_SIZE, HFCheckpoint, read_header
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.workspace import Workspace
from triton_helpers import make_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, f"not one line: {text!r}"
    return text


# -- pickled weights ---------------------------------------------------------------------------------

class _Payload:
    """Unpickling this calls open(marker, "w"): the file appears iff the pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_evil_pickle(path: Path, marker: Path) -> Path:
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "payload": _Payload(marker)}, path)
    return path


def test_the_pickle_payload_is_live(tmp_path):
    """Control: loading the same kind of file the unsafe way does run its code."""
    marker = tmp_path / "control-ran"
    path = write_evil_pickle(tmp_path / "control.bin", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> dict:
    d = make_hf_llama(tmp_path_factory.mktemp("cfg"), num_hidden_layers=1)
    return json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "last.ckpt"])
def test_pickle_only_checkpoint_is_refused_without_loading(tmp_path, llama_config, name):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(llama_config))
    marker = tmp_path / "ran"
    write_evil_pickle(ckpt / name, marker)
    with pytest.raises(ToolchainError) as err:
        HFCheckpoint(ckpt).tensors
    text = one_line(err)
    assert name in text and "pickle" in text
    assert "save_pretrained(" in text and "safe_serialization=True" in text
    assert not marker.exists()


def test_convert_of_a_pickle_checkpoint_writes_nothing(tmp_path, llama_config):
    from toolchain.checkpoint.stage import run_convert

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(llama_config))
    marker = tmp_path / "ran"
    write_evil_pickle(ckpt / "pytorch_model.bin", marker)
    root = tmp_path / "ws"
    root.mkdir()
    spec = load_spec(write_spec(tmp_path / "spec.yaml", ckpt))
    with pytest.raises(ToolchainError) as err:
        run_convert(spec, Workspace(root))
    assert "pytorch_model.bin" in one_line(err)
    assert not marker.exists()
    assert [p for p in root.rglob("*")] == []


def test_medusa_heads_pickle_is_refused(tmp_path):
    from toolchain.checkpoint.medusa import read_heads

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    marker = tmp_path / "ran"
    write_evil_pickle(heads / "medusa_lm_head.pt", marker)
    with pytest.raises(ToolchainError) as err:
        read_heads(heads)
    text = one_line(err)
    assert "medusa_lm_head.pt" in text and "safe_serialization=True" in text
    assert not marker.exists()


def test_eagle_draft_pickle_is_refused(tmp_path):
    from toolchain.checkpoint.eagle import read_draft

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    marker = tmp_path / "ran"
    write_evil_pickle(draft / "pytorch_model.bin", marker)
    with pytest.raises(ToolchainError) as err:
        read_draft(draft, target=None)
    assert "pytorch_model.bin" in one_line(err)
    assert not marker.exists()


def test_draft_model_pickle_is_refused(tmp_path, llama_config):
    """draft_target's draft model goes through the same reader as the target."""
    from toolchain.checkpoint.convert import convert_checkpoint

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(llama_config))
    marker = tmp_path / "ran"
    write_evil_pickle(draft / "model.pth", marker)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ToolchainError) as err:
        convert_checkpoint(draft, out, tp=1, pp=1, dtype="float32", target="cpu")
    assert "model.pth" in one_line(err)
    assert not marker.exists()
    assert list(out.iterdir()) == []


# -- static guarantees over the source ---------------------------------------------------------------

def _sources():
    return sorted((REPO / "toolchain").rglob("*.py"))


def test_no_unsafe_deserialisation_in_the_toolchain():
    """No torch.load / pickle / unsafe YAML anywhere in toolchain/ (the Triton models included)."""
    bad = re.compile(r"\btorch\.load\(|\bpickle\.loads?\(|\byaml\.(unsafe_)?load\(|\byaml\.load_all\(|"
                     r"\bLoader=yaml\.(Unsafe|Full)?Loader\b|\bimport pickle\b|\bimport dill\b")
    found = [f"{p.relative_to(REPO)}:{i}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert found == []


def test_every_from_pretrained_passes_trust_remote_code_explicitly():
    """A from_pretrained call without it would leave transformers to prompt (or default) on remote code."""
    missing = []
    for p in _sources():
        text = p.read_text()
        for m in re.finditer(r"\.from_pretrained\(", text):
            depth, end = 1, m.end()
            while depth and end < len(text):  # the whole call, nested parentheses included
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            call = text[m.end():end]
            if "trust_remote_code" not in call:
                missing.append(f"{p.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}")
    assert missing == []


# -- YAML ----------------------------------------------------------------------------------------------

def test_spec_yaml_with_a_python_tag_is_refused(tmp_path):
    marker = tmp_path / "ran"
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: x\nmodel: !!python/object/apply:builtins.open [{json.dumps(str(marker))}, w]\n")
    with pytest.raises(ToolchainError):
        load_spec(spec)
    assert not marker.exists()


def test_set_override_with_a_python_tag_is_refused(tmp_path, hf_llama):
    marker = tmp_path / "ran"
    spec = write_spec(tmp_path / "spec.yaml", hf_llama)
    with pytest.raises((ToolchainError, yaml.YAMLError)):
        load_spec(spec, [f"name=!!python/object/apply:builtins.open [{json.dumps(str(marker))}, w]"])
    assert not marker.exists()


# -- tokenizers with remote code ----------------------------------------------------------------------

@pytest.fixture()
def remote_code_tokenizer(tmp_path) -> tuple[Path, Path]:
    """A tokenizer directory whose tokenizer_config.json maps AutoTokenizer to a module beside it;
    importing that module creates the marker."""
    d = make_tiny_tokenizer(tmp_path / "tok")
    marker = tmp_path / "ran"
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return d, marker


REFUSAL = "set model.trust_remote_code: true"


def test_remote_code_tokenizer_is_refused_by_default(remote_code_tokenizer):
    from toolchain.remote_code import auto_tokenizer

    d, marker = remote_code_tokenizer
    with pytest.raises(ToolchainError) as err:
        auto_tokenizer(d)
    text = one_line(err)
    assert REFUSAL in text and str(d) in text
    assert not marker.exists()


def test_remote_code_tokenizer_loads_when_trusted(remote_code_tokenizer):
    """Control: the fixture really needs its code, and the opt-in runs it."""
    from toolchain.remote_code import auto_tokenizer

    d, marker = remote_code_tokenizer
    tok = auto_tokenizer(d, trust_remote_code=True)
    assert type(tok).__name__ == "EvilTokenizer" and marker.exists()


@pytest.mark.parametrize("loader", ["bench", "openai", "calibration", "eval"])
def test_every_tokenizer_loader_refuses_remote_code(remote_code_tokenizer, tmp_path, hf_llama, loader):
    d, marker = remote_code_tokenizer
    with pytest.raises(ToolchainError) as err:
        if loader == "bench":
            from toolchain.bench.workload import load_tokenizer
            load_tokenizer(d)
        elif loader == "openai":
            from toolchain.openai.text import TextCodec
            TextCodec(d)
        elif loader == "calibration":
            from toolchain.quant.calibration import hf_tokenizer
            hf_tokenizer(d)
        else:
            from toolchain.eval.run import spec_tokenizer
            spec_tokenizer(load_spec(write_spec(tmp_path / "spec.yaml", hf_llama, model={"tokenizer": str(d)})))
    assert REFUSAL in one_line(err)
    assert not marker.exists()


def _backend_model(name: str, monkeypatch):
    """Import a Triton Python model file with a stand-in triton_python_backend_utils."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    path = REPO / "toolchain" / "triton" / "backend_models" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_safety_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["preprocessing", "postprocessing"])
def test_triton_tokenizer_models_refuse_remote_code(remote_code_tokenizer, monkeypatch, name):
    d, marker = remote_code_tokenizer
    module = _backend_model(name, monkeypatch)

    def config(trust: str) -> dict:
        params = {"tokenizer_dir": str(d), "multimodal_model_path": "", "trust_remote_code": trust}
        return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})}

    with pytest.raises(ValueError) as err:
        module.TritonPythonModel().initialize(config("false"))
    assert REFUSAL in one_line(err)
    assert not marker.exists()
    module.TritonPythonModel().initialize(config("true"))  # the spec's opt-in reaches the model
    assert marker.exists()


def test_trust_remote_code_flows_from_the_spec(tmp_path, hf_llama):
    from toolchain.llmapi.args import llm_args, options_problem
    from toolchain.triton.templates import build_models

    spec = load_spec(write_spec(tmp_path / "spec.yaml", hf_llama))
    assert spec.model.trust_remote_code is False
    assert llm_args(spec, hf_llama)["trust_remote_code"] is False
    trusted = load_spec(tmp_path / "spec.yaml", ["model.trust_remote_code=true"])
    assert llm_args(trusted, hf_llama)["trust_remote_code"] is True
    # It is the spec's field, not a free LLM() option.
    opts = load_spec(tmp_path / "spec.yaml", ["llmapi.options.trust_remote_code=true"])
    assert "model.trust_remote_code" in options_problem(opts)

    from toolchain.triton.repo import repo_options
    for s, want in ((spec, False), (trusted, True)):
        models = build_models(repo_options(s, Workspace(tmp_path / "ws")))
        for name in ("preprocessing", "postprocessing"):
            assert models[name].parameters["trust_remote_code"] is want


def test_cpu_llm_takes_trust_remote_code_from_its_arguments(hf_llama):
    from toolchain.llmapi.cpu_llm import engine_spec

    assert engine_spec({"model": str(hf_llama)}).model.trust_remote_code is False
    assert engine_spec({"model": str(hf_llama), "trust_remote_code": True}).model.trust_remote_code is True


# -- safetensors headers ------------------------------------------------------------------------------

def _safetensors(path: Path, header: dict | bytes, data: bytes = b"", claimed: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw) if claimed is None else claimed))
        fh.write(raw)
        fh.write(data)
    return path


def test_header_longer_than_the_file_is_refused(tmp_path):
    path = _safetensors(tmp_path / "model.safetensors", b"{}", claimed=10_000)
    with pytest.raises(ToolchainError) as err:
        read_header(path)
    text = one_line(err)
    assert str(path) in text and "exceeds the file size" in text


def test_huge_header_fails_fast_with_bounded_memory(tmp_path):
    """A header length over the format's 100 MB limit, in a (sparse) file big enough to hold it:
    refused after reading 8 bytes, whatever the claim."""
    assert MAX_HEADER_SIZE == 100_000_000  # the safetensors crate's MAX_HEADER_SIZE
    path = tmp_path / "model.safetensors"
    claimed = MAX_HEADER_SIZE + 1
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", claimed))
        fh.truncate(8 + claimed + 1024)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(ToolchainError) as err:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = one_line(err)
    assert str(path) in text and "limit" in text
    assert peak < 1 << 20, f"peak {peak} bytes"


def test_tensor_data_past_the_end_is_refused(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    path = _safetensors(tmp_path / "model.safetensors", header, data=b"\0" * 16)
    with pytest.raises(ToolchainError) as err:
        read_header(path)
    assert str(path) in one_line(err) and "truncated" in str(err.value)


@pytest.mark.parametrize("offsets", [[-16, 0], [8, 4], [0.0, 16.0], ["0", "16"]])
def test_bad_data_offsets_are_refused(tmp_path, offsets):
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}
    path = _safetensors(tmp_path / "model.safetensors", header, data=b"\0" * 16)
    with pytest.raises(ToolchainError) as err:
        read_header(path)
    assert str(path) in one_line(err)


def test_index_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path, llama_config):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(llama_config))
    _safetensors(tmp_path / "outside.safetensors", {})
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../outside.safetensors"}}))
    with pytest.raises(ToolchainError) as err:
        HFCheckpoint(ckpt).files
    assert "../outside.safetensors" in one_line(err)


def test_medusa_heads_with_a_lying_header_are_refused(tmp_path):
    from toolchain.checkpoint.medusa import read_heads

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    path = _safetensors(heads / "medusa_lm_head.safetensors", b"{}", claimed=1 << 40)
    with pytest.raises(ToolchainError) as err:
        read_heads(heads)
    assert str(path) in one_line(err)


@pytest.mark.parametrize("claimed", [MAX_HEADER_SIZE + 8, 4096])
def test_engine_rank_file_with_a_lying_header_is_refused(tmp_path, claimed):
    from toolchain.engine.cpu.weights import _read_rank

    path = tmp_path / "rank0.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", claimed))
        fh.write(b"{}")
        if claimed > MAX_HEADER_SIZE:
            fh.truncate(8 + claimed + 8)
    with pytest.raises(ToolchainError) as err:
        _read_rank(path, {})
    assert str(path) in one_line(err)


# -- the workspace ------------------------------------------------------------------------------------

@pytest.fixture()
def spec(tmp_path, hf_llama):
    return load_spec(write_spec(tmp_path / "spec.yaml", hf_llama, name="safe"))


@pytest.mark.parametrize("name", ["../escape", "/tmp/escape", "..", "a/../../b", ".hidden"])
def test_spec_names_that_are_paths_are_refused(tmp_path, hf_llama, name):
    with pytest.raises(ToolchainError) as err:
        load_spec(write_spec(tmp_path / "spec.yaml", hf_llama, name=name))
    assert "name" in one_line(err)
    with pytest.raises(ToolchainError):
        load_spec(write_spec(tmp_path / "spec.yaml", hf_llama), [f"name={name}"])


LINKS = ["engines", "model_repo", "reports", "engines/safe", "model_repo/safe", "reports/safe"]


@pytest.mark.parametrize("link", LINKS)
def test_a_symlink_out_of_the_workspace_is_refused(tmp_path, spec, link):
    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside, target_is_directory=True)
    ws = Workspace(root)
    getter = {"engines": ws.checkpoint_dir, "model_repo": ws.model_repo_dir, "reports": ws.report_dir}
    with pytest.raises(ToolchainError) as err:
        getter[link.split("/")[0]](spec)
    text = one_line(err)
    assert str(root / link) in text and "outside the workspace" in text


def test_convert_through_an_escaping_link_writes_nothing(tmp_path, spec):
    from toolchain.checkpoint.stage import run_convert

    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "engines").mkdir(parents=True)
    outside.mkdir()
    (root / "engines" / "safe").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ToolchainError) as err:
        run_convert(spec, Workspace(root))
    assert "outside the workspace" in one_line(err)
    assert list(outside.iterdir()) == []


def test_bench_default_out_through_an_escaping_link_is_refused(tmp_path, spec, capsys):
    """--out may name any directory; the default reports/<name> may not lead out of the root."""
    from toolchain.cli import main

    root, outside = tmp_path / "ws", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "reports").symlink_to(outside, target_is_directory=True)
    rc = main(["--root", str(root), "bench", str(tmp_path / "spec.yaml"), "--url", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "outside the workspace" in err and len(err.strip().splitlines()) == 1
    assert list(outside.iterdir()) == []


def test_links_inside_the_workspace_are_fine(tmp_path, spec):
    root = tmp_path / "ws"
    (root / "big").mkdir(parents=True)
    (root / "engines").symlink_to(root / "big", target_is_directory=True)
    assert Workspace(root).checkpoint_dir(spec) == root / "engines" / "safe" / "checkpoint"


def test_atomic_dir_replaces_a_link_without_touching_its_target(tmp_path):
    from toolchain.fsutil import atomic_dir

    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    final = tmp_path / "out"
    final.symlink_to(target, target_is_directory=True)
    with atomic_dir(final) as tmp:
        (tmp / "new").write_text("y")
    assert not final.is_symlink() and (final / "new").is_file()
    assert (target / "keep").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
