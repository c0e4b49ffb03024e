"""Which TensorRT-LLM flow a spec runs, as the performance model, its data and the calibrated rows name it.

"engine": a trtllm-build engine served by the tensorrtllm backend (target `trtllm`); "pytorch": the LLM API's
PyTorch backend (target `llmapi`, and Dynamo's TensorRT-LLM worker, which runs the LLM API); "cpu": this host's
CPU engine behind either path, predicted from the host profile instead. Read off the target's row (its path and
device), never its name.
"""

from __future__ import annotations

from toolchain.targets import CPU, ENGINE, GPU, LLMAPI, Target, target_of
from toolchain.versions import TRTLLM_VERSION

PATHS = ("engine", "pytorch", "cpu")
PATH_OF_ROW = {(ENGINE, GPU): "engine", (LLMAPI, GPU): "pytorch", (ENGINE, CPU): "cpu", (LLMAPI, CPU): "cpu"}
"""(Target.path, Target.device) -> the performance model's path."""

__all__ = ["PATHS", "TRTLLM_VERSION", "path_of", "path_of_row"]


def path_of_row(row: Target) -> str:
    return PATH_OF_ROW[(row.path, row.device)]


def path_of(spec) -> str:
    return path_of_row(target_of(spec))
