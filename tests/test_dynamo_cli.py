"""`toolchain dynamo SPEC` on this host, as a user runs it: it serves until SIGTERM, then stops every process it
started and says so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
pytestmark = [pytest.mark.server, pytest.mark.extras]

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "build" / "tiny-llama-dynamo.yaml"


def _children(pid: int) -> set[int]:
    """Every process whose parent chain reaches `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def test_serves_until_sigterm_and_leaves_nothing(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from toolchain.cli import main; sys.exit(main())", "--root", str(tmp_path), "dynamo", str(SPEC),
                             "--set", "dynamo.http_port=0", "--workers", "1", "--timeout", "240"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        url = re.search(r"OpenAI\s+(http://\S+)/v1 \(model (\S+)\)", text)
        assert url, text
        req = urllib.request.Request(url.group(1) + "/v1/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": url.group(2), "prompt": "x = ", "max_tokens": 4}).encode())
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        started = _children(proc.pid)
        assert len(started) >= 2  # the frontend and the worker, at least
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Dynamo stopped" in rest, text + rest
    alive = {pid for pid in started if Path(f"/proc/{pid}").exists()}
    assert not alive
    assert list((tmp_path / "reports" / "tiny-llama-dynamo" / "dynamo").glob("*.log"))  # the logs stay
