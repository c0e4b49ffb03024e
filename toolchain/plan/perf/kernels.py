"""Measured kernel times: AIConfigurator's per-operation database, read at run time from the installed package.

AIConfigurator (PyPI `aiconfigurator-core` 0.12.0, Apache-2.0, NVIDIA) ships what its collectors timed on real
GPUs: TensorRT-LLM's GEMMs by (m, n, k) and precision, context and generation attention by batch, sequence and
heads, and the custom all-reduce by message size, per GPU and TensorRT-LLM version, as Parquet tables under
`aiconfigurator_core/systems/data/<system>/<op>/trtllm/<version>/` (collector/trtllm/collect_gemm.py and
collect_attn.py time `tensorrt_llm._torch` modules under CUDA graphs: the PyTorch backend's kernels). The package
is installed beside the toolchain without its dependencies (`make setup`; its own code needs numpy 2 and is never
imported here) and read with pyarrow; where it is not installed every prediction falls back to the roofline and
says so.

How a shape between the measured ones is looked up follows the database's own rules as its documentation
states them (aiconfigurator-core's perf_interp: "nearest-site transfer in util space", "hold a boundary util"),
written here afresh: a GEMM at a measured (n, k) interpolates along m; at another (n, k) it takes the achieved
share of the speed-of-light time (`util`) of the nearest measured sites (log2 distance at most 2) at the same m,
inverse-distance weighted; beyond the measured range it holds the boundary's util. Attention and the all-reduce
interpolate on their grids, in log space, and scale past the grid's end by their work.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from toolchain.gpus import Gpu

PACKAGE = "aiconfigurator-core"
VERSION = "0.12.0"
SYSTEMS = {"H100 80GB": "h100_sxm", "H200 141GB": "h200_sxm", "A100 80GB": "a100_sxm", "L40S": "l40s",
           "B200 180GB": "b200_sxm", "GB200 186GB": "gb200", "B300 288GB": "b300_sxm"}
"""The toolchain's GPU names -> AIConfigurator's system names (aiconfigurator_core/systems/<system>.yaml).
The PCIe H100, A100 40GB, L4 and A30 have empty directories in 0.12.0."""
MAX_SITE_DISTANCE = 2.0
"""How far (in log2 units of n and k) a measured GEMM site may be from the asked shape to lend its util."""
NEAREST_SITES = 4


@dataclass(frozen=True)
class Table:
    """Where one table's rows came from."""

    system: str
    version: str
    path: Path


def data_root() -> Path | None:
    """The installed database's data directory, or None when aiconfigurator-core 0.12.0 is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    root = Path(str(dist.locate_file("aiconfigurator_core/systems/data")))
    return root if root.is_dir() else None


def table(system: str, op: str, name: str, version: str | None = None) -> Table | None:
    """The `name` table of `op` on `system` at TensorRT-LLM `version`, by default the newest one (versions sorted
    as the directory names sort, 1.3.0rc20 after 1.3.0rc10), or None."""
    root = data_root()
    if root is None:
        return None
    found = sorted((root / system / op / "trtllm").glob(f"{version or '*'}/{name}.parquet"),
                   key=lambda p: _version_key(p.parent.name))
    return Table(system, found[-1].parent.name, found[-1]) if found else None


def _version_key(version: str) -> tuple:
    parts = version.replace("rc", ".rc.").split(".")
    return tuple((0, int(p)) if p.isdigit() else (-1, p) for p in parts)


@cache
def _columns(path: Path, columns: tuple[str, ...]) -> dict[str, list]:
    import pyarrow.parquet as pq  # pyarrow comes with the database; imported only when it is there

    return pq.read_table(path, columns=list(columns)).to_pydict()


# ------------------------------------------------------------------------------------------- interpolation


def _interp(xs: list[float], ys: list[float], x: float, log: bool = True) -> float:
    """Piecewise-linear interpolation of y at x within [xs[0], xs[-1]] (in log-log space with `log`); callers
    handle the outside."""
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    lo, hi = i - 1, i
    x0, x1, y0, y1 = xs[lo], xs[hi], ys[lo], ys[hi]
    if log and min(x0, x1, y0, y1, x) > 0:
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    t = (x - x0) / (x1 - x0)
    return y0 + t * (y1 - y0)


def _curve(xs: list[float], ys: list[float], x: float, work) -> float:
    """y(x) on a measured curve; past either end, the end's y scaled by the work ratio work(x) / work(end) (the
    end's util held)."""
    if x <= xs[0]:
        return ys[0] * work(x) / work(xs[0])
    if x >= xs[-1]:
        return ys[-1] * work(x) / work(xs[-1])
    return _interp(xs, ys, x)


