"""Benchmark reports `toolchain calibrate` learns from: which of three formats a file is, and what it says.

Each format is told by its keys (`sniff`) and read into a `Report`: the deployment facts it records (`Facts`,
None where it records nothing) and its measured operating points (`Point`). What a report lacks comes from the
command's flags or a spec (plan/calibrate.py); nothing here guesses a fact the file does not hold, except where a
cited upstream rule settles it (the engine path's FP8 KV cache).

- trtllm-bench `--report_json` (tensorrt_llm/bench/dataclasses/reporting.py get_statistics_dict): `engine`
  (model, version, backend "TRT" | "Pytorch", dtype, kv_cache_dtype, quantization), `machine` (newer releases
  only: the device name), `world_info` (tp_size, pp_size, ep_size, max_batch_size, max_num_tokens,
  kv_cache_percentage), `request_info`, `performance` (system_output_throughput_tok_s), `streaming_metrics`
  (avg_ttft_ms, avg_tpot_ms; with --streaming only) and `dataset` (avg_isl, avg_osl). The report does not record
  `--concurrency`, so a run is a maximum-throughput one (every request queued at once, as NVIDIA's published
  tables ran) unless the command's --concurrency says otherwise.
- AIPerf's profile_export_aiperf.json (aiperf 0.13, JsonExportData schema 1.4): `schema_version`,
  `aiperf_version`, one {unit, avg, p50, ...} object per metric (time_to_first_token, inter_token_latency = TPOT,
  output_token_throughput), `input_config` (phases[kind=profiling].concurrency and requests, datasets' prompts
  isl/osl means, models), and `telemetry_data` (the GPU's name, when DCGM telemetry ran). No TP, precision,
  TensorRT-LLM version or path.
- This project's report.json (toolchain/bench/report.py build_report): `tool` "toolchain bench X",
  `deployment` (bench/deployment.py describe: target, tp, pp, dtype, quantization, kv_cache_dtype, gpu,
  spec_hash) and `levels`, one per concurrency, each with ttft_ms / tpot_ms {mean, ...}, isl / osl, and
  output_tokens_per_s.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from toolchain import gpus
from toolchain.errors import ToolchainError
from toolchain.fsutil import sha256_file
from toolchain.plan.calibration import MODELS
from toolchain.plan.perf.paths import path_of_row
from toolchain.quant import formats
from toolchain.targets import TARGETS

TRTLLM_BENCH, AIPERF, TOOLCHAIN_BENCH = "trtllm-bench", "aiperf", "toolchain-bench"
FORMATS = (TRTLLM_BENCH, AIPERF, TOOLCHAIN_BENCH)
MODEL_ALIASES = {"llama-3.3-70b": "llama-3.1-70b"}
"""Checkpoints named otherwise whose shapes a data/models config has: Llama 3.3 70B is Llama 3.1 70B's
architecture (the published files plan NVIDIA's "Llama 3.3 70B" rows on llama-3.1-70b, calibration.py)."""
BACKEND_PATHS = {"trt": "engine", "tensorrt": "engine", "pytorch": "pytorch"}
"""trtllm-bench's engine.backend: "TRT" for an engine it built (the engine flow), "Pytorch" for the PyTorch
backend (reporting.py); its --backend choice is spelled "tensorrt"."""
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "fp16", "bf16", "fp32", "half")


@dataclass
class Facts:
    """What a deployment was; None where the source does not say."""

    gpu: str | None = None
    """A GPU-table name (gpus.py)."""
    tp: int | None = None
    pp: int | None = None
    method: str | None = None
    """quantization.method of a spec: none, fp8, nvfp4, ..."""
    kv_cache: str | None = None
    """quantization.kv_cache: none, int8, fp8."""
    path: str | None = None
    """engine or pytorch (plan/perf/paths.py)."""
    version: str | None = None
    """The TensorRT-LLM release that ran it."""
    model: str | None = None
    """A data/models name or a directory holding config.json."""
    dtype: str | None = None
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    kv_fraction: float | None = None


@dataclass(frozen=True)
class Point:
    """One measured operating point of a report."""

    isl: int
    osl: int
    output_tokens_per_s: float
    """Output tokens/s of the whole replica."""
    concurrency: int | None
    """Requests kept in flight; None: a maximum-throughput run (every request queued at once)."""
    requests: int | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    label: str = ""


