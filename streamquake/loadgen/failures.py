"""How one request's measurement ends early: the whole-stream deadline, or a failure of a kind
(``ErrorKind``) with a reason. The client turns either into the sample's error."""

from __future__ import annotations

from streamquake.loadgen.samples import ErrorKind


class _StreamTimeout(Exception):
    """The whole-stream deadline (plan.timeout_s) passed."""


class _Failed(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: ErrorKind = kind
        self.detail = detail


class _Cancelled(Exception):
    """The client abandons the stream (its class's ``cancel``): not a failure of the target."""
