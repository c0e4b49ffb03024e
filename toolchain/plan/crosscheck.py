"""A second opinion on a spec's performance: NVIDIA AIConfigurator's estimate, beside the toolchain's own.

AIConfigurator (PyPI `aiconfigurator`, Apache-2.0) models TensorRT-LLM from per-kernel measurements of a given
TensorRT-LLM release, so its figures are labelled with that release (the `Backend: trtllm (VERSION)` line of its
report). It is never a dependency of the package: `ensure_venv` installs aiconfigurator==0.12.0 into a venv of
its own on first use (benchmarks/.venv/aiconfigurator, beside AIPerf's), and `estimate` runs its
`aiconfigurator cli estimate` (aggregated serving, one replica of tp x pp GPUs at a batch size) there and parses
the report. Its 0.12.0 data: trtllm 1.3.0rc20 on H100/H200/B200/L40S, 1.0.0 on A100 (systems/data/*/gemm/trtllm).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.gpus import Gpu
from toolchain.plan.perf.kernels import SYSTEMS as KERNEL_SYSTEMS

VERSION = "0.12.0"
VENV = Path(__file__).resolve().parents[2] / "benchmarks" / ".venv" / "aiconfigurator"
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 600

SYSTEMS = KERNEL_SYSTEMS
"""The toolchain's GPU names -> AIConfigurator's system names: the cards its 0.12.0 database holds (the PCIe H100
and the L4 have empty directories there, so a cross-check on them could only fail)."""
# quantization.method -> --gemm-quant-mode (the choices of `aiconfigurator cli estimate --help`); awq is a
# per-group int4 format, which AIConfigurator models as int4 weight-only.
GEMM = {"none": "bfloat16", "fp8": "fp8", "int8_wo": "int8_wo", "int4_wo": "int4_wo", "awq": "int4_wo",
        "smoothquant": "sq"}
KV = {"none": "bfloat16", "fp8": "fp8", "int8": "int8"}  # quantization.kv_cache -> --kvcache-quant-mode


@dataclass(frozen=True)
class Estimate:
    """AIConfigurator's figures for one configuration, and what they rest on."""

    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float
    per_gpu_output_tokens_per_s: float
    concurrency: int
    memory_gb: float
    tensorrt_llm: str
    """The TensorRT-LLM release of the kernel measurements the estimate comes from."""
    tool: str = f"aiconfigurator {VERSION}"
    roles: dict[str, dict[str, float]] | None = None
    """A disaggregated estimate (`--estimate-mode disagg`): per role ("prefill", "decode") its tp, pp, bs, workers
    and memory_gb, as the report's "(p) ..." and "(d) ..." lines give them; None for aggregated serving."""

    @property
    def label(self) -> str:
        return f"{self.tool} (data: TensorRT-LLM {self.tensorrt_llm})"

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "output_tokens_per_s": self.output_tokens_per_s,
                "per_gpu_output_tokens_per_s": self.per_gpu_output_tokens_per_s, "concurrency": self.concurrency,
                "memory_gb": self.memory_gb, "tensorrt_llm": self.tensorrt_llm, "basis": self.label}


_FIELDS = {  # report line label -> (Estimate field, number pattern)
    "TTFT": ("ttft_ms", r"([\d,.]+) ms"),
    "TPOT": ("tpot_ms", r"([\d,.]+) ms"),
    "tokens/s": ("output_tokens_per_s", r"([\d,.]+)"),
    "tokens/s/gpu": ("per_gpu_output_tokens_per_s", r"([\d,.]+)"),
    "Concurrency": ("concurrency", r"(\d+)"),
    "Memory (GPU)": ("memory_gb", r"([\d,.]+) GB"),
}


# A disaggregated report's per-role lines ("(p) TP:  2", "(d) Memory:  31.854 GB"; verified on 0.12.0's output).
_ROLE_LINE = re.compile(r"\((p|d)\) (TP|PP|BS|Workers|Memory)")
_ROLE_NAMES = {"p": "prefill", "d": "decode"}


