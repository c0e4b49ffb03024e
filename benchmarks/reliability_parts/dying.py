"""Part (e) of benchmarks/reliability.py: a dying model instance.

The tensorrt_llm stub killed with requests in flight, under `toolchain serve` (the path users run: it must
end every request, print one line naming the instance, exit non-zero and leave nothing behind) and, for
information, under a bare TritonServer object with nothing watching it; and killed while the server
loads the repository, where start must fail in bounded time.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from reliability_parts.common import LOG_DEATH, SPEC, Grpc, http_get, models_ready, proc_status, stub_pids
from toolchain.triton.grpc_client import token_request
from toolchain.triton.server import TritonServer, python_stubs


def _close(client) -> None:
    try:
        client.stop_stream(cancel_requests=True)
        client.close()
    except Exception:
        pass


class Inflight:
    """`n` streaming tensorrt_llm requests of 400 tokens on one gRPC stream, each seen streaming before
    `started()` returns; `poll()` records which ended (final response or error) and when, from `t0`."""

    def __init__(self, grpc_url: str, n: int):
        import tritonclient.grpc as grpcclient

        self.n = n
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))
        self.ended: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.started: set = set()
        self.t0 = time.monotonic()
        for i in range(n):
            self.client.async_stream_infer("tensorrt_llm", token_request([5 + i, 6, 7], 400, end_id=([-1], "INT32")),
                                           request_id=f"k{i}", enable_empty_final_response=True)

    def wait_started(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while len(self.started) < self.n and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                result, error = self.got.get(timeout=1)
                if result is not None:
                    self.started.add(result.get_response().id)
        return len(self.started)

    def poll(self, wait: float = 0.05) -> None:
        with contextlib.suppress(queue.Empty):
            result, error = self.got.get(timeout=wait)
            if error is not None:
                # an error without a request id ends the stream for every request on it
                rid = getattr(error, "request_id", None) or ""
                msg = str(error)
                targets = [rid] if rid else [f"k{i}" for i in range(self.n)]
                for r in targets:
                    self.ended.setdefault(r, time.monotonic() - self.t0)
                    self.errors.setdefault(r, msg[:200])
            elif result.get_response().parameters["triton_final_response"].bool_param:
                self.ended.setdefault(result.get_response().id, time.monotonic() - self.t0)

    @property
    def all_ended(self) -> bool:
        return len(self.ended) >= self.n

    def close(self, timeout: float = 10.0) -> bool:
        """True if closing hung. tritonclient's stop_stream waits for the server to end the stream, which
        it never does while a request on it is unanswered: closed from a daemon thread, with cancellation."""
        closer = threading.Thread(target=_close, args=(self.client,), daemon=True)
        closer.start()
        closer.join(timeout)
        return closer.is_alive()

    def report(self) -> dict:
        return {"inflight_requests": self.n, "streaming_before_kill": len(self.started),
                "requests_ended": len(self.ended), "hung_requests": self.n - len(self.ended),
                "requests_ended_s": {k: round(v, 3) for k, v in sorted(self.ended.items())},
                "all_ended_s": round(max(self.ended.values()), 3) if self.all_ended else None,
                "errors": sorted(set(self.errors.values()))[:3]}


def part_e(server, n_inflight: int = 6) -> dict:
    """The stub killed under a bare TritonServer object (no `toolchain serve` watching it)."""
    inflight = Inflight(server.grpc_url, n_inflight)
    inflight.wait_started()
    pid = stub_pids(server.process.pid)["tensorrt_llm"]
    inflight.t0 = t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    detect = {"server_not_ready": None, "model_not_ready": None, "toolchain_ready_false": None}
    bound = 30.0
    while time.monotonic() - t_kill < bound and (not inflight.all_ended or None in detect.values()):
        inflight.poll()
        now = time.monotonic() - t_kill
        if detect["server_not_ready"] is None and http_get(f"{server.http_url}/v2/health/ready", 0.5) != 200:
            detect["server_not_ready"] = round(now, 3)
        if detect["model_not_ready"] is None and \
                http_get(f"{server.http_url}/v2/models/tensorrt_llm/ready", 0.5) != 200:
            detect["model_not_ready"] = round(now, 3)
        if detect["toolchain_ready_false"] is None and not server.ready:  # TritonServer.ready: also dead stubs
            detect["toolchain_ready_false"] = round(now, 3)
    stream_close_hung = inflight.close()
    new_pid = stub_pids(server.process.pid).get("tensorrt_llm") if server.process.poll() is None else None
    # does a new request after the death get an answer (an error or tokens) in bounded time?
    after = Grpc(server.grpc_url).stream("tensorrt_llm", token_request([5, 6, 7], 3, end_id=([-1], "INT32")),
                                         timeout=30)[0] if server.process.poll() is None else "server gone"
    times = [t for t in detect.values() if t is not None]
    log_hits = [line[:200] for line in server.log_text().splitlines() if LOG_DEATH.search(line)]
    return {
        **inflight.report(),
        "bound_s": bound,
        "time_to_detect_s": min(times) if times else None,
        "detected_by": detect,
        "client_stream_close_hung": stream_close_hung,
        "server_ready_after": http_get(f"{server.http_url}/v2/health/ready") == 200,
        "model_ready_after": http_get(f"{server.http_url}/v2/models/tensorrt_llm/ready") == 200,
        "dead_stubs": server.dead_stubs(),
        "stub_restarted": new_pid is not None and new_pid != pid,
        "request_after_death": after,
        "server_alive": server.process.poll() is None,
        "log_lines": log_hits[:4],
    }


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and proc_status(int(entry.name)).get("PPid") == str(pid):
            out.append(int(entry.name))
    return out


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def _running(pid: int, argv0_suffix: bytes) -> bool:
    """`pid` is still that process (its argv[0] ends with the suffix) and not a zombie."""
    return proc_status(pid).get("State", "Z").split()[0] not in ("Z", "X") and _argv0(pid).endswith(argv0_suffix)


def _shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _pump(stream, sink: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        sink.put(line.rstrip("\n"))
    sink.put(None)


class ServeRun:
    """`toolchain serve` as a subprocess in its own session, its stdout and stderr pumped into queues."""

    def __init__(self, ws_root: Path):
        exe = str(Path(sys.executable).parent / "toolchain")
        self.argv = [exe, "--root", str(ws_root), "serve", str(SPEC), "--set", "serving.http_port=0",
                     "--set", "serving.grpc_port=0", "--set", "serving.metrics_port=0"]
        self.shm_before = _shm_names()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self.out_q: queue.Queue = queue.Queue()
        self.err_q: queue.Queue = queue.Queue()
        self.pumps = [threading.Thread(target=_pump, args=(self.proc.stdout, self.out_q), daemon=True),
                      threading.Thread(target=_pump, args=(self.proc.stderr, self.err_q), daemon=True)]
        for th in self.pumps:
            th.start()
        self.stdout: list[str] = []
        self.urls: dict[str, str] = {}
        self.stubs: dict[str, int] = {}
        self.triton: int | None = None
        self.t_start = time.monotonic()

    def wait_up(self, start_timeout_s: float) -> None:
        """Read stdout until serve prints that it is up (noting the URLs it prints), then find its tritonserver."""
        proc, stdout = self.proc, self.stdout
        deadline = self.t_start + start_timeout_s
        while time.monotonic() < deadline and "Ctrl-C to stop" not in stdout:
            try:
                line = self.out_q.get(timeout=0.5)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            if line is None:
                break
            stdout.append(line)
            m = re.match(r"\s+(HTTP|gRPC|metrics)\s+(\S+)$", line)
            if m:
                self.urls[m.group(1)] = m.group(2)
        until = time.monotonic() + 5
        while self.triton is None and time.monotonic() < until and proc.poll() is None:
            self.triton = next((c for c in _children(proc.pid) if _argv0(c).endswith(b"/tritonserver")), None)
            time.sleep(0.05 if self.triton is None else 0)

    @property
    def up(self) -> bool:
        return "Ctrl-C to stop" in self.stdout and self.triton is not None and "gRPC" in self.urls

    def stop(self, result: dict) -> None:
        """If serve did not end by itself: stop it (and what it started), but count it; then drain the pumps."""
        proc = self.proc
        if proc.poll() is None:
            result["serve_stopped_by_benchmark"] = True
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                for pid in [self.triton, *self.stubs.values(), proc.pid]:
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
        for th in self.pumps:
            th.join(5)
        self.stdout += [x for x in list(self.out_q.queue) if x is not None]

    def processes_left(self) -> list[str]:
        """The server and the stubs still running, given a moment to be reaped."""
        watched = {"tritonserver": (self.triton, b"/tritonserver"),
                   **{name: (pid, b"triton_python_backend_stub") for name, pid in self.stubs.items()}}
        deadline = time.monotonic() + 5
        while True:
            left = sorted(name for name, (pid, argv0) in watched.items() if pid and _running(pid, argv0))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def exit_report(self) -> dict:
        """How serve ended: its exit code, its last stderr line (one line naming the instance), what it left."""
        stderr = [x for x in list(self.err_q.queue) if x is not None]
        err_lines = [x for x in stderr if x.strip()]
        last = err_lines[-1] if err_lines else ""
        left = self.processes_left()
        prefix = f"tc{self.proc.pid}_"
        shm_new = sorted(_shm_names() - self.shm_before)
        return {
            "serve_exit_code": self.proc.returncode,
            "stderr_last_line": last[:400],
            "stderr_lines": len(err_lines),
            "one_line_naming_instance": bool(last.startswith("error: ") and "tensorrt_llm_0_0" in last
                                             and "died" in last and not any("Traceback" in x for x in stderr)),
            "stdout_tail": self.stdout[-2:],
            "processes_left": left,
            "shm_regions_left": [n for n in shm_new if n.startswith(prefix)],
            "shm_prefix": prefix,
        }


def kill_stub_under_serve(serve: ServeRun, inflight: Inflight, bound_s: float) -> dict:
    """SIGKILL the tensorrt_llm stub with `inflight` streaming; watch readiness and serve's exit for `bound_s`."""
    victim = serve.stubs["tensorrt_llm_0_0"]
    inflight.t0 = t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    detect = {"server_not_ready": None, "serve_exited": None}
    while time.monotonic() - t_kill < bound_s and (not inflight.all_ended or None in detect.values()):
        inflight.poll()
        now = round(time.monotonic() - t_kill, 3)
        if detect["server_not_ready"] is None and http_get(f"{serve.urls['HTTP']}/v2/health/ready", 0.5) != 200:
            detect["server_not_ready"] = now
        if detect["serve_exited"] is None and serve.proc.poll() is not None:
            detect["serve_exited"] = now
    times = [t for t in detect.values() if t is not None]
    return {**inflight.report(), "bound_s": bound_s, "time_to_detect_s": min(times) if times else None,
            "detected_by": detect, "client_stream_close_hung": inflight.close()}