@dataclass
class Report:
    file: Path
    sha256: str
    format: str
    facts: Facts
    points: list[Point]
    notes: list[str] = field(default_factory=list)
    spec_hash: str | None = None
    expert_parallel: bool = False
    """The run split experts over GPUs (trtllm-bench ep_size > 1, a report's moe_ep > 1): a spec must say how."""


def sniff(doc) -> str | None:
    """The format of a parsed report by its keys, or None."""
    if not isinstance(doc, dict):
        return None
    if {"engine", "world_info", "performance", "dataset"} <= doc.keys():
        return TRTLLM_BENCH
    if "schema_version" in doc and "aiperf_version" in doc:
        return AIPERF
    if str(doc.get("tool", "")).startswith("toolchain bench") and "deployment" in doc and "levels" in doc:
        return TOOLCHAIN_BENCH
    return None


def read_report(file: Path) -> Report:
    """Read and sniff one report, or a one-line error saying why it cannot be read."""
    file = Path(file)
    try:
        doc = json.loads(file.read_text())
    except OSError as err:
        raise ToolchainError(f"cannot read report {file}: {err.strerror or err}", "pass an existing report file") from None
    except ValueError as err:
        raise ToolchainError(f"{file} is not JSON ({err})",
                             "pass trtllm-bench --report_json output, AIPerf's profile_export_aiperf.json or a "
                             "toolchain bench report.json") from None
    kind = sniff(doc)
    if kind is None:
        raise ToolchainError(f"{file}: not a report calibrate reads (no trtllm-bench engine/world_info/performance/"
                             "dataset keys, no AIPerf schema_version/aiperf_version, no toolchain bench "
                             "tool/deployment/levels)",
                             "pass trtllm-bench --report_json output, AIPerf's profile_export_aiperf.json or a "
                             "toolchain bench report.json")
    reader = {TRTLLM_BENCH: _trtllm_bench, AIPERF: _aiperf, TOOLCHAIN_BENCH: _toolchain_bench}[kind]
    report = Report(file, sha256_file(file), kind, Facts(), [])
    try:
        reader(doc, report)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ToolchainError(f"{file}: a {kind} report without the field it needs ({type(err).__name__}: {err})",
                             "pass the report as the tool wrote it") from None
    if not report.points:
        raise ToolchainError(f"{file}: no measured point to learn from ({kind})",
                             "pass a report of a completed run")
    return report


# ------------------------------------------------------------------------------------------ shared readers


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def gpu_named(name: str, memory_gib: float | None = None) -> str | None:
    """The GPU-table name of a device name as a tool reports it ("NVIDIA H100 80GB HBM3"), or None when the
    table has no unambiguous match: the longest table name or alias the device's name starts with, refused when
    the memory the name or the tool states is more than 10% off the table's."""
    try:
        return gpus.lookup(name).name
    except ToolchainError:
        pass
    key = _key(re.sub(r"^\s*nvidia\s+(geforce\s+)?", "", name, flags=re.I))
    table = {_key(g.name): g for g in gpus.GPUS}
    table.update({_key(alias): gpus.lookup(full) for alias, full in gpus.ALIASES.items()})
    matches = [k for k in table if key.startswith(k)]
    if not matches:
        return None
    best = max(matches, key=len)
    rest = key[len(best):]
    for descriptor in (r"\d+gb", r"hbm\d*e?", r"sxm\d*"):  # the memory and form factor the name may add
        rest = re.sub(descriptor, "", rest)
    if rest:  # another variant than the table's ("H100 NVL", "H200 NVL")
        return None
    gpu = table[best]
    stated = re.search(r"(\d+)\s*GB", name, flags=re.I)
    for memory in (memory_gib, float(stated.group(1)) if stated else None):
        if memory and abs(memory - gpu.memory_gib) > 0.1 * gpu.memory_gib:
            return None
    return gpu.name


def model_named(name: str | None) -> str | None:
    """A data/models config for a checkpoint name ("nvidia/Llama-3.1-8B-Instruct-FP8" -> llama-3.1-8b), or None."""
    if not name:
        return None
    base = str(name).rstrip("/").split("/")[-1].lower()
    for alias, known in MODEL_ALIASES.items():
        if base == alias or base.startswith(alias + "-"):
            return known
    names = sorted((p.name for p in MODELS.iterdir() if (p / "config.json").is_file()), key=len, reverse=True)
    return next((n for n in names if base == n or base.startswith(n + "-")), None)


