"""AIPerf 0.13 (genai-perf's successor) against the project's OpenAI server (`toolchain.openai`),
streamed /v1/completions and /v1/chat/completions: AIPerf must finish with every request
successful and a positive TTFT. AIPerf lives in its own venv, benchmarks/.venv/aiperf, which
`benchmarks/harness_accuracy.py` creates (pinned aiperf==0.13.0); these tests never install it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import needs_extras, starts_server

REPO = Path(__file__).resolve().parents[1]
AIPERF = REPO / "benchmarks" / ".venv" / "aiperf" / "bin" / "aiperf"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not AIPERF.exists(), reason=f"AIPerf is not installed at {AIPERF.relative_to(REPO)}: "
                       "`python benchmarks/harness_accuracy.py` installs aiperf==0.13.0 there"),
]

LIMITS = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 256, "max_num_tokens": 256}
MODEL = "tiny-words"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
REQUESTS = 8


@pytest.fixture(scope="module")
@starts_server
@needs_extras
def server(tmp_path_factory, hf_llama_words):
    """The OpenAI server on a CPU engine built from the tiny word-level Llama, its tokenizer given a
    chat template (for /v1/chat/completions); yields (server, tokenizer dir)."""
    from conftest import write_spec
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.openai import OpenAIServer
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    root = tmp_path_factory.mktemp("aiperf-openai")
    spec = load_spec(write_spec(root / "spec.yaml", hf_llama_words, limits=LIMITS, build={"tokens_per_block": 16}))
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    tok = root / "tokenizer-chat"
    tok.mkdir()
    for f in Path(hf_llama_words).iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tok / f.name)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    with OpenAIServer(ws.engine_dir(spec), tok, MODEL, log_path=root / "server.log",
                      extra_args=("--max-tokens-in-paged-kv-cache", "1024", "--engine-threads", "1",
                                  "--log-level", "warning")) as srv:
        yield srv, tok


@pytest.mark.parametrize("endpoint_type", ["completions", "chat"])
def test_aiperf_completes_against_the_openai_server(server, endpoint_type, tmp_path):
    srv, tok = server
    out = tmp_path / "artifacts"
    cmd = [str(AIPERF), "profile", "-m", MODEL, "--endpoint-type", endpoint_type, "--streaming", "-u", srv.url,
           "--tokenizer", str(tok), "--isl", "16", "--isl-stddev", "0", "--osl", "8", "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--concurrency", "2", "--request-count", str(REQUESTS),
           "--warmup-request-count", "2", "--random-seed", "1", "--ui-type", "none", "--no-server-metrics",
           "--no-gpu-telemetry", "--artifact-dir", str(out)]
    # No HF_HUB_OFFLINE: aiperf 0.13.0's offline mode resolves --tokenizer through the Hub cache and
    # rejects a local directory; online, an absolute path loads locally without a Hub call.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    assert proc.returncode == 0, f"aiperf exited {proc.returncode}:\n{tail}\n--- server log:\n{srv.log_text()[-2000:]}"
    export = out / "profile_export_aiperf.json"
    assert export.exists(), tail
    data = json.loads(export.read_text())
    assert data["request_count"]["avg"] == REQUESTS, data["request_count"]
    assert not (data.get("error_request_count") or {}).get("avg"), data.get("error_summary")
    assert data.get("error_summary") in (None, []), data["error_summary"]
    assert data["time_to_first_token"]["p50"] > 0
    assert data["time_to_first_token"]["count"] == REQUESTS
