"""Request heads made once per kind: geventhttpclient's client, with each request's head made
from the one it built for the same request line and fixed headers.

A stream's requests differ only in their trace context and their body's length
(``StreamClient.measure``), yet geventhttpclient merges, checks and joins every header of every
request: about 28 us of the load process's CPU a request, for a head that is the last one's
but for two values. The first head of each kind is built (and every name and value checked) by
geventhttpclient; later ones are it with the two values put in. A head of any other kind (no
``traceparent``, a chunked or empty body, a ``Content-Length`` of the caller's) is built by
geventhttpclient every time."""

from __future__ import annotations

from typing import Any

from geventhttpclient import HTTPClient

TRACEPARENT = "traceparent"
_KINDS_MAX = 64         # kinds of head kept (a plan has a few: one per path and header set)
_Parts = tuple[str, str, str]
_UNSEEN: Any = object()


class HeadClient(HTTPClient):
    """:class:`geventhttpclient.HTTPClient` whose request heads are made once per kind."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._heads: dict[tuple[object, ...], _Parts | None] = {}

    def _build_request(self, method: str, request_uri: str, body: Any = b"",
                       headers: Any = None, chunked: bool | None = None) -> str:
        trace = headers.get(TRACEPARENT) if type(headers) is dict else None
        if trace is None or chunked or type(body) is not bytes or not body:
            return super()._build_request(method, request_uri, body=body, headers=headers,
                                          chunked=chunked)
        key = (method, request_uri, *[kv for kv in headers.items() if kv[0] != TRACEPARENT])
        parts = self._heads.get(key, _UNSEEN)
        if parts is _UNSEEN or parts is None:
            head: str = super()._build_request(method, request_uri, body=body,
                                               headers=headers, chunked=chunked)
            if parts is _UNSEEN:
                if len(self._heads) >= _KINDS_MAX:
                    self._heads.clear()
                own_length = any(k.lower() == "content-length" for k in headers)
                self._heads[key] = None if own_length else cut(head, trace, len(body))
            return head
        before, between, after = parts
        return f"{before}{trace}{between}{len(body)}{after}"


def cut(head: str, trace: str, length: int) -> _Parts | None:
    """``head`` without its ``traceparent`` value and its ``Content-Length`` value (a header
    line each, found once, that one after this one): what is before, between and after them.
    None where the head is not so."""
    trace_line = f"\r\n{TRACEPARENT}: {trace}\r\n"
    length_line = f"\r\nContent-Length: {length}\r\n"
    at, to = head.find(trace_line), head.find(length_line)
    if at < 0 or to < at or head.count(trace_line) != 1 or head.count(length_line) != 1:
        return None
    value = at + len(trace_line) - 2 - len(trace)
    number = to + len(length_line) - 2 - len(str(length))
    return head[:value], head[value + len(trace):number], head[number + len(str(length)):]
