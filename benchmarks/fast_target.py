"""A benchmark-only OpenAI streaming server that costs little per event, so that it is never
what bounds a client's events/s (``streams_sweep.py --target fast``).

    .venv/bin/python benchmarks/fast_target.py [--ttft-ms 100] [--itl-ms 20] [--tokens 50]
        [--per-write 1]

Prints its URL on stdout once it listens. The bytes are the embedded target's own (the OpenAI
encoder of ``streamquake.protocols``, with ``stamp_send_time``: every event opens with ``: t=<epoch
ns>``, read right before the write), but each response's events are encoded once and written
from bytes, ``--per-write`` events to a write (one HTTP chunk), over bare asyncio transports:
no aiohttp request handling, no per-token encoding, one timer per write. Events that share a
write share its stamp. Loopback only; every request gets the same answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamquake.protocols import get  # noqa: E402
from streamquake.protocols.base import STAMP_SLOT, Completion, GenRequest  # noqa: E402

_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n")
_MAX_HEAD = 64 * 1024


def _chunk(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class Frames:
    """One response's writes, pre-encoded: the first token (with the role chunk), a write of
    ``per_write`` tokens, the last write's remainder, and the closing events."""

    def __init__(self, tokens: int, per_write: int) -> None:
        enc = get("openai").encoder(GenRequest(model="sim-1", prompt_tokens=3, max_tokens=tokens,
                                               include_usage=True), False)
        enc.stamp_send_time = True
        token = json.dumps("tok ").encode()
        self.first = enc.token(token)
        self.one = enc.token(token)
        self.per_write = per_write
        self.closing = enc.closing(Completion(tokens, False))
        self.tokens = tokens


class Stream(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.left = 0               # tokens still to send in the response in progress
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.left == 0 and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self.transport.close()
                return
            head = self.buf[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.start()

    def start(self) -> None:
        assert self.transport is not None
        self.transport.write(_HEAD)
        s = self.server
        self.left = s.frames.tokens
        self.timer = s.loop.call_later(s.ttft_s, self.send)

    def send(self) -> None:
        if self.transport is None:
            return
        s, f = self.server, self.server.frames
        k = min(self.left, f.per_write)
        body = (f.first + f.one * (k - 1)) if self.left == f.tokens else f.one * k
        self.left -= k
        if self.left == 0:
            body += f.closing
        out = _chunk(body.replace(STAMP_SLOT, b"%d" % time.time_ns()))
        if self.left == 0:
            out += b"0\r\n\r\n"
            self.timer = None
        else:
            self.timer = s.loop.call_later(s.itl_s * k, self.send)
        self.transport.write(out)
        if self.left == 0 and self.buf:
            self.data_received(b"")      # a pipelined request waits here


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.loop = asyncio.get_running_loop()
        self.frames = Frames(args.tokens, args.per_write)
        self.ttft_s, self.itl_s = args.ttft_ms / 1000.0, args.itl_ms / 1000.0


async def serve(args: argparse.Namespace) -> None:
    server = Server(args)
    srv = await server.loop.create_server(lambda: Stream(server), "127.0.0.1", args.port,
                                          backlog=4096)
    port = srv.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=100.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--per-write", type=int, default=1)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
