"""`run_bench` and `toolchain bench` against a real tritonserver serving a mock
`ensemble`: a decoupled Python model with the ensemble text contract and known
timing, so the measured TTFT/TPOT can be checked against the truth."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import starts_server
from test_bench_workload import MOCK_WORDS, make_word_tokenizer
from toolchain.cli import main as cli_main
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The mock's truth, from the moment its execute() sees the request:
EMPTY_MS = 30        # an empty first response (must not count as the first token)
FIRST_TOKEN_MS = 50  # first word
STEP_MS = 10         # every further word
OSL = 8

MOCK_CONFIG = f"""
name: "ensemble"
backend: "python"
max_batch_size: 8
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "empty_ms" value: {{ string_value: "{EMPTY_MS}" }} }}
parameters {{ key: "first_token_ms" value: {{ string_value: "{FIRST_TOKEN_MS}" }} }}
parameters {{ key: "step_ms" value: {{ string_value: "{STEP_MS}" }} }}
"""

MOCK_MODEL = textwrap.dedent(f"""
    import json
    import threading
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils

    WORDS = {MOCK_WORDS!r}
    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


    def _scalar(request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy().ravel()[0]


    def _text(s):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[s.encode()]], dtype=np.object_))])


    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"])["parameters"]
            self.ms = {{k: float(v["string_value"]) for k, v in params.items()}}

        def execute(self, requests):
            for request in requests:
                t0 = time.perf_counter()
                sender = request.get_response_sender()
                # The ensemble contract the bench must honour: streaming, EOS ignored, a prompt.
                problem = None
                if not _scalar(request, "stream"):
                    problem = "stream must be true"
                elif _scalar(request, "end_id") != -1:
                    problem = "end_id must be -1 (ignore_eos)"
                elif not _scalar(request, "text_input"):
                    problem = "empty prompt"
                if problem:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(problem)), flags=FINAL)
                    continue
                n = int(_scalar(request, "max_tokens"))
                threading.Thread(target=self._stream, args=(sender, t0, n), daemon=True).start()
            return None

        def _stream(self, sender, t0, n):
            def at(ms):
                delay = t0 + ms / 1000.0 - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)

            at(self.ms["empty_ms"])
            sender.send(_text(""))
            for k in range(n):
                at(self.ms["first_token_ms"] + k * self.ms["step_ms"])
                sender.send(_text(" " + WORDS[k % len(WORDS)]))
            sender.send(flags=FINAL)
""")

# Triton's LLM-API model contract: every streamed text_output is the whole text so far.
LLMAPI_CONFIG = """
name: "llmapi"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "sampling_param_max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "sampling_param_exclude_input_from_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "streaming" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
LLMAPI_MODEL = textwrap.dedent(f"""
    import numpy as np
    import triton_python_backend_utils as pb_utils

    WORDS = {MOCK_WORDS!r}
    FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


    def _scalar(request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy().ravel()[0]


    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                if not _scalar(request, "streaming") or not _scalar(request, "sampling_param_exclude_input_from_output"):
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "streaming and sampling_param_exclude_input_from_output must be true")), flags=FINAL)
                    continue
                n, text = int(_scalar(request, "sampling_param_max_tokens")), ""
                for k in range(n):
                    text += " " + WORDS[k % len(WORDS)]
                    out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=FINAL if k == n - 1 else 0)
            return None
""")

REPORT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "output_tokens_per_s", "requests_per_s", "num_requests",
               "errors", "window_s", "goodput_req_per_s", "token_count_source", "workload", "slo")
STAT_KEYS = ("p50", "p90", "p95", "p99", "mean", "stdev", "min", "max", "n")


@pytest.fixture(scope="module")
@starts_server
def served(tmp_path_factory):
    from toolchain.triton.server import TritonServer

    root = tmp_path_factory.mktemp("bench-live")
    repo = root / "repo"
    (repo / "ensemble" / "1").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(MOCK_CONFIG)
    (repo / "ensemble" / "1" / "model.py").write_text(MOCK_MODEL)
    tok = make_word_tokenizer(root / "tokenizer")
    from toolchain.bench.mock import write_triton_mock

    write_triton_mock(repo, "mock_ids", contract="token-ids", ttft_ms=20, step_ms=3)
    write_triton_mock(repo, "mock_chunks", ttft_ms=20, step_ms=3, empty_ms=5, tokens_per_response=4,
                      flag_only_final=True)
    (repo / "llmapi" / "1").mkdir(parents=True)
    (repo / "llmapi" / "config.pbtxt").write_text(LLMAPI_CONFIG)
    (repo / "llmapi" / "1" / "model.py").write_text(LLMAPI_MODEL)
    with TritonServer(repo, "127.0.0.1", 0, 0, 0, log_path=root / "server.log") as server:
        yield server, tok, root


