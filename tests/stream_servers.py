"""What the tests' hand-written streaming servers share (tests/format_servers.py,
tests/part_servers.py): a handler that sends each SSE event as its own HTTP chunk ``gap_s``
apart with TCP_NODELAY (as uvicorn and llama-server send them), and a server on a free
loopback port in a thread of the test process."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def compact(obj: object) -> bytes:
    """JSON as servers send it: no spaces."""
    return json.dumps(obj, separators=(",", ":")).encode()


class ChunkedEvents(BaseHTTPRequestHandler):
    """HTTP/1.1, quiet, each event its own chunk; a subclass says ``gap_s`` and ``do_POST``."""

    protocol_version = "HTTP/1.1"
    gap_s = 0.002

    def setup(self) -> None:
        super().setup()
        # As uvicorn does: each event leaves at once, not held for the peer's delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()
        time.sleep(self.gap_s)

    def _event(self, obj: object, name: str | None = None) -> None:
        """One SSE event (``obj`` as JSON, or bytes as they are) in a chunk of its own."""
        head = b"" if name is None else b"event: " + name.encode() + b"\n"
        self._chunk(head + b"data: " + (obj if isinstance(obj, bytes) else compact(obj))
                    + b"\n\n")

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")       # the chunked terminator: the body ended cleanly
        self.wfile.flush()


@contextmanager
def serve_in_thread(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler``'s server on a free loopback port, in a thread of this process; yields its
    URL and stops it after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
