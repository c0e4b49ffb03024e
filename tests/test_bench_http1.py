"""The harness's HTTP/1.1 client against a raw asyncio server: every body framing, keep-alive reuse,
an idle connection the server closed, cancellation by close, and malformed answers."""

from __future__ import annotations

import asyncio

import pytest

from toolchain.bench.protocols.http1 import Http1Error, Http1Pool


class RawServer:
    """Answers each request with the next canned reply; records requests and connections."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.connections = 0
        self.server = None

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
                             .split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if callable(reply):
                    if await reply(writer) == "close":
                        writer.close()
                        return
                    continue
                for piece in reply:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc):
        self.server.close()


def chunked(*parts: bytes) -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head] + [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


def run(coro):
    return asyncio.run(coro)


def test_chunked_sse_lines_split_across_chunks_and_keep_alive_reuse():
    async def main():
        srv = RawServer([chunked(b"data: {\"a\"", b": 1}\n\ndata: [DO", b"NE]\n\n"),
                         [b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", b"{\"b\": 2}\n"]])
        async with srv as url:
            pool = Http1Pool(url + "/prefix")
            async with await pool.post("/v1/completions", b'{"x": 1}') as resp:
                assert resp.status == 200
                lines = [ln async for ln in resp.lines()]
            assert lines == [b'data: {"a": 1}\n', b"\n", b"data: [DONE]\n", b"\n"]
            async with await pool.post("/v1/other", b"{}") as resp:
                assert await resp.payload() == {"b": 2}
            await pool.close()
        assert srv.connections == 1  # the second request reused the first connection
        assert srv.requests[0].startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
        assert srv.requests[0].endswith(b'\r\n\r\n{"x": 1}') and b"Content-Length: 8\r\n" in srv.requests[0]
    run(main())


def test_body_until_close_and_an_error_status_with_text():
    async def http10_until_close(writer):
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nline one\nline two")
        await writer.drain()
        return "close"

    async def main():
        srv = RawServer([[b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nno model!"], http10_until_close])
        async with srv as url:
            pool = Http1Pool(url)
            async with await pool.post("/x", b"") as resp:
                assert resp.status == 404 and await resp.payload() == "no model!"
            assert len(pool._idle) == 1  # a complete error answer leaves the connection reusable
            async with await pool.post("/y", b"") as resp:
                assert [ln async for ln in resp.lines()] == [b"line one\n", b"line two"]
            assert not pool._idle  # HTTP/1.0 without a length: the connection ends with the body
            await pool.close()
    run(main())


def test_stopping_at_done_keeps_the_connection():
    async def main():
        srv = RawServer([chunked(b"data: 1\n\n", b"data: [DONE]\n\n"), chunked(b"data: 2\n\n")])
        async with srv as url:
            pool = Http1Pool(url)
            async with await pool.post("/a", b"") as resp:
                async for line in resp.lines():
                    if line.startswith(b"data: [DONE]"):
                        break  # what the SSE readers do; the terminating chunk is still unread
            assert len(pool._idle) == 1
            async with await pool.post("/b", b"") as resp:
                assert [ln async for ln in resp.lines()] == [b"data: 2\n", b"\n"]
            await pool.close()
        assert srv.connections == 1
    run(main())


def test_idle_connection_closed_by_the_server_is_replaced():
    async def close_after_reply(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return "close"

    async def main():
        srv = RawServer([close_after_reply, [b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nyes"]])
        async with srv as url:
            pool = Http1Pool(url)
            async with await pool.post("/a", b"") as resp:
                assert await resp.read() == b"ok"
            await asyncio.sleep(0.05)  # the server has closed that connection by now
            async with await pool.post("/b", b"") as resp:
                assert await resp.read() == b"yes"
            await pool.close()
        assert srv.connections == 2 and len(srv.requests) == 2
    run(main())


def test_closing_mid_stream_drops_the_connection():
    async def slow_stream(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(50):
            writer.write(b"8\r\ndata: %d\n\r\n" % (i % 10))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        return None

    async def main():
        srv = RawServer([slow_stream, [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])
        async with srv as url:
            pool = Http1Pool(url)
            async with await pool.post("/s", b"") as resp:
                async for line in resp.lines():
                    if line.startswith(b"data: 2"):
                        break  # cancel after three events
            assert not pool._idle  # not reusable: the rest of the stream was never read
            async with await pool.post("/t", b"") as resp:
                assert await resp.read() == b"ok"
            await pool.close()
        assert srv.connections == 2
    run(main())


@pytest.mark.parametrize("reply, message", [
    ([b"SSH-2.0-OpenSSH_9\r\n"], "not an HTTP response"),
    ([b"HTTP/1.1 200 OK\r\nContent-Type: x\r\n"], "inside the response headers"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], "mid-response"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n"], "longer than its size"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "bad chunk size"),
])
def test_malformed_answers_are_one_line_errors(reply, message):
    async def answer_then_close(writer):
        for piece in reply:
            writer.write(piece)
        await writer.drain()
        return "close"

    async def main():
        srv = RawServer([answer_then_close])
        async with srv as url:
            pool = Http1Pool(url)
            with pytest.raises(Http1Error, match=message):
                async with await pool.post("/x", b"") as resp:
                    await resp.read()
            await pool.close()
    run(main())