def spec_file(root: Path, tok: Path, name: str, **workload_and_slo) -> Path:
    slo = workload_and_slo.pop("slo", {})
    workload = {"num_requests": 24, "warmup_requests": 2, "concurrency": 2, "input_tokens": 32,
                "output_tokens": OSL, "seed": 0, **workload_and_slo}
    data = {"name": name, "model": {"checkpoint": str(tok)},
            "validation": {"workload": workload, "slo": slo}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_run_bench_measures_the_mock_truth(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "truth", slo={"ttft_p99_ms": 1000, "tpot_p99_ms": 100}))
    out = root / "out-truth"
    report = run_bench(spec, server.urls["grpc"], out)

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    for key in REPORT_KEYS:
        assert key in report, key
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(STAT_KEYS) <= set(report[key])

    assert report["errors"] == 0 and report["num_requests"] == 24 and report["warmup_requests"] == 2
    assert report["token_count_source"] == "tokenizer"
    assert report["osl_mismatches"] == 0 and report["osl"]["min"] == report["osl"]["max"] == OSL

    ttft, tpot, ttfr = report["ttft_ms"]["p50"], report["tpot_ms"]["p50"], report["ttfr_ms"]["p50"]
    print(f"\nmock truth TTFT {FIRST_TOKEN_MS} ms / TPOT {STEP_MS} ms / TTFR {EMPTY_MS} ms; "
          f"measured p50 TTFT {ttft:.3f} ms, TPOT {tpot:.3f} ms, TTFR {ttfr:.3f} ms, "
          f"ITL p50 {report['itl_ms']['p50']:.3f} ms, E2E p50 {report['e2e_ms']['p50']:.3f} ms")
    # Measured = truth + transport/scheduling overhead (client and server share 2 cores).
    assert FIRST_TOKEN_MS - 0.5 <= ttft <= FIRST_TOKEN_MS + 6
    assert EMPTY_MS - 0.5 <= ttfr <= EMPTY_MS + 6       # the empty response was seen, but not as a token
    assert STEP_MS - 1 <= tpot <= STEP_MS + 1
    e2e_truth = FIRST_TOKEN_MS + (OSL - 1) * STEP_MS
    assert e2e_truth - 0.5 <= report["e2e_ms"]["p50"] <= e2e_truth + 7
    assert report["itl_ms"]["n"] == 24 * (OSL - 1)
    # closed loop with 2 outstanding: about 2 requests per E2E
    assert report["requests_per_s"] == pytest.approx(2000 / e2e_truth, rel=0.25)
    assert report["output_tokens_per_s"] == pytest.approx(report["requests_per_s"] * OSL, rel=1e-6)
    assert report["slo"]["passed"] is True
    assert report["slo"]["ttft_p99_ms"]["threshold"] == 1000
    assert report["goodput_fraction"] == 1.0
    # The mock has no model config, so no prediction: said once, not an error.
    assert report["prediction"]["predicted"] is False and "not readable" in report["prediction"]["note"]

    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 26 and sum(r["warmup"] == "1" for r in rows) == 2
    assert all(r["error"] == "" and int(r["osl"]) == OSL and int(r["isl"]) == 32 for r in rows)