# ------------------------------------------------------------------------------------------- GEMM


@dataclass(frozen=True, eq=False)
class GemmSites:
    """One precision's GEMMs on one system: per measured (n, k), latency (ms) along m."""

    table: Table
    dtype: str
    sites: dict[tuple[int, int], tuple[list[float], list[float]]]


@cache
def gemm_sites(system: str, dtype: str) -> GemmSites | None:
    t = table(system, "gemm", "gemm_perf")
    if t is None:
        return None
    cols = _columns(t.path, ("gemm_dtype", "m", "n", "k", "latency"))
    rows: dict[tuple[int, int], dict[int, float]] = {}
    for d, m, n, k, lat in zip(cols["gemm_dtype"], cols["m"], cols["n"], cols["k"], cols["latency"], strict=True):
        if d == dtype and lat and lat > 0:
            rows.setdefault((n, k), {})[m] = lat
    if not rows:
        return None
    sites = {}
    for site, curve in rows.items():
        ms = sorted(curve)
        sites[site] = ([float(m) for m in ms], [curve[m] for m in ms])
    return GemmSites(t, dtype, sites)


def gemm_sol_terms(gpu: Gpu, precision: str, weight_bytes: float, m: float, n: int, k: int) -> tuple[float, float]:
    """(compute, memory) milliseconds of an (m x k) by (k x n) GEMM at the speed of light: its FLOPs at the dense
    peak, its bytes (weights in their format, activations in and out in the half type) at the datasheet bandwidth."""
    peak = (gpu.peak(precision) or gpu.peak("fp16") or 1.0) * 1e12
    assert gpu.bandwidth_gb_s is not None
    flops = 2.0 * m * n * k / peak
    memory = (n * k * weight_bytes + 2.0 * m * (n + k)) / (gpu.bandwidth_gb_s * 1e9)
    return flops * 1e3, memory * 1e3


def gemm_sol_ms(gpu: Gpu, precision: str, weight_bytes: float, m: float, n: int, k: int) -> float:
    """Speed-of-light time of a GEMM: the longer of `gemm_sol_terms`."""
    return max(gemm_sol_terms(gpu, precision, weight_bytes, m, n, k))


def gemm_ms(gpu: Gpu, sites: GemmSites, precision: str, weight_bytes: float, m: float, n: int, k: int
            ) -> tuple[float, bool]:
    """(milliseconds, measured) of one GEMM: on a measured site along m, else the util of the nearest sites
    (`measured` False when none lies within MAX_SITE_DISTANCE and the nearest one lends its util anyway)."""
    m = max(m, 1.0)

    def at_site(site: tuple[int, int]) -> float:
        ms, lats = sites.sites[site]
        return _curve(ms, lats, m, lambda x: gemm_sol_ms(gpu, precision, weight_bytes, x, *site))

    sol = gemm_sol_ms(gpu, precision, weight_bytes, m, n, k)
    if (n, k) in sites.sites:  # never faster than the datasheet allows (AIConfigurator clamps its GEMMs so too)
        return max(at_site((n, k)), sol), True
    near = nearest_sites(sites, n, k)
    weights = [1.0 / max(d, 1e-6) ** 2 for d, _ in near]
    utils = [min(1.0, gemm_sol_ms(gpu, precision, weight_bytes, m, *s) / at_site(s)) for _, s in near]
    util = sum(w * u for w, u in zip(weights, utils, strict=True)) / sum(weights)
    return sol / util, near[0][0] <= MAX_SITE_DISTANCE


@cache
def nearest_sites(sites: GemmSites, n: int, k: int) -> list[tuple[float, tuple[int, int]]]:
    """The measured sites that lend an unmeasured (n, k) their util: the NEAREST_SITES closest in log2 space within
    MAX_SITE_DISTANCE, or the closest one when none is that close, with their distances."""
    ln, lk = math.log2(n), math.log2(k)
    ranked = sorted((math.hypot(math.log2(sn) - ln, math.log2(sk) - lk), (sn, sk)) for sn, sk in sites.sites)
    return [(d, s) for d, s in ranked[:NEAREST_SITES] if d <= MAX_SITE_DISTANCE] or ranked[:1]


