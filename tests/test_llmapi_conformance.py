"""The LLM-API path's artifacts against what trtllm-serve declares upstream (facts/llmapi.json
trtllm_serve): the options the trtllm-serve line uses, the routes the project's OpenAI server
claims to share with trtllm-serve, and the trtllm_* Prometheus families it exports. Where the
project knowingly differs, the difference is an explicit list here, so a change on either side
shows up as a failing test rather than a surprise on a GPU host."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest

from toolchain import upstream
from toolchain.llmapi import launch

SERVE = upstream.facts("llmapi")["trtllm_serve"]
APP = Path(__file__).resolve().parents[1] / "toolchain" / "openai" / "app.py"

# Routes upstream's OpenAIServer.register_routes adds that the project's server does not serve.
UPSTREAM_ONLY_ROUTES = {
    ("/perf_metrics", "GET"), ("/steady_clock_offset", "GET"), ("/steady_clock_offset", "POST"),
    ("/kv_cache_events", "POST"), ("/v1/responses", "POST"),
}
# trtllm_* families the project exports under the names later collectors give them; the 1.2
# collector read upstream has none of them (see toolchain/openai/metrics.py).
PROJECT_ONLY_FAMILIES = {
    "trtllm_prompt_tokens": "counter", "trtllm_generation_tokens": "counter",
    "trtllm_num_requests_running": "gauge", "trtllm_num_requests_waiting": "gauge",
}


# -- options -------------------------------------------------------------------------------------------------


def test_serve_options_read_from_upstream():
    opts = SERVE["options"]
    assert opts["--host"]["default"] == "localhost" and opts["--port"]["default"] == 8000
    assert opts["--config"] == {**opts["--config"], "aliases": ["--extra_llm_api_options"],
                                "dest": "extra_llm_api_options"}
    assert opts["--tensor_parallel_size"]["aliases"] == ["--tp_size"]
    assert opts["--trust_remote_code"]["is_flag"] is True
    assert len({e["dest"] for e in opts.values()}) == len(opts)  # one option per serve() argument


@pytest.fixture
def spec_ws(tmp_path, hf_llama):
    """tp 8 x pp 2 on hosts of 8 GPUs, so both the one-host and the srun lines are rendered."""
    from conftest import write_spec
    from toolchain.spec import load_spec
    from toolchain.workspace import Workspace

    path = write_spec(tmp_path / "conf.yaml", hf_llama, name="conf-model", target="llmapi",
                      parallelism={"tp": 8, "pp": 2}, gpu={"per_node": 8})
    return load_spec(path), Workspace(tmp_path / "ws")


def _options(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_every_trtllm_serve_option_emitted_exists_upstream(spec_ws):
    spec, ws = spec_ws
    known = launch.serve_options()
    lines = launch.gpu_launch_lines(spec, ws)
    for key in ("trtllm_serve", "trtllm_serve_multi_node"):
        argv = shlex.split(lines[key])
        serve_args = argv[argv.index(launch.TRTLLM_SERVE) + 2:]  # after `trtllm-serve MODEL`
        emitted = _options(serve_args)
        assert emitted, key
        for opt in emitted:
            assert opt in known, (key, opt)
        # Each option is given a value (none of these is a flag upstream).
        assert not any(known[o].get("is_flag") for o in emitted)
    assert known[launch.SERVE_CONFIG_OPTION]["dest"] == "extra_llm_api_options"


# -- routes --------------------------------------------------------------------------------------------------


def _project_routes() -> set[tuple[str, str]]:
    """(path, method) pairs app.py registers: @app.get/@app.post decorators and
    app.add_api_route(path, handler, methods=[...]) calls (read, not run: no engine needed)."""
    tree = ast.parse(APP.read_text())
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func in ("app.get", "app.post", "app.put", "app.delete") and node.args:
            out.add((ast.literal_eval(node.args[0]), func.split(".")[1].upper()))
        elif func == "app.add_api_route":
            methods = next(k.value for k in node.keywords if k.arg == "methods")
            out |= {(ast.literal_eval(node.args[0]), m) for m in ast.literal_eval(methods)}
    return out


def _upstream_routes() -> set[tuple[str, str]]:
    out = set()
    for path, entry in SERVE["routes"].items():
        if entry["methods"] == "any":  # a mounted app (Prometheus) answers GET, which is what a scrape sends
            out.add((path, "GET"))
        else:
            out |= {(path, m) for m in entry["methods"]}
    return out


def test_project_routes_are_upstream_routes():
    ours, theirs = _project_routes(), _upstream_routes()
    assert {"/health", "/health_generate", "/version", "/v1/models", "/v1/completions", "/v1/chat/completions",
            "/metrics", "/prometheus/metrics"} <= {p for p, _ in ours}
    assert ours - theirs == set()
    assert theirs - ours == UPSTREAM_ONLY_ROUTES
    # Upstream mounts /prometheus/metrics only when the LLM args ask for perf metrics.
    assert SERVE["routes"]["/prometheus/metrics"]["when"] == "self.llm.args.return_perf_metrics"


# -- metrics -------------------------------------------------------------------------------------------------


def _family(name: str, kind: str) -> str:
    """A family as prometheus-client names it: a counter's `_total` is added on exposition, so
    `Counter("x_total")` and `Counter("x")` are both family `x`."""
    return name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name


def _upstream_families() -> dict[str, dict]:
    return {_family(n, e["kind"]): e for n, e in SERVE["metrics"]["families"].items()}


def _project_families() -> dict[str, tuple[str, list[str]]]:
    from toolchain.openai.metrics import PREFIX, ServerMetrics

    assert PREFIX == SERVE["metrics"]["prefix"]["value"]
    registry = ServerMetrics("m").registry
    # registry.collect() yields families with the counter suffix already removed.
    out = {}
    for collector in list(registry._collector_to_names):  # every registered metric, even with no sample yet
        for fam in collector.describe():
            out[fam.name] = (fam.type, list(getattr(collector, "_labelnames", ())))
    return out


def test_trtllm_families_exist_upstream_with_the_same_kind_and_labels():
    ours, theirs = _project_families(), _upstream_families()
    assert ours and all(name.startswith("trtllm_") for name in ours)
    for name, (kind, labels) in ours.items():
        if name in PROJECT_ONLY_FAMILIES:
            assert PROJECT_ONLY_FAMILIES[name] == kind, name
            assert name not in theirs, f"{name} is upstream now: drop it from PROJECT_ONLY_FAMILIES"
            continue
        assert name in theirs, name
        assert theirs[name]["kind"] == kind, name
        assert theirs[name]["labels"] == labels, name
    assert set(PROJECT_ONLY_FAMILIES) <= set(ours)
    # Every 1.2 family is exported, with upstream's buckets for the histograms.
    assert set(theirs) <= set(ours)


def test_histogram_buckets_match_upstream():
    from toolchain.openai import metrics

    fams = _upstream_families()
    assert fams["trtllm_e2e_request_latency_seconds"]["buckets"] == metrics.LATENCY_BUCKETS
    assert fams["trtllm_request_queue_time_seconds"]["buckets"] == metrics.LATENCY_BUCKETS
    assert fams["trtllm_time_to_first_token_seconds"]["buckets"] == metrics.TTFT_BUCKETS
    assert fams["trtllm_time_per_output_token_seconds"]["buckets"] == metrics.TPOT_BUCKETS
