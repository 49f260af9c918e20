"""The shared reader's compiled step (``speedups.FramedStep``) against the Python it stands for:
after any read, the stream that read it through the compiled step and the one that read it
through ``_Stream._step_read`` hold the same sample, tally, parser, arrival and guard, and the
step gave the same answer. The compiled step folds a read in itself only where it is the
stream's template events and nothing else, and every rarer judgement is Python's: these tests
give it reads of every kind (cut events, odd events, a burst's wait, stalls, reads seen late,
reads without a kernel stamp, a deadline passed, an event limit, an answer kept).
"""

from __future__ import annotations

import io
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
from geventhttpclient.response import HTTPParseError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamquake.loadgen import client, self_measure, speedups
from streamquake.loadgen.client import StreamClient, _Abandon, _Stream
from streamquake.loadgen.failures import _Cancelled, _Failed, _StreamTimeout
from streamquake.loadgen.plan import Cancel, LoadPlan, RequestClassPlan
from streamquake.loadgen.reader import BACKLOG
from streamquake.loadgen.samples import RequestSample
from streamquake.loadgen.sse_parser import SSELimitError, SSELimits, SSEParser
from streamquake.loadgen.stamps import _BLOCK, Arrival
from streamquake.loadgen.tally import _Tally
from streamquake.procs import read_listening_line, stop
from streamquake.protocols.openai import OpenAIEncoder
from tests.conftest import REPO, cli_cmd
from tests.test_plain_events import _ODD, STALL_MS, _encoder, _state, cut_reads

pytestmark = pytest.mark.skipif(speedups.FramedStep is None,
                                reason="the compiled part is not built, or Python was asked for")


class _Resp:
    """What ``_Stream._step_read`` reads of the response (a chunked body decoded in C)."""

    message_complete = False
    _sock = object()
    _body_buffer = bytearray()


def _stream(max_events: int, deadline: float, answer: bool) -> _Stream:
    plan = LoadPlan(base_url="http://127.0.0.1:9", protocol="openai", samples_path="/tmp",
                    end_at=0.0, stall_threshold_ms=STALL_MS)
    sample = RequestSample(cls="c", sent=0.0, scheduled=None, trace_id="t", span_id="s")
    guard = self_measure.Guard(io.StringIO())
    tally = _Tally(sample, plan, 100.0, max_events, guard)
    if answer:
        tally.answer = []
    stream = _Stream(_Resp(), tally, SSEParser(SSELimits()),  # type: ignore[arg-type]
                     Arrival(None, 100.0), deadline, None)
    assert speedups.Chunked is not None
    stream.fast, stream.fd = speedups.Chunked(), 0
    return stream


def _everything(stream: _Stream) -> dict[str, Any]:
    a, g = stream.arrival, stream.tally.guard
    assert g is not None
    return {**_state(stream, stream.tally), "answer": stream.tally.answer,
            "arrival": (a.at, a.seen, a.kernel, a.with_headers),
            "guard": (dict(g._seen), g._kernel_reads, g._user_reads, g._seen_max_s)}


def _outcome(call: Any) -> tuple[str, object]:
    try:
        got = call()
    except _Failed as exc:
        return "failed", (exc.kind, exc.detail)
    except (SSELimitError, _StreamTimeout, _Cancelled) as exc:
        return type(exc).__name__, str(exc)
    return "ok", "BACKLOG" if got is BACKLOG else got


def _read_both(compiled: _Stream, step: Any, python: _Stream, body: bytes, seen: float,
               lag: float, nraw: int, compare: bool = True) -> tuple[str, object]:
    """One read by both paths: the same answer; and where ``compare``, the same state once
    the compiled step has given it back (flush), as its stream's reader makes it do."""
    got = _outcome(lambda: step.fold(body, seen, lag, nraw))
    assert got == _outcome(lambda: python._step_read(body, seen, lag, nraw, None)), body
    if compare:
        step.flush()
        assert not step.hot
        assert _everything(compiled) == _everything(python), body
    return got


@st.composite
def reads(draw: st.DrawFn) -> tuple[list[tuple[bytes, float, float, int, bool]], int, float,
                                     bool]:
    """A stream's body in reads, mostly runs of whole token events (the reads the compiled
    step folds), with odd events and cuts among them; each with when our code saw it, how
    long before that the kernel stamped it (-1: no stamp), and the read's size."""
    enc = _encoder(False, draw(st.booleans()))
    events = [enc.opening()]
    for i in range(draw(st.integers(1, 60))):
        events.append(enc.token(b'"tok%d"' % i) if draw(st.integers(0, 9))
                      else draw(st.sampled_from(_ODD)))
    out, t = [], 100.0
    for part in cut_reads(draw, events, 2, 3):
        t += draw(st.sampled_from([0.0, 0.0005, 0.02, 0.02, 0.02, 0.02, 0.049, 0.052, 0.06, 0.3]))
        lag = draw(st.sampled_from([0.0, 0.0, 0.0, 0.0001, 0.002, 0.3, -1.0]))
        nraw = len(part) + 12 if draw(st.integers(0, 9)) else _BLOCK
        # Whether the state is compared after this read: the compiled step holds it across
        # the reads between (and gives it back at a read it leaves to Python, or at the end).
        out.append((part, t + max(lag, 0.0), lag, nraw, draw(st.integers(0, 3)) == 0))
    return (out, draw(st.sampled_from([4, 30, 10_000])),
            draw(st.sampled_from([1e9, 1e9, 100.5])), draw(st.integers(0, 9)) == 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads())
