"""Where a deployment's servers listen and are reached: one resolution of binds, ports, published ports and client
URLs from the spec and the exposure policy (toolchain/triton/exposure.py), read by every launcher, printed line,
manifest, preflight check and client that needs one.

    endpoints(spec).triton.http_url       # "http://127.0.0.1:8000"
    endpoints(spec).triton.ports          # {"http": 8000, "grpc": 8001, "metrics": 8002}
    endpoints(spec).openai.url            # the OpenAI server (llmapi.openai_port) on serving.host

Per server: `bind`, the address it binds on a host (tritonserver's --http-address etc.; trtllm-serve's --host);
`port` (0: picked free at start); `published_on`, the host address a container publishes the port on, which is
the bind, so a container exposes what the same spec exposes without one (exposure.published_on); and the client
address, the bind with a wildcard reached on loopback. Replica i serves cluster.replica_spec(spec, i), the spec
with its ports shifted, so `endpoints(cluster.replica_spec(spec, i))` is replica i's.

Metrics: tritonserver serves them on serving.metrics_host (exposure.metrics_host: loopback off loopback unless
asked). They are "private", left out of a pod's declared ports and a Service, only when they stay on loopback while
the other endpoints are exposed (exposure.metrics_private). A loopback spec, with or without admin_key_file, binds
everything on loopback alike: its metrics are published on 127.0.0.1 beside HTTP and gRPC. The admin key guards
Triton's administrative APIs only; it never moves an endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from toolchain.triton import exposure

# Addresses that bind every interface (tritonserver, docker -p and Python's socket read "" the same way).
WILDCARDS = ("0.0.0.0", "", "::")
LOOPBACK = "127.0.0.1"
TRITON_KINDS = ("http", "grpc", "metrics")


def client_host(bind: str) -> str:
    """The address a client on this host reaches a server bound to `bind` on: loopback for a wildcard."""
    return LOOPBACK if bind in WILDCARDS else bind


@dataclass(frozen=True)
class Endpoint:
    """One listening port: where it binds on a host, its number (0: picked free at start) and where a container
    publishes it."""

    bind: str
    port: int
    published_on: str

    @property
    def client_host(self) -> str:
        return client_host(self.bind)

    @property
    def address(self) -> str:
        """host:port a client dials (an IPv6 address in brackets), as tritonclient.grpc takes it."""
        host = self.client_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class UrlAccessors:
    """The URL accessors of what maps http, grpc and metrics to addresses in `urls`: TritonEndpoints and the
    servers (TritonServer, TritonLaunch)."""

    @property
    def urls(self) -> dict[str, str]:
        raise NotImplementedError

    @property
    def http_url(self) -> str:
        return self.urls["http"]

    @property
    def grpc_url(self) -> str:
        """host:port, as tritonclient.grpc.InferenceServerClient takes it."""
        return self.urls["grpc"]

    @property
    def metrics_url(self) -> str:
        return self.urls["metrics"]


@dataclass(frozen=True)
class TritonEndpoints(UrlAccessors):
    """tritonserver's three endpoints (rank 0's, under mpirun) and whether its metrics stay private."""

    http: Endpoint
    grpc: Endpoint
    metrics: Endpoint
    metrics_private: bool

    def __getitem__(self, kind: str) -> Endpoint:
        return {"http": self.http, "grpc": self.grpc, "metrics": self.metrics}[kind]

    @property
    def ports(self) -> dict[str, int]:
        """kind -> port, in tritonserver's order (http, grpc, metrics); 0 is picked at start."""
        return {kind: self[kind].port for kind in TRITON_KINDS}

    @property
    def binds(self) -> dict[str, str]:
        return {kind: self[kind].bind for kind in TRITON_KINDS}

    @property
    def declared(self) -> dict[str, int]:
        """The ports a pod declares and a Service reaches: every fixed one but metrics kept private."""
        return {kind: port for kind, port in self.ports.items()
                if port and not (kind == "metrics" and self.metrics_private)}

    @property
    def urls(self) -> dict[str, str]:
        """http and metrics as URLs, grpc as host:port (tritonclient.grpc.InferenceServerClient)."""
        return {"http": self.http.url, "grpc": self.grpc.address, "metrics": f"{self.metrics.url}/metrics"}

    def with_ports(self, ports: dict[str, int]) -> "TritonEndpoints":
        """The same endpoints on `ports` (kind -> port; the ones a launcher picked for port 0)."""
        moved = {kind: replace(self[kind], port=ports.get(kind, self[kind].port)) for kind in TRITON_KINDS}
        return replace(self, http=moved["http"], grpc=moved["grpc"], metrics=moved["metrics"])

    def reached_at(self, host: str) -> "TritonEndpoints":
        """The same endpoints with HTTP and gRPC bound on `host` (rank 0's host of gpu.hostfile)."""
        return replace(self, http=replace(self.http, bind=host), grpc=replace(self.grpc, bind=host))


@dataclass(frozen=True)
class Endpoints:
    """Every server a spec describes: Triton's endpoints, the OpenAI server's (llmapi.openai_port, which serve
    starts beside Triton on target llmapi-cpu and trtllm-serve serves on the LLM-API path) and the Dynamo frontend
    `toolchain dynamo` starts here (dynamo.http_port, on loopback: dynamo/launcher.py; in a cluster the Dynamo
    operator fixes its port, dynamo/manifests.py)."""

    triton: TritonEndpoints
    openai: Endpoint
    dynamo: Endpoint


def endpoints(spec) -> Endpoints:
    """The endpoints `spec` serves on, resolved from serving.host, serving.metrics_host, the ports and the
    exposure policy."""
    s = spec.serving

    def at(kind: str, bind: str, port: int) -> Endpoint:
        return Endpoint(bind, port, exposure.published_on(s, kind))

    triton = TritonEndpoints(http=at("http", s.host, s.http_port), grpc=at("grpc", s.host, s.grpc_port),
                             metrics=at("metrics", exposure.metrics_host(s), s.metrics_port),
                             metrics_private=exposure.metrics_private(s))
    return Endpoints(triton=triton, openai=at("openai", s.host, spec.llmapi.openai_port),
                     dynamo=Endpoint(LOOPBACK, spec.dynamo.http_port, LOOPBACK))
