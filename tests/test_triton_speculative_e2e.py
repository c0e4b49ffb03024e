"""Draft-target speculative decoding on CPU through the real tritonserver: the BLS runs
upstream's draft -> target loop over tensorrt_llm_draft and tensorrt_llm, and its text is the
text of plain decoding, token for token, with the acceptance figures reported."""

from __future__ import annotations

import pytest

from conftest import make_hf_llama, starts_server
from triton_helpers import deploy, stream, text_request, token_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 96, "max_num_tokens": 128}
PROMPTS = ["w10 w20 w30 w40 w50", "w7 w8 w9", "w100 w3 w77 w12 w13 w14"]


@pytest.fixture(scope="module", params=["same-model", "other-model"])
@starts_server
def served(request, tmp_path_factory, hf_llama_words):
    """The target, and as its draft either the target itself (every draft token agrees) or another
    random model with the same vocabulary (few do)."""
    target = draft = hf_llama_words
    if request.param == "other-model":
        draft = tmp_path_factory.mktemp("draft")
        make_hf_llama(draft, seed=7)
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), target, limits=LIMITS, build={"tokens_per_block": 16},
                              serving={"streaming": False},
                              speculative={"mode": "draft_target", "max_draft_len": 4, "draft_model": str(draft)})
    with server:
        yield request.param, server


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_text_equals_plain_decoding(served, prompt):
    kind, server = served
    plain = stream(server.grpc_url, "tensorrt_llm_bls", text_request(prompt, 20, stream=False))
    spec = stream(server.grpc_url, "tensorrt_llm_bls",
                  text_request(prompt, 20, stream=False, num_draft_tokens=([4], "INT32"),
                               return_perf_metrics=([True], "BOOL")))
    assert not plain.errors and not spec.errors, (plain.errors, spec.errors)
    assert spec.texts() == plain.texts() and plain.texts()[0].strip()
    last = spec.responses[-1]
    drafted = int(last.as_numpy("total_draft_tokens").reshape(-1)[0])
    accepted = int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    rate = float(last.as_numpy("acceptance_rate").reshape(-1)[0])
    assert drafted > 0 and 0 <= accepted <= drafted and abs(rate - accepted / drafted) < 1e-6
    if kind == "same-model":
        assert accepted == drafted  # the draft is the target: it is never wrong


def test_speculation_refuses_what_upstream_refuses(served):
    _, server = served
    bad = stream(server.grpc_url, "tensorrt_llm_bls",
                 text_request(PROMPTS[0], 8, stream=False, num_draft_tokens=([4], "INT32"),
                              return_context_logits=([True], "BOOL")))
    assert bad.errors and "context logits are not supported with speculative decoding" in str(bad.errors[0])
    logits = stream(server.grpc_url, "tensorrt_llm_bls",
                    text_request(PROMPTS[0], 8, stream=False, num_draft_tokens=([4], "INT32"),
                                 use_draft_logits=([True], "BOOL")))
    # Without speculative.use_draft_logits the draft engine is built without gather_generation_logits and
    # cannot return them: the executor's refusal, named by the draft model (test_triton_draft_logits.py
    # deploys with the field and speculates).
    assert len(logits.errors) == 1 and "tensorrt_llm_draft" in str(logits.errors[0])
    assert "gather_generation_logits must be enabled" in str(logits.errors[0])
    assert "speculative.use_draft_logits" in str(logits.errors[0])  # the spec field that builds it


