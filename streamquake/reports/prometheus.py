"""``run --metrics-port N``: the run's measurements in the Prometheus exposition format while
it lasts (the official ``prometheus_client``), on 127.0.0.1 unless told otherwise; and
``run --metrics-file PATH.prom``: the final figures in node_exporter's textfile format, written
atomically when the run ends.

It reads what the load process appends to ``<out>/run/samples/samples-<pid>.jsonl`` (complete
lines only; a line still being written is read on the next pass) and listens to the runner's
events for the phase and the faults. Each measurement counts in the phase the verdicts count
it in, by the one rule (``loadgen/scorecard.py``'s ``attribute``), so the final figures are the
report's: a request is read once its phases are known (it ended before the latest phase's
planned end): every measurement of a request counts in the step it was due in, whenever it
ended, and one its timeout cut off is counted in ``streamquake_censored_total``.

Exposed (labels ``scenario``, ``phase``, ``class``): ``streamquake_ttfb_seconds``,
``streamquake_ttft_seconds``, ``streamquake_itl_seconds``, ``streamquake_e2e_seconds``
(histograms), ``streamquake_requests_total`` (requests whose end counts in the phase),
``streamquake_requests_sent_total``, ``streamquake_request_errors_total`` (+``kind``),
``streamquake_retried_attempts_total`` (+``kind``), ``streamquake_stalled_requests_total``,
``streamquake_chunks_missing_total``, ``streamquake_chunks_expected_total`` and
``streamquake_unattributed_total`` (+``metric``; 0 under the rule for steps) and
``streamquake_censored_total`` (+``metric``) (counters); ``streamquake_fault_active``
(``fault``, ``type``, ``fault_phase``; 1 while applied), ``streamquake_phase`` (1 for the
current phase) and ``streamquake_run_info``.

A ``steps:`` scenario: the ``phase`` label carries the step's name (so dashboards built on
phases keep working, a step being a phase with a name of its own), and
``streamquake_step_info`` (``phase``, ``kind``, ``index``; always 1) tells each step's kind
(warmup, baseline, fault, recovery) and place in the timeline, to join on ``phase``.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
    write_to_textfile,
)

from streamquake.errors import PreflightError
from streamquake.loadgen.attribution import Window, attribute, ended_at
from streamquake.loadgen.metrics import UNATTRIBUTED
from streamquake.loadgen.samples import ERROR_KINDS, RequestSample
from streamquake.loadgen.tail import SampleTail
from streamquake.metric_catalog import CATALOG
from streamquake.run.events import Events, FaultApplied, FaultReverted, PhaseStarted, RunStarted
from streamquake.version import __version__

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0)
PHASES = ("warmup", "baseline", "fault", "recovery")
_BUCKETS = {"itl_ms": ITL_BUCKETS}      # a gap between events is short; the rest, latencies


@dataclass
class MetricsServer:
    scenario: str
    samples_dir: Path
    port: int | None                # None: no HTTP server, only the final figures (write())
    host: str = "127.0.0.1"
    poll_s: float = 0.5
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, base = self.registry, ["scenario", "phase", "class"]
        # The metric catalog's exported histograms, by metric name (_Series observes them).
        self.hist = {
            m.name: Histogram(f"streamquake_{m.prometheus}_seconds", m.about, base,
                              buckets=_BUCKETS.get(m.name, LATENCY_BUCKETS), registry=r)
            for m in CATALOG if m.prometheus is not None
        }
        self.requests = Counter("streamquake_requests", "Requests whose end counts in the "
                                "phase (the report's requests)", base, registry=r)
        self.sent = Counter("streamquake_requests_sent", "Requests sent in the phase, however "
                            "they ended (the report's sent)", base, registry=r)
        self.errors = Counter("streamquake_request_errors", "Failed requests by kind",
                              [*base, "kind"], registry=r)
        self.retried = Counter("streamquake_retried_attempts", "Failed attempts that were "
                               "retried (not requests)", [*base, "kind"], registry=r)
        self.unattributed = Counter("streamquake_unattributed", "Measurements that spanned a "
                                    "phase edge, counted in no phase", [*base, "metric"],
                                    registry=r)
        self.censored = Counter("streamquake_censored", "Measurements a request's timeout "
                                "cut off (known only as at least that long), counted in the "
                                "phase the request was due in", [*base, "metric"], registry=r)
        self.stalled = Counter("streamquake_stalled_requests",
                               "Successful requests with at least one stall", base, registry=r)
        self.missing = Counter("streamquake_chunks_missing", "SSE events missing by id",
                               base, registry=r)
        self.expected = Counter("streamquake_chunks_expected", "SSE events the server sent",
                                base, registry=r)
        self.fault_active = Gauge("streamquake_fault_active", "1 while a fault is applied",
                                  ["scenario", "fault", "type", "fault_phase"], registry=r)
        self.phase = Gauge("streamquake_phase", "1 for the phase the run is in",
                           ["scenario", "phase"], registry=r)
        Gauge("streamquake_run_info", "The run being measured", ["scenario", "version"],
              registry=r).labels(self.scenario, __version__).set(1)
        self._phases: list[str] = list(PHASES)            # the steps, once the run starts
        for p in self._phases:
            self.phase.labels(self.scenario, p).set(0)
        self._windows: list[Window] = []                  # planned, as they begin
        self._pending: list[RequestSample] = []           # ended past the latest known edge
        self._tail = SampleTail(self.samples_dir)
        self._seen: set[tuple[str, str, str]] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = int(self._server.server_address[1])
        return f"http://{self.host}:{port}/metrics"

    def attach(self, events: Events) -> None:
        events.on(RunStarted, self._on_run)
        events.on(PhaseStarted, self._on_phase)
        events.on(FaultApplied, self._on_applied)
        events.on(FaultReverted, self._on_reverted)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sq-metrics-tail", daemon=True)
        self._thread.start()
        if self.port is None:
            return
        try:
            self._server, _ = start_http_server(self.port, addr=self.host,
                                                registry=self.registry)
        except OSError as exc:
            raise PreflightError(f"cannot serve metrics on {self.host}:{self.port} "
                                 f"({exc.strerror or exc}); pick another --metrics-port") from exc

    def stop(self) -> None:
        """Read what is left (every phase is known now), then stop serving. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.poll(final=True)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def write(self, path: Path) -> None:
        """The figures now, in node_exporter's textfile format, atomically (a temporary file
        renamed over ``path``: a collector never reads half of it)."""
        write_to_textfile(str(path), self.registry)

    def _on_run(self, event: RunStarted) -> None:
        if event.scenario.steps is None:
            return
        steps = event.scenario.timeline
        info = Gauge("streamquake_step_info", "A step of the timeline: its kind and place "
                     "(join on phase, the step's name)", ["scenario", "phase", "kind", "index"],
                     registry=self.registry)
        for i, step in enumerate(steps):
            info.labels(self.scenario, step.name, step.kind, str(i)).set(1)
        for p in self._phases:
            self.phase.remove(self.scenario, p)
        self._phases = [step.name for step in steps]
        for p in self._phases:
            self.phase.labels(self.scenario, p).set(0)

    def _on_phase(self, event: PhaseStarted) -> None:
        with self._lock:
            self._windows.append(Window(event.phase, event.start, event.start + event.duration_s))
        for p in self._phases:
            self.phase.labels(self.scenario, p).set(1 if p == event.phase else 0)

    def _on_applied(self, event: FaultApplied) -> None:
        r = event.record
        self.fault_active.labels(self.scenario, r.name, r.type, r.phase).set(1)

    def _on_reverted(self, event: FaultReverted) -> None:
        r = event.record
        self.fault_active.labels(self.scenario, r.name, r.type, r.phase).set(
            1 if r.error and r.reverted is None else 0)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Read every complete new line of every samples file; count each request whose
        phases are all known (``final``: every one, the run is over)."""
        with self._lock:
            windows = list(self._windows)
        known = windows[-1].end if windows else 0.0
        waiting, self._pending = [*self._pending, *self._tail.poll()], []
        for s in waiting:
            if final or ended_at(s) < known:
                attribute(s, windows, functools.partial(self._series, cls=s.cls))
            else:
                self._pending.append(s)

    def _series(self, phase: str, cls: str) -> _Series:
        labels = (self.scenario, phase, cls)
        if labels not in self._seen:      # every series of this phase and class, from zero
            self._seen.add(labels)
            self.stalled.labels(*labels)
            self.requests.labels(*labels)
            for kind in ERROR_KINDS:
                self.errors.labels(*labels, kind)
            for metric in UNATTRIBUTED:
                self.unattributed.labels(*labels, metric)
        return _Series(self, labels)


class _Series:
    """One phase and class of the exporter, told by ``attribute`` what counts there."""

    def __init__(self, server: MetricsServer, labels: tuple[str, str, str]) -> None:
        self.m, self.labels = server, labels
        self.late_errors: dict[str, int] = {}    # counted as unattributed e2e_ms

    def add_retried(self, s: RequestSample) -> None:
        self.m.retried.labels(*self.labels, s.error or "unknown").inc()

    def add_sent(self, s: RequestSample) -> None:
        self.m.sent.labels(*self.labels).inc()

    def add_queue_delay(self, s: RequestSample) -> None:
        pass

    def add_unattributed(self, metric: str, n: int = 1) -> None:
        self.m.unattributed.labels(*self.labels, metric).inc(n)

    def add_ended_after(self, metric: str, n: int = 1) -> None:
        pass

    def add_censored(self, metric: str, at_least_ms: float, at: float | None = None) -> None:
        self.m.censored.labels(*self.labels, metric).inc()

    def add_first_byte(self, s: RequestSample) -> None:
        if s.ttfb_ms is not None:
            self.m.hist["ttfb_ms"].labels(*self.labels).observe(s.ttfb_ms / 1e3)

    def add_first_token(self, s: RequestSample) -> None:
        if s.ttft_ms is not None:
            self.m.hist["ttft_ms"].labels(*self.labels).observe(s.ttft_ms / 1e3)

    def add_gaps(self, gaps_ms: list[float], at: float | None = None) -> None:
        itl = self.m.hist["itl_ms"].labels(*self.labels)
        for gap in gaps_ms:
            itl.observe(gap / 1e3)

    def add_outcome(self, s: RequestSample) -> None:
        if s.cancelled:
            return      # abandoned by the client: neither a success nor an error, no E2E
        m = self.m
        m.requests.labels(*self.labels).inc()
        m.missing.labels(*self.labels).inc(s.missing_events)
        m.expected.labels(*self.labels).inc(s.expected_events)
        if s.error is not None:
            m.errors.labels(*self.labels, s.error).inc()
            return
        if s.stalls > 0:
            m.stalled.labels(*self.labels).inc()
        if s.e2e_ms is not None:
            m.hist["e2e_ms"].labels(*self.labels).observe(s.e2e_ms / 1e3)