def test_the_compiled_step_leaves_what_step_read_leaves(
        case: tuple[list[tuple[bytes, float, float, int, bool]], int, float, bool]) -> None:
    assert speedups.FramedStep is not None
    chunks, max_events, deadline, answer = case
    compiled, python = (_stream(max_events, deadline, answer) for _ in range(2))
    step: Any = client._Stream.stepper(compiled)
    assert type(step) is speedups.FramedStep
    for body, seen, lag, nraw, compare in chunks:
        got = _read_both(compiled, step, python, body, seen, lag, nraw, compare)
        if got[0] != "ok" or got[1] not in (None, "BACKLOG"):
            break
    step.flush()
    assert _everything(compiled) == _everything(python)


def _tokens(enc: OpenAIEncoder, n: int, first: int = 0) -> bytes:
    return b"".join(enc.token(b'"tok%d"' % i) for i in range(first, first + n))


def test_template_reads_are_folded_in_c_and_every_other_read_is_pythons() -> None:
    """Whole reads of template events are the compiled step's, a burst's among them; a stall,
    a read without a stamp, one seen after the deadline, one with a cut event, and a stream
    being abandoned are Python's, each leaving the same state as Python does."""
    assert speedups.FramedStep is not None
    compiled, python = _stream(10_000, 101.0, False), _stream(10_000, 101.0, False)
    step: Any = speedups.FramedStep(compiled, BACKLOG, HTTPParseError, 50.0, 20.0)
    enc = _encoder(False, False)
    t = 100.0
    plan: list[tuple[bytes, float, float, bool]] = [
        (enc.opening(), 0.01, 0.0, False),          # no content yet
        (_tokens(enc, 1), 0.01, 0.0, False),             # the first content: add's, which
        (_tokens(enc, 1, 1), 0.01, 0.0, True),           # taught the template
        (_tokens(enc, 2, 2), 0.02, 0.0001, True),
        (_tokens(enc, 1, 4), 0.0, 0.0001, True),         # the same stamp as the read before
        (_tokens(enc, 1, 5), 0.06, 0.0, True),           # a burst's wait: held (the guard asked)
        (_tokens(enc, 2, 40), 0.0, 0.0, True),           # its stamp, held: a burst's events
        (_tokens(enc, 3, 6), 0.02, -1.0, False),         # no kernel stamp
        (_tokens(enc, 1, 9), 0.02, 0.0, True),
        (_tokens(enc, 1, 10)[:-5], 0.02, 0.0, False),    # an event cut by the read's end
        (_tokens(enc, 1, 10)[-5:] + _tokens(enc, 1, 11), 0.02, 0.0, False),
        (_tokens(enc, 1, 12), 0.02, 0.0, True),
        (_tokens(enc, 2, 13) + b": ping\n\n", 0.02, 0.0, False),   # a run, then something else
        (_tokens(enc, 1, 15), 0.3, 0.0, False),          # a stall
        (_tokens(enc, 1, 16), 0.02, 0.0, True),          # after the stall, as before it
        (_tokens(enc, 1, 17), 0.02, 0.3, False),         # seen late: the client's own stall
        (_tokens(enc, 1, 18), 0.02, 0.0, True),
        (_tokens(enc, 1, 19), 0.5, 0.49, False),         # seen after the deadline: Python's raise
    ]
    for body, wait, lag, folded in plan:
        t += wait
        before = step.folded
        got = _read_both(compiled, step, python, body, t + max(lag, 0.0), lag, len(body) + 8)
        assert step.folded - before == folded, body
        if got[0] != "ok":
            break
    assert got == ("_StreamTimeout", "")
    assert step.folded == 9 and step.reads == 0      # fold() makes no read of its own
    s = compiled.tally.sample
    assert s.shared_stamps > 0 and s.client_stalls == 1
    assert (s.burst_reads, s.burst_events) == (1, 4)

    # A stream its client is abandoning is checked event by event (_Abandon.check): Python's.
    abandoning, python = _stream(10_000, 1e9, False), _stream(10_000, 1e9, False)
    cls = RequestClassPlan(cancel=Cancel(share=1.0, after_tokens=100))
    abandoning.abandon, python.abandon = _Abandon(cls, 100.0), _Abandon(cls, 100.0)
    step = speedups.FramedStep(abandoning, BACKLOG, HTTPParseError, 50.0, 20.0)
    t = 100.0
    for i in range(6):
        t += 0.02
        _read_both(abandoning, step, python, _tokens(enc, 1, i), t, 0.0, 100)
    assert step.folded == 0 and abandoning.tally.sample.content_events == 6


