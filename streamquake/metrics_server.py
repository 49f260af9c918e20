"""``run --metrics-port N``: the run's measurements in the Prometheus exposition format while
it lasts (the official ``prometheus_client``), on 127.0.0.1 unless told otherwise.

It reads what the load process appends to ``<out>/run/samples/samples-<pid>.jsonl`` (complete
lines only; a line still being written is read on the next pass) and listens to the runner's
events for the phase and the faults. A request is counted whole in the phase it was sent in,
even when it ended after (the verdicts attribute each measurement to its own phase instead).

Exposed (labels ``scenario``, ``phase``, ``class``): ``streamquake_ttfb_seconds``,
``streamquake_ttft_seconds``, ``streamquake_itl_seconds``, ``streamquake_e2e_seconds``
(histograms), ``streamquake_requests_total``, ``streamquake_request_errors_total`` (+``kind``),
``streamquake_stalled_requests_total``, ``streamquake_chunks_missing_total`` and
``streamquake_chunks_expected_total`` (counters); ``streamquake_fault_active`` (``fault``,
``type``, ``fault_phase``; 1 while applied), ``streamquake_phase`` (1 for the current phase)
and ``streamquake_run_info``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from streamquake import __version__
from streamquake.errors import PreflightError
from streamquake.events import Events, FaultApplied, FaultReverted, PhaseStarted
from streamquake.loadgen.samples import ERROR_KINDS, RequestSample
from streamquake.loadgen.tail import SampleTail

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0)
PHASES = ("warmup", "baseline", "fault", "recovery")


@dataclass
class MetricsServer:
    scenario: str
    samples_dir: Path
    port: int
    host: str = "127.0.0.1"
    poll_s: float = 0.5
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r, base = self.registry, ["scenario", "phase", "class"]
        self.hist = {
            "ttfb": Histogram("streamquake_ttfb_seconds", "Request sent to first response byte",
                              base, buckets=LATENCY_BUCKETS, registry=r),
            "ttft": Histogram("streamquake_ttft_seconds", "Request sent to first generated text",
                              base, buckets=LATENCY_BUCKETS, registry=r),
            "itl": Histogram("streamquake_itl_seconds", "Gap between content events",
                             base, buckets=ITL_BUCKETS, registry=r),
            "e2e": Histogram("streamquake_e2e_seconds", "Request sent to end of stream "
                             "(successful requests)", base, buckets=LATENCY_BUCKETS, registry=r),
        }
        self.requests = Counter("streamquake_requests", "Requests finished", base, registry=r)
        self.errors = Counter("streamquake_request_errors", "Failed requests by kind",
                              [*base, "kind"], registry=r)
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
        for p in PHASES:
            self.phase.labels(self.scenario, p).set(0)
        self._windows: list[tuple[str, float]] = []       # (phase, start), in order
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
        events.on(PhaseStarted, self._on_phase)
        events.on(FaultApplied, self._on_applied)
        events.on(FaultReverted, self._on_reverted)

    def start(self) -> None:
        try:
            self._server, _ = start_http_server(self.port, addr=self.host,
                                                registry=self.registry)
        except OSError as exc:
            raise PreflightError(f"cannot serve metrics on {self.host}:{self.port} "
                                 f"({exc.strerror or exc}); pick another --metrics-port") from exc
        self._thread = threading.Thread(target=self._loop, name="sq-metrics-tail", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Read what is left, then stop serving. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.poll()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _on_phase(self, event: PhaseStarted) -> None:
        with self._lock:
            self._windows.append((event.phase, time.time()))
        for p in PHASES:
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

    def poll(self) -> None:
        """Read every complete new line of every samples file."""
        for sample in self._tail.poll():
            self._observe(sample)

    def _phase_of(self, sent: float) -> str:
        with self._lock:
            name = "none"
            for phase, start in self._windows:
                if sent >= start:
                    name = phase
            return name

    def _observe(self, s: RequestSample) -> None:
        labels = (self.scenario, self._phase_of(s.scheduled or s.sent), s.cls)
        if labels not in self._seen:      # every series of this phase and class, from zero
            self._seen.add(labels)
            self.stalled.labels(*labels)
            for kind in ERROR_KINDS:
                self.errors.labels(*labels, kind)
        self.requests.labels(*labels).inc()
        if s.ttfb_ms is not None:
            self.hist["ttfb"].labels(*labels).observe(s.ttfb_ms / 1e3)
        if s.ttft_ms is not None:
            self.hist["ttft"].labels(*labels).observe(s.ttft_ms / 1e3)
        itl = self.hist["itl"].labels(*labels)
        for gap in s.itl_ms:
            itl.observe(gap / 1e3)
        self.missing.labels(*labels).inc(s.missing_events)
        self.expected.labels(*labels).inc(s.expected_events)
        if s.error is not None:
            self.errors.labels(*labels, s.error).inc()
            return
        if s.stalls > 0:
            self.stalled.labels(*labels).inc()
        if s.e2e_ms is not None:
            self.hist["e2e"].labels(*labels).observe(s.e2e_ms / 1e3)
