"""Where tritonserver comes from and what it needs around it.

Three sources, in order: an explicit path (spec `serving.tritonserver`), a
`tritonserver` on PATH (an NGC container), and the server bundled in the
`nvidia-pytriton` wheel. The wheel's server needs help to run the Python
backend: a backend directory holding `libtriton_python.so`, the utils module
and the stub built for *this* interpreter's minor version, plus an environment
in which the stub (which embeds libpython and ignores PYTHONPATH) picks up this
environment's interpreter, standard library and site-packages.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError

PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    source: str  # "spec", "PATH" or "nvidia-pytriton"
    wheel_root: Path | None = None  # site-packages/pytriton/tritonserver when the binary is the wheel's

    @property
    def needs_backend_dir(self) -> bool:
        return self.wheel_root is not None


def _wheel_root_of(binary: Path) -> Path | None:
    """The wheel's `tritonserver/` directory if `binary` sits inside that layout."""
    root = binary.resolve().parent.parent
    if (root / "backends" / "python" / PYTHON_BACKEND_FILES[0]).is_file() and (root / "python_backend_stubs").is_dir():
        return root
    return None


def _wheel_binary() -> Path | None:
    try:
        import pytriton  # noqa: F401  (only located, never imported for its API)
    except ImportError:
        return None
    binary = Path(pytriton.__file__).resolve().parent / "tritonserver" / "bin" / "tritonserver"
    return binary if binary.is_file() else None


def resolve_binary(explicit: Path | str | None = None) -> ServerBinary:
    """Pick the tritonserver to run (explicit -> PATH -> nvidia-pytriton wheel)."""
    if explicit is not None:
        found = shutil.which(str(explicit)) if "/" not in str(explicit) else str(explicit)
        path = Path(found) if found else None
        if path is None or not path.is_file():
            raise ToolchainError(f"tritonserver binary not found: {explicit}",
                                 "fix serving.tritonserver or remove it to use the nvidia-pytriton server")
        return ServerBinary(path, "spec", _wheel_root_of(path))
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerBinary(Path(on_path), "PATH", _wheel_root_of(Path(on_path)))
    wheel = _wheel_binary()
    if wheel is not None:
        return ServerBinary(wheel, "nvidia-pytriton", _wheel_root_of(wheel))
    raise ToolchainError("no tritonserver found (no serving.tritonserver, none on PATH, no nvidia-pytriton wheel)",
                         "pip install nvidia-pytriton==0.7.0 or set serving.tritonserver")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trtllm-toolchain" / "triton-backends"


def backend_dir(server: ServerBinary, cache: Path | None = None) -> Path:
    """A `--backend-directory` holding `python/` for this interpreter; built once
    per (wheel, Python minor version) and reused."""
    assert server.wheel_root is not None
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server.wheel_root / "python_backend_stubs" / minor / STUB
    if not stub.is_file():
        have = sorted(p.name for p in (server.wheel_root / "python_backend_stubs").iterdir())
        raise ToolchainError(f"the nvidia-pytriton wheel has no Python backend stub for Python {minor} "
                             f"(has {', '.join(have)})",
                             "run the toolchain with one of those Python versions")
    sources = [server.wheel_root / "backends" / "python" / name for name in PYTHON_BACKEND_FILES] + [stub]
    key = hashlib.sha256("\0".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sources).encode())
    root = cache or _cache_root()
    final = root / f"py{minor}-{key.hexdigest()[:16]}"
    if (final / "python" / STUB).is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (CI): a per-user temp directory will do
        final = Path(tempfile.gettempdir()) / f"trtllm-toolchain-{os.getuid()}" / final.name
        if (final / "python" / STUB).is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
    # Built in a temp dir and renamed so concurrent servers never see half a copy.
    tmp = Path(tempfile.mkdtemp(prefix=".backends-", dir=final.parent))
    try:
        (tmp / "python").mkdir()
        for src in sources:
            shutil.copy2(src, tmp / "python" / src.name)
        (tmp / "python" / STUB).chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def server_env(server: ServerBinary, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs.

    The stub takes its stdlib and site-packages from the first `python` on PATH,
    so this environment's bin goes first; this interpreter's LIBDIR goes first on
    LD_LIBRARY_PATH (wheel server only) so the stub loads the same libpython
    patch release (a different one breaks `ssl`, and with it transformers)."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir])
    libs = []
    if server.wheel_root is not None:
        # Only for the wheel's stub, which we pick for this interpreter's minor
        # version; a container's stub brings its own libpython.
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir:
            libs.append(libdir)
        wheel_libs = server.wheel_root.parent.parent / "nvidia_pytriton.libs"
        if wheel_libs.is_dir():
            libs.append(str(wheel_libs))
    libs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p not in libs]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env
