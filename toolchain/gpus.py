"""The GPUs the planner knows, and the device a spec plans against.

Memory is what `nvidia-smi` reports as total for the card (a little below the
marketing figure: an "80GB" H100 shows 81559 MiB), because that is what the
CUDA context, the engine and the KV cache share. SM versions decide which
precisions TensorRT-LLM 1.2 can build (tensorrt_llm/builder.py; the support matrix in
docs/source/legacy/reference/precision.md).

The performance model (plan/perf/) reads each card's memory bandwidth, dense tensor-core peak per
precision and interconnect. They are the datasheet figures, quoted per row with the document they come
from: NVIDIA prints tensor throughput "with sparsity", so the dense peak here is half the printed number;
NVLink is printed as the total of both directions per GPU, so a link here holds one direction, the rate a
ring all-reduce moves data at.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from toolchain.errors import ToolchainError
from toolchain.host import GIB, host_memory_bytes
from toolchain.targets import target_of



PRECISIONS = ("fp16", "fp8", "int8", "fp4")
"""The tensor-core input types a peak is given for; fp16 stands for bf16 too (the same rate on every card here)."""


@dataclass(frozen=True)
class Link:
    """How one GPU reaches its peers for tensor- and pipeline-parallel traffic."""

    kind: str
    """"nvlink" (through NVSwitch or bridges) or "pcie"."""
    gb_s: float
    """GB/s (10^9 bytes) one way per GPU: half the datasheet's bidirectional total."""
    latency_us: float
    """Fixed cost of one small collective, in microseconds: an uncalibrated default (NCCL's and TensorRT-LLM's
    small-message all-reduce take a few microseconds over NVLink and tens over PCIe); calibration replaces it."""


# Per-direction bandwidths: NVLink 4 (H100/H200 SXM) 900 GB/s total, NVLink 3 (A100 SXM) 600 GB/s, NVLink 5
# (B200) 1.8 TB/s, as each card's datasheet prints them; PCIe Gen5 x16 128 GB/s and Gen4 x16 64 GB/s total.
NVLINK3 = Link("nvlink", 300.0, 8.0)
NVLINK4 = Link("nvlink", 450.0, 8.0)
NVLINK5 = Link("nvlink", 900.0, 8.0)
PCIE4 = Link("pcie", 32.0, 25.0)
PCIE5 = Link("pcie", 64.0, 25.0)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    sm: int | None
    """Compute capability as major*10+minor; None for the host (target cpu)."""
    kind: str = "gpu"  # "gpu" or "host"
    bandwidth_gb_s: float | None = None
    """Memory bandwidth in GB/s (10^9 bytes per second), as the datasheet gives it; None: not known."""
    peak_tflops: tuple[tuple[str, float], ...] = ()
    """Dense tensor-core peak in TFLOP/s (TOP/s for int8) per precision of PRECISIONS the card has."""
    link: Link | None = None
    """Its interconnect to the other GPUs of the deployment; None: not known."""

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

    def peak(self, precision: str) -> float | None:
        """Dense tensor-core TFLOP/s at `precision` (one of PRECISIONS); None where the card has none."""
        return dict(self.peak_tflops).get(precision)

    @property
    def has_performance(self) -> bool:
        """The performance model can predict on it: bandwidth, an fp16 peak and an interconnect are known."""
        return self.bandwidth_gb_s is not None and self.peak("fp16") is not None and self.link is not None


def _peaks(fp16: float, fp8: float | None = None, int8: float | None = None,
           fp4: float | None = None) -> tuple[tuple[str, float], ...]:
    given = {"fp16": fp16, "fp8": fp8, "int8": int8, "fp4": fp4}
    return tuple((k, v) for k, v in given.items() if v is not None)