# ------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionGrid:
    """One attention configuration's measured latencies (ms): per batch, along the sequence (context: the
    prompt length; generation: the cached tokens)."""

    table: Table
    heads: int
    kv_heads: int
    curves: dict[int, tuple[list[float], list[float]]]


@cache
def attention_grids(system: str, phase: str, head_dim: int, kv_dtype: str, attn_dtype: str = "bfloat16"
                    ) -> dict[tuple[int, int], AttentionGrid]:
    """Every (heads, kv heads) measured for `phase` ("context" or "generation") at `head_dim` without a window,
    beam 1, with the KV cache in `kv_dtype` (and, for context, the FMHA in `attn_dtype`)."""
    t = table(system, "attention", f"{phase}_attention_perf")
    if t is None:
        return {}
    names = ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "window_size", "beam_width",
             "attn_dtype", "kv_cache_dtype", "step", "latency")
    cols = _columns(t.path, names)
    rows: dict[tuple[int, int], dict[int, dict[int, float]]] = {}
    for b, isl, h, kv, hd, win, beam, ad, kd, step, lat in zip(*(cols[c] for c in names), strict=True):
        if hd != head_dim or win != 0 or beam != 1 or kd != kv_dtype or not lat or lat <= 0:
            continue
        if phase == "context" and ad != attn_dtype:
            continue
        seq = isl if phase == "context" else step + isl
        rows.setdefault((h, kv), {}).setdefault(b, {})[seq] = lat
    out = {}
    for key, per_batch in rows.items():
        curves = {}
        for b, by_seq in per_batch.items():
            seqs = sorted(by_seq)
            curves[b] = ([float(s) for s in seqs], [by_seq[s] for s in seqs])
        out[key] = AttentionGrid(t, key[0], key[1], curves)
    return out


def nearest_grid(grids: dict[tuple[int, int], AttentionGrid], heads: int, kv_heads: int
                 ) -> tuple[AttentionGrid, float] | None:
    """The measured (heads, kv heads) closest to the asked (the same group size first), and the factor its
    latency is scaled by (heads asked over heads measured: the work is per head)."""
    if not grids:
        return None
    if (heads, kv_heads) in grids:
        return grids[(heads, kv_heads)], 1.0
    group = heads / max(kv_heads, 1)

    def distance(key: tuple[int, int]) -> tuple[float, float]:
        h, kv = key
        return abs(math.log2((h / kv) / group)), abs(math.log2(h / heads))

    best = min(grids, key=distance)
    return grids[best], heads / best[0]


def grid_ms(grid: AttentionGrid, batch: float, seq: float, seq_work) -> float:
    """Latency at (batch, seq): along seq on each measured batch (past the ends by `seq_work`), then along the
    batch in log space; above the largest batch, per sequence as at the largest, below the smallest in proportion."""
    batches = sorted(grid.curves)

    def at(b: int) -> float:
        seqs, lats = grid.curves[b]
        return _curve(seqs, lats, seq, seq_work)

    batch = max(batch, 1e-9)
    if batch <= batches[0]:
        return at(batches[0]) * batch / batches[0]
    if batch >= batches[-1]:
        return at(batches[-1]) * batch / batches[-1]
    i = bisect.bisect_left(batches, batch)
    if batches[i] == batch:
        return at(batches[i])
    return _interp([float(batches[i - 1]), float(batches[i])], [at(batches[i - 1]), at(batches[i])], batch)


# ------------------------------------------------------------------------------------------- all-reduce


@cache
def allreduce_curves(system: str) -> dict[int, tuple[list[float], list[float]]]:
    """TensorRT-LLM's custom all-reduce in bf16, per GPU count: latency (ms) along the message (elements)."""
    t = table(system, "comm", "custom_allreduce_perf")
    if t is None:
        return {}
    cols = _columns(t.path, ("allreduce_dtype", "num_gpus", "message_size", "latency"))
    rows: dict[int, dict[int, float]] = {}
    for d, n, size, lat in zip(cols["allreduce_dtype"], cols["num_gpus"], cols["message_size"], cols["latency"],
                               strict=True):
        if d == "bfloat16" and lat and lat > 0:
            rows.setdefault(n, {})[size] = lat
    return {n: ([float(s) for s in sorted(r)], [r[s] for s in sorted(r)]) for n, r in rows.items()}