def parse(report: str) -> Estimate:
    """The figures of an `aiconfigurator cli estimate` report ("Performance Estimate" block, one `Label: value`
    per line); a report without them (an error, another tool version) is refused in one line. A disaggregated
    report ("Performance Estimate (disagg)") gives each role's lines instead of one `Memory (GPU)`: its memory_gb
    is then the larger role's (what one GPU must hold)."""
    values: dict[str, float | int | str] = {}
    roles: dict[str, dict[str, float]] = {}
    for line in report.splitlines():
        label, sep, rest = line.strip().partition(":")
        if not sep:
            continue
        rest = rest.strip()
        role = _ROLE_LINE.fullmatch(label)
        if role:
            leading = re.match(r"[\d,.]+", rest)
            if leading:
                key = "memory_gb" if role.group(2) == "Memory" else role.group(2).lower()
                roles.setdefault(_ROLE_NAMES[role.group(1)], {})[key] = float(leading.group().replace(",", ""))
        elif label == "Backend":
            found = re.fullmatch(r"trtllm \(([^)]+)\)", rest)
            if found:
                values["tensorrt_llm"] = found.group(1)
        elif label in _FIELDS:
            name, pattern = _FIELDS[label]
            found = re.fullmatch(pattern, rest)
            if found:
                number = found.group(1).replace(",", "")
                values[name] = int(number) if name == "concurrency" else float(number)
    if roles and "memory_gb" not in values and all("memory_gb" in r for r in roles.values()):
        values["memory_gb"] = max(r["memory_gb"] for r in roles.values())
    missing = [f for f in ("tensorrt_llm", *(n for n, _ in _FIELDS.values())) if f not in values]
    if missing:
        raise ToolchainError(f"aiconfigurator's report lacks {', '.join(missing)}",
                             f"run `{VENV}/bin/aiconfigurator cli estimate ...` by hand to see its error")
    return Estimate(**values, roles=roles or None)  # type: ignore[arg-type]


def command(spec, device: Gpu, batch_size: int, executable: Path | str = "aiconfigurator") -> list[str]:
    """`aiconfigurator cli estimate` for the spec's model (its config.json directory), GPU, parallelism,
    format and workload, at `batch_size` concurrent requests, aggregated serving on TensorRT-LLM."""
    system = SYSTEMS.get(device.name)
    if system is None:
        raise ToolchainError(f"AIConfigurator has no data for {device.name}",
                             f"cross-check on one of {', '.join(SYSTEMS)}")
    q = spec.quantization
    gemm = GEMM.get(str(q.method))
    if gemm is None:
        raise ToolchainError(f"AIConfigurator has no quantization mode for {q.method}",
                             f"cross-check a spec with quantization.method one of {', '.join(GEMM)}")
    kv = KV.get(str(q.kv_cache))
    if kv is None:
        raise ToolchainError(f"AIConfigurator has no KV-cache mode for {q.kv_cache}",
                             f"cross-check a spec with quantization.kv_cache one of {', '.join(KV)}")
    # `cli estimate` models the target model alone (its options name no draft model or heads), so a speculative
    # deployment would be estimated as plain decoding: refused rather than compared with a different thing.
    if spec.speculative.mode != "none":
        raise ToolchainError(f"AIConfigurator's estimate does not model speculative decoding "
                             f"({spec.speculative.mode})", "cross-check the candidate without it")
    wl = spec.validation.workload
    return [str(executable), "cli", "estimate", "--model-path", str(spec.model.checkpoint), "--system", system,
            "--backend", "trtllm", "--estimate-mode", "agg", "--isl", str(wl.input_tokens),
            "--osl", str(wl.output_tokens), "--batch-size", str(batch_size),
            "--tp-size", str(spec.parallelism.tp), "--pp-size", str(spec.parallelism.pp),
            "--gemm-quant-mode", gemm, "--kvcache-quant-mode", kv,
            "--free-gpu-memory-fraction", str(spec.serving.kv_cache_free_gpu_mem_fraction),
            "--no-color", "--log-level", "ERROR"]


