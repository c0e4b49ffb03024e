"""What a JSON-schema constraint and log-probabilities cost per output token, through the OpenAI server.

build/tiny-llama-llmapi.yaml (target llmapi-cpu) served by the OpenAI server as `toolchain deploy` starts it, and
streamed /v1/completions requests in three modes: plain; `response_format` json_schema (XGrammar's token mask
every step, engine/cpu/guided.py); `logprobs: 1` (each token's log-probability and its top alternative). Each mode
at concurrency 1 and 8 (closed loop, the same prompts and `max_tokens`), in rounds that alternate the modes (order
rotated every round) so drift in what else runs on the host hits all three alike.

TPOT per request is (last token - first token) / (completion_tokens - 1), completion_tokens from the stream's
usage chunk; each mode's figures are the medians over rounds of each round's TPOT p50. Keys:
`tpot_ratio_json_schema_c1`, `..._c8`, `tpot_ratio_logprobs_c1`, `..._c8`: the median over rounds of the mode's
TPOT p50 over plain's in the same round (paired, so a round the host was busy for counts once), and
`meets_target`: the constrained TPOT at concurrency 8 at most 1.2x the unconstrained one. A constrained answer
ends when its JSON closes, so it can be shorter than max_tokens (`tokens_mean`).

    python benchmarks/request_features.py [--json PATH] [--requests N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402

SPEC = REPO / "build" / "tiny-llama-llmapi.yaml"
CONCURRENCIES = (1, 8)
TARGET_RATIO = 1.2
# An object with one free-text field: the grammar stays open for the whole answer, so every token is masked.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    "logprobs": {"logprobs": 1},
}
PROMPTS = ["def parse(text):\n", "class Config:\n    def __init__(self", "import os\n\n\ndef main(",
           "for key, value in items:\n", "    return self._", "with open(path) as f:\n", "try:\n    import json\n",
           "if __name__ == \"__main__\":\n"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _server(root: Path):
    """The OpenAI server on the spec's LLM() arguments, as deploy starts it (not started)."""
    from toolchain.pipeline import convert_for, model_repo_for, openai_server
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    # guided decoding on, as trtllm-serve needs it for response_format (LLM()'s guided_decoding_backend)
    spec = load_spec(SPEC, ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0",
                            "llmapi.openai_port=0", "serving.guided_decoding_backend=xgrammar"])
    ws = Workspace(root)
    convert_for(spec)(spec, ws)
    model_repo_for(spec)(spec, ws)
    return openai_server(spec, ws, root / "openai.log")


def _one(url: str, body: dict) -> dict[str, Any]:
    """One streamed request: its first and last token times and completion_tokens (or its error)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"}
        first = last = None
        tokens = 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                return {"error": str(obj["error"])}
            usage = obj.get("usage") or {}
            tokens = usage.get("completion_tokens") or tokens
            if any((c.get("text") or "") for c in obj.get("choices") or []):
                last = time.perf_counter()
                first = first or last
        if first is None or last is None or tokens < 2:
            return {"error": f"{tokens} token(s) streamed"}
        return {"ttft_ms": (first - start) * 1e3, "tpot_ms": (last - first) * 1e3 / (tokens - 1), "tokens": tokens}
    finally:
        conn.close()


def _level(url: str, model: str, mode: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """`requests` requests of `mode`, `concurrency` outstanding at once; TPOT / TTFT p50 and the errors."""
    counter = iter(range(requests))
    lock = threading.Lock()
    results: list[dict[str, Any]] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0, **MODES[mode]}
            results.append(_one(url, body))

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "tpot_ms_p50": statistics.median(r["tpot_ms"] for r in ok) if ok else None,
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in ok) if ok else None,
            "tokens_mean": statistics.mean(r["tokens"] for r in ok) if ok else None}


def _median(levels: list[dict[str, Any]], key: str) -> float | None:
    values = [lv[key] for lv in levels if lv[key] is not None]
    return round(statistics.median(values), 3) if values else None


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--requests", type=int, default=96, help="measured requests per mode and concurrency")
    ap.add_argument("--rounds", type=int, default=4, help="alternating runs the requests are split into")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="24 requests per level, 2 rounds")
    args = ap.parse_args(argv)
    from toolchain.llmapi.launch import served_model_name
    from toolchain.spec import load_spec

    requests, rounds = (24, 2) if args.quick else (args.requests, max(1, args.rounds))
    out: dict[str, Any] = {"spec": str(SPEC.relative_to(REPO)), "requests_per_level": requests, "rounds": rounds,
                           "max_tokens": args.max_tokens, "schema": SCHEMA, "modes": {}}
    model = served_model_name(load_spec(SPEC))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="request-features-") as d:
        with _server(Path(d)) as server:
            log(f"openai server up in {server.started_s:.1f} s")
            _level(server.url, model, "plain", 2, 4, args.max_tokens)  # warm-up, unmeasured
            for c in CONCURRENCIES:
                runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
                for r in range(rounds):
                    order = list(MODES)[r % len(MODES):] + list(MODES)[:r % len(MODES)]
                    for mode in order:
                        runs[mode].append(_level(server.url, model, mode, c, max(c, requests // rounds),
                                                 args.max_tokens))
                        log(f"{mode} c{c} round {r}: {json.dumps(runs[mode][-1])}")
                for mode, levels in runs.items():
                    out["modes"].setdefault(mode, {})[f"c{c}"] = {
                        **{key: _median(levels, key) for key in ("tpot_ms_p50", "ttft_ms_p50", "tokens_mean")},
                        "requests": sum(lv["requests"] for lv in levels),
                        "errors": sum(lv["errors"] for lv in levels),
                        "first_error": next((lv["first_error"] for lv in levels if lv["first_error"]), None)}
                    if mode != "plain":
                        paired = [_ratio(lv["tpot_ms_p50"], base["tpot_ms_p50"])
                                  for lv, base in zip(levels, runs["plain"], strict=True)]
                        known = [r for r in paired if r is not None]
                        out[f"tpot_ratio_{mode}_c{c}"] = round(statistics.median(known), 3) if known else None
    constrained = out.get("tpot_ratio_json_schema_c8")
    out["target_ratio"] = TARGET_RATIO
    out["meets_target"] = constrained is not None and constrained <= TARGET_RATIO
    out["seconds"] = round(time.monotonic() - t0, 1)
    print_and_write(out, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
