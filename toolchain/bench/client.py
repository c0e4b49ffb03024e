"""Closed-loop gRPC streaming load against the ensemble / tensorrt_llm_bls text contract.

One gRPC stream per concurrency slot, each with at most one request in flight.
Triton's stream reports a failed request as an error message without its
request id, so a shared stream could not say which request failed; with one
request per stream the attribution is exact, and a timed-out request is
cancelled by restarting only its own stream. Responses are still matched by
request id, so a late response from a cancelled request is never mistaken for
the next one's.

The callback runs on the stream's receiver thread: it stamps the arrival with
`time.perf_counter_ns()` first and only stores the chunk; token counting
happens after the run so it cannot delay the next arrival stamp.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from toolchain.bench.records import RequestRecord, Response
from toolchain.errors import ToolchainError

TEXT_OUTPUT = "text_output"
EXACT_COUNT_OUTPUT = "output_ids"  # when a model streams token ids, their count is exact
_REQUIRED_INPUTS = ("text_input", "max_tokens")


@dataclass
class Contract:
    """What the served model accepts, from its metadata: optional inputs are sent only if declared."""

    model: str
    inputs: set[str]
    outputs: set[str]

    @property
    def exact_counts(self) -> bool:
        return EXACT_COUNT_OUTPUT in self.outputs


@dataclass
class RequestOptions:
    max_tokens: int
    ignore_eos: bool = True
    exclude_input_in_output: bool | None = True


def _short(err: Exception) -> str:
    msg = getattr(err, "message", None)
    text = msg() if callable(msg) else (msg or str(err))
    return " ".join(str(text).split())[:200]


def check_endpoint(url: str, model: str, timeout_s: float = 5.0) -> Contract:
    """Fail with one line if the server is unreachable or the model is missing, not ready or not streaming."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(url)
    except Exception as err:
        raise ToolchainError(f"bad Triton gRPC URL '{url}': {_short(err)}", "pass --url host:port") from None
    try:
        try:
            client.is_server_live(client_timeout=timeout_s)
        except InferenceServerException as err:
            raise ToolchainError(f"Triton server not reachable at {url} ({_short(err)})",
                                 "start it with `toolchain serve SPEC` or pass --url host:port") from None
        if not client.is_model_ready(model, client_timeout=timeout_s):
            index = client.get_model_repository_index(as_json=True, client_timeout=timeout_s).get("models", [])
            states = {m.get("name"): m for m in index}
            if model not in states:
                served = ", ".join(sorted(n for n in states if n)) or "nothing"
                raise ToolchainError(f"model '{model}' not found on the Triton server at {url} (it serves: {served})",
                                     "set validation.workload.endpoint to a served model or regenerate the model repository")
            entry = states[model]
            raise ToolchainError(
                f"model '{model}' is not ready on {url} (state {entry.get('state', '?')}: {entry.get('reason', '')})",
                "check the tritonserver log for why it failed to load")
        meta = client.get_model_metadata(model, as_json=True, client_timeout=timeout_s)
        config = client.get_model_config(model, as_json=True, client_timeout=timeout_s).get("config", {})
    except InferenceServerException as err:
        raise ToolchainError(f"Triton server at {url} failed a metadata call for '{model}': {_short(err)}") from None
    finally:
        client.close()
    contract = Contract(model, {i["name"] for i in meta.get("inputs", [])}, {o["name"] for o in meta.get("outputs", [])})
    missing = [n for n in (*_REQUIRED_INPUTS, "stream") if n not in contract.inputs]
    if missing or TEXT_OUTPUT not in contract.outputs:
        absent = ", ".join(missing + ([TEXT_OUTPUT] if TEXT_OUTPUT not in contract.outputs else []))
        raise ToolchainError(f"model '{model}' on {url} lacks {absent}: it is not the ensemble/BLS text contract",
                             "bench the `ensemble` or `tensorrt_llm_bls` model (validation.workload.endpoint)")
    if not config.get("model_transaction_policy", {}).get("decoupled", False):
        raise ToolchainError(f"model '{model}' on {url} is not decoupled, so it cannot stream tokens",
                             "deploy with serving.streaming: true")
    return contract


def make_inputs(prompt: str, opts: RequestOptions, contract: Contract) -> list:
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value, dtype: str, np_dtype):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    inputs = [
        tensor("text_input", prompt.encode("utf-8"), "BYTES", np.object_),
        tensor("max_tokens", opts.max_tokens, "INT32", np.int32),
        tensor("stream", True, "BOOL", np.bool_),
    ]
    if opts.ignore_eos and "end_id" in contract.inputs:
        # end_id -1 matches no token, so generation runs to max_tokens and OSL is exact.
        inputs.append(tensor("end_id", -1, "INT32", np.int32))
    if opts.exclude_input_in_output is not None and "exclude_input_in_output" in contract.inputs:
        inputs.append(tensor("exclude_input_in_output", opts.exclude_input_in_output, "BOOL", np.bool_))
    return inputs