def test_cli_exits_nonzero_when_an_slo_is_missed(served, capsys):
    server, tok, root = served
    spec = spec_file(root, tok, "missed", num_requests=4, warmup_requests=0, slo={"ttft_p99_ms": 5})
    out = root / "out-missed"
    rc = cli_main(["bench", str(spec), "--url", server.urls["grpc"], "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "SLO missed: ttft_p99_ms" in err
    report = json.loads((out / "report.json").read_text())  # written before failing
    assert report["slo"]["passed"] is False and report["slo"]["ttft_p99_ms"]["passed"] is False


def test_cli_passes_and_defaults_out_to_the_report_dir(served, tmp_path, capsys):
    server, tok, root = served
    spec = spec_file(root, tok, "passing", num_requests=4, warmup_requests=1, slo={"e2e_p99_ms": 5000})
    rc = cli_main(["--root", str(tmp_path), "bench", str(spec), "--url", server.urls["grpc"],
                   "--set", "validation.workload.concurrency=3"])
    assert rc == 0
    assert capsys.readouterr().out.count("prediction: none (the model's config is not readable") == 1
    report = json.loads((tmp_path / "reports" / "passing" / "report.json").read_text())
    assert report["workload"]["concurrency"] == 3 and report["slo"]["passed"] is True


def test_model_not_served_names_the_model(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "bls", endpoint="tensorrt_llm_bls"))
    with pytest.raises(ToolchainError, match=r"model 'tensorrt_llm_bls' not found .*serves: ensemble"):
        run_bench(spec, server.urls["grpc"], root / "out-bls")


def test_contract_violation_is_counted_as_errors(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    # Without ignore_eos no end_id is sent; this mock then refuses every request. (The limit keeps three
    # failures in a row from stopping the run, which test_three_refusals_in_a_row_stop_the_run checks.)
    spec = load_spec(spec_file(root, tok, "errs", num_requests=3, warmup_requests=0, ignore_eos=False,
                               max_consecutive_failures=4))
    report = run_bench(spec, server.urls["grpc"], root / "out-errs")
    assert report["errors"] == 3 and report["num_requests"] == 0
    assert "end_id must be -1" in next(iter(report["error_reasons"]))
    assert report["slo"]["passed"] is False and report["aborted"] is None


def test_three_refusals_in_a_row_stop_the_run(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "refused", num_requests=8, warmup_requests=0, ignore_eos=False,
                               sweep=[2, 2]))
    report = run_bench(spec, server.urls["grpc"], root / "out-refused")
    stopped = report["stopped"]
    assert report["complete"] is False and len(report["levels"]) == 1  # the second level never ran
    assert stopped["level"] == 0 and stopped["reason"].startswith("3 consecutive requests failed: ")
    assert "end_id must be -1" in stopped["reason"] and stopped["url"] == server.urls["grpc"]
    assert stopped["last_response"] is None  # each refusal was an error message, no response


def test_timed_out_requests_are_cancelled_and_counted(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "slow", num_requests=3, warmup_requests=0, max_consecutive_failures=4))
    report = run_bench(spec, server.urls["grpc"], root / "out-slow", request_timeout_s=0.02)  # first token is at 50 ms
    assert report["errors"] == 3 and report["error_reasons"] == {"timed out after 0.02 s": 3}
    assert report["aborted"] is None  # the server is fine, only slow
    # the stream stays usable afterwards
    again = run_bench(spec, server.urls["grpc"], root / "out-slow2")
    assert again["errors"] == 0 and again["num_requests"] == 3


def test_unreachable_server_names_the_url(tmp_path):
    from toolchain.bench.run import run_bench
    from toolchain.triton.server import free_port

    url = f"127.0.0.1:{free_port('127.0.0.1')}"
    spec = load_spec(spec_file(tmp_path, tmp_path, "down"))
    with pytest.raises(ToolchainError, match=f"not reachable at {url}"):
        run_bench(spec, url, tmp_path / "out")


def test_token_id_contract_counts_exactly_and_cancels(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "ids", endpoint="mock_ids", num_requests=12, output_tokens=10,
                               cancel_fraction=0.5, multi_turn={"turns": 2}))
    r = run_bench(spec, server.urls["grpc"], root / "out-ids")
    assert r["token_count_source"] == "server" and r["transport"]["contract"] == "token-ids"
    assert {"input_ids", "input_lengths", "request_output_len", "streaming", "end_id"} <= set(r["workload"]["inputs_sent"])
    assert r["errors"] == 0 and r["cancelled"] > 0
    assert r["osl"]["min"] == r["osl"]["max"] == 10
    rows = list(csv.DictReader((root / "out-ids" / "requests.csv").open()))
    second = [x for x in rows if x["turn"] == "1"]
    assert second and all(int(x["isl"]) > 32 for x in second)  # the history came along


def test_http_generate_stream_and_multi_token_chunks(served):
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "http", protocol="triton-http", endpoint="mock_chunks", num_requests=6,
                               output_tokens=12))
    r = run_bench(spec, None, root / "out-http", url=server.urls["http"], metrics_url=server.metrics_url)
    assert r["errors"] == 0 and r["num_requests"] == 6 and r["osl"]["mean"] == 12
    assert r["itl_ms"]["n"] == 6 * 2 and r["itl_per_token_ms"]["p50"] < r["itl_ms"]["p50"]
    srv = r["levels"][0]["server"]
    assert srv["available"] and srv["server_requests_success"] == 6  # the server-side cross-check
    g = run_bench(load_spec(spec_file(root, tok, "chunks", endpoint="mock_chunks", num_requests=6, output_tokens=12)),
                  server.urls["grpc"], root / "out-chunks", metrics_url="")
    assert g["ttfr_ms"]["p50"] < g["ttft_ms"]["p50"]  # the empty first response is not a token
    assert g["e2e_final_ms"]["p50"] > g["e2e_ms"]["p50"]  # the flag-only final arrives after the last token
    assert g["levels"][0]["server"]["available"] is False


