"""Planning from config.json alone, for `toolchain convert --dry-run` on a
directory that holds no weights yet (a 70B deployment planned on a laptop
before the download).

The family table states every HF tensor's shape in config symbols, so the
headers a complete checkpoint would have can be synthesised; the planner then
runs exactly as it does on real headers (meta tensors, no data).
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolchain.archs import load_params
from toolchain.archs.common import NameTable, expected_shape
from toolchain.checkpoint.hf_reader import HFCheckpoint, TensorInfo

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConfigOnlyCheckpoint(HFCheckpoint):
    """An HF checkpoint directory with config.json only: the tensor index is
    what the family table expects, in the dtype config.json names. Reading
    data is a programming error (only planning may use it)."""

    def __init__(self, directory: Path | str):
        super().__init__(directory)
        family, params = load_params(self.config, str(self.config_path))
        dtype = TORCH_DTYPES[params.dtype or "float32"]
        tensors: dict[str, TensorInfo] = {}
        for name, match in NameTable(family, params).expected():
            row = match.row
            if row.tied_from and params.tie_word_embeddings:
                continue  # a tied HF checkpoint stores no lm_head; the planner derives it
            # Pre-transform shapes cannot be inferred from the table's post-transform ones.
            shape = expected_shape(row, params) if row.transform is None else None
            if shape is None:  # a transformed row, or one without a shape
                raise ValueError(f"{family.name}: row {row.hf} cannot be planned from config.json alone")
            stored = torch.uint8 if row.dtype == "uint8" else dtype  # bytes as stored (MXFP4 blocks and scales)
            tensors[name] = TensorInfo(name, self.config_path, shape, stored)
        self._tensors = tensors
        self._files = []
        self._weight_map = None

    def load(self, name: str) -> torch.Tensor:
        raise RuntimeError(f"{self.directory} holds no weights; {name} cannot be read (planning only)")
