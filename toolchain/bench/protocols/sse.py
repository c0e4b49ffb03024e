"""HTTP plumbing shared by the SSE transports (Triton generate_stream, OpenAI).

Requests go through `http1.Http1Pool` (keep-alive connections, as many as
requests in flight, so none queues inside the client) with no overall timeout
(the caller times each request). An SSE event is stamped the
moment its `data:` line has been read; comment lines and other fields are
skipped. A non-2xx answer becomes one line naming the status and the
server's message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import AsyncIterator

from toolchain.errors import ToolchainError
from toolchain.bench.protocols.http1 import Http1Pool


def normalize_http_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ToolchainError(f"bad HTTP URL '{url}'", "pass --url http://host:port")
    return url


def get_json(url: str, timeout_s: float = 5.0, method: str = "GET", body: dict | None = None):
    """Sync JSON call for the checks before a run. Raises ToolchainError for an unreachable server,
    returns (status, parsed body or text) otherwise."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        base = url.split("/v")[0]
        raise ToolchainError(f"server not reachable at {base} ({reason})",
                             "start it, or pass --url with the right host:port") from None
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def error_text(status: int, payload) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("message", payload))
        if isinstance(err, dict):
            err = err.get("message", err)
        payload = err
    return f"HTTP {status}: " + " ".join(str(payload).split())[:180]


class HttpClient:
    """Base of the SSE transports: a keep-alive pool (protocols.http1) opened per run."""

    url: str

    def __init__(self):
        self.http = None

    async def open(self) -> None:
        self.http = Http1Pool(self.url)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None

    async def events(self, resp) -> AsyncIterator[tuple[int, str]]:
        """(arrival ns, data payload) for each SSE `data:` line of a response."""
        async for line in resp.lines():
            t = time.perf_counter_ns()
            if line.startswith(b"data:"):
                yield t, line[5:].strip().decode("utf-8", "replace")