def _target(directory: Path, config: str) -> Iterator[str]:
    path = directory / "target.yaml"
    path.write_text(config)
    proc = subprocess.Popen(
        cli_cmd("target", "serve", "--protocol", "openai", "--port", "0", "--config", str(path)),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        yield read_listening_line(proc, 60, "target")     # a busy machine starts slowly
    finally:
        assert proc.stdout is not None
        proc.stdout.close()
        stop(proc)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded target, OpenAI's wire: streams of 40 tokens 2 ms apart."""
    yield from _target(tmp_path_factory.mktemp("target"),
                       "ttft: 5ms\nitl: 2ms\noutput_tokens: {min: 40, max: 40}\n")


@pytest.fixture(scope="module")
def long_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded target, streams of 400 tokens 10 ms apart (4 s)."""
    yield from _target(tmp_path_factory.mktemp("long"),
                       "ttft: 5ms\nitl: 10ms\noutput_tokens: {min: 400, max: 400}\n")


def _measure_all(url: str, n: int, timeout_s: float = 10.0, tokens: int | None = None
                 ) -> list[RequestSample]:
    plan = LoadPlan.model_validate({"base_url": url, "protocol": "openai", "model": "sim-1",
                                    "samples_path": "/nonexistent", "end_at": 0.0,
                                    "timeout_s": timeout_s, "connect_timeout_s": 2.0})

    def one() -> RequestSample:
        c = StreamClient(plan)
        try:
            cls = RequestClassPlan() if tokens is None else RequestClassPlan(max_tokens=tokens)
            return c.measure(cls, random.Random(0))
        finally:
            c.close()

    with gevent.Timeout(60):
        jobs = [gevent.spawn(one) for _ in range(n)]
        gevent.joinall(jobs, raise_error=True)
    return [j.value for j in jobs]


def _kept_steps(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The steps the streams are read with from here on, in order (the real ones run)."""
    steps: list[Any] = []
    stepper = client._Stream.stepper

    def kept(self: _Stream) -> Any:
        steps.append(stepper(self))
        return steps[-1]

    monkeypatch.setattr(client._Stream, "stepper", kept)
    return steps


@pytest.mark.timeout(120)
def test_streams_read_through_the_compiled_step_fold_their_template_reads(
        target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams of the embedded target read by the shared reader: their template reads are
    folded by the compiled step, into the same events, reads and clock as the Python steps
    read them into."""
    steps = _kept_steps(monkeypatch)
    compiled = _measure_all(target, 4)
    assert len(steps) == 4 and all(type(s) is speedups.FramedStep for s in steps)
    # Each stream's content reads are the step's but for a few: the first content, the read
    # that teaches the template, the last tokens read with the closing events (a busy machine
    # makes fewer reads of more events each, so the count is the run's own).
    assert sum(s.folded for s in steps) >= sum(s.content_reads for s in compiled) - 5 * 4 > 0
    monkeypatch.setattr(speedups, "FramedStep", None)
    steps.clear()
    python = _measure_all(target, 4)
    assert [getattr(s, "__name__", None) for s in steps] == ["step"] * 4      # Python's

    def essence(s: RequestSample) -> tuple[object, ...]:
        return (s.error, s.content_events, len(s.itl_ms), s.clock, s.finish_reason,
                s.usage_tokens)

    assert [essence(s) for s in compiled] == [essence(s) for s in python] == \
        [(None, 40, 39, "kernel", "stop", 40)] * 4


@pytest.mark.timeout(120)
def test_a_stream_cut_off_while_the_step_holds_its_state_keeps_every_event_it_read(
        long_target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose timeout ends it between reads the compiled step folded (its state the
    step's then): its sample has every event read up to there, as the Python steps give it,
    not the counts of the step's last hand-over to Python."""
    steps = _kept_steps(monkeypatch)
    compiled = _measure_all(long_target, 2, timeout_s=1.0, tokens=400)
    assert all(type(s) is speedups.FramedStep and s.folded > 20 and not s.hot for s in steps)
    monkeypatch.setattr(speedups, "FramedStep", None)
    python = _measure_all(long_target, 2, timeout_s=1.0, tokens=400)
    # About 100 tokens in a second (10 ms apart); a busy machine's share of them, at least.
    for s in compiled + python:
        assert s.error == "timeout"
        assert 40 <= s.content_events == len(s.itl_ms) + 1 < 400, s.content_events
        assert s.body_bytes > 200 * s.content_events
