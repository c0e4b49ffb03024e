"""The bench's adapter spread: workload classes that name LoRA adapters, sent as Triton's `lora_task_id` or as the
OpenAI `model`, reported per class (per-adapter TTFT) — against the in-process OpenAI mock and hand-made Triton
contracts."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_bench_openai import serve_in_thread

from toolchain.bench.datasets import Plan
from toolchain.bench.mock import make_word_tokenizer, openai_app
from toolchain.bench.protocols.contract import LLMAPI, TEXT, TOKEN_IDS, Contract, check_lora, request_tensors
from toolchain.bench.records import RequestRecord
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

BASE_TTFT_MS, STEP_MS = 20, 4
ADAPTER_TTFT_MS = {"attn": 60.0, "all": 120.0}
CLASSES = [{"name": "base", "share": 2}, {"name": "attn", "share": 1, "adapter": "attn"},
           {"name": "all", "share": 1, "adapter": "all"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_word_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def server():
    """The OpenAI mock serving two adapters by name, each with its own TTFT, in a thread; yields its URL."""
    yield from serve_in_thread(openai_app(model="mock", ttft_ms=BASE_TTFT_MS, step_ms=STEP_MS, precise=False,
                                          adapters=ADAPTER_TTFT_MS))


def _spec(root: Path, tok: Path, name: str, classes=CLASSES, **workload):
    wl = {"num_requests": 24, "warmup_requests": 1, "concurrency": 4, "input_tokens": 8, "output_tokens": 4,
          "endpoint": "mock", "protocol": "openai-completions", "classes": classes, **workload}
    data = {"name": name, "model": {"checkpoint": str(tok)}, "validation": {"workload": wl},
            "lora": {"adapters": {"attn": str(root / "attn"), "all": str(root / "all")}}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def test_classes_spread_the_sessions_over_the_adapters_by_share(tmp_path, tok):
    wl = _spec(tmp_path, tok, "spread").validation.workload
    from transformers import AutoTokenizer

    plan = Plan(wl, AutoTokenizer.from_pretrained(tok), max_input=64, max_seq=128)
    sessions = list(plan.sessions(0, 800))
    by_class = Counter((s.cls, s.adapter) for s in sessions)
    assert set(by_class) == {("base", None), ("attn", "attn"), ("all", "all")}
    assert abs(by_class[("base", None)] / 800 - 0.5) < 0.06
    assert all(abs(by_class[(a, a)] / 800 - 0.25) < 0.05 for a in ("attn", "all"))
    assert [plan.prompt(s, 0, []).adapter for s in sessions[:20]] == [s.adapter for s in sessions[:20]]


def test_triton_requests_carry_the_task_id_as_uint64_and_the_contract_must_declare_it():
    inputs = {"text_input", "max_tokens", "stream", "lora_task_id"}
    c = Contract("ensemble", TEXT, inputs, {"text_output"}, decoupled=True)
    tensors = {n: (d, a) for n, d, a in request_tensors(c, text="x", ids=None, max_tokens=4, streaming=True,
                                                         ignore_eos=False, exclude_input=None, lora_task_id=2)}
    dtype, arr = tensors["lora_task_id"]
    assert dtype == "UINT64" and arr.dtype == np.uint64 and arr.tolist() == [[2]]  # [[id]], the backend's client
    base = request_tensors(c, text="x", ids=None, max_tokens=4, streaming=True, ignore_eos=False, exclude_input=None)
    assert "lora_task_id" not in [n for n, _, _ in base]  # the base model: no task id at all
    check_lora(c, "u", {"attn": 1})
    for kind, declared, words in ((TOKEN_IDS, {"input_ids"}, "declares no lora_task_id input"),
                                  (LLMAPI, {"text_input", "lora_task_id"}, "takes no LoRA adapter per request")):
        with pytest.raises(ToolchainError, match=words) as err:
            check_lora(Contract("m", kind, declared, set(), decoupled=True), "u", {"attn": 1, "all": 2})
        assert "(attn, all)" in str(err.value) and "\n" not in str(err.value)
    check_lora(Contract("m", LLMAPI, set(), set(), decoupled=True), "u", {})  # no adapters: nothing to check


def test_triton_http_and_grpc_send_each_prompt_its_adapter_task_id():
    from toolchain.bench.datasets import Prompt, Turn
    from toolchain.bench.protocols.triton_grpc import TritonGrpc
    from toolchain.bench.protocols.triton_http import TritonHttp
    from tritonclient.grpc import service_pb2

    contract = Contract("ensemble", TEXT, {"text_input", "max_tokens", "stream", "lora_task_id"}, {"text_output"},
                        decoupled=True)
    adapters = {"attn": 1, "all": 2}
    http = TritonHttp("http://127.0.0.1:1", "ensemble", adapters=adapters)
    http.contract = contract
    rec = RequestRecord(index=0, request_id="r")
    for adapter, want in (("all", 2), (None, None)):
        body = json.loads(http.build(rec, Prompt("hi", None, None, 1, adapter), Turn(max_tokens=3), 0))
        assert body.get("lora_task_id") == want
    assert "lora_task_id" in http.inputs_sent

    grpc = TritonGrpc("127.0.0.1:1", "ensemble", adapters=adapters)
    grpc.contract = contract

    async def build(adapter):
        await grpc.open()
        try:
            return grpc.build(rec, Prompt("hi", None, None, 1, adapter), Turn(max_tokens=3), 0)
        finally:
            await grpc.close()

    req = service_pb2.ModelInferRequest.FromString(asyncio.run(build("attn")))
    at = [i.name for i in req.inputs].index("lora_task_id")
    assert req.inputs[at].datatype == "UINT64" and list(req.inputs[at].shape) == [1, 1]
    assert np.frombuffer(req.raw_input_contents[at], np.uint64).tolist() == [1]
    req = service_pb2.ModelInferRequest.FromString(asyncio.run(build(None)))
    assert "lora_task_id" not in [i.name for i in req.inputs]


def test_openai_requests_name_the_adapter_as_model_and_report_ttft_per_adapter(server, tok, tmp_path):
    from toolchain.bench.run import run_bench

    report = run_bench(_spec(tmp_path, tok, "mixed", num_requests=32, concurrency=4), url=server,
                       out_dir=tmp_path / "out", plots=False)
    assert report["errors"] == 0 and report["num_requests"] == 32
    per = report["per_class"]
    assert {name: c["adapter"] for name, c in per.items()} == {"base": None, "attn": "attn", "all": "all"}
    for name, ttft in (("base", BASE_TTFT_MS), *ADAPTER_TTFT_MS.items()):
        assert ttft <= per[name]["ttft_ms"]["p50"] < ttft + 40, (name, per[name]["ttft_ms"])  # the mock's, per model
    rows = (tmp_path / "out" / "requests.csv").read_text().splitlines()
    assert rows[0].split(",")[3:5] == ["class", "adapter"]
    assert {tuple(r.split(",")[3:5]) for r in rows[1:]} == {("base", ""), ("attn", "attn"), ("all", "all")}


def test_openai_refuses_an_adapter_the_server_does_not_list(server, tok, tmp_path):
    from toolchain.bench.run import run_bench

    spec = _spec(tmp_path, tok, "missing")
    spec.lora.adapters["other"] = tmp_path / "other"
    spec.validation.workload.classes[1].adapter = "other"
    with pytest.raises(ToolchainError, match="LoRA adapter.s. other not served") as err:
        run_bench(spec, url=server, out_dir=tmp_path / "out", plots=False)
    assert "\n" not in str(err.value)