def method_of_algo(algo) -> str:
    """A spec's quantization.method for a TensorRT-LLM QuantAlgo string ("FP8", "NVFP4", None, ...)."""
    if algo in (None, "", "None", "none", "NO_QUANT"):
        return "none"
    by_algo = {f.quant_algo: name for name, f in formats.METHODS.items() if f.quant_algo}
    method = by_algo.get(str(algo).upper())
    if method is None:
        raise ToolchainError(f"quantization {algo!r} is not a format the planner models",
                             f"calibrate runs of {', '.join(sorted(by_algo))} or none")
    return method


def kv_of(dtype) -> str | None:
    """quantization.kv_cache for a reported KV-cache dtype; None for "auto" or nothing (the checkpoint decides)."""
    text = str(dtype or "").strip().lower()
    if text in ("", "none", "auto"):
        return None
    if text in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return "fp8"
    if text == "int8":
        return "int8"
    if text in FLOAT_DTYPES:
        return "none"
    raise ToolchainError(f"KV-cache dtype {dtype!r} is not one the planner models", "pass --kv-cache none, int8 or fp8")


def _int(value) -> int | None:
    return None if value in (None, "") else int(round(float(value)))


# ---------------------------------------------------------------------------------------------- the formats


def _trtllm_bench(doc: dict, report: Report) -> None:
    engine, world, perf, data = doc["engine"], doc["world_info"], doc["performance"], doc["dataset"]
    facts = report.facts
    backend = str(engine.get("backend") or "").strip().lower()
    if backend:
        facts.path = BACKEND_PATHS.get(backend)
        if facts.path is None:
            raise ToolchainError(f"{report.file}: trtllm-bench backend {engine['backend']!r} is neither the engine "
                                 "flow nor the PyTorch backend", "calibrate runs of backend TRT or Pytorch")
    machine = doc.get("machine") or {}
    if machine.get("name"):
        facts.gpu = gpu_named(str(machine["name"]), machine.get("memory.total"))
        if facts.gpu is None:
            report.notes.append(f"machine.name {machine['name']!r} is not in the GPU table")
    facts.tp, facts.pp = _int(world.get("tp_size")), _int(world.get("pp_size"))
    report.expert_parallel = (_int(world.get("ep_size")) or 1) > 1
    if "quantization" in engine:
        facts.method = method_of_algo(engine["quantization"])
    facts.kv_cache = kv_of(engine.get("kv_cache_dtype"))
    if facts.kv_cache is None and facts.path == "engine" and facts.method == "fp8":
        # perf-overview.md (0.17): "If you specify FP8 quantization, the KV cache will automatically be set to FP8"
        facts.kv_cache = "fp8"
    if str(engine.get("dtype") or "").lower() in ("float16", "bfloat16", "float32"):
        facts.dtype = str(engine["dtype"]).lower()
    facts.version = str(engine["version"]) if engine.get("version") else None
    model_path = engine.get("model_path")
    if model_path and (Path(model_path) / "config.json").is_file():
        facts.model = str(Path(model_path).resolve())
    else:
        facts.model = model_named(engine.get("model")) or model_named(model_path)
    facts.max_batch_size, facts.max_num_tokens = _int(world.get("max_batch_size")), _int(world.get("max_num_tokens"))
    share = world.get("kv_cache_percentage")
    if share:
        facts.kv_fraction = float(share) / 100 if float(share) > 1 else float(share)
    requests = doc.get("request_info") or {}
    isl = _int(data.get("avg_isl") or requests.get("avg_input_length"))
    osl = _int(data.get("avg_osl") or requests.get("avg_output_length"))
    stream = doc.get("streaming_metrics") or {}
    report.points.append(Point(*_lengths(isl, osl, report), float(perf["system_output_throughput_tok_s"]), None,
                               _int(requests.get("num_requests") or data.get("num_requests")),
                               _float(stream.get("avg_ttft_ms")), _float(stream.get("avg_tpot_ms")), "run"))


def _lengths(isl: int | None, osl: int | None, report: Report) -> tuple[int, int]:
    if not isl or not osl:
        raise ToolchainError(f"{report.file}: the run's input and output lengths are not recorded",
                             "pass the report as the tool wrote it")
    return isl, osl


