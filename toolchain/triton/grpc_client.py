"""Hand-made gRPC requests to a running tritonserver: tensors from Python values, the inputs of the
ensemble / BLS (text) and of `tensorrt_llm` (token ids), and one streamed request collected up to its
final response. The tests and the benchmarks (benchmarks/reliability.py, distributed.py) both speak to
servers this way, so it lives in the package that both import.

The end of a request is the 1.2 contract's: with tritonclient's `enable_empty_final_response` the last
response carries the `triton_final_response` parameter, possibly with no outputs.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import numpy as np


def tensor(name: str, value, dtype: str, batch: bool = True):
    """A gRPC input from a Python value: one batch row `[1, ...]`, or the value's
    own shape with batch=False (models with max_batch_size 0)."""
    import tritonclient.grpc as grpcclient

    numpy_types = {"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32,
                   "BOOL": np.bool_}
    if dtype == "BYTES":
        values = value if isinstance(value, (list, tuple)) else [value]
        arr = np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=object)
    else:
        arr = np.array(value, dtype=numpy_types[dtype])
        if batch:
            arr = arr.reshape(1, -1) if arr.ndim <= 1 else arr[None]
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def text_request(prompt: str, max_tokens: int, stream: bool = True, **extra) -> list:
    """Inputs for the ensemble / BLS: text_input, max_tokens, stream plus extras given as
    name=(value, dtype)."""
    inputs = [tensor("text_input", prompt, "BYTES"), tensor("max_tokens", [max_tokens], "INT32"),
              tensor("stream", [stream], "BOOL")]
    inputs += [tensor(name, value, dtype) for name, (value, dtype) in extra.items()]
    return inputs


def token_request(prompt_ids: list[int], max_tokens: int, stream: bool = True, **extra) -> list:
    """Inputs for `tensorrt_llm` directly."""
    inputs = [tensor("input_ids", prompt_ids, "INT32"), tensor("input_lengths", [len(prompt_ids)], "INT32"),
              tensor("request_output_len", [max_tokens], "INT32"), tensor("streaming", [stream], "BOOL")]
    inputs += [tensor(name, value, dtype) for name, (value, dtype) in extra.items()]
    return inputs


@dataclass
class Streamed:
    """The responses of one streamed request: those that carried outputs, the errors, the final flags seen."""

    responses: list = field(default_factory=list)  # InferResult objects that carried outputs
    errors: list = field(default_factory=list)
    finals: int = 0

    def outputs(self, name: str) -> list[np.ndarray]:
        return [r.as_numpy(name) for r in self.responses if r.as_numpy(name) is not None]

    def texts(self, name: str = "text_output") -> list[str]:
        return [b"".join(x if isinstance(x, bytes) else str(x).encode() for x in a.reshape(-1)).decode()
                for a in self.outputs(name)]

    def tokens(self, name: str = "output_ids") -> list[int]:
        return [int(t) for a in self.outputs(name) for t in a.reshape(-1)]


def stream(grpc_url: str, model: str, inputs: list, request_id: str = "1", timeout: float = 60.0,
           outputs: list[str] | None = None) -> Streamed:
    """Send one request over a gRPC stream and collect responses up to the final
    flag (empty final responses enabled, as robust 1.2 clients do)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    out = Streamed()
    try:
        requested = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        client.async_stream_infer(model, inputs, request_id=request_id, outputs=requested,
                                  enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout)
            if error is not None:
                out.errors.append(error)
                break  # an error ends the request (the server sends it with the final flag)
            response = result.get_response()
            if response.outputs:
                out.responses.append(result)
            if response.parameters["triton_final_response"].bool_param:
                out.finals += 1
                break
    finally:
        client.stop_stream()
        client.close()
    return out