# Peaks: the datasheet's "with sparsity" tensor figures halved. H100 SXM and H200 share the GH100 compute
# (989.4 dense bf16, 1978.9 fp8 and int8), and differ in memory.
_GH100 = _peaks(989.4, 1978.9, 1978.9)
_GA100 = _peaks(312.0, None, 624.0)
GPUS: tuple[Gpu, ...] = (
    # "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM column: 3.35 TB/s HBM3, NVLink 900 GB/s.
    Gpu("H100 80GB", 81559 / 1024, 90, bandwidth_gb_s=3350.0, peak_tflops=_GH100, link=NVLINK4),
    # Same datasheet, H100 PCIe column: 2 TB/s HBM2e, bf16 1,513 / fp8 3,026 / int8 3,026 (sparse), PCIe Gen5.
    # nvidia-smi shows the same 81559 MiB as the SXM card.
    Gpu("H100 PCIe", 81559 / 1024, 90, bandwidth_gb_s=2000.0, peak_tflops=_peaks(756.5, 1513.0, 1513.0),
        link=PCIE5),
    # "NVIDIA H200 Tensor Core GPU" datasheet, H200 SXM column: 4.8 TB/s HBM3e, the H100 SXM's compute, NVLink 900.
    Gpu("H200 141GB", 143771 / 1024, 90, bandwidth_gb_s=4800.0, peak_tflops=_GH100, link=NVLINK4),
    # "NVIDIA A100 Tensor Core GPU" datasheet, SXM columns: 2,039 GB/s (80GB HBM2e) and 1,555 GB/s (40GB HBM2);
    # bf16 312, int8 624 dense (no fp8 on Ampere); NVLink 600 GB/s.
    Gpu("A100 80GB", 81920 / 1024, 80, bandwidth_gb_s=2039.0, peak_tflops=_GA100, link=NVLINK3),
    Gpu("A100 40GB", 40960 / 1024, 80, bandwidth_gb_s=1555.0, peak_tflops=_GA100, link=NVLINK3),
    # "NVIDIA L40S GPU" datasheet: 864 GB/s GDDR6; bf16 362.05, fp8 733, int8 733 dense; PCIe Gen4 x16, no NVLink.
    Gpu("L40S", 46068 / 1024, 89, bandwidth_gb_s=864.0, peak_tflops=_peaks(362.05, 733.0, 733.0), link=PCIE4),
    # "NVIDIA L4 Tensor Core GPU" datasheet: 300 GB/s; bf16 242, fp8 485, int8 485 TOPS (sparse); PCIe Gen4 x16.
    Gpu("L4", 23034 / 1024, 89, bandwidth_gb_s=300.0, peak_tflops=_peaks(121.0, 242.5, 242.5), link=PCIE4),
    # "NVIDIA Ada GPU Architecture" whitepaper, appendix table for the RTX 4090: 1,008 GB/s; fp16 with fp32
    # accumulate 165.2, fp8 with fp32 accumulate 330.3, int8 660.6 dense; PCIe Gen4.
    Gpu("RTX 4090", 24564 / 1024, 89, bandwidth_gb_s=1008.0, peak_tflops=_peaks(165.2, 330.3, 660.6), link=PCIE4),
    # "NVIDIA Ampere GA102 GPU Architecture" whitepaper, RTX 3090: 936 GB/s; fp16 with fp32 accumulate 71,
    # int8 284 dense; PCIe Gen4.
    Gpu("RTX 3090", 24576 / 1024, 86, bandwidth_gb_s=936.0, peak_tflops=_peaks(71.0, None, 284.0), link=PCIE4),
    # "NVIDIA HGX B200" / "DGX B200" datasheets, per GPU (the 8-GPU figures / 8, sparsity halved): 8 TB/s HBM3e,
    # bf16 2.25, fp8 4.5, int8 4.5, fp4 9 PFLOP/s dense; NVLink 5 1.8 TB/s. nvidia-smi shows 183359 MiB.
    Gpu("B200 180GB", 183359 / 1024, 100, bandwidth_gb_s=8000.0, peak_tflops=_peaks(2250.0, 4500.0, 4500.0, 9000.0),
        link=NVLINK5),
    # "NVIDIA GB200 NVL72" datasheet, "GB200 Grace Blackwell Superchip" column (one Grace CPU and two GPUs, tensor
    # figures with sparsity): FP4 40, FP8/FP6 20, INT8 20 POPS, FP16/BF16 10 PFLOPS, up to 372 GB HBM3e at 16 TB/s,
    # NVLink 3.6 TB/s; per GPU and dense: bf16 2.5, fp8 5, int8 5, fp4 10 PFLOP/s, 8 TB/s, NVLink 5. Memory is the
    # datasheet's 186 GB per GPU (no nvidia-smi total is in this repository's sources).
    Gpu("GB200 186GB", 186e9 / GIB, 100, bandwidth_gb_s=8000.0,
        peak_tflops=_peaks(2500.0, 5000.0, 5000.0, 10000.0), link=NVLINK5),
    # "NVIDIA HGX B300" datasheet (Blackwell Ultra, SM 103), 8 GPUs: FP4 144 PFLOPS sparse / 105 dense, FP8/FP6 72,
    # FP16/BF16 36 PFLOPS (sparse), NVLink 5 at 1.8 TB/s per GPU, "up to 2.3 TB" of HBM3e; per GPU dense: bf16 2.25,
    # fp8 4.5, fp4 13.125 PFLOP/s (13,125 as glennklockwood.com/garden/processors/B300 tabulates it) and 8 TB/s.
    # Blackwell Ultra cuts INT8 tensor throughput and the published per-GPU figures disagree, so none is given
    # (integer formats are refused on SM 100-119 anyway). Memory: 288 GB per GPU (2.3 TB / 8, the per-GPU figure
    # HGX B300 platform tables and glennklockwood.com give: 8 stacks of 12-high HBM3e); an earlier 270 GB here came
    # from a GB300 rack article and understated it by 6%. Not an nvidia-smi total.
    Gpu("B300 288GB", 288e9 / GIB, 103, bandwidth_gb_s=8000.0, peak_tflops=_peaks(2250.0, 4500.0, None, 13125.0),
        link=NVLINK5),
)
# Short spellings people write; "A100" alone means the 80GB card, "H100" the SXM card.
ALIASES = {"H100": "H100 80GB", "H100 SXM": "H100 80GB", "H200": "H200 141GB", "A100": "A100 80GB",
           "4090": "RTX 4090", "3090": "RTX 3090", "B200": "B200 180GB", "GB200": "GB200 186GB", "B300": "B300 288GB"}


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
    """The device `spec` plans against: the named/described GPU; without one, this host's RAM for a target
    whose row budgets it (the CPU targets, `Target.budgets_host_ram`); None when a GPU target names no GPU."""
    g = spec.gpu
    if g.name:
        base = lookup(g.name)
        return dataclasses.replace(base, memory_gib=g.memory_gib or base.memory_gib, sm=g.sm or base.sm)
    if g.memory_gib:
        return Gpu(f"{g.memory_gib:g} GiB GPU", g.memory_gib, g.sm)
    if target_of(spec).budgets_host_ram:
        return Gpu("host RAM", host_memory_bytes() / GIB, None, kind="host")
    return None
