"""Digest every artefact the toolchain writes or prints for the specs in build/, so a refactor can show
that nothing a GPU host or a user reads changed.

    python -m tools.artefact_digest --out before.json        # on the old commit
    python -m tools.artefact_digest --out after.json         # on the new one
    python -m tools.artefact_digest --compare before.json after.json

Per spec: `plan --json`, the dry runs of convert and build-engine, `serve --print` and
`--manifests`, `dynamo --print`/`--manifests` where the spec has workers, and, for specs whose
weights are here, a real convert, build-engine (the fake trtllm-build 1.2.1 of tests/ for target
trtllm) and model-repo, each output file by its SHA-256. The tiny Llama is also run through every
quantization method and KV-cache format on targets cpu, trtllm and llmapi-cpu. Manifests are left
out (they record hashes of the settings each stage reads, which a refactor may rightly re-key), and
the temporary directory holding the workspace is written as <TMP> wherever it is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE_BUILD = REPO / "tests" / "fake_trtllm_build"
TINY = REPO / "build" / "tiny-llama.yaml"
QUANT_VARIANTS = [
    ["quantization.method=int8_wo"], ["quantization.method=int4_wo"],
    ["quantization.method=awq"], ["quantization.method=awq", "quantization.group_size=64"],
    ["quantization.method=smoothquant"], ["quantization.method=fp8"],
    ["quantization.kv_cache=int8"], ["quantization.kv_cache=fp8"],
]
TARGET_VARIANTS = [["target=trtllm", "gpu.name=H100 80GB"], ["target=llmapi-cpu"], ["target=llmapi", "gpu.name=H100 80GB"]]


# What differs from run to run by design: the temporary directories of atomic writes (pid and a random
# suffix), the Python backend's shared-memory prefix (pid and a random suffix) and the free port each
# Dynamo worker's system server is given.
_VOLATILE = [(re.compile(r"\.([\w.-]+)\.(tmp|old)-\d+-\w+"), r".\1.\2-<PID>"),
             (re.compile(r"shm-region-prefix-name=tc\d+_[0-9a-f]+_"), "shm-region-prefix-name=<SHM>"),
             (re.compile(r"DYN_SYSTEM_PORT=\d+"), "DYN_SYSTEM_PORT=<PORT>")]


def normalize(text: str, tmp: Path) -> str:
    """`text` with the temporary directory as <TMP>, the checkout as <REPO> and the volatile names fixed."""
    text = text.replace(str(tmp), "<TMP>").replace(str(REPO), "<REPO>")
    for pattern, fixed in _VOLATILE:
        text = pattern.sub(fixed, text)
    return text


def _run(root: Path, argv: list[str]) -> tuple[int, str]:
    """(exit status, stdout + stderr with the temporary directory spelled <TMP>) of one in-process CLI call."""
    from toolchain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["--root", str(root), *argv])
        except SystemExit as exc:  # click's standalone mode
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, normalize(out.getvalue() + "\n--stderr--\n" + err.getvalue(), root.parent)


def _tree(path: Path, root: Path) -> dict[str, str]:
    """SHA-256 of each file under `path` but manifests, with <TMP> for the temporary directory in text files."""
    digests = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"):
        data = file.read_bytes()
        with contextlib.suppress(UnicodeDecodeError):
            data = normalize(data.decode(), root.parent).encode()
        digests[str(file.relative_to(path))] = hashlib.sha256(data).hexdigest()
    return digests


def _digest_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest_spec(spec: Path, sets: list[str], full: bool) -> dict:
    """Everything one spec (with `--set` overrides) prints and writes, in a fresh workspace."""
    overrides = [arg for s in sets for arg in ("--set", s)]
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="digest-") as tmp:
        root = Path(tmp) / "ws"
        root.mkdir()
        printed = {
            "plan": ["plan", str(spec), "--json"],
            "convert-dry": ["convert", str(spec), "--dry-run"],
            "build-dry": ["build-engine", str(spec), "--dry-run"],
            "serve-print": ["serve", str(spec), "--print"],
            "serve-manifests": ["serve", str(spec), "--manifests", str(Path(tmp) / "k8s")],
            "dynamo-print": ["dynamo", str(spec), "--print"],
            "dynamo-manifests": ["dynamo", str(spec), "--manifests", str(Path(tmp) / "dgd")],
        }
        record = Path(tmp) / "trtllm-build-calls.jsonl"
        os.environ["FAKE_TRTLLM_BUILD_RECORD"] = str(record)
        for stage in ("convert", "build-engine", "model-repo") if full else ():
            rc, text = _run(root, [stage, str(spec), *overrides])
            result[stage] = {"rc": rc}
            if rc:
                result[stage]["sha256"] = _digest_text(text)
                break
        if record.is_file():
            result["trtllm-build-calls"] = _digest_text(normalize(record.read_text(), root.parent))
        for sub in ("engines", "model_repo"):
            if (root / sub).is_dir():
                result[sub] = _tree(root / sub, root)
        # The printed commands last, so that those needing an engine or a repository see one.
        for key, argv in printed.items():
            rc, text = _run(root, argv + overrides)
            result[key] = {"rc": rc, "sha256": _digest_text(text)}
        for key, sub in (("serve-manifests", "k8s"), ("dynamo-manifests", "dgd")):
            if (Path(tmp) / sub).is_dir():
                result[key]["files"] = _tree(Path(tmp) / sub, root)
    return result


def _has_weights(spec: Path) -> bool:
    import yaml

    ckpt = (spec.parent / yaml.safe_load(spec.read_text())["model"]["checkpoint"]).resolve()
    return any(ckpt.glob("*.safetensors"))


def collect(only: str | None = None) -> dict:
    """Every digest, or those whose key holds `only`."""
    os.environ["PATH"] = f"{FAKE_BUILD}{os.pathsep}{os.environ['PATH']}"
    os.environ["PYTHONPATH"] = str(FAKE_BUILD / "site")  # the fake's tensorrt_llm 1.2.1 metadata
    runs: dict[str, dict] = {}
    for spec in sorted((REPO / "build").glob("*.yaml")):
        if only and only not in spec.name:
            continue
        print(f"digest {spec.name}", file=sys.stderr)
        runs[spec.name] = digest_spec(spec, [], _has_weights(spec))
    for target in [[]] + TARGET_VARIANTS:
        for quant in [[]] + QUANT_VARIANTS:
            sets = target + quant
            if not sets:
                continue
            key = f"{TINY.name} " + " ".join(sets)
            if only and only not in key:
                continue
            print(f"digest {key}", file=sys.stderr)
            runs[key] = digest_spec(TINY, sets, full=True)
    return runs


def compare(before: dict, after: dict) -> list[str]:
    """One line per difference between two digests."""
    lines = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b:
            if a is None or b is None:
                lines.append(f"{key}: only in {'after' if a is None else 'before'}")
                continue
            for part in sorted(set(a) | set(b)):
                if a.get(part) != b.get(part):
                    x, y = a.get(part), b.get(part)
                    if not (isinstance(x, dict) and isinstance(y, dict)):
                        lines.append(f"{key}: {part} differs")
                        continue
                    files = sorted(f for f in set(x) | set(y) if x.get(f) != y.get(f))
                    lines.append(f"{key}: {part} differs: {', '.join(files[:6])}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the digest here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--only", metavar="TEXT", help="only the digests whose key holds TEXT")
    args = parser.parse_args()
    if args.compare:
        diff = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(diff) or "identical")
        return 1 if diff else 0
    runs = collect(args.only)
    text = json.dumps(runs, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
