"""heads.HeadClient: a request head made from the one built for its kind is the head
geventhttpclient builds, byte for byte, for any trace context and body length; a head of any
other kind is geventhttpclient's own."""

from __future__ import annotations

from geventhttpclient import HTTPClient
from hypothesis import given, settings
from hypothesis import strategies as st

from streamquake.loadgen.heads import TRACEPARENT, HeadClient, cut

_HEX = "0123456789abcdef"
_TRACES = st.builds(lambda t, s, f: f"00-{t}-{s}-{f}", st.text(_HEX, min_size=32, max_size=32),
                    st.text(_HEX, min_size=16, max_size=16), st.sampled_from(["00", "01"]))
_NAMES = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda n: n.lower() not in ("traceparent", "content-length", "transfer-encoding", "host",
                                "expect"))
_VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=20)
_HEADERS = st.dictionaries(_NAMES, _VALUES, max_size=4)


def _both(url: str = "http://127.0.0.1:9/") -> tuple[HTTPClient, HeadClient]:
    return HTTPClient.from_url(url), HeadClient.from_url(url)


@settings(max_examples=200, deadline=None)
@given(_HEADERS, st.lists(st.tuples(_TRACES, st.binary(min_size=1, max_size=300)), min_size=1,
                          max_size=4), st.sampled_from(["/v1/chat/completions", "/a?b=c"]))
def test_every_head_of_a_kind_is_geventhttpclients(fixed: dict[str, str],
                                                   requests: list[tuple[str, bytes]],
                                                   uri: str) -> None:
    plain, made = _both()
    for trace, body in requests:
        headers = {**fixed, TRACEPARENT: trace}
        assert made._build_request("POST", uri, body=body, headers=headers) == \
            plain._build_request("POST", uri, body=body, headers=headers)
    assert len(made._heads) == 1        # one kind: the first built it, the others reused it


def test_heads_of_other_kinds_are_built_every_time() -> None:
    plain, made = _both("http://127.0.0.1:8080/")
    trace = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    cases = [
        ({"x": "1"}, b"{}"),                                    # no traceparent
        ({TRACEPARENT: trace}, b""),                            # no body
        ({TRACEPARENT: trace, "content-length": "2"}, b"{}"),   # the caller's own length
        ({TRACEPARENT: trace, "Content-Length": "2"}, b"{}"),
        ({TRACEPARENT: trace, "Content-Length": "2"}, b"{1234}"),
        ({TRACEPARENT: trace, "Host": "other"}, b"{}"),
        ({TRACEPARENT: trace, "Expect": "100-continue"}, b"{}"),
    ]
    for headers, body in cases * 2:
        assert made._build_request("POST", "/x", body=body, headers=headers) == \
            plain._build_request("POST", "/x", body=body, headers=headers)
    assert made._build_request("POST", "/x", body=b"{}", headers=cases[0][0],
                               chunked=True) == \
        plain._build_request("POST", "/x", body=b"{}", headers=cases[0][0], chunked=True)


def test_a_head_is_cut_only_around_values_found_once_in_order() -> None:
    head = "POST / HTTP/1.1\r\ntraceparent: T\r\nContent-Length: 12\r\n\r\n"
    assert cut(head, "T", 12) == ("POST / HTTP/1.1\r\ntraceparent: ",
                                  "\r\nContent-Length: ", "\r\n\r\n")
    twice = ("POST / HTTP/1.1\r\ntraceparent: T\r\nx: 1\r\ntraceparent: T\r\n"
             "Content-Length: 1\r\n\r\n")
    assert cut(twice, "T", 1) is None
    backwards = "POST / HTTP/1.1\r\nContent-Length: 1\r\ntraceparent: T\r\n\r\n"
    assert cut(backwards, "T", 1) is None
    assert cut(head, "U", 12) is None