def allreduce_ms(system: str, elements: float, ranks: int) -> float | None:
    """One all-reduce of `elements` half-type values over `ranks` GPUs, or None when not measured for that count
    (past the largest message, the time grows with the bytes)."""
    curves = allreduce_curves(system)
    if ranks <= 1:
        return 0.0
    if ranks not in curves:
        return None
    sizes, lats = curves[ranks]
    return _curve(sizes, lats, max(elements, 1.0), lambda x: max(x, sizes[0]))


# ------------------------------------------------------------------------------------------- experts

MOE_DTYPES = {None: "bfloat16", "FP8": "fp8", "FP8_BLOCK_SCALES": "fp8_block", "NVFP4": "nvfp4",
              "W4A16_MXFP4": "w4a16_mxfp4", "W4A8_MXFP4_MXFP8": "w4a8_mxfp4_mxfp8"}
"""The QuantAlgo the runtime runs the experts in (quant/formats.py Format.algo_on) -> the `moe_dtype` the MoE table
names it by; an algorithm missing here has no measured experts."""
MOE_DISTRIBUTION = "power_law_1.2"
"""Which of the table's routing skews (balanced, power_law_1.01, power_law_1.2) a lookup takes: the one
AIConfigurator's own MoE model asks for by default (sdk/config.py ModelConfig.workload_distribution "power_law",
sdk/models/moe.py MOEModel._power_law_alpha 1.2 for Mixtral, Llama 4 and gpt-oss); MLA_MOE_DISTRIBUTION for
DeepSeek's."""
MLA_MOE_DISTRIBUTION = "power_law_1.01"
"""The skew AIConfigurator's DeepSeek model asks for (sdk/models/deepseek.py DeepSeekModel._power_law_alpha 1.01)."""
MOE_LOW_LATENCY = "moe_torch_flow_min_latency"
"""The kernel_source of the rows AIConfigurator keeps apart as TensorRT-LLM's low-latency NVFP4 kernel
(sdk/operations/moe.py MoE.load_data: the engine folds them into a second view); the default view leaves them out."""


def current_version(system: str) -> str | None:
    """The TensorRT-LLM version AIConfigurator queries on `system` by default: the `current` slot of
    systems/query_versions.yaml (its overrides first). The MoE lookup takes it rather than the newest directory,
    whose table (1.3.0rc23) holds a few newer shapes only."""
    root = data_root()
    if root is None:
        return None
    slots = yaml.safe_load((root.parent / "query_versions.yaml").read_text())
    chosen = (slots.get("overrides") or {}).get(system, {}).get("trtllm") or slots["defaults"]["trtllm"]
    return chosen.get("current")


@dataclass(frozen=True)
class ExpertsKey:
    """One MoE shape as the table keys it: the model's whole experts (hidden and per-expert intermediate size,
    top k of E) and how they are split (moe_tp x moe_ep), in one dtype."""

    dtype: str
    hidden: int
    inter: int
    topk: int
    experts: int
    moe_tp: int
    moe_ep: int


@cache
def moe_curves(system: str, distribution: str = MOE_DISTRIBUTION
               ) -> tuple[Table | None, dict[ExpertsKey, tuple[list[float], list[float]]]]:
    """The current version's fused-MoE latencies (ms) on `system` at `distribution`, per shape along
    num_tokens: the tokens entering the MoE block, all ranks' under attention DP (the table's `num_tokens`; one
    rank's share of the experts is timed, collector/trtllm/collect_moe.py)."""
    version = current_version(system)
    found = table(system, "moe", "moe_perf", version) if version is not None else None
    if found is None:
        return None, {}
    names = ("kernel_source", "moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
             "moe_tp_size", "moe_ep_size", "distribution", "latency")
    cols = _columns(found.path, names)
    rows: dict[ExpertsKey, dict[int, float]] = {}
    for src, d, tokens, h, inter, topk, e, mtp, mep, dist, lat in zip(*(cols[c] for c in names), strict=True):
        if dist != distribution or src == MOE_LOW_LATENCY or not lat or lat <= 0:
            continue
        rows.setdefault(ExpertsKey(d, h, inter, topk, e, mtp, mep), {})[tokens] = lat
    curves = {key: ([float(t) for t in sorted(r)], [r[t] for t in sorted(r)]) for key, r in rows.items()}
    return found, curves


