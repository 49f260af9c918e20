"""A gateway that holds each answer whole, as LiteLLM's proxy was seen to (issue 31): it reads
the upstream's whole response before it sends the client anything, then writes the headers and
each event in a write of its own, ``GAP_S`` apart. Every event reaches the client in a read of
its own, so no read looks like a burst; only the arrival pattern against the stream's length
gives the hold away (``RequestSample.held``).

``serve(upstream)`` runs it in a thread of the test process and yields its URL.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

GAP_S = 0.0005          # between two events' writes
_TIMEOUT_S = 60.0


async def _head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None     # the client closed its kept-alive connection


def _field(head: bytes, name: bytes) -> bytes | None:
    m = re.search(rb"\r\n" + name + rb":[ \t]*([^\r\n]*)", head, re.I)
    return m.group(1).strip() if m else None


async def _dechunk(reader: asyncio.StreamReader) -> bytes:
    body = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")      # no trailers from the servers used here
            return body
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _whole_answer(host: str, port: int, head: bytes, body: bytes) -> tuple[bytes, bytes]:
    """Ask the upstream on a connection of its own and wait for its whole answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = re.sub(rb"\r\nConnection:[^\r\n]*", b"", head, flags=re.I)
        writer.write(head[:-2] + b"Connection: close\r\n\r\n" + body)
        await writer.drain()
        rhead = await reader.readuntil(b"\r\n\r\n")
        if (_field(rhead, b"Transfer-Encoding") or b"").lower() == b"chunked":
            return rhead, await _dechunk(reader)
        length = _field(rhead, b"Content-Length")
        return rhead, await (reader.readexactly(int(length)) if length else reader.read())
    finally:
        writer.close()


async def _client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  host: str, port: int) -> None:
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = asyncio.get_running_loop()
    try:
        while (head := await _head(reader)) is not None:
            body = await reader.readexactly(int(_field(head, b"Content-Length") or 0))
            rhead, answer = await asyncio.wait_for(_whole_answer(host, port, head, body),
                                                   _TIMEOUT_S)
            status = rhead.split(b"\r\n", 1)[0].replace(b"HTTP/1.0", b"HTTP/1.1")
            ctype = _field(rhead, b"Content-Type") or b"text/event-stream"
            writer.write(status + b"\r\nContent-Type: " + ctype
                         + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            # The held answer goes out an event a write, on a schedule (a late wake-up
            # shortens the next gap): what the client sees of a gateway that waited for it.
            events = [e + b"\n\n" for e in re.split(rb"\r?\n\r?\n", answer) if e.strip()]
            start = loop.time()
            for i, event in enumerate(events):
                await asyncio.sleep(max(0.0, start + i * GAP_S - loop.time()))
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


@contextmanager
def serve(upstream: str) -> Iterator[str]:
    """The relay on a free loopback port in front of ``upstream`` (http://host:port), in a
    thread of its own; stopped after (asyncio.run cancels what is still open)."""
    up = urlsplit(upstream)
    host, port = up.hostname or "127.0.0.1", up.port or 80
    ready = threading.Event()
    found: list[tuple[str, asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        server = await asyncio.start_server(lambda r, w: _client(r, w, host, port),
                                            "127.0.0.1", 0)
        found.append((f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                      asyncio.get_running_loop(), stop))
        ready.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the hold relay did not start"
    url, loop, stop = found[0]
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
