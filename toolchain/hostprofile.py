"""This host's measured profile: what the performance model needs to predict the CPU engine here.

`toolchain probe-host` (toolchain/engine/probe.py) runs the CPU engine's own kernels on synthetic shapes once and
stores what it measured here, as JSON under the user's cache directory. The file's name is a hash of everything
that makes a profile stale: the CPU model, the cores this process may use, the torch version, the threads the
engine runs with, and the engine code itself (a hash of toolchain/engine/cpu/*.py), so a profile taken before any
of them changed is never read; `probe-host --force` measures again regardless. Reading a profile never measures:
`toolchain plan` only says how to make one when there is none.

This module holds the data and the cache, nothing that imports torch, so the planner can read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_file

PROFILE_VERSION = 2
"""Bumped when the profile's fields or their meaning change: older files are then stale."""

ENGINE_DIR = Path(__file__).resolve().parent / "engine" / "cpu"


@dataclass(frozen=True)
class HostKey:
    """What a profile is valid for."""

    cpu: str
    cores: int
    torch: str
    threads: int
    engine: str
    """sha256 (12 hex) of the CPU engine's code."""

    def digest(self) -> str:
        text = json.dumps({**asdict(self), "version": PROFILE_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HostProfile:
    """Rates of the CPU engine's kernels on this host, at `key.threads` torch threads."""

    key: HostKey
    measured_at: str
    """ISO date and time (UTC) of the measurement."""
    seconds: float
    """How long the probe took."""
    stream_gb_s: float
    """GB/s the fp32 matrix-vector product (a decode step's linear) reads weights at, from a working set far
    larger than the last-level cache: main-memory bandwidth as the engine meets it."""
    cache_gb_s: float
    """The same from a working set that fits the last-level cache (a quarter of it)."""
    cache_bytes: int
    """Size of the last-level cache; a step whose weights fit it reads them at cache_gb_s."""
    gemm_gflops: dict[str, dict[str, float]]
    """Per precision the engine computes in ("fp32", "bf16", "int8_wo", "int4_wo", "int8"), GFLOP/s (GOP/s for
    int8) of its linear kernel by rows per call ("1", "16", ...): a skinny call reaches less of the peak."""
    attention_gb_s: float
    """Bytes of cached K/V per second a decode step's attention gets through: the gather out of the paged pool
    (index_select) and the scaled-dot-product call over it."""
    attention_gflops: float
    """GFLOP/s of a context chunk's causal attention (4 x heads x head_size per query-key pair)."""
    step_us: float
    """Fixed cost of one engine iteration (scheduler, batch assembly, Python) beyond its kernels."""
    layer_us: float
    """Cost per decoder layer of each rank shard a step runs, beyond its kernels (the Python of the layer's ops:
    norms, rotary, cache writes, the sums), measured on the tiny model at tp 1 and 2 in one process."""
    sequence_us: float
    """Cost per sequence in a step beyond its kernels (sampling, its attention rows, the callback)."""
    gloo: dict[str, float] | None = None
    """Rank exchange between processes (engine/cpu/comm.py): {"latency_us", "gb_s"} of two rank processes alone,
    and with the serving probe "served_latency_us", the fixed cost an exchange has when the ranks serve beside
    tritonserver (probe_host.probe_ranks); None when not measured."""
    serving: dict | None = None
    """The served path's costs, measured through it (tritonserver's ensemble over gRPC, streaming, with this
    toolchain's bench as the client) on the embedded tiny model: {"protocol", "step_us", "sequence_us",
    "request_us", "measured": {...}}. step_us and sequence_us are the whole per-step and per-sequence costs beyond
    the kernels and the per-layer cost (scheduler, sampling and the responses' way out), and stand in for the
    engine-only step_us and sequence_us; request_us is a request's way to its first step and its first token's
    way back (preprocessing, the ensemble's hops, gRPC). None when not measured."""
    notes: list[str] = field(default_factory=list)

    def gemm_peak(self, precision: str) -> float | None:
        """GFLOP/s at the most rows measured."""
        curve = self.gemm_gflops.get(precision)
        if not curve:
            return None
        return curve[max(curve, key=int)]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HostProfile":
        return cls(**{**data, "key": HostKey(**data["key"])})

    @property
    def date(self) -> str:
        return self.measured_at[:10]


def cache_dir() -> Path:
    """Where profiles live: $XDG_CACHE_HOME (or ~/.cache)/trtllm-toolchain/host-profile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trtllm-toolchain" / "host-profile"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def engine_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(ENGINE_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def resolve_threads(threads: int) -> int:
    """The engine's threads as serving.engine_threads means them: 0 is every core this process may use."""
    if threads < 0:
        raise ToolchainError(f"threads {threads} must be >= 0", "pass 0 (every core) or a count")
    return threads or usable_cores()


def current_key(threads: int) -> HostKey:
    return HostKey(cpu_model(), usable_cores(), torch_version(), resolve_threads(threads), engine_hash())


def profile_path(key: HostKey, root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"threads{key.threads}-{key.digest()}.json"


def load_profile(threads: int, root: Path | None = None) -> HostProfile | None:
    """The profile measured on this host for `threads` engine threads, or None when there is none or it is stale
    (a key changed) or unreadable."""
    key = current_key(threads)
    path = profile_path(key, root)
    try:
        data = json.loads(path.read_text())
        profile = HostProfile.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return profile if profile.key == key else None


def save_profile(profile: HostProfile, root: Path | None = None) -> Path:
    path = profile_path(profile.key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(json.dumps(profile.as_dict(), indent=2) + "\n")
    return path


def missing_note(threads: int) -> str:
    """What plan and bench say when no profile exists for these threads."""
    flag = "" if threads == 1 else f" --threads {threads}"
    return f"no profile of this host for {resolve_threads(threads)} engine thread(s): run `toolchain probe-host{flag}`"
