"""One resolution of where a deployment's servers bind, listen, are published and are reached
(toolchain/triton/endpoints.py), and the checks that nothing else in toolchain/ resolves them again."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import write_spec
from toolchain.bench.run import default_metrics_url, default_url
from toolchain.checks.serving import bound_ports
from toolchain.cli import main
from toolchain.spec import load_spec
from toolchain.triton import cluster, exposure
from toolchain.triton.endpoints import Endpoint, client_host, endpoints
from toolchain.versions import TRITON_IMAGE

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "toolchain"
ENGINE_70B = REPO / "build" / "llama3-70b-sq-tp4pp2.yaml"  # trtllm, host 0.0.0.0
LLMAPI_8B = REPO / "build" / "llama3-8b-llmapi-h100.yaml"  # llmapi, host 0.0.0.0


def spec_with(tmp_path, target="cpu", **serving):
    return load_spec(write_spec(tmp_path / "s.yaml", tmp_path, target=target, serving=serving,
                                llmapi={"openai_port": 8080}))


def test_loopback_spec(tmp_path):
    ep = endpoints(spec_with(tmp_path))
    assert ep.triton.ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert ep.triton.binds == dict.fromkeys(("http", "grpc", "metrics"), "127.0.0.1")
    assert ep.triton.urls == {"http": "http://127.0.0.1:8000", "grpc": "127.0.0.1:8001",
                              "metrics": "http://127.0.0.1:8002/metrics"}
    assert not ep.triton.metrics_private and ep.triton.declared == ep.triton.ports
    assert ep.openai == Endpoint("127.0.0.1", 8080, "127.0.0.1") and ep.openai.url == "http://127.0.0.1:8080"
    assert ep.dynamo == Endpoint("127.0.0.1", 8000, "127.0.0.1")  # `toolchain dynamo` binds its frontend on loopback


def test_every_interface_is_reached_on_loopback_and_metrics_stay_private(tmp_path):
    ep = endpoints(spec_with(tmp_path, host="0.0.0.0"))
    assert ep.triton.http == Endpoint("0.0.0.0", 8000, "0.0.0.0") and ep.triton.http_url == "http://127.0.0.1:8000"
    assert ep.triton.grpc_url == "127.0.0.1:8001"
    assert ep.triton.metrics == Endpoint("127.0.0.1", 8002, "127.0.0.1")
    assert ep.triton.metrics_private and ep.triton.declared == {"http": 8000, "grpc": 8001}
    asked = endpoints(spec_with(tmp_path, host="0.0.0.0", metrics_host="0.0.0.0")).triton
    assert not asked.metrics_private and asked.metrics_url == "http://127.0.0.1:8002/metrics"
    assert [client_host(h) for h in ("0.0.0.0", "", "::", "10.1.2.3")] == ["127.0.0.1"] * 3 + ["10.1.2.3"]


def test_ipv6_addresses_are_bracketed(tmp_path):
    ep = endpoints(spec_with(tmp_path, host="::1")).triton
    assert ep.urls == {"http": "http://[::1]:8000", "grpc": "[::1]:8001", "metrics": "http://[::1]:8002/metrics"}


def test_ports_picked_at_start_and_rank0_host(tmp_path):
    ep = endpoints(spec_with(tmp_path, http_port=0, grpc_port=0, metrics_port=0)).triton
    assert ep.declared == {}
    picked = ep.with_ports({"http": 40001, "grpc": 40002, "metrics": 40003}).reached_at("10.0.0.7")
    assert picked.urls == {"http": "http://10.0.0.7:40001", "grpc": "10.0.0.7:40002",
                           "metrics": "http://127.0.0.1:40003/metrics"}
    assert ep.ports == {"http": 0, "grpc": 0, "metrics": 0}  # frozen: the original is untouched


def test_replicas_shift_every_port(tmp_path):
    spec = load_spec(LLMAPI_8B)
    one = endpoints(cluster.replica_spec(spec.model_copy(update={"serving": spec.serving.model_copy(
        update={"replicas": 2})}), 1))
    assert one.triton.ports == {k: p + cluster.REPLICA_PORT_STEP for k, p in endpoints(spec).triton.ports.items()}
    assert one.openai.port == endpoints(spec).openai.port + cluster.REPLICA_PORT_STEP


def test_clients_and_checks_read_the_same_endpoints(tmp_path):
    spec = spec_with(tmp_path, host="0.0.0.0", target="llmapi-cpu")
    ep = endpoints(spec)
    assert default_url(spec, "triton-grpc") == ep.triton.grpc_url and default_url(spec, "openai") == ep.triton.http_url
    assert default_metrics_url(spec) == ep.triton.metrics_url
    assert bound_ports(spec) == [("serving.http_port", "0.0.0.0", 8000), ("serving.grpc_port", "0.0.0.0", 8001),
                                 ("serving.metrics_port", "127.0.0.1", 8002), ("llmapi.openai_port", "0.0.0.0", 8080)]


# -- the metrics port: published exactly where the other endpoints are ------------------------------------------

def _published(docker: list[str]) -> list[str]:
    return [docker[i + 1] for i, a in enumerate(docker) if a == "-p"]


@pytest.mark.parametrize("spec_path", [ENGINE_70B, LLMAPI_8B])
def test_loopback_with_admin_key_file_publishes_metrics(tmp_path, capsys, spec_path):
    """Before issue 33, `serve --print` decided whether Triton's container publishes metrics twice: the LLM-API
    line kept them private when the admin APIs were restricted and metrics were on loopback, the engine path's
    when metrics were on loopback while serving.host was not. They disagreed on a loopback serving.host with
    serving.admin_key_file set (restricted, yet nothing exposed). The second is right: the key guards Triton's
    administrative APIs and moves no endpoint, so a loopback spec's metrics are published on 127.0.0.1 beside
    HTTP and gRPC and a pod declares them. Endpoints.triton.metrics_private is now the one rule."""
    key = tmp_path / "admin.key"
    key.write_text("k3y-for-tests-0123456789abcdef\n")
    sets = ["serving.host=127.0.0.1", f"serving.admin_key_file={key}"]
    spec = load_spec(spec_path, sets)
    args = [a for s in sets for a in ("--set", s)]
    assert main(["--root", str(tmp_path / "ws"), "serve", str(spec_path), "--print", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    tritons = [shlex.split(line) for line in out if line.startswith("docker run") and "--metrics-port" in line]
    assert tritons
    for docker in tritons:
        assert "--http-restricted-api" in " ".join(docker[docker.index(TRITON_IMAGE) + 1:])  # the key still asked
        assert sorted(_published(docker)) == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    assert exposure.restricted(spec.serving) and not endpoints(spec).triton.metrics_private
    if spec_path == ENGINE_70B:
        kubectl = next(shlex.split(line) for line in out if line.startswith("kubectl run"))
        overrides = json.loads(next(a for a in kubectl if a.startswith("--overrides=")).split("=", 1)[1])
        assert [p["containerPort"] for p in overrides["spec"]["containers"][0]["ports"]] == [8000, 8001, 8002]


# -- defined once -----------------------------------------------------------------------------------------------

# A port dictionary built from the spec's fields, and the wildcard addresses a client reaches on loopback: only
# endpoints.py may spell them.
_AGAIN = [re.compile(r"""["']http["']\s*:\s*[\w.]*\.http_port"""), re.compile(r"""["']metrics["']\s*:\s*[\w.]*\.metrics_port"""),
          re.compile(r"""\(\s*["']0\.0\.0\.0["']\s*,\s*["']{2}\s*,"""),
          re.compile(r"""exposure\.(metrics_host|metrics_private|published_on)\(""")]


def test_endpoints_are_resolved_in_one_place():
    found = [f"{p.relative_to(REPO)}:{n}" for p in sorted(PACKAGE.rglob("*.py")) if p.name != "endpoints.py"
             and p.name != "exposure.py" for n, line in enumerate(p.read_text().splitlines(), 1)
             if any(r.search(line) for r in _AGAIN)]
    assert found == [], "resolve ports, binds and client URLs with toolchain.triton.endpoints.endpoints(spec)"
