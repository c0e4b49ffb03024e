"""Streaming per-rank safetensors writer.

The plan fixes every rank file's tensors, shapes and dtypes before any weight
is read, so each file's header (with all data offsets) is written first and
the data is then filled in group by group. Each HF tensor is read once and its
slices go to every rank in the same pass; memory holds one group (a layer's
q/k/v at most), never a whole rank, let alone all ranks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from toolchain.checkpoint.hf_reader import ST_DTYPES, HFCheckpoint
from toolchain.checkpoint.layout import TORCH_DTYPES, Plan, PlannedTensor, prepare, shard_group

ST_CODES = {dtype: code for code, dtype in ST_DTYPES.items()}


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


class RankFileWriter:
    """One rank file written in plan order; out-of-plan, duplicate or mis-shaped
    tensors raise (converter bugs), and `close` checks nothing is left out."""

    def __init__(self, path: Path, planned: list[PlannedTensor]):
        self.path = Path(path)
        self._planned = {t.name: t for t in planned}
        if len(self._planned) != len(planned):
            raise ValueError(f"{path.name}: duplicate tensor names in the plan")
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._offsets: dict[str, int] = {}
        for t in planned:
            header[t.name] = {"dtype": ST_CODES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            self._offsets[t.name] = offset
            offset += t.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors aligns the data start to 8 bytes
        self._data_start = 8 + len(blob)
        self._written: set[str] = set()
        self._fh = open(self.path, "wb")
        self._fh.write(struct.pack("<Q", len(blob)))
        self._fh.write(blob)
        self._fh.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        planned = self._planned.get(name)
        if planned is None or name in self._written:
            raise ValueError(f"{self.path.name}: {name} is {'written twice' if planned else 'not in the plan'}")
        if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
            raise ValueError(f"{self.path.name}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {planned.shape} {planned.dtype}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._fh.seek(self._data_start + self._offsets[name])
        self._fh.write(data.data)  # the array's buffer as a memoryview: no copy
        self._written.add(name)

    def close(self) -> None:
        self._fh.close()
        left = sorted(set(self._planned) - self._written)
        if left:
            raise ValueError(f"{self.path.name}: {len(left)} planned tensors never written, e.g. {left[0]}")

    def abort(self) -> None:
        self._fh.close()


def write_plan(plan: Plan, ckpt: HFCheckpoint, out_dir: Path) -> dict[str, int]:
    """Write every rank file of `plan` into `out_dir`; returns file name -> bytes."""
    dtype = TORCH_DTYPES[plan.options.dtype]
    writers = [RankFileWriter(Path(out_dir) / rank_file(r), tensors) for r, tensors in enumerate(plan.ranks)]
    try:
        quant = plan.quant
        for group in plan.groups:
            if quant is not None and quant.handles(group):
                for rank, items in quant.write_group(group, ckpt).items():
                    for name, piece in items:
                        writers[rank].write(name, piece)
                continue
            # The first output's row is the row the sources matched (a tied
            # lm_head is an extra output of the embedding's group).
            row = group.outputs[0].row
            tensors = {s: prepare(ckpt.load(s), row, dtype, s) for s in group.sources}
            for rank, items in shard_group(group, tensors, plan.params, plan.options).items():
                for name, piece in items:
                    writers[rank].write(name, piece)
            del tensors
        if quant is not None:
            for rank, w in enumerate(writers):
                stage = rank // plan.options.tp
                for local, (name, _, _) in enumerate(quant.kv_planned(stage)):
                    w.write(name, quant.kv_scale(stage, local, ckpt))
        if plan.medusa is not None:
            from toolchain.checkpoint.medusa import write_heads

            write_heads(plan.medusa, writers, plan.options.dtype, plan.options.tp)
        if plan.eagle is not None:
            from toolchain.checkpoint.eagle import write_draft

            draft, shape = plan.eagle
            write_draft(draft, shape, ckpt, writers, plan.options)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return {w.path.name: w.path.stat().st_size for w in writers}
