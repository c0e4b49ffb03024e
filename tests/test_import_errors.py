"""`toolchain import` refuses what it cannot read faithfully in one line naming the file and the field: a
repository not made from the templates, an engine of another release, models that disagree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolchain.cli import main
from upstream_templates import draft_target_set, plain_set, write_engine_config, write_repository


def _edit(params: dict[str, str], model: str, old: str, new: str) -> dict[str, str]:
    assert old in params[model], (model, old)
    return params | {model: params[model].replace(old, new)}


def _plain(tmp_path, hf):
    return plain_set(hf, write_engine_config(tmp_path / "engine", max_batch_size=64))


def _backend(tmp_path, hf):
    return _edit(_plain(tmp_path, hf), "tensorrt_llm", "triton_backend:tensorrtllm", "triton_backend:onnxruntime")


def _tokenizers(tmp_path, hf):
    return _edit(_plain(tmp_path, hf), "postprocessing", f"tokenizer_dir:{hf},", f"tokenizer_dir:{tmp_path},")


def _batch_sizes(tmp_path, hf):
    return _edit(_plain(tmp_path, hf), "ensemble", "triton_max_batch_size:64", "triton_max_batch_size:32")


def _engine_batch(tmp_path, hf):
    params = _plain(tmp_path, hf)
    write_engine_config(tmp_path / "engine", max_batch_size=128)
    return params


def _version(tmp_path, hf):
    params = _plain(tmp_path, hf)
    write_engine_config(tmp_path / "engine", max_batch_size=64, version="1.1.0")
    return params


def _decoupled(tmp_path, hf):
    return _edit(_plain(tmp_path, hf), "tensorrt_llm_bls", "decoupled_mode:False", "decoupled_mode:True")


def _draft_engine(tmp_path, hf):
    engine = write_engine_config(tmp_path / "engine", max_batch_size=4, max_draft_len=4, speculative_mode=2)
    params = draft_target_set(hf, engine, tmp_path / "draft")
    return _edit(params, "tensorrt_llm_draft", f"engine_dir:{tmp_path / 'draft'},", "")


def _unfilled(tmp_path, hf):
    return _edit(_plain(tmp_path, hf), "tensorrt_llm", ",prompt_embedding_table_data_type:TYPE_FP16", "")


def _quant_algo(tmp_path, hf):
    params = _plain(tmp_path, hf)
    path = tmp_path / "engine" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["pretrained_config"]["quantization"]["quant_algo"] = "W4A8_QSERVE_PER_GROUP"
    path.write_text(json.dumps(cfg))
    return params


def _missing_model(tmp_path, hf):
    params = _plain(tmp_path, hf)
    del params["postprocessing"]
    return params


CASES = {
    # case: (parameters, then the words the one line must hold: file, field)
    "backend": (_backend, ["tensorrt_llm/config.pbtxt", "backend 'onnxruntime'"]),
    "missing model": (_missing_model, ["no postprocessing/config.pbtxt"]),
    "engine version": (_version, ["engine/config.json", "field 'version'", "1.1.0", "1.2.1"]),
    "tokenizers": (_tokenizers, ["preprocessing/config.pbtxt", "postprocessing/config.pbtxt", "tokenizer_dir"]),
    "batch sizes": (_batch_sizes, ["ensemble/config.pbtxt", "max_batch_size", "32", "64"]),
    "engine batch": (_engine_batch, ["engine/config.json", "build_config.max_batch_size 128",
                                     "tensorrt_llm/config.pbtxt"]),
    "decoupled": (_decoupled, ["tensorrt_llm_bls/config.pbtxt", "decoupled"]),
    "draft engine": (_draft_engine, ["tensorrt_llm_draft/config.pbtxt", "gpt_model_path (engine_dir) is unset"]),
    "quant algo": (_quant_algo, ["engine/config.json", "pretrained_config.quantization.quant_algo",
                                 "W4A8_QSERVE_PER_GROUP"]),
    "unfilled": (_unfilled, ["tensorrt_llm/config.pbtxt line", "${prompt_embedding_table_data_type}"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_naming_file_and_field(case, tmp_path, hf_llama_words, capsys):
    make, words = CASES[case]
    repo = write_repository(tmp_path / "repo", make(tmp_path, hf_llama_words))
    out = tmp_path / "spec.yaml"
    assert main(["import", str(repo), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert "(" in err  # the how-to-fix hint
    assert not out.exists()  # nothing written


def test_unknown_parameter_is_refused(tmp_path, hf_llama_words, capsys):
    repo = write_repository(tmp_path / "repo", _plain(tmp_path, hf_llama_words))
    path = repo / "preprocessing" / "config.pbtxt"
    path.write_text(path.read_text() + 'parameters { key: "my_knob" value { string_value: "1" } }\n')
    assert main(["import", str(repo), "--out", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "preprocessing/config.pbtxt" in err and "'my_knob'" in err and "template" in err and "\n" not in err


def test_extra_model_and_not_a_repository(tmp_path, hf_llama_words, capsys):
    repo = write_repository(tmp_path / "repo", _plain(tmp_path, hf_llama_words))
    (repo / "mine").mkdir()
    (repo / "mine" / "config.pbtxt").write_text('name: "mine"\nbackend: "python"\n')
    assert main(["import", str(repo), "--out", str(tmp_path / "s.yaml")]) == 2
    assert "model 'mine' is not one of upstream's" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["import", str(empty)]) == 2
    assert "neither a model repository" in capsys.readouterr().err


def test_engine_given_on_the_command_line_wins(tmp_path, hf_llama_words, capsys):
    """--engine replaces the engine_dir of the repository (here one that does not exist on this host)."""
    engine = write_engine_config(tmp_path / "elsewhere", max_batch_size=64)
    params = plain_set(hf_llama_words, Path("/nonexistent/engine"))
    repo = write_repository(tmp_path / "repo", params)
    out, report = tmp_path / "s.yaml", tmp_path / "r.json"
    assert main(["import", str(repo), "--engine", str(engine), "--out", str(out), "--report", str(report)]) == 0
    assert json.loads(report.read_text())["mismatches"] == []
    assert main(["import", str(repo), "--out", str(out)]) == 2
    assert "/nonexistent/engine has no config.json" in capsys.readouterr().err


def test_hf_checkpoint_of_another_model_is_refused(tmp_path, hf_llama_words, capsys):
    engine = write_engine_config(tmp_path / "engine", max_batch_size=64)
    cfg = json.loads((engine / "config.json").read_text())
    cfg["pretrained_config"]["hidden_size"] = 4096
    (engine / "config.json").write_text(json.dumps(cfg))
    repo = write_repository(tmp_path / "repo", plain_set(hf_llama_words, engine))
    assert main(["import", str(repo), "--hf", str(hf_llama_words), "--out", str(tmp_path / "s.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json: hidden_size 64 disagrees with" in err and "pretrained_config.hidden_size 4096" in err
    assert "\n" not in err