def moe_ms(system: str, dtype: str, tokens: float, hidden: int, inter: int, topk: int, experts: int, moe_tp: int,
           moe_ep: int, distribution: str = MOE_DISTRIBUTION) -> float | None:
    """One fused MoE (the routed experts of one layer on one rank) for `tokens` tokens, interpolated along
    num_tokens at the exact shape (the table was collected at the models' own shapes, so none is transferred from
    another), past the measured range in proportion to the tokens; None where the shape is not in the table."""
    curve = moe_curves(system, distribution)[1].get(ExpertsKey(dtype, hidden, inter, topk, experts, moe_tp, moe_ep))
    if curve is None:
        return None
    return _curve(*curve, max(tokens, 1.0), lambda x: x)


# ------------------------------------------------------------------------------------------- latent attention


@cache
def mla_grids(system: str, phase: str, kv_dtype: str) -> dict[tuple[int, int], AttentionGrid]:
    """Multi-head latent attention's own kernel (DeepSeek-V3's shapes: 512 latent + 64 rope values a token) for
    `phase` ("context" or "generation"), keyed (heads, 1) as attention_grids keys (heads, KV heads), with the
    KV cache in `kv_dtype`: the `mla` tables' context_mla_perf / generation_mla_perf (the attention alone; the
    projections around it are GEMMs and, in generation, the absorbed kv_b BMMs of mla_bmm_ms)."""
    t = table(system, "mla", f"{phase}_mla_perf")
    if t is None:
        return {}
    names = ("mla_dtype", "kv_cache_dtype", "num_heads", "batch_size", "isl", "step", "latency")
    cols = _columns(t.path, names)
    rows: dict[int, dict[int, dict[int, float]]] = {}
    for md, kd, h, b, isl, step, lat in zip(*(cols[c] for c in names), strict=True):
        if md != "bfloat16" or kd != kv_dtype or not lat or lat <= 0:
            continue
        seq = isl if phase == "context" else step + isl
        rows.setdefault(h, {}).setdefault(b, {})[seq] = lat
    out = {}
    for h, per_batch in rows.items():
        curves = {b: ([float(s) for s in sorted(by)], [by[s] for s in sorted(by)]) for b, by in per_batch.items()}
        out[(h, 1)] = AttentionGrid(t, h, 1, curves)
    return out


@cache
def mla_bmm_curves(system: str) -> dict[tuple[str, str, int], tuple[list[float], list[float]]]:
    """Generation's absorbed kv_b BMMs (mla_bmm_perf: `mla_gen_pre` multiplies the queries into the latent space,
    `mla_gen_post` the attention's output back out), per (op, dtype, heads) along num_tokens."""
    t = table(system, "mla_bmm", "mla_bmm_perf")
    if t is None:
        return {}
    names = ("op_name", "bmm_dtype", "num_tokens", "num_heads", "latency")
    cols = _columns(t.path, names)
    rows: dict[tuple[str, str, int], dict[int, float]] = {}
    for op, d, tokens, h, lat in zip(*(cols[c] for c in names), strict=True):
        if lat and lat > 0:
            rows.setdefault((op, d, h), {})[tokens] = lat
    return {key: ([float(x) for x in sorted(r)], [r[x] for x in sorted(r)]) for key, r in rows.items()}


def mla_bmm_ms(system: str, dtype: str, tokens: float, heads: int) -> float | None:
    """Both absorbed BMMs of one layer for `tokens` generating tokens over `heads` heads, or None where not
    measured (past the last row in proportion to the tokens)."""
    curves = mla_bmm_curves(system)
    parts = [curves.get((op, dtype, heads)) for op in ("mla_gen_pre", "mla_gen_post")]
    if tokens <= 0:
        return 0.0
    if any(c is None for c in parts):
        return None
    return sum(_curve(*c, max(tokens, 1.0), lambda x: x) for c in parts if c is not None)
