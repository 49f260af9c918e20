"""Servers on loopback that send the exact bytes of real engines' streams the embedded target
does not: Hugging Face ``transformers serve`` (an OpenAI chat stream that never sends
``data: [DONE]``; bytes from shared notes "real-engines") and the Responses API's error and
incomplete endings. Each event is its own HTTP chunk, as uvicorn sends them.

In a thread of the test process (``serve``), or alone: ``python tests/format_servers.py``
prints ``LISTENING http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit

from tests.stream_servers import ChunkedEvents, serve_in_thread

GAP_S = 0.002           # between two events
WORDS = (" measure", " the", " stream", " as", " it", " is", " sent", " now")


class Handler(ChunkedEvents):
    gap_s = GAP_S

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        url = urlsplit(self.path)
        case = parse_qs(url.query).get("case", ["ok"])[0]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if url.path.endswith("/responses"):
            self._responses(body, case)
        else:
            self._transformers(body, case)

    def _cut(self) -> None:
        # The connection closes inside the chunked body: no terminator.
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    # --- transformers serve (transformers 5.x) ---------------------------------------------

    def _transformers(self, body: dict[str, object], case: str) -> None:
        """``case``: ok (finish chunk with usage, terminator, no [DONE]), no-finish (content
        then the terminator), cut (the finish chunk, then the connection closes)."""
        n = body.get("max_tokens")
        n = n if isinstance(n, int) and n > 0 else 32
        base = {"created": int(time.time()), "model": "Qwen/Qwen2.5-0.5B-Instruct",
                "object": "chat.completion.chunk", "system_fingerprint": ""}
        rid = f"chatcmpl-{threading.get_ident() % 100000}-{time.monotonic_ns()}"

        def chunk(choice: dict[str, object], **extra: object) -> dict[str, object]:
            # The key order of transformers' chunks: id, choices, then the rest.
            return {"id": rid, "choices": [choice], **base, **extra}

        self._event(chunk({"delta": {"role": "assistant"}, "index": 0}))
        for i in range(n):
            self._event(chunk({"delta": {"content": WORDS[i % len(WORDS)]}, "index": 0}))
        if case == "no-finish":
            self._end()
            return
        self._event(chunk({"delta": {}, "index": 0, "finish_reason": "length"},
                          usage={"completion_tokens": n, "prompt_tokens": 37,
                                 "total_tokens": n + 37}))
        if case == "cut":
            self._cut()
            return
        self._end()

    # --- the Responses API's other endings -------------------------------------------------

    def _responses(self, body: dict[str, object], case: str) -> None:
        """``case``: failed (two deltas, response.failed), error (two deltas, an ``error``
        event), filtered (two deltas, response.incomplete for a content filter), cut (two
        deltas, then the body ends with no terminal event)."""
        seq = iter(range(1000))
        response = {"id": "resp_67ccd2bed1ec8190b14f964abc054267", "object": "response",
                    "created_at": int(time.time()), "status": "in_progress", "error": None,
                    "incomplete_details": None, "model": "gpt-4.1-2025-04-14", "output": [],
                    "usage": None}

        def typed(kind: str, **fields: object) -> None:
            self._event({"type": kind, "sequence_number": next(seq), **fields}, kind)

        typed("response.created", response=response)
        typed("response.in_progress", response=response)
        typed("response.output_item.added", output_index=0,
              item={"id": "msg_1", "type": "message", "status": "in_progress", "content": [],
                    "role": "assistant"})
        for word in WORDS[:2]:
            typed("response.output_text.delta", item_id="msg_1", output_index=0,
                  content_index=0, delta=word, logprobs=[])
        usage = {"input_tokens": 12, "output_tokens": 2, "total_tokens": 14}
        if case == "failed":
            typed("response.failed", response={
                **response, "status": "failed",
                "error": {"code": "server_error", "message": "The model crashed mid-answer"}})
        elif case == "error":
            typed("error", code="rate_limit_exceeded", message="Slow down, please", param=None)
        elif case == "filtered":
            typed("response.incomplete", response={
                **response, "status": "incomplete", "usage": usage,
                "incomplete_details": {"reason": "content_filter"}})
        self._end()


@contextmanager
def serve() -> Iterator[str]:
    """The server on a free loopback port, in a thread of this process; yields its URL."""
    with serve_in_thread(Handler) as url:
        yield url


if __name__ == "__main__":
    with serve() as url:
        print(f"LISTENING {url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            sys.exit(0)
