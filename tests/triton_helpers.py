"""Helpers for tests that talk to a real tritonserver: a tiny tokenizer that fits
the random test Llama, a deployment of it, and a trivial decoupled Python model. The
gRPC request helpers (tensors, text and token requests, streaming with the
end-of-request rule of the 1.2 contract) are toolchain.triton.grpc_client's."""

from __future__ import annotations

import textwrap
from pathlib import Path

# The gRPC request helpers live in the package (the benchmarks use them too); re-exported for the tests.
from toolchain.triton.grpc_client import Streamed, stream, tensor, text_request, token_request  # noqa: F401

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


def make_char_tokenizer(out: Path, vocab_size: int = 250) -> Path:
    """A character tokenizer saved as PreTrainedTokenizerFast: ids 0..2 are <unk>, <s>, </s>, then one token per
    printable ASCII character, then fillers up to `vocab_size`. Any ASCII text is spellable, so a grammar's mask
    (guided decoding) always leaves the random test model a way to write JSON, regexes' matches and the like."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in string.printable[:95]:
        vocab.setdefault(ch, len(vocab))
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # characters join with nothing between them
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