def disagg_command(model_path: Path | str, system: str, isl: int, osl: int, prefill: tuple[int, int, int],
                   decode: tuple[int, int, int], gemm: str, kv: str,
                   executable: Path | str = "aiconfigurator") -> list[str]:
    """`aiconfigurator cli estimate --estimate-mode disagg` for prefill and decode workers given as (tp, batch
    size, workers) each, pp 1 (the four per-role options 0.12.0 requires in that mode)."""
    (ptp, pbs, pw), (dtp, dbs, dw) = prefill, decode
    return [str(executable), "cli", "estimate", "--model-path", str(model_path), "--system", system,
            "--backend", "trtllm", "--estimate-mode", "disagg", "--isl", str(isl), "--osl", str(osl),
            "--prefill-tp-size", str(ptp), "--prefill-pp-size", "1", "--prefill-batch-size", str(pbs),
            "--prefill-num-workers", str(pw), "--decode-tp-size", str(dtp), "--decode-pp-size", "1",
            "--decode-batch-size", str(dbs), "--decode-num-workers", str(dw),
            "--gemm-quant-mode", gemm, "--kvcache-quant-mode", kv, "--no-color", "--log-level", "ERROR"]


def install_command(venv: Path = VENV) -> str:
    """The shell command that makes the venv by hand (what ensure_venv runs)."""
    return f"python3 -m venv {venv} && {venv}/bin/pip install aiconfigurator=={VERSION}"


def ensure_venv(venv: Path = VENV) -> Path:
    """The aiconfigurator executable of `venv`, creating the venv and installing aiconfigurator==0.12.0 into it
    the first time (a marker file says the install completed)."""
    exe = venv / "bin" / "aiconfigurator"
    marker = venv / f".aiconfigurator-{VERSION}"
    if marker.is_file() and exe.is_file():
        return exe
    print(f"==> installing aiconfigurator {VERSION} into {venv} (once) ...", file=sys.stderr)
    try:
        if not (venv / "bin" / "python").is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", f"aiconfigurator=={VERSION}"],
                       check=True, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        tail = (err.stderr or err.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise ToolchainError(f"could not install aiconfigurator {VERSION} into {venv}: {tail[0]}",
                             f"check the network, or make it by hand: {install_command(venv)}") from None
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"installing aiconfigurator {VERSION} into {venv} took over {INSTALL_TIMEOUT_S} s",
                             f"retry, or make it by hand: {install_command(venv)}") from None
    marker.write_text(f"aiconfigurator=={VERSION}\n")
    return exe


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]
"""Runs an `aiconfigurator` command line and returns its exit status and text output."""


def run_command(cmd: list[str]) -> "subprocess.CompletedProcess[str]":
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"aiconfigurator ran over {RUN_TIMEOUT_S} s", "drop --cross-check") from None


def estimate(spec, device: Gpu, batch_size: int, venv: Path = VENV, *, executable: Path | str | None = None,
             runner: Runner = run_command) -> Estimate:
    """Run AIConfigurator on the spec at `batch_size` and return its labelled figures. `executable` skips the
    venv check (a caller that made it once); `runner` runs the command line (tests feed a recorded report)."""
    cmd = command(spec, device, batch_size, executable or ensure_venv(venv))
    done = runner(cmd)
    if done.returncode != 0:
        last = ((done.stderr or "").strip().splitlines() or ["no output"])[-1]
        # 0.12.0 names the quantization its database lacks ("GEMM perf data missing for quant 'sq' at <dir>;
        # available: [...]"): said in a few words, the directory left to the hint's command
        missing = re.search(r"perf data missing for quant '([^']+)'.*available: (\[[^]]*\])", last)
        if missing:
            system = cmd[cmd.index("--system") + 1]
            raise ToolchainError(f"no {system} data for {missing.group(1)} (has {missing.group(2)})",
                                 f"run it by hand: {' '.join(cmd)}")
        raise ToolchainError(f"aiconfigurator failed: {last}", f"run it by hand: {' '.join(cmd)}")
    return parse(done.stdout)