def test_llmapi_contract_keeps_only_the_new_part_of_each_cumulative_text(served):
    """Triton's llmapi model streams the LLM API's cumulative output.text: counting every response's
    text as new would count 1 + 2 + ... + n tokens instead of n."""
    from toolchain.bench.run import run_bench

    server, tok, root = served
    spec = load_spec(spec_file(root, tok, "llmapi", endpoint="llmapi", num_requests=4, output_tokens=6))
    g = run_bench(spec, server.urls["grpc"], root / "out-llmapi", metrics_url="")
    assert g["errors"] == 0 and g["num_requests"] == 4
    with open(root / "out-llmapi" / "requests.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["warmup"] in ("False", "0", "")]
    assert [int(r["osl"]) for r in rows] == [6] * 4


def test_cli_rate_sweep_writes_table_json_csv_and_plots(served, capsys):
    server, tok, root = served
    path = spec_file(root, tok, "sweep", num_requests=8, warmup_requests=1, slo={"ttft_p99_ms": 5000})
    out = root / "out-sweep"
    rc = cli_main(["bench", str(path), "--url", server.urls["grpc"], "--out", str(out), "--mode", "rate",
                   "--sweep", "10,20", "--slo", "tpot_p99_ms<=1000"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "sweep" in captured.out and "highest load meeting the SLOs: 20" in captured.out
    report = json.loads((out / "report.json").read_text())
    assert [lv["load"]["value"] for lv in report["levels"]] == [10.0, 20.0]
    assert report["sweep"]["levels"][0]["slo_passed"] and report["workload"]["slo_thresholds"] == [
        "ttft_p99_ms", "tpot_p99_ms"]
    assert {"latency_vs_load.png", "latency_cdf.png", "itl_by_position.png"} <= {p.name for p in out.iterdir()}
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == 17 and {r["level"] for r in rows} == {"-1", "0", "1"}


def test_grpc_streams_are_reused_and_a_failed_request_never_poisons_one(served):
    """One persistent stream per in-flight request: reused after a final response, closed after a timeout,
    a cancellation or an error, and the next request on that slot sees only its own responses."""
    import asyncio

    from toolchain.bench.datasets import Prompt, Turn
    from toolchain.bench.protocols.triton_grpc import TritonGrpc
    from toolchain.bench.records import RequestRecord

    server, _, _ = served
    tr = TritonGrpc(server.urls["grpc"], "ensemble")
    tr.prepare()
    prompt = Prompt(text="alpha bravo charlie", messages=None, ids=None, isl=3)
    seq = iter(range(100))

    async def one(turn=Turn(max_tokens=OSL), timeout=5.0, request=None):
        rec = RequestRecord(index=0, request_id=f"t{next(seq)}")
        try:
            await asyncio.wait_for(tr.run(rec, prompt, turn, 0, request), timeout)
        except asyncio.TimeoutError:
            rec.timed_out = True
        return rec

    def clean(rec):  # exactly this request's stream: the empty first response, OSL words, the final flag
        return (rec.ok and len(rec.responses) == OSL + 1 and not rec.responses[0].text
                and all(r.text for r in rec.responses[1:]))

    async def main():
        await tr.open()
        try:
            a = await one()
            assert clean(a) and len(tr._idle) == 1
            stream = tr._idle[0]
            b = await one()
            assert clean(b) and tr._idle == [stream]  # the same stream served both
            both = await asyncio.gather(one(), one())  # two in flight: a second stream is opened
            assert all(map(clean, both)) and len(tr._idle) == 2 and stream in tr._idle

            taken = tr._idle[-1]  # the next request's stream
            slow = await one(timeout=0.01)  # first token at 50 ms: cancelled mid-request
            assert slow.timed_out and not slow.ok and len(tr._idle) == 1 and taken not in tr._idle
            assert taken.cancelled()
            cut = await one(Turn(max_tokens=OSL, cancel_after=2))
            assert cut.cancelled and len(tr._idle) == 0
            tr.ignore_eos = False  # this mock refuses a request without end_id -1
            bad_req = tr.build(RequestRecord(index=0, request_id="bad"), prompt, Turn(max_tokens=OSL), 0)
            tr.ignore_eos = True
            bad = await one(request=bad_req)
            assert "end_id must be -1" in bad.error and len(tr._idle) == 0
            after = await asyncio.gather(one(), one(), one())
            assert all(map(clean, after)) and len(tr._idle) == 3

            class Gone:  # an idle stream the server ended, not yet known as done: one fresh retry
                def done(self):
                    return False

                async def write(self, _):
                    raise asyncio.InvalidStateError("RPC already finished.")

                def cancel(self):
                    return True

            tr._idle.append(Gone())
            retried = await one()
            assert clean(retried) and not any(isinstance(c, Gone) for c in tr._idle)
        finally:
            await tr.close()

    asyncio.run(main())
