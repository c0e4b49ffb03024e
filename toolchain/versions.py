"""The TensorRT-LLM release this toolchain targets and the Triton image that serves it.

Engines deserialize only in the TensorRT-LLM (and TensorRT) that built them, so
the image is read from upstream's own table: each tensorrtllm_backend `rYY.MM`
branch's dockerfile/Dockerfile.triton.trt_llm_backend pins the TensorRT-LLM its
`YY.MM-trtllm-python-py3` container builds (facts/containers.json). The first
release shipping TRTLLM_VERSION is the pin.
"""

from __future__ import annotations

import re

from toolchain import upstream

TRTLLM_VERSION = "1.2.1"
TRTLLM_LINE = ".".join(TRTLLM_VERSION.split(".")[:2])


def _releases() -> dict[str, dict]:
    return upstream.facts("containers")["releases"]


def container_for(version: str) -> str:
    """The first Triton release whose trtllm container ships TensorRT-LLM `version`."""
    shipping = sorted(tag for tag, rel in _releases().items() if rel["tensorrt_llm"] == version)
    if not shipping:
        raise LookupError(f"no Triton trtllm container ships TensorRT-LLM {version} (facts/containers.json)")
    return shipping[0]


TRITON_CONTAINER = container_for(TRTLLM_VERSION)
TRITON_IMAGE = _releases()[TRITON_CONTAINER]["image"]
TENSORRT_VERSION = _releases()[TRITON_CONTAINER]["tensorrt"]


def in_line(version: str | None, line: str = TRTLLM_LINE) -> bool:
    """True for 1.2, 1.2.0, 1.2.1, 1.2.0rc3, ... of `line`."""
    return bool(version) and re.match(rf"^{re.escape(line)}(\.|rc|$)", str(version).strip()) is not None


def tensorrt_of(version: str | None) -> str | None:
    """The TensorRT that a Triton container shipping TensorRT-LLM `version` carries, if one does."""
    found = {rel["tensorrt"] for rel in _releases().values() if rel["tensorrt_llm"] == str(version or "").strip()}
    return found.pop() if len(found) == 1 else None

