"""A quantized tiny model end to end: convert (AWQ int4 + INT8 KV cache, and NVFP4, TP 2),
build the CPU engine, serve it with a real tritonserver; the streamed text
must equal the engine's own greedy output. And `toolchain eval` reports the
quality of every method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_TRAINED
from test_e2e_pipeline import FREE_PORTS, MAX_TOKENS, _stream_text
from toolchain.spec import load_spec
from toolchain.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]
needs_tiny = pytest.mark.skipif(not (TINY_TRAINED / "config.json").is_file(), reason="embedded model missing")
CALIB = ["quantization.calibration.samples=8", "quantization.calibration.seq_len=128"]
PROMPTS = ["def main(argv):\n    ", "    return self."]


@needs_tiny
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("method, kv, algo", [("awq", "int8", "W4A16_AWQ"), ("nvfp4", "none", "NVFP4")])
def test_quantized_model_served_through_triton(tmp_path, method, kv, algo):
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    from toolchain.engine.build import run_build
    from toolchain.engine.cpu import CpuEngine, SamplingParams
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer

    spec = load_spec(REPO / "build" / "tiny-llama.yaml", FREE_PORTS + CALIB + [
        f"quantization.method={method}", f"quantization.kv_cache={kv}", f"name=tiny-llama-{method}"])
    ws = Workspace(tmp_path)
    run_build(spec, ws)
    pretrained = json.loads((ws.engine_dir(spec) / "config.json").read_text())["pretrained_config"]
    assert pretrained["quantization"]["quant_algo"] == algo
    tok = AutoTokenizer.from_pretrained(spec.model.tokenizer_dir)
    engine = CpuEngine.load(ws.engine_dir(spec))
    expected = {p: tok.decode(engine.generate(tok.encode(p), SamplingParams(max_new_tokens=MAX_TOKENS,
                                                                           end_id=tok.eos_token_id)),
                              skip_special_tokens=True) for p in PROMPTS}
    run_model_repo(spec, ws)
    with TritonServer(ws.model_repo_dir(spec), host="127.0.0.1", http_port=0, grpc_port=0, metrics_port=0) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        for prompt in PROMPTS:
            text = _stream_text(client, "ensemble", prompt, True)
            assert text.endswith(expected[prompt]), (prompt, text, expected[prompt])
    assert any(t.strip() for t in expected.values()), "the engine generated nothing to compare"


@needs_tiny
@pytest.mark.slow
@pytest.mark.parametrize("method, kv", [("int8_wo", "none"), ("int4_wo", "none"), ("awq", "none"),
                                        ("smoothquant", "none"), ("fp8", "fp8"), ("none", "int8")])
def test_eval_reports_each_method(tmp_path, method, kv):
    from toolchain.eval import run_eval

    spec = load_spec(REPO / "build" / "tiny-llama.yaml", CALIB + [f"quantization.method={method}",
                                                                   f"quantization.kv_cache={kv}"])
    report = run_eval(spec, Workspace(tmp_path), max_tokens=512, window=128, threads=1)
    assert report["model"]["quantization"]["kv_cache_quant_algo"] == {"none": None, "int8": "INT8",
                                                                        "fp8": "FP8"}[kv]
    assert report["tokens_evaluated"] > 400
    # The trained tiny model has no outlier channels: every format stays close to fp.
    assert report["perplexity"] < 1.1 * report["reference_perplexity"]
    assert report["greedy_token_agreement"] > 0.8
