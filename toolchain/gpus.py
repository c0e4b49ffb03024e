"""The GPUs the planner knows, and the device a spec plans against.

Memory is what `nvidia-smi` reports as total for the card (a little below the
marketing figure: an "80GB" H100 shows 81559 MiB), because that is what the
CUDA context, the engine and the KV cache share. SM versions decide which
precisions TensorRT-LLM 1.2 can build (tensorrt_llm/builder.py; the support matrix in
docs/source/legacy/reference/precision.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toolchain.errors import ToolchainError
from toolchain.host import GIB, host_memory_bytes
from toolchain.targets import CPU, target_of



@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    sm: int | None
    """Compute capability as major*10+minor; None for the host (target cpu)."""
    kind: str = "gpu"  # "gpu" or "host"

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def arch(self) -> str:
        if self.sm is None:
            return "cpu"
        for low, name in ((100, "Blackwell"), (90, "Hopper"), (89, "Ada"), (80, "Ampere"), (75, "Turing")):
            if self.sm >= low:
                return name
        return "pre-Turing"


GPUS: tuple[Gpu, ...] = (
    Gpu("H100 80GB", 81559 / 1024, 90),
    Gpu("H200 141GB", 143771 / 1024, 90),
    Gpu("A100 80GB", 81920 / 1024, 80),
    Gpu("A100 40GB", 40960 / 1024, 80),
    Gpu("L40S", 46068 / 1024, 89),
    Gpu("L4", 23034 / 1024, 89),
    Gpu("RTX 4090", 24564 / 1024, 89),
    Gpu("RTX 3090", 24576 / 1024, 86),
)
# Short spellings people write; "A100" alone means the 80GB card.
ALIASES = {"H100": "H100 80GB", "H200": "H200 141GB", "A100": "A100 80GB", "4090": "RTX 4090", "3090": "RTX 3090"}


def _key(name: str) -> str:
    # "h100", "H100-80GB" and "h100 80 gb" name the same card.
    return re.sub(r"[^a-z0-9]", "", name.lower())


def lookup(name: str) -> Gpu:
    """The table entry for a GPU name (case, spaces and dashes ignored)."""
    table = {_key(g.name): g for g in GPUS}
    table.update({_key(alias): table[_key(full)] for alias, full in ALIASES.items()})
    gpu = table.get(_key(name))
    if gpu is None:
        raise ToolchainError(f"unknown gpu.name '{name}'",
                             f"use one of {', '.join(g.name for g in GPUS)}, or set gpu.memory_gib and gpu.sm")
    return gpu


def resolve(spec) -> Gpu | None:
    """The device `spec` plans against: the named/described GPU; for the CPU targets
    without one, this host's RAM; None when a trtllm spec names no GPU."""
    g = spec.gpu
    if g.name:
        base = lookup(g.name)
        return Gpu(base.name, g.memory_gib or base.memory_gib, g.sm or base.sm)
    if g.memory_gib:
        return Gpu(f"{g.memory_gib:g} GiB GPU", g.memory_gib, g.sm)
    if target_of(spec).device == CPU:
        return Gpu("host RAM", host_memory_bytes() / GIB, None, kind="host")
    return None
