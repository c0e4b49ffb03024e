"""The spec's SLOs, measured by the harness against a live deployment (marker `perf`)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def report(perf_spec, deployment):
    from toolchain.bench.run import run_bench

    return run_bench(perf_spec, deployment["grpc"], REPO / "reports" / f"{perf_spec.name}-perf",
                     metrics_url=deployment["metrics"] or "", plots=True)


def test_server_is_live_and_the_model_ready(perf_spec, deployment):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(deployment["grpc"])
    try:
        assert client.is_server_live() and client.is_model_ready(perf_spec.validation.workload.endpoint)
    finally:
        client.close()


def test_every_request_completes(report):
    assert report["complete"], report["aborted"]
    assert report["errors"] == 0, report["error_reasons"]
    assert report["num_requests"] > 0


def test_slos_are_met(report):
    from toolchain.cli.bench import missed_slos

    assert report["slo"]["passed"], f"SLO missed: {missed_slos(report['slo'])}"


def test_output_lengths_are_exact(perf_spec, report):
    if perf_spec.validation.workload.ignore_eos:
        assert report["osl_mismatches"] == 0


def test_server_counted_what_the_client_sent(report):
    srv = report["levels"][-1]["server"]
    if not srv.get("available"):
        pytest.skip("no metrics endpoint to cross-check against")
    assert srv["server_requests_success"] >= report["num_requests"]
