"""The CPU engine's native kernels (csrc/), compiled on first use with this host's C++ compiler.

torch has no paged attention for CPU, and the gather-then-SDPA path costs a sixth of a decode step at 16 requests
(csrc/paged_attention.cpp says why). The kernels are built once per source, torch version and CPU into
$XDG_CACHE_HOME/trtllm-toolchain/cpu-kernels/ or $TOOLCHAIN_CPU_KERNELS_DIR (`make setup` builds them; a process
that finds them missing builds them itself, under torch's lock, so concurrent workers build once). Without a
compiler the engine keeps its torch path and says why in one line; TOOLCHAIN_CPU_NATIVE=0 keeps it there. The
kernels change speed, not what the engine accepts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

try:
    import ninja  # a dependency; a checkout installed without it may still find ninja on PATH
except ImportError:
    ninja = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_attention.cpp", "layer_ops.cpp")]
# -march=native: the build directory is keyed by this CPU's flags, so a cache shared between hosts never hands
# one the other's instructions. -ffp-contract=off: no fused multiply-adds, so elementwise results round as
# torch's separate operations do (layer_ops.cpp). -fopenmp: at::parallel_for is OpenMP inline in ATen's headers;
# the library then binds to the libgomp torch has loaded already (the same soname).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
ENV_SWITCH = "TOOLCHAIN_CPU_NATIVE"
DIR_VARIABLE = "TOOLCHAIN_CPU_KERNELS_DIR"
LIBRARY = "toolchain_cpu_kernels"
STALE_LOCK_S = 600  # a build takes about 10 s; a lock this old outlived the process that took it

_loaded: dict[str, Any] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def cache_dir() -> Path:
    """$TOOLCHAIN_CPU_KERNELS_DIR, else $XDG_CACHE_HOME (or ~/.cache)/trtllm-toolchain/cpu-kernels."""
    if os.environ.get(DIR_VARIABLE):
        return Path(os.environ[DIR_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trtllm-toolchain" / "cpu-kernels"


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()


def build_key() -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join([torch.__version__, platform.machine(), _cpu_flags(), *CFLAGS]).encode())
    return h.hexdigest()[:16]


def _build() -> Any:
    from torch.utils.cpp_extension import load

    where = cache_dir() / build_key()
    ready = where / "ready"  # written after a whole build: a library another process is still linking is not read
    if ready.exists():
        torch.ops.load_library(str(where / f"{LIBRARY}.so"))
        return torch.ops.toolchain_cpu
    where.mkdir(parents=True, exist_ok=True)
    lock = where / "lock"  # torch's FileBaton: a build killed midway leaves it, and every later load would wait on it
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    path = os.environ.get("PATH", "")
    if ninja is not None:  # the ninja wheel's binary, where the venv's bin is not on PATH
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        load(name=LIBRARY, sources=[str(s) for s in SOURCES], build_directory=str(where), extra_cflags=CFLAGS,
             is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    ready.touch()
    return torch.ops.toolchain_cpu


def ops() -> Any | None:
    """torch.ops.toolchain_cpu once built and loaded; None where disabled or unbuildable (logged once)."""
    if "ops" in _loaded:  # decided once per process: the engine's hot path asks on every layer
        return _loaded["ops"]
    _loaded["ops"] = None
    if enabled():
        try:
            _loaded["ops"] = _build()
        except Exception as e:  # no compiler, no headers, a failed build: the torch path stays, said once
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            log.warning("CPU engine: native kernels unavailable (%s); the engine runs on torch's path, slower",
                        last[:200])
    return _loaded["ops"]


def main() -> int:
    """What `make setup` runs: build now, and say where or why not."""
    start = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if ops() is None:
        print("    native CPU kernels not built; the CPU engine uses its torch path")
        return 0
    print(f"    native CPU kernels ready in {time.monotonic() - start:.0f} s: {cache_dir() / build_key()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