def _text(arr) -> str:
    return "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in np.asarray(arr).ravel())


class _Slot:
    """One stream, one request in flight."""

    def __init__(self, url: str, contract: Contract):
        import tritonclient.grpc as grpcclient

        self.url, self.contract = url, contract
        self.client = grpcclient.InferenceServerClient(url)
        self.outputs = [grpcclient.InferRequestedOutput(TEXT_OUTPUT)]
        if contract.exact_counts:
            self.outputs.append(grpcclient.InferRequestedOutput(EXACT_COUNT_OUTPUT))
        self._lock = threading.Lock()
        self._current: RequestRecord | None = None
        self._done = threading.Event()
        self.stray = 0  # responses for a request no longer in flight (after a timeout)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        t = time.perf_counter_ns()
        with self._lock:
            rec = self._current
            if rec is None:
                self.stray += 1
                return
            if error is not None:
                rec.error = _short(error)
                self._done.set()
                return
            resp = result.get_response()
            if resp.id != rec.request_id:
                self.stray += 1
                return
            param = resp.parameters.get("triton_final_response")
            final = bool(param is not None and param.bool_param)
            names = {o.name for o in resp.outputs}
            if EXACT_COUNT_OUTPUT in names:
                rec.token_source = "server"
                rec.responses.append(Response(t, int(np.asarray(result.as_numpy(EXACT_COUNT_OUTPUT)).size)))
            elif TEXT_OUTPUT in names:
                rec.responses.append(Response(t, 0, _text(result.as_numpy(TEXT_OUTPUT))))
            elif not final:
                rec.responses.append(Response(t, 0, ""))
            if final:
                rec.t_final = t
                self._done.set()

    def run(self, rec: RequestRecord, prompt: str, opts: RequestOptions, timeout_s: float) -> None:
        inputs = make_inputs(prompt, opts, self.contract)
        with self._lock:
            self._current = rec
            self._done.clear()
        rec.t_send = time.perf_counter_ns()
        try:
            self.client.async_stream_infer(self.contract.model, inputs, outputs=self.outputs,
                                           request_id=rec.request_id, enable_empty_final_response=True)
        except Exception as err:  # the stream broke earlier; its error was for a previous request
            rec.error = f"send failed: {_short(err)}"
        finished = rec.error is not None or self._done.wait(timeout_s)
        with self._lock:
            self._current = None
            if not finished:
                rec.error = f"timed out after {timeout_s:g} s"
        if rec.error is not None:
            self._restart()

    def _restart(self) -> None:
        # Cancels whatever the old stream still had in flight; a fresh stream is valid again.
        try:
            self.client.stop_stream(cancel_requests=True)
        except Exception:
            pass
        try:
            self.client.start_stream(callback=self._on_response)
        except Exception:
            pass  # the next send fails and is recorded against its own request

    def server_live(self) -> bool:
        try:
            return bool(self.client.is_server_live(client_timeout=2.0))
        except Exception:
            return False

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()


@dataclass
class Job:
    record: RequestRecord
    prompt: str
    opts: RequestOptions


class ClosedLoop:
    """Keep `concurrency` requests outstanding until every job of a phase is done."""

    def __init__(self, url: str, contract: Contract, concurrency: int, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.slots = [_Slot(url, contract) for _ in range(concurrency)]
        self.aborted: str | None = None

    def run_phase(self, jobs: list[Job]) -> None:
        pending: queue.Queue[Job] = queue.Queue()
        for job in jobs:
            pending.put(job)

        def worker(slot: _Slot) -> None:
            while True:
                try:
                    job = pending.get_nowait()
                except queue.Empty:
                    return
                if self.aborted:
                    job.record.error = f"not sent: {self.aborted}"
                    continue
                job.record.t_sched = time.perf_counter_ns()
                slot.run(job.record, job.prompt, job.opts, self.timeout_s)
                if job.record.error is not None and not self.aborted and not slot.server_live():
                    self.aborted = f"Triton server at {self.url} stopped responding"

        threads = [threading.Thread(target=worker, args=(s,), daemon=True, name=f"bench-slot-{i}")
                   for i, s in enumerate(self.slots)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # a timed join keeps Ctrl-C responsive
                t.join(0.5)

    @property
    def stray_responses(self) -> int:
        return sum(s.stray for s in self.slots)

    def close(self) -> None:
        for slot in self.slots:
            try:
                slot.close()
            except Exception:
                pass

    def __enter__(self) -> "ClosedLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
