"""Lazy reader for a Hugging Face checkpoint directory.

Only safetensors headers are read up front: they give every tensor's name,
shape and dtype, so the converter can check names and plan every rank before
reading a weight. Data is read one tensor at a time on request.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from toolchain.errors import ToolchainError

from toolchain.weights_source import INDEX  # noqa: F401  (re-exported: the readers name it from here)

# The safetensors format's own bound on the JSON header (MAX_HEADER_SIZE in the safetensors crate,
# src/tensor.rs): checked before the header is read, so a file claiming a huge header costs no memory.
MAX_HEADER_SIZE = 100_000_000

# Weight files that are pickles (torch.save / PyTorch Lightning): unpickling runs whatever code the file
# names, so they are never loaded; a directory holding only these is refused, naming a converter.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
CONVERT_HINT = ("convert it where you trust it: transformers' model.save_pretrained(DIR, safe_serialization=True), "
                "or safetensors.torch.save_file(state_dict, 'model.safetensors')")


def pickled_weights(directory: Path) -> list[str]:
    """Names of pickle-format weight files in `directory` (sorted), for the refusal message."""
    return sorted({p.name for pattern in PICKLE_PATTERNS for p in Path(directory).glob(pattern) if p.is_file()})


def refuse_pickles(directory: Path, where: str, what: str = "*.safetensors weights") -> None:
    """Raise the one-line refusal when `directory` holds pickled weights instead of `what`."""
    pickled = pickled_weights(directory)
    if pickled:
        raise ToolchainError(f"{where} has no {what}, only {pickled[0]}, a pickle that could run code when loaded; "
                             "weights are read from safetensors only", CONVERT_HINT)


def header_length(path: Path, fh, size: int) -> int:
    """The header length of the safetensors file open as `fh`, refused (ValueError) when it exceeds
    the format's limit or the file: checked before any of the header is read."""
    raw = fh.read(8)
    if len(raw) < 8:
        raise ValueError("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_SIZE:
        raise ValueError(f"header length {n} exceeds the safetensors limit of {MAX_HEADER_SIZE} bytes")
    if n > size - 8:
        raise ValueError(f"header length {n} exceeds the file size {size}")
    return n


def check_header(path: Path, hint: str = "re-download or re-save the file") -> None:
    """Refuse a safetensors file whose header length lies (over the limit or past the end of the file),
    reading 8 bytes: for files handed to safe_open, so the error names the file in one line."""
    try:
        with open(path, "rb") as fh:
            header_length(path, fh, os.fstat(fh.fileno()).st_size)
    except ValueError as err:
        raise ToolchainError(f"cannot read {path}: corrupt safetensors header: {err}", hint) from None

# safetensors dtype codes -> torch dtypes (the ones a HF LLM checkpoint carries).
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    """Byte offset of the data in the file (header included)."""


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check the file holds all the data it
    announces (a truncated download fails here, naming the file)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            n = header_length(path, fh, size)
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        tensors: dict[str, TensorInfo] = {}
        data_end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            # Offsets index into the data after the header: a negative or non-integer one would point
            # back into the header (or anywhere), so only whole offsets in order are taken.
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
                raise ValueError(f"tensor {name} has bad data_offsets {info['data_offsets']!r}")
            dtype = ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name} has unsupported dtype {info['dtype']}")
            shape = tuple(int(d) for d in info["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"tensor {name} has a negative dimension in {list(shape)}")
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name} spans {end - begin} bytes, its shape needs {numel * dtype.itemsize}")
            data_end = max(data_end, end)
            tensors[name] = TensorInfo(name, path, shape, dtype, 8 + n + begin)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as err:
        # RecursionError: a header of deeply nested JSON; still a corrupt file, named in one line.
        raise ToolchainError(f"corrupt safetensors file {path}: {err}",
                             "re-download or re-save the checkpoint") from None
    if 8 + n + data_end > size:
        raise ToolchainError(
            f"truncated safetensors file {path}: {size} bytes, header announces {8 + n + data_end}",
            "re-download or re-save the checkpoint",
        )
    return tensors


def read_json_object(path: Path, where: str, missing_hint: str) -> dict:
    """A side directory's config.json (heads, drafts) as a dict, or one clear error."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ToolchainError(f"{where} has no {Path(path).name}", missing_hint) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ToolchainError(f"{where}/{Path(path).name} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ToolchainError(f"{where}/{Path(path).name} must hold a JSON object")
    return data


class HFCheckpoint:
    """config.json plus a name -> TensorInfo index over the safetensors shards."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ToolchainError(f"HF checkpoint directory not found: {self.directory}",
                                 "set model.checkpoint in the spec to a directory with config.json and *.safetensors")
        self.config_path = self.directory / "config.json"
        if not self.config_path.is_file():
            raise ToolchainError(f"no config.json in {self.directory}",
                                 "point model.checkpoint at a Hugging Face model directory")
        try:
            self.config = json.loads(self.config_path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise ToolchainError(f"malformed {self.config_path}: {err}") from None
        if not isinstance(self.config, dict):
            raise ToolchainError(f"{self.config_path} must hold a JSON object")
        self._handles: dict[Path, int] = {}  # open file descriptors
        self._files: list[Path] | None = None
        self._tensors: dict[str, TensorInfo] | None = None
        self._weight_map: dict[str, str] | None = None  # the index's name -> shard file, when there is one

    @property
    def files(self) -> list[Path]:
        """The safetensors shards (found on first use, so config checks come first)."""
        if self._files is None:
            self._files = self._shard_files()
        return self._files

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """name -> TensorInfo from every shard header (read on first use; no weight data)."""
        if self._tensors is None:
            tensors: dict[str, TensorInfo] = {}
            for path in self.files:
                for name, info in read_header(path).items():
                    if name in tensors:
                        raise ToolchainError(f"tensor {name} appears in both {tensors[name].file.name} and {path.name}",
                                             f"remove stray safetensors files from {self.directory}")
                    tensors[name] = info
            self._tensors = tensors
            self._check_index(tensors)
        return self._tensors

    def _shard_files(self) -> list[Path]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._weight_map = dict(weight_map)
            except (ValueError, KeyError, TypeError) as err:
                raise ToolchainError(f"malformed {index}: {err}") from None
            # Shards are plain file names beside the index: one naming a path ("../x", "/abs") would
            # read a file outside the checkpoint directory.
            odd = [n for n in self._weight_map.values()
                   if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
            if odd:
                raise ToolchainError(f"{index} names shard {odd[0]!r}, not a file name in {self.directory}",
                                     "the index must list the shard files beside it")
            names = sorted(set(self._weight_map.values()))
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise ToolchainError(f"{INDEX} names missing shard file(s): {', '.join(missing)}",
                                     f"download them into {self.directory}")
            return [self.directory / n for n in names]
        self._weight_map = None
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            refuse_pickles(self.directory, str(self.directory))
            raise ToolchainError(f"no *.safetensors weights in {self.directory}",
                                 "add the model.safetensors weights to the directory, or convert from where they are "
                                 "(`toolchain convert SPEC --set model.checkpoint=DIR`): later stages use what convert read")
        return files

    def _check_index(self, tensors: dict[str, TensorInfo]) -> None:
        if self._weight_map is None:
            return
        for name, fname in self._weight_map.items():
            info = tensors.get(name)
            if info is None or info.file.name != fname:
                raise ToolchainError(f"{INDEX} puts {name} in {fname} but that file does not hold it",
                                     "the index and the shards come from different downloads")

    @property
    def input_files(self) -> list[Path]:
        """Every file the conversion depends on (for manifests)."""
        files = self.files
        extra = [self.directory / INDEX] if self._weight_map is not None else []
        return [self.config_path, *extra, *files]

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def meta(self, name: str) -> torch.Tensor:
        """A data-less tensor with the right shape and dtype (for planning)."""
        info = self.tensors[name]
        return torch.empty(info.shape, dtype=info.dtype, device="meta")

    def load(self, name: str) -> torch.Tensor:
        """Read one tensor into its own memory with plain reads, not a memory map:
        pages of a mapped file count in the process's RSS until unmapped, so a
        converter reading a 2 GB checkpoint through mmap peaks at 2 GB whatever
        it frees (measured by benchmarks/convert_memory.py)."""
        return self.read(self.tensors[name])

    def read(self, info: TensorInfo) -> torch.Tensor:
        """Read the tensor `info` describes (also one hidden from `tensors`, e.g. an
        AutoAWQ qweight behind the virtual weight the planner sees)."""
        name = info.name
        numel = 1
        for d in info.shape:
            numel *= d
        size = numel * info.dtype.itemsize
        buf = bytearray(size)
        try:
            fd = self._handles.get(info.file)
            if fd is None:
                fd = self._handles[info.file] = os.open(info.file, os.O_RDONLY)
            view, got = memoryview(buf), 0
            while got < size:
                n = os.preadv(fd, [view[got:]], info.offset + got)
                if n <= 0:
                    raise OSError(f"unexpected end of file after {got} of {size} bytes")
                got += n
        except OSError as err:
            raise ToolchainError(f"cannot read {name} from {info.file}: {err}",
                                 "re-download or re-save the checkpoint") from None
        if size == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(buf, dtype=info.dtype).reshape(info.shape)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def close(self) -> None:
        for fd in self._handles.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
