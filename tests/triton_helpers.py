"""Helpers for tests that talk to a real tritonserver: a tiny tokenizer that fits
the random test Llama, gRPC streaming with the end-of-request rule of the 1.2
contract, and a trivial decoupled Python model."""

from __future__ import annotations

import queue
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORDS_FROM = 3  # ids 0..2 are <unk>, <s>, </s>


def make_tiny_tokenizer(out: Path, vocab_size: int = 250) -> Path:
    """A whitespace WordLevel tokenizer saved as PreTrainedTokenizerFast: `w<i>` is
    token i, so any text made of such words round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(WORDS_FROM, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return Path(out)


def deploy(root: Path, hf_dir: Path, **sections):
    """Convert, build and render `hf_dir` with a spec of `sections` under `root`; returns
    (spec, workspace, an unstarted TritonServer on free ports)."""
    from conftest import write_spec
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import load_spec
    from toolchain.triton.repo import run_model_repo
    from toolchain.triton.server import TritonServer
    from toolchain.workspace import Workspace

    sections["serving"] = {"http_port": 0, "grpc_port": 0, "metrics_port": 0, **sections.get("serving", {})}
    spec = load_spec(write_spec(root / "spec.yaml", hf_dir, **sections))
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    run_model_repo(spec, ws)
    return spec, ws, TritonServer.from_spec(spec, ws.model_repo_dir(spec), log_path=root / "server.log")


def tensor(name: str, value, dtype: str, batch: bool = True):
    """A gRPC input from a Python value: one batch row `[1, ...]`, or the value's
    own shape with batch=False (models with max_batch_size 0)."""
    import tritonclient.grpc as grpcclient

    numpy_types = {"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
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


ECHO_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

ECHO_MODEL = textwrap.dedent("""\
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            {init}

        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                for v in values.reshape(-1):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
""")


def write_echo_model(repo: Path, name: str = "echo", fail_with: str | None = None) -> Path:
    """A decoupled Python model streaming each IN value back as one response;
    `fail_with` makes initialize() raise that message instead."""
    model_dir = Path(repo) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name))
    init = f"raise RuntimeError({fail_with!r})" if fail_with else "pass"
    (model_dir / "1" / "model.py").write_text(ECHO_MODEL.format(init=init))
    return model_dir


def readme_curls(port: int) -> list[tuple[str, dict]]:
    """The `curl` examples of README.md's fenced blocks that talk to localhost:`port`, as (path, JSON body):
    what a newcomer pastes first, so the tests send exactly these bodies to a live server."""
    import json
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(command, comments=True)
            if argv[:1] != ["curl"]:
                continue
            url = next(a for a in argv if a.startswith("localhost:"))
            if url.startswith(f"localhost:{port}/"):
                found.append((url.split("/", 1)[1], json.loads(argv[argv.index("-d") + 1])))
    return found