def test_shipped_draft_target_spec_deploys_and_speculates(tmp_path, capsys):
    """`toolchain deploy build/tiny-llama-draft-target.yaml`: the trained tiny Llama verified against
    its shipped draft (models/tiny-llama-draft), benched through the BLS, which speculates."""
    import json
    from pathlib import Path

    import yaml

    from toolchain.cli import main

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path / "ws"
    argv = ["--root", str(root), "deploy", str(repo / "build" / "tiny-llama-draft-target.yaml")]
    for item in ("serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
                 "validation.workload.num_requests=6", "validation.workload.warmup_requests=1"):
        argv += ["--set", item]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((root / "reports" / "tiny-llama-draft-target" / "report.json").read_text())
    assert report["num_requests"] == 6 and report["slo"]["passed"] is True
    spec = report["speculation"]  # the bench asked for the BLS's acceptance figures
    assert spec["requests"] == 6 and 0 < spec["accepted_draft_tokens"] <= spec["draft_tokens"]
    assert abs(spec["acceptance_rate"] - spec["accepted_draft_tokens"] / spec["draft_tokens"]) < 1e-9

    # The same deployment, asked directly: the draft (same corpus and tokenizer) is often right.
    spec = yaml.safe_load((repo / "build" / "tiny-llama-draft-target.yaml").read_text())
    models = repo / "models"
    (tmp_path / "direct").mkdir()
    _, _, server = deploy(tmp_path / "direct", models / "tiny-llama", limits=spec["limits"],
                               parallelism=spec["parallelism"], build=spec["build"],
                               serving={"streaming": False, "kv_cache_free_gpu_mem_fraction": 0.85},
                               speculative={**spec["speculative"], "draft_model": str(models / "tiny-llama-draft")})
    with server:
        prompt = "import os\n\nclass Path"
        plain = stream(server.grpc_url, "tensorrt_llm_bls", text_request(prompt, 24, stream=False))
        fast = stream(server.grpc_url, "tensorrt_llm_bls",
                      text_request(prompt, 24, stream=False, num_draft_tokens=([4], "INT32"),
                                   return_perf_metrics=([True], "BOOL")))
    assert not plain.errors and not fast.errors and fast.texts() == plain.texts()
    assert float(fast.responses[-1].as_numpy("acceptance_rate").reshape(-1)[0]) > 0.3


def test_ngram_drafts_from_the_sequence_itself_and_change_nothing(tmp_path_factory, hf_llama_words):
    """speculative.mode ngram: no draft model; the BLS looks the sequence's last tokens up earlier in
    it (prompt lookup) and sends what followed as draft_input_ids. A prompt that repeats itself
    gives drafts at once; the text is plain decoding's."""
    spec, ws, server = deploy(tmp_path_factory.mktemp("ws"), hf_llama_words, limits=LIMITS, build={"tokens_per_block": 16},
                              serving={"streaming": False},
                              speculative={"mode": "ngram", "max_draft_len": 4, "ngram_size": 2})
    prompt = " ".join(["w5 w6 w7 w8 w9"] * 3) + " w5 w6"
    with server:
        plain = stream(server.grpc_url, "tensorrt_llm_bls", text_request(prompt, 20, stream=False))
        fast = stream(server.grpc_url, "tensorrt_llm_bls",
                      text_request(prompt, 20, stream=False, num_draft_tokens=([4], "INT32"),
                                   return_perf_metrics=([True], "BOOL")))
    assert not plain.errors and not fast.errors and fast.texts() == plain.texts()
    drafted = int(fast.responses[-1].as_numpy("total_draft_tokens").reshape(-1)[0])
    assert drafted >= 4  # the first lookup alone finds "w7 w8 w9 w5"


def test_prompt_lookup_finds_the_latest_earlier_occurrence(monkeypatch):
    import importlib.util
    import sys
    import types
    from pathlib import Path

    # The BLS imports Triton's stub module at load; its pure helpers use none of it.
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                        types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1))
    path = Path(__file__).resolve().parents[1] / "toolchain" / "triton" / "backend_models" / "tensorrt_llm_bls.py"
    spec = importlib.util.spec_from_file_location("bls_under_test", path)
    bls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bls)
    assert bls._lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 2, 3) == [4, 5, 1]  # the latest "1 2", not the first
    assert bls._lookup([1, 2, 3, 9, 7, 2], 3, 2) == [3, 9]  # falls back to the 1-gram "2"
    assert bls._lookup([1, 2, 3], 3, 2) == []
    assert bls._lookup([4, 5, 4], 2, 4) == [5, 4]  # what is there, up to k


def test_stop_words_and_min_tokens_end_where_plain_decoding_ends(served):
    """A stop word that straddles two speculative steps (the target sees only its own step's
    output) still ends the text where plain decoding ends it; min_tokens counts the whole output."""
    _, server = served
    prompt = PROMPTS[0]
    plain = stream(server.grpc_url, "tensorrt_llm_bls", text_request(prompt, 20, stream=False))
    words = plain.texts()[0].split()
    # With 4 draft tokens a step yields at most 5: the words at 5 and 6 straddle a step boundary
    # whenever every draft token is accepted, and often otherwise.
    stop = f"{words[4]} {words[5]}"
    for extra in ({"stop_words": ([stop], "BYTES")}, {"min_tokens": ([9], "INT32")}):
        want = stream(server.grpc_url, "tensorrt_llm_bls", text_request(prompt, 20, stream=False, **extra))
        got = stream(server.grpc_url, "tensorrt_llm_bls",
                     text_request(prompt, 20, stream=False, num_draft_tokens=([4], "INT32"), **extra))
        assert not want.errors and not got.errors and got.texts() == want.texts(), extra
    assert len(want.texts()[0].split()) >= 9


