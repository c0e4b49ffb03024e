"""The TensorRT-LLM line this toolchain targets and the Triton image that serves it.

Engines only load in the TensorRT-LLM version that built them (Triton §8 #4);
the release notes pair TensorRT-LLM 1.2 with Triton container 25.12
(trtllm-checkpoint-and-build.md §0).
"""

from __future__ import annotations

import re

TRTLLM_LINE = "1.2"
TRITON_CONTAINER = "25.12"
TRITON_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_CONTAINER}-trtllm-python-py3"


def in_line(version: str | None, line: str = TRTLLM_LINE) -> bool:
    """True for 1.2, 1.2.0, 1.2.1, 1.2.0rc3, ... of `line`."""
    return bool(version) and re.match(rf"^{re.escape(line)}(\.|rc|$)", str(version).strip()) is not None
