"""A hostile streaming target on 127.0.0.1, for tests: one behaviour per request path.

    python tests/hostile_server.py [CERT KEY]

Plain sockets, one thread per connection, every answer closes its connection (so each
request meets its behaviour on a fresh socket). Prints ``LISTENING http://127.0.0.1:P`` (and
`` https://127.0.0.1:Q`` with a certificate) once bound. ``/mixed`` rotates through the
behaviours request by request, for whole runs through the CLI (``/echo-mixed`` through the
ways a target can echo credentials). Bodies are the generic ``sse``
protocol: ``{"text": ...}`` events and a final ``{"done": true}``.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import itertools
import json
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Connection: close\r\n")
FINAL = b'data: {"done": true, "usage": {"output_tokens": 2}}\n\n'
TOKEN = b'data: {"text": "t "}\n\n'


class Request:
    def __init__(self, sock: socket.socket, method: str, target: str,
                 headers: dict[str, str]) -> None:
        self.sock = sock
        self.method = method
        self.path = urlsplit(target).path
        self.query = {k: v[-1] for k, v in parse_qs(urlsplit(target).query).items()}
        self.target = target
        self.headers = headers

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


def read_request(sock: socket.socket) -> Request | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk or len(buf) > 1 << 20:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(sock, method, target, headers)


def stream(req: Request, body: bytes, extra: bytes = b"") -> None:
    req.send(SSE_HEAD + extra + b"\r\n" + body)


def ok(req: Request) -> None:
    stream(req, b"id: 1\n" + TOKEN + b"id: 2\n" + TOKEN + b"id: 3\n" + FINAL)


def paced_forever(req: Request) -> None:
    """Valid events, one every 20 ms, never the final one."""
    req.send(SSE_HEAD + b"\r\n")
    while True:
        req.send(TOKEN)
        time.sleep(0.02)


def flood(req: Request) -> None:
    """Valid events as fast as the socket takes them, never the final one: a socket that never
    runs dry."""
    req.send(SSE_HEAD + b"\r\n")
    block = TOKEN * 4096
    while True:
        req.send(block)


def final_then_flood(req: Request) -> None:
    """A complete stream, then bytes forever where the body should end."""
    req.send(SSE_HEAD + b"\r\n" + TOKEN + TOKEN + FINAL)
    block = b": keep-alive\n" * 4096
    while True:
        req.send(block)


def silent(req: Request) -> None:
    req.send(SSE_HEAD + b"\r\n" + TOKEN + TOKEN)
    time.sleep(3600)


def big_event(req: Request) -> None:
    """One 10 MB event (the final one, so that a client without limits counts it a success)."""
    body = b'data: {"done": true, "pad": "' + b"x" * 10_000_000 + b'"}\n\n'
    req.send(SSE_HEAD + b"\r\n")
    for i in range(0, len(body), 65536):
        req.send(body[i:i + 65536])
    time.sleep(3600)


def endless_line(req: Request) -> None:
    req.send(SSE_HEAD + b"\r\n" + b"data: ")
    block = b"x" * 65536
    while True:
        req.send(block)


def data_forever(req: Request) -> None:
    """``data:`` lines forever, never the blank line that would end the event."""
    req.send(SSE_HEAD + b"\r\n")
    block = b'data: {"text": "never dispatched"}\n' * 2048
    while True:
        req.send(block)


def bad_json(req: Request) -> None:
    stream(req, TOKEN + b"data: {not json\n\n" + FINAL)


def html(req: Request) -> None:
    page = b"<html><body>Welcome to nginx!</body></html>"
    req.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nConnection: close\r\n"
             b"Content-Length: " + str(len(page)).encode() + b"\r\n\r\n" + page)


def status(req: Request) -> None:
    code = int(req.query.get("code", "503"))
    reason = {429: "Too Many Requests", 500: "Internal Server Error",
              503: "Service Unavailable"}.get(code, "Error")
    body = json.dumps({"error": {"message": f"{reason.lower()}, try later"}}).encode()
    retry = f"Retry-After: {req.query['retry']}\r\n".encode() if "retry" in req.query else b""
    req.send(f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n".encode() + retry
             + b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
             + body)


def reset(req: Request) -> None:
    """Half an event, then a TCP RST (SO_LINGER 0)."""
    req.send(SSE_HEAD + b"\r\n" + TOKEN + b'data: {"text": "hal')
    time.sleep(0.05)
    req.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    req.sock.close()


def slowloris(req: Request) -> None:
    """Response headers one byte at a time, 20 ms apart: they would take about 10 s."""
    head = SSE_HEAD + b"X-Padding: " + b"p" * 400 + b"\r\n\r\n"
    for byte in head:
        req.send(bytes([byte]))
        time.sleep(0.02)
    req.send(TOKEN + FINAL)


def hang(req: Request) -> None:
    time.sleep(3600)


def gzipped(req: Request) -> None:
    stream(req, gzip.compress(TOKEN + FINAL), b"Content-Encoding: gzip\r\n")


def bad_chunked(req: Request) -> None:
    """A valid first chunk, then a chunk header that is not hex (once the client reads the
    body, so that the body's framing, not the headers, is what breaks)."""
    req.send(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
             + b"%x\r\n" % len(TOKEN) + TOKEN + b"\r\n")
    time.sleep(0.2)
    req.send(b"zz-not-hex\r\n" + TOKEN)
    time.sleep(3600)


def chunk_extension_forever(req: Request) -> None:
    """Chunked framing whose chunk header never ends: bytes forever, no body byte."""
    req.send(SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"1;ext=")
    block = b"a" * 65536
    while True:
        req.send(block)


def redirect(req: Request) -> None:
    req.send(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + req.target.encode()
             + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def echo_key(req: Request) -> None:
    """A 401 that repeats the caller's credentials, as some APIs (and proxies) do."""
    seen = f"{req.headers.get('authorization', '')} {req.target}"
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {seen}"}}).encode()
    req.send(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
             b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
             + body)


def echo_key_event(req: Request) -> None:
    """HTTP 200, then an error event that repeats the credentials."""
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    error = json.dumps({"error": {"message": f"key {key} is revoked; query was {req.target}"}})
    stream(req, TOKEN + b"data: " + error.encode() + b"\n\n")


def echo_key_id(req: Request) -> None:
    """A good stream whose response id holds the key 110 characters in, across the cut."""
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    rid = json.dumps({"id": "r" * 110 + key + "/" + req.target, "text": "t "})
    stream(req, b"data: " + rid.encode() + b"\n\n" + TOKEN + FINAL)


def echo_key_redirect(req: Request) -> None:
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    req.send(b"HTTP/1.1 302 Found\r\nLocation: https://login.example/?api_key=" + key.encode()
             + b"&next=" + req.target.encode() + b"\r\nContent-Length: 0\r\n"
             b"Connection: close\r\n\r\n")


# What the endless heads send before they give up (a client without a bound on a response's
# head holds all of it; the old one grew without end): far past any sane head, yet bounded.
HEAD_FLOOD_BYTES = 16 << 20


def endless_headers(req: Request) -> None:
    """A status line, then 1 KB header lines as fast as the socket takes them, never a blank."""
    req.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
    line = b"X-Filler: " + b"f" * 1012 + b"\r\n"
    block = line * 64
    for _ in range(HEAD_FLOOD_BYTES // len(block)):
        req.send(block)


def endless_header_line(req: Request) -> None:
    """A status line, then one header line that never ends."""
    req.send(b"HTTP/1.1 200 OK\r\nX-Endless: ")
    block = b"e" * 65536
    for _ in range(HEAD_FLOOD_BYTES // len(block)):
        req.send(block)


def echo_key_part(req: Request) -> None:
    """A 401 that quotes the caller's key in part or transformed, as real APIs do (OpenAI:
    ``Incorrect API key provided: sk-abc123def4********wxyz``): ``how`` says which."""
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    how = req.query.get("how", "prefix").partition("?")[0]
    quoted = {"prefix": key[:12] + "********" + key[-4:], "upper": key.upper(),
              "reversed": key[::-1], "base64": base64.b64encode(key.encode()).decode(),
              "percent": urllib.parse.quote(key, safe=""),
              "middle": "..." + key[4:14] + "..."}[how]
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {quoted}"}}).encode()
    req.send(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
             b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
             + body)


def _openai(chunks: list[dict[str, object]], done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _chunk(delta: dict[str, object], finish: str | None = None,
           model: str = "tiny") -> dict[str, object]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _usage(tokens: int) -> dict[str, object]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny",
            "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}


def openai_served(req: Request) -> None:
    """llama-server's shape: a role chunk with content null, content chunks, a finish chunk,
    a usage chunk with no choices, [DONE]; it names its own model whatever was asked."""
    stream(req, _openai([_chunk({"role": "assistant", "content": None}),
                         *[_chunk({"content": "t"}) for _ in range(8)],
                         _chunk({}, "length"), _usage(8)]))


def openai_cut(req: Request) -> None:
    """llama-cpp-python's server when another request waits: [DONE] and no finish chunk."""
    stream(req, _openai([_chunk({"role": "assistant"}),
                         *[_chunk({"content": "t"}) for _ in range(3)]]))


def openai_short(req: Request) -> None:
    """A finished stream whose usage says 8 tokens, though 6 content events came."""
    stream(req, _openai([*[_chunk({"content": "t"}) for _ in range(6)], _chunk({}, "length"),
                         _usage(8)]))


def openai_empty(req: Request) -> None:
    """A finished stream with no generated text (a prompt the server cannot answer)."""
    stream(req, _openai([_chunk({"role": "assistant", "content": ""}), _chunk({}, "stop")]))


def openai_no_usage(req: Request) -> None:
    stream(req, _openai([*[_chunk({"content": "t"}) for _ in range(5)], _chunk({}, "stop")]))


def anthropic_cut(req: Request) -> None:
    """Anthropic's events with message_stop, but no message_delta saying why it stopped."""
    events = [("message_start", {"type": "message_start", "message": {"id": "msg_1"}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": "t"}}),
              ("message_stop", {"type": "message_stop"})]
    stream(req, b"".join(b"event: %s\ndata: %s\n\n" % (e.encode(), json.dumps(d).encode())
                         for e, d in events))


def fastapi_401(req: Request) -> None:
    """FastAPI's error shape, repeating the key deep in the text (llama-cpp-python's server)."""
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    body = json.dumps({"detail": "x" * 230 + f" Invalid API key: {key}"}).encode()
    req.send(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
             b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
             + body)


def plain_404(req: Request) -> None:
    body = b"File Not Found"
    req.send(b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nConnection: close\r\n"
             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def wrong_shape(req: Request) -> None:
    """Valid JSON events of the wrong shape for OpenAI, then [DONE] (issue 20)."""
    chunk: dict[str, object] = {"id": "c", "object": "chat.completion.chunk"}
    kind = req.query.get("kind", "no-choices")
    if kind == "null-choices":
        chunk["choices"] = None
    elif kind == "list-delta":
        chunk["choices"] = [{"index": 0, "delta": ["t"], "finish_reason": None}]
    stream(req, _openai([chunk, chunk, _chunk({}, "stop")]))


def echo_key_at(req: Request) -> None:
    """The caller's key ``offset`` characters into the text of one answer: ``how`` says which
    (an error body of each shape, an error event, an event that is not JSON, the response's
    id, model and finish reason, a redirect, a Retry-After)."""
    key = req.headers.get("authorization", "").removeprefix("Bearer ")
    text = "k" * int(req.query.get("offset", "0")) + key + " and the rest of the message"
    how = req.query.get("how", "json")

    def answer(status: str, ctype: str, body: bytes, extra: str = "") -> None:
        req.send(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{extra}Connection: close\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    if how == "json":
        answer("401 Unauthorized", "application/json",
               json.dumps({"error": {"message": text}}).encode())
    elif how == "detail":
        answer("401 Unauthorized", "application/json", json.dumps({"detail": text}).encode())
    elif how == "plain":
        answer("500 Internal Server Error", "text/plain", text.encode())
    elif how == "redirect":
        answer("302 Found", "text/plain", b"", f"Location: /{text.replace(' ', '-')}\r\n")
    elif how == "retry":
        answer("429 Too Many Requests", "application/json", b"{}",
               f"Retry-After: {text}\r\n")
    elif how == "ctype":
        answer("200 OK", f"text/html; x={text.replace(' ', '-')}", b"<html></html>")
    elif how == "event":
        stream(req, _openai([_chunk({"content": "t"}), {"error": {"message": text}}]))
    elif how == "not-json":
        stream(req, b"data: " + text.encode() + b"\n\n")
    else:   # "id": what the answer says of itself
        stream(req, _openai([{**_chunk({"content": "t"}, model=text), "id": text},
                             _chunk({}, text)]))


ROUTES: dict[str, Callable[[Request], None]] = {
    "/wrong-shape": wrong_shape, "/echo-key-at": echo_key_at,
    "/v1/chat/completions": openai_served, "/openai-cut": openai_cut,
    "/openai-short": openai_short, "/openai-no-usage": openai_no_usage,
    "/openai-empty": openai_empty,
    "/anthropic-cut": anthropic_cut, "/fastapi-401": fastapi_401, "/plain-404": plain_404,
    "/ok": ok, "/paced-forever": paced_forever, "/flood": flood, "/silent": silent,
    "/final-then-flood": final_then_flood,
    "/big-event": big_event, "/endless-line": endless_line, "/data-forever": data_forever,
    "/bad-json": bad_json, "/html": html, "/status": status, "/reset": reset,
    "/slowloris": slowloris, "/hang": hang, "/gzip": gzipped, "/bad-chunked": bad_chunked,
    "/chunk-extension-forever": chunk_extension_forever, "/redirect": redirect,
    "/echo-key": echo_key, "/echo-key-event": echo_key_event,
    "/echo-key-redirect": echo_key_redirect, "/echo-key-id": echo_key_id,
    "/echo-key-part": echo_key_part, "/endless-headers": endless_headers,
    "/endless-header-line": endless_header_line,
}
# /mixed: what a whole run meets, in turn (paced and silent streams end at the timeout).
MIXED = ["/ok", "/data-forever", "/endless-line", "/big-event", "/bad-json", "/html",
         "/status", "/gzip", "/reset", "/ok", "/flood", "/echo-key", "/echo-key-event",
         "/echo-key-redirect"]
# /echo-mixed: credentials echoed in every way a target can, between normal streams.
ECHO_MIXED = ["/ok", "/echo-key", "/echo-key-event", "/echo-key-redirect", "/echo-key-id"]
# /echo-part-mixed: the key quoted in part or transformed, in turn, between normal streams.
PART_MIXED = ["/ok", "/echo-key-part?how=prefix", "/echo-key-part?how=upper",
              "/echo-key-part?how=reversed", "/echo-key-part?how=base64",
              "/echo-key-part?how=percent", "/echo-key-part?how=middle"]
_turns = itertools.count()
_lock = threading.Lock()


def handle(conn: socket.socket, tls: ssl.SSLContext | None) -> None:
    try:
        if tls is not None:
            conn = tls.wrap_socket(conn, server_side=True)
        req = read_request(conn)
        if req is None:
            return
        if req.path == "/close":
            return                                 # read the request, answer nothing, close
        path = req.path
        if path in ("/mixed", "/echo-mixed", "/echo-part-mixed"):
            turns = {"/mixed": MIXED, "/echo-mixed": ECHO_MIXED}.get(path, PART_MIXED)
            with _lock:
                path = turns[next(_turns) % len(turns)]
            path, _, query = path.partition("?")
            req.query.update({k: v[-1] for k, v in parse_qs(query).items()})
        ROUTES.get(path, ok)(req)
    except (OSError, ssl.SSLError):
        pass                                       # the client gave up: that is its right
    finally:
        with contextlib.suppress(OSError):
            conn.close()


def serve(listener: socket.socket, tls: ssl.SSLContext | None) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn, tls), daemon=True).start()


def listen() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def main() -> None:
    plain = listen()
    urls = [f"http://127.0.0.1:{plain.getsockname()[1]}"]
    threading.Thread(target=serve, args=(plain, None), daemon=True).start()
    if len(sys.argv) == 3:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(sys.argv[1], sys.argv[2])
        secure = listen()
        urls.append(f"https://127.0.0.1:{secure.getsockname()[1]}")
        threading.Thread(target=serve, args=(secure, ctx), daemon=True).start()
    print("LISTENING " + " ".join(urls), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
