"""A lean HTTP/1.1 client on asyncio streams, for the timed requests.

Why not aiohttp here: the time from "send" to the request's bytes leaving the
socket is part of every TTFT this harness reports, and aiohttp's request path
costs ~0.35 ms of Python per request on a 2-core host (measured against this
client and against perf_analyzer on the OpenAI mock; benchmarks/README.md).
A request here is one write of pre-built bytes; the response is read as
status line, headers, then the body (chunked, Content-Length or until close)
line by line, so each SSE line can be stamped as it arrives.

Connections are kept alive and reused, one request at a time each (no
pipelining), and a pool grows to the number of requests in flight. A request
that fails on a reused connection before any response byte arrived is sent
again on a fresh one: the server may have closed the idle connection.
Closing a response before its end drops the connection, which is how an
HTTP client cancels a streamed request; leaving its `async with` normally
reads the few bytes after `[DONE]` first, so the connection is kept.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import AsyncIterator
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 0.1  # a caller that stops at `data: [DONE]` leaves the body's last bytes unread


class Http1Error(ConnectionError):
    pass


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class Http1Response:
    def __init__(self, pool: "Http1Pool", conn: _Connection, status: int, headers: dict[str, str], version: str):
        self._pool = pool
        self._conn: _Connection | None = conn  # None once closed
        self.status, self.headers = status, headers
        encoding = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in encoding
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self._keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close" and (
            self._chunked or self._length is not None)
        self._done = False
        self._body = self._pieces()  # one reader of the body, shared by lines(), read() and the drain

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: chunk payloads, or reads of a Content-Length / until-close body."""
        if self._conn is None:
            raise Http1Error("response body read after the response was closed")
        r = self._conn.reader
        if self._chunked:
            while True:
                size_line = await r.readline()
                if not size_line:
                    raise Http1Error("server closed the connection mid-response")
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise Http1Error(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                data = await r.readexactly(size)
                if await r.readexactly(2) != b"\r\n":
                    raise Http1Error("chunk longer than its size line says")
                yield data
        elif self._length is not None:
            left = self._length
            while left:
                data = await r.read(min(left, 1 << 16))
                if not data:
                    raise Http1Error("server closed the connection mid-response")
                left -= len(data)
                yield data
        else:
            while data := await r.read(1 << 16):
                yield data
        self._done = True

    async def lines(self) -> AsyncIterator[bytes]:
        """Body lines with their line ends, each yielded as soon as it is complete."""
        buf = b""
        async for data in self._body:
            buf += data
            start = 0
            while (end := buf.find(b"\n", start)) >= 0:
                yield buf[start:end + 1]
                start = end + 1
            buf = buf[start:]
        if buf:
            yield buf

    async def read(self) -> bytes:
        return b"".join([p async for p in self._body])

    async def payload(self):
        """The body as JSON where it parses, else as text (for error messages)."""
        raw = await self.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")

    def close(self) -> None:
        """Drop the connection unless the body was read to its end on a keep-alive connection."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep:
            self._pool.release(conn)
        else:
            conn.close()

    async def __aenter__(self) -> "Http1Response":
        return self

    async def __aexit__(self, exc_type, *_) -> None:
        # Left normally before the end (an SSE client stops at [DONE]): read the rest, which is
        # already on its way, so the connection can be reused instead of reopened (~0.5 ms).
        if exc_type is None and self._conn is not None and self._keep and not self._done:
            try:
                await asyncio.wait_for(self._drain(), DRAIN_TIMEOUT_S)
            except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                pass
        self.close()

    async def _drain(self) -> None:
        async for _ in self._body:
            pass


class Http1Pool:
    """Keep-alive connections to one origin; `base_url` may carry a path prefix."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._idle: list[_Connection] = []
        self._ssl = ssl.create_default_context() if self.https else None

    async def _connect(self) -> _Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=1 << 20), CONNECT_TIMEOUT_S)
        return _Connection(reader, writer)

    def release(self, conn: _Connection) -> None:
        self._idle.append(conn)

    def request_bytes(self, method: str, path: str, body: bytes, content_type: str = "application/json") -> bytes:
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\nAccept: */*\r\n\r\n")
        return head.encode("latin-1") + body

    async def post(self, path: str, body: bytes) -> Http1Response:
        """Send POST `path` and read the status line and headers."""
        raw = self.request_bytes("POST", path, body)
        while self._idle:
            conn = self._idle.pop()
            if conn.reader.at_eof() or conn.writer.is_closing():
                conn.close()
                continue
            try:
                return await self._exchange(conn, raw)
            except (_Unanswered, ConnectionResetError, BrokenPipeError):
                conn.close()  # closed by the server while idle: try the next one, then a fresh one
            except BaseException:
                conn.close()
                raise
        conn = await self._connect()
        try:
            return await self._exchange(conn, raw)
        except _Unanswered:
            conn.close()
            raise Http1Error("server closed the connection without answering") from None
        except BaseException:
            conn.close()
            raise

    async def _exchange(self, conn: _Connection, raw: bytes) -> Http1Response:
        conn.writer.write(raw)
        await conn.writer.drain()
        status_line = await conn.reader.readline()
        if not status_line:
            raise _Unanswered()
        try:
            version, code = status_line.decode("latin-1").split(None, 2)[:2]
            status = int(code)
        except ValueError:
            conn.close()
            raise Http1Error(f"not an HTTP response: {status_line[:60]!r}") from None
        headers: dict[str, str] = {}
        while True:
            line = await conn.reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                conn.close()
                raise Http1Error("server closed the connection inside the response headers")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return Http1Response(self, conn, status, headers, version)

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


class _Unanswered(Exception):
    """EOF before the status line (an idle connection the server had closed)."""