def test_medusa_serves_plain_decoding_through_tritonserver(tmp_path_factory, hf_llama_words):
    """Medusa runs inside the tensorrt_llm model (decoding_mode medusa, medusa_choices from the
    heads): streamed and whole responses carry plain decoding's tokens, with the acceptance
    figures."""
    from conftest import MEDUSA_TREE, write_medusa_heads
    from toolchain.draft_tree import choices_text
    from toolchain.engine.cpu.engine import CpuEngine
    from toolchain.engine.cpu.sampling import SamplingParams

    heads = write_medusa_heads(tmp_path_factory.mktemp("heads"), hf_llama_words)
    plain_spec, plain_ws, _ = deploy(tmp_path_factory.mktemp("plain"), hf_llama_words, limits=LIMITS,
                                     build={"tokens_per_block": 16})
    plain = CpuEngine.load(plain_ws.engine_dir(plain_spec))
    spec, ws, server = deploy(tmp_path_factory.mktemp("medusa"), hf_llama_words, limits=LIMITS,
                              build={"tokens_per_block": 16}, speculative={"mode": "medusa", "heads": str(heads)})
    config = (ws.model_repo_dir(spec) / "tensorrt_llm" / "config.pbtxt").read_text()
    assert '"medusa"' in config and choices_text(MEDUSA_TREE) in config
    prompt = [0, 12, 13, 14, 15, 16]
    want = plain.generate(prompt, SamplingParams(max_new_tokens=24))
    totals = [0, 0]
    with server:
        for streaming in (True, False):
            got = stream(server.grpc_url, "tensorrt_llm",
                         token_request(prompt, 24, stream=streaming, end_id=([-1], "INT32"),
                                       return_perf_metrics=([True], "BOOL")))
            assert not got.errors, got.errors
            assert got.tokens() == want
            last = got.responses[-1]
            drafted = int(last.as_numpy("total_draft_tokens").reshape(-1)[0])
            accepted = int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
            assert drafted > 0 and 0 <= accepted <= drafted
            totals[0] += drafted
            totals[1] += accepted
        # The model's Prometheus gauges add up both requests (they refresh every stats period).
        import time

        from toolchain.bench.servermetrics import scrape

        deadline, got = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            metrics = scrape(server.metrics_url) or {}
            got = {dict(labels)["spec_decode_metric"]: value for (name, labels), value in metrics.items()
                   if name == "toolchain_spec_decode_metrics" and dict(labels).get("model") == "tensorrt_llm"}
            if got.get("total_draft_tokens") == totals[0]:
                break
            time.sleep(0.2)
        assert (got["total_draft_tokens"], got["total_accepted_draft_tokens"]) == tuple(totals), got
        assert got["draft_steps"] > 0 and abs(got["acceptance_rate"] - totals[1] / totals[0]) < 1e-6


def test_tensorrt_llm_takes_draft_logits_with_an_acceptance_threshold(served):
    """draft_logits and draft_acceptance_threshold reach the CPU engine as the C++ backend passes
    them (ExternalDraftTokensConfig): threshold 0 accepts every draft token."""
    import numpy as np

    _, server = served
    prompt, draft = [0, 10, 20, 30], [5, 6, 7]
    logits = np.zeros((len(draft), 250), np.float32)  # one request's [k, vocab]
    got = stream(server.grpc_url, "tensorrt_llm",
                 token_request(prompt, 4, stream=False, end_id=([-1], "INT32"), draft_input_ids=(draft, "INT32"),
                               draft_logits=(logits, "FP32"), draft_acceptance_threshold=([0.0], "FP32"),
                               return_perf_metrics=([True], "BOOL")))
    assert not got.errors, got.errors
    assert got.tokens()[:3] == draft
    assert int(got.responses[-1].as_numpy("total_accepted_draft_tokens").reshape(-1)[0]) == 3
    bad = stream(server.grpc_url, "tensorrt_llm",
                 token_request(prompt, 4, stream=False, draft_input_ids=(draft, "INT32"),
                               draft_logits=(logits[:2], "FP32")))
    assert bad.errors and "draft_logits must be [3 draft tokens" in str(bad.errors[0])