def _float(value) -> float | None:
    return None if value in (None, "") else float(value)


def _metric(doc: dict, name: str) -> float | None:
    value = doc.get(name)
    return _float(value.get("avg")) if isinstance(value, dict) else None


def _aiperf(doc: dict, report: Report) -> None:
    config = doc.get("input_config") or {}
    phases = [p for p in config.get("phases") or [] if p.get("kind") == "profiling"]
    concurrency = _int(phases[0].get("concurrency")) if phases else None
    requests = _int(phases[0].get("requests")) if phases else None
    if phases and phases[0].get("type") not in (None, "concurrency"):
        raise ToolchainError(f"{report.file}: an AIPerf {phases[0]['type']} run (an open loop)",
                             "calibrate AIPerf runs made with --concurrency")
    if concurrency is None:
        words = shlex.split(str((doc.get("run_info") or {}).get("cli_command") or ""))
        if "--concurrency" in words[:-1]:
            concurrency = int(words[words.index("--concurrency") + 1])
    prompts: dict = next((d.get("prompts") for d in config.get("datasets") or [] if d.get("prompts")), {}) or {}
    isl = _int(_metric(doc, "input_sequence_length") or (prompts.get("isl") or {}).get("mean"))
    osl = _int(_metric(doc, "output_sequence_length") or (prompts.get("osl") or {}).get("mean"))
    tput = _metric(doc, "output_token_throughput")
    if concurrency is None:
        raise ToolchainError(f"{report.file}: the AIPerf run's concurrency is not recorded",
                             "calibrate AIPerf runs made with --concurrency")
    if tput is None:
        raise ToolchainError(f"{report.file}: no output_token_throughput in the AIPerf export",
                             "pass the profiling phase's profile_export_aiperf.json")
    report.points.append(Point(*_lengths(isl, osl, report), tput, concurrency, requests or _int(_metric(doc, "request_count")),
                               _metric(doc, "time_to_first_token"), _metric(doc, "inter_token_latency"),
                               f"concurrency {concurrency}"))
    names = {g.get("gpu_name") for ep in ((doc.get("telemetry_data") or {}).get("endpoints") or {}).values()
             for g in (ep.get("gpus") or {}).values() if g.get("gpu_name")}
    if len(names) == 1:
        report.facts.gpu = gpu_named(names.pop())
    models = ((config.get("models") or {}).get("items") or [{}])
    report.facts.model = model_named(models[0].get("name"))


def _toolchain_bench(doc: dict, report: Report) -> None:
    d = doc["deployment"]
    row = TARGETS.get(str(d.get("target")))
    if row is not None and row.predicts_from_host_profile or d.get("gpu") == "host CPU":
        raise ToolchainError(f"{report.file}: a CPU target's report ({d.get('target')}); calibrate learns GPU rows",
                             "the CPU engine is predicted from this host's profile: run `toolchain probe-host`")
    facts = report.facts
    facts.path = path_of_row(row) if row is not None else None
    if d.get("gpu"):
        facts.gpu = gpu_named(str(d["gpu"]))
    facts.tp, facts.pp = _int(d.get("tp")), _int(d.get("pp"))
    facts.method = d.get("quantization")
    facts.kv_cache = kv_of(d.get("kv_cache_dtype"))
    facts.dtype = d.get("dtype") if d.get("dtype") in ("float16", "bfloat16", "float32") else None
    report.spec_hash = d.get("spec_hash")
    report.expert_parallel = (_int(d.get("moe_ep")) or 1) > 1
    for level in doc["levels"]:
        load = level.get("load") or {}
        if load.get("mode") != "concurrency":
            report.notes.append(f"level {level.get('level')}: an open loop ({load.get('mode')}), not fitted")
            continue
        work = doc.get("workload") or {}
        isl = _int((level.get("isl") or {}).get("mean") or work.get("input_tokens"))
        osl = _int((level.get("osl") or {}).get("mean") or work.get("output_tokens"))
        report.points.append(Point(*_lengths(isl, osl, report), float(level["output_tokens_per_s"]), _int(load["value"]),
                                   _int(level.get("num_requests")), _float((level.get("ttft_ms") or {}).get("mean")),
                                   _float((level.get("tpot_ms") or {}).get("mean")),
                                   f"level {level.get('level')} (concurrency {load['value']})"))
