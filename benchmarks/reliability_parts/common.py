"""What every part of benchmarks/reliability.py shares: the embedded default's deployment, readings of
the server's processes (/proc) and of its /metrics, and keep-alive HTTP and per-thread gRPC clients that
report timeouts apart from errors (an unanswered request is the figure these parts count)."""

from __future__ import annotations

import http.client
import queue
import re
import sys
import threading
import time
from pathlib import Path

from toolchain.triton.grpc_client import tensor

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "build" / "tiny-llama.yaml"
MODELS = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls", "preprocessing", "postprocessing")
REQUEST_TIMEOUT_S = 30.0
LOG_DEATH = re.compile(r"Stub process .* (is not healthy|unhealthy)|stub .*died|Segmentation fault|"
                       r"terminate called|Failed to (initialize|restart) stub|signal \d+ received", re.I)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the deployment --------------------------------------------------------------------------------------------

def load_default_spec(overrides=()):
    from toolchain.spec import load_spec

    return load_spec(SPEC, ["serving.http_port=0", "serving.grpc_port=0", "serving.metrics_port=0", *overrides])


def deploy(root: Path, overrides=()):
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer
    from toolchain.workspace import Workspace

    spec = load_default_spec(overrides)
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws, converted=True)
    run_model_repo(spec, ws)
    return spec, ws, TritonServer.from_spec(spec, ws.model_repo_dir(spec), log_path=root / "server.log")


def http_get(url: str, timeout: float = 2.0) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except Exception:
        return None


def models_ready(server) -> dict[str, bool]:
    return {m: http_get(f"{server.http_url}/v2/models/{m}/ready") == 200 for m in MODELS}


# -- /proc -----------------------------------------------------------------------------------------------------

def proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def rss_kb(pid: int) -> int:
    return int(proc_status(pid).get("VmRSS", "0 kB").split()[0])


def threads(pid: int) -> int:
    return int(proc_status(pid).get("Threads", "0"))


def stub_pids(server_pid: int) -> dict[str, int]:
    """model -> pid of its triton_python_backend_stub (children of the server whose cmdline names it)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(proc_status(int(entry.name)).get("PPid", "-1")) != server_pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if not argv or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        for m in MODELS:
            if any(a.endswith(f"/{m}/1/model.py".encode()) for a in argv):
                out[m] = int(entry.name)
    return out


def kv_and_active(metrics_url: str) -> dict:
    from toolchain.bench.servermetrics import scrape

    got = scrape(metrics_url) or {}
    out = {}
    for (name, labels), v in got.items():
        lab = dict(labels)
        if lab.get("model") != "tensorrt_llm":
            continue
        if name == "nv_trt_llm_kv_cache_block_metrics":
            out["kv_" + lab["kv_cache_block_type"]] = v
        elif name == "nv_trt_llm_request_metrics":
            out["req_" + lab["request_type"]] = v
    return out


def wait_idle(metrics_url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        g = kv_and_active(metrics_url)
        if (g.get("kv_used") == 0 and g.get("req_active") == 0) or time.monotonic() > deadline:
            return g
        time.sleep(0.25)


def proc_snapshot(server) -> dict:
    pids = stub_pids(server.process.pid)
    trt = pids.get("tensorrt_llm")
    return {"trt_threads": threads(trt) if trt else None,
            "rss_kb": rss_kb(server.process.pid) + sum(rss_kb(p) for p in pids.values()),
            "trt_rss_kb": rss_kb(trt) if trt else None, "server_threads": threads(server.process.pid),
            "rss_kb_by_process": {"tritonserver": rss_kb(server.process.pid),
                                  **{m: rss_kb(p) for m, p in sorted(pids.items())}}}


# -- requests --------------------------------------------------------------------------------------------------

class Http:
    """One keep-alive HTTP/1.1 connection per thread, reopened after any failure."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.local = threading.local()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.timeout = timeout
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
                self.local.conn = None
            return resp.status, data
        except BaseException:
            conn.close()
            self.local.conn = None
            raise


class Grpc:
    """A tritonclient gRPC client per thread, and raw channels for hand-made bytes."""

    def __init__(self, url: str):
        self.url = url
        self.local = threading.local()

    def client(self):
        import tritonclient.grpc as grpcclient

        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = grpcclient.InferenceServerClient(self.url)
        return c

    def stream(self, model: str, inputs: list, timeout: float = REQUEST_TIMEOUT_S, request_id: str = "r",
               parameters: dict | None = None) -> tuple[str, list]:
        """One request on a fresh stream: ('ok', token/text pieces) / ('error', msg) / ('timeout', ...)."""
        c = self.client()
        got: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        pieces = []
        try:
            c.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True,
                                 parameters=parameters)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    result, error = got.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    return "timeout", pieces
                if error is not None:
                    return "error", [str(error)]
                response = result.get_response()
                if response.outputs:
                    pieces.append(result)
                if response.parameters["triton_final_response"].bool_param:
                    return "ok", pieces
        except Exception as err:
            return "error", [str(err)]
        finally:
            try:
                c.stop_stream()
            except Exception:
                self.local.client = None

    def unary(self, model: str, inputs: list, timeout: float = REQUEST_TIMEOUT_S) -> tuple[str, object]:
        from tritonclient.utils import InferenceServerException

        try:
            return "ok", self.client().infer(model, inputs, client_timeout=timeout)
        except InferenceServerException as err:
            if "Deadline" in str(err) or "DEADLINE" in str(err.status() or ""):
                return "timeout", str(err)
            return "error", str(err)

    def raw(self, method: str, payload: bytes, stream: bool = False, timeout: float = REQUEST_TIMEOUT_S) -> str:
        import grpc

        ch = getattr(self.local, "channel", None)
        if ch is None:
            ch = self.local.channel = grpc.insecure_channel(self.url)
        path = f"/inference.GRPCInferenceService/{method}"
        try:
            if stream:
                call = ch.stream_stream(path)(iter([payload]), timeout=timeout)
                for _ in call:
                    pass
            else:
                ch.unary_unary(path)(payload, timeout=timeout)
            return "ok"
        except grpc.RpcError as err:
            return "timeout" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "error"


def arr_input(name: str, value, dtype: str, shape=None):
    import tritonclient.grpc as grpcclient

    if shape is None:
        return tensor(name, value, dtype)
    t = grpcclient.InferInput(name, list(shape), dtype)
    if value is not None:
        t.set_data_from_numpy(value)
    return t