def part_e_serve(ws_root: Path, n_inflight: int = 6, bound_s: float = 60.0, start_timeout_s: float = 240.0) -> dict:
    """The path users run: `toolchain serve build/tiny-llama.yaml` (a subprocess, on the workspace `deploy()`
    built) with `n_inflight` streams in flight over gRPC when the tensorrt_llm stub is SIGKILLed. serve must
    see the dead stub, stop tritonserver (which ends every request on it: the connection closes), print one
    line naming the instance and exit non-zero, leaving no tritonserver, stub or /dev/shm region behind."""
    serve = ServeRun(ws_root)
    result: dict = {"command": " ".join(serve.argv[1:])}
    serve.wait_up(start_timeout_s)
    inflight = None
    try:
        if not serve.up:
            raise RuntimeError(f"serve did not come up in {start_timeout_s:.0f} s (rc {serve.proc.poll()}): "
                               f"{serve.stdout[-3:]} {list(serve.err_q.queue)[-3:]}")
        result["serve_up_s"] = round(time.monotonic() - serve.t_start, 1)
        serve.stubs = python_stubs(serve.triton)  # instance -> pid, every model's
        inflight = Inflight(serve.urls["gRPC"], n_inflight)
        inflight.wait_started()
        result.update(kill_stub_under_serve(serve, inflight, bound_s))
    except Exception as err:
        result["failure"] = str(err)[:500]
        if inflight is not None:
            result.update(inflight.report())
            inflight.close()
        else:
            result["hung_requests"] = n_inflight
        serve.stubs = python_stubs(serve.triton) if serve.triton else {}
    finally:
        serve.stop(result)
    result.update(serve.exit_report())
    result.setdefault("serve_stopped_by_benchmark", False)
    return result


def part_e_load(spec, ws, tmp: Path) -> dict:
    """The tensorrt_llm stub killed while the server loads the repository: start must fail in bounded time."""

    server = TritonServer.from_spec(spec, ws.model_repo_dir(spec), log_path=tmp / "server-load-kill.log")
    result: dict = {}

    def starter():
        t = time.monotonic()
        try:
            server.start(timeout=90)
            result["outcome"] = "started"
        except Exception as err:
            result["outcome"] = f"start failed: {str(err)[:300]}"
        result["start_s"] = round(time.monotonic() - t, 2)

    th = threading.Thread(target=starter)
    th.start()
    killed = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and killed is None and th.is_alive():
        if server.process is not None:
            pid = stub_pids(server.process.pid).get("tensorrt_llm")
            if pid:
                time.sleep(0.3)  # inside initialize(): the engine is loading
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
        time.sleep(0.02)
    th.join(timeout=150)
    result["killed_stub"] = killed is not None
    result["start_hung"] = th.is_alive()
    if result.get("outcome") == "started":
        result["models_ready"] = models_ready(server)
    server.stop()
    return result
