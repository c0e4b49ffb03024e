"""Everything specific to TensorRT-LLM 1.2's `trtllm-build`.

Only the command line is produced here; it runs on a GPU host. Flag names and
defaults follow trtllm-checkpoint-and-build.md §5 (1.x line). The full flag
table, version check and per-rank logs belong to the planning issue.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.spec import DeploymentSpec

SUPPORTED_LINE = "1.2"


def build_command(spec: DeploymentSpec, checkpoint_dir: Path, output_dir: Path, binary: str = "trtllm-build") -> list[str]:
    """The `trtllm-build` invocation for this spec (§5.2, §5.3, §5.7)."""
    lim = spec.limits
    return [
        binary,
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--gemm_plugin", "auto",
        "--max_batch_size", str(lim.max_batch_size),
        "--max_input_len", str(lim.max_input_len),
        "--max_seq_len", str(lim.max_seq_len),
        "--max_num_tokens", str(lim.max_num_tokens),
        # Paged context FMHA is what KV-cache reuse and chunked context need (§5.3).
        "--use_paged_context_fmha", "enable",
        "--workers", str(spec.parallelism.world_size),
    ]


def require_trtllm_build(cmd: list[str]) -> str:
    binary = shutil.which(cmd[0])
    if binary is None:
        raise ToolchainError(
            "trtllm-build not found on PATH; this host cannot build TensorRT engines",
            f"on a GPU host with TensorRT-LLM {SUPPORTED_LINE}.x run: {shlex.join(cmd)}",
        )
    return binary
