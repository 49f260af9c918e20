"""What the runner tells the load process to do, written as JSON to ``$STREAMQUAKE_LOAD_PLAN``.

Header values stay as templates (``Bearer ${OPENAI_API_KEY}``): the load process expands them
from its own environment, so secrets are never written to disk; a credential written literally
is lifted into that environment first (:func:`lift_literal_secrets`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from streamquake.envref import ENV_REF
from streamquake.protocols import Protocol

# The environment variable that gives the load process its plan file, and the locustfile it runs.
PLAN_ENV = "STREAMQUAKE_LOAD_PLAN"
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# A load process started before its plan is written (the runner's way: the steps' times are
# set once Locust is up, not guessed ahead) says it is up with ``ready-<pid>`` beside the plan's
# path, then waits for the plan, at most PLAN_FILE_WAIT_S.
READY_PREFIX = "ready-"
PLAN_FILE_WAIT_S = 120.0


def write_plan(path: Path, plan: BaseModel) -> None:
    """Write a load plan whole or not at all: a load process waiting for it never reads half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(plan.model_dump_json(indent=2))
    tmp.replace(path)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SlowRead(_Frozen):
    """A slow consumer (a request class's ``read``): it reads its stream no faster than
    ``rate_bytes_per_s`` body bytes a second, and/or pauses ``pause_s`` after every
    ``pause_every`` events, on connections whose receive buffer (SO_RCVBUF, set before the
    connect) is ``receive_buffer`` bytes: the server's sends back up onto it."""

    rate_bytes_per_s: float | None = None
    pause_s: float = 0.0
    pause_every: int = 1
    receive_buffer: int | None = None


class Cancel(_Frozen):
    """Client cancellations (a request class's ``cancel``): a ``share`` of its streams, drawn
    from the plan's seed, is closed by the client (the socket closed, as a browser tab that
    closes) ``after_s`` seconds from the request's start, or at its ``after_tokens``-th
    content event: exactly one of the two."""

    share: float
    after_s: float | None = None
    after_tokens: int | None = None


class Conversation(_Frozen):
    """A class's sessions (its ``conversation``): ``turns`` requests, each sending ``system``
    (the same in every session), the earlier turns' prompts and answers, then its own prompt
    (the class's prompts in order); a think time drawn from ``think_min_s``-``think_max_s``
    between a turn's answer and the next turn."""

    turns: int
    system: str = ""
    think_min_s: float = 0.0
    think_max_s: float = 0.0


class RequestClassPlan(_Frozen):
    name: str = "default"
    weight: float = 1.0
    prompts: list[str] = Field(default_factory=lambda: ["Say something."])
    # Per prompt (a dataset's rows): its own max_tokens, 0 for the class's; None: all the class's.
    prompt_max_tokens: list[int] | None = None
    max_tokens: int = 64
    body: dict[str, Any] | None = None     # full request body; overrides prompts/max_tokens
    priority: int | None = None            # the body field `priority` (vLLM's), on every body
    read: SlowRead | None = None           # a slow consumer; None reads as fast as it can
    cancel: Cancel | None = None           # a share of streams the client abandons early
    conversation: Conversation | None = None   # sessions of turns whose history grows


class ClosedLoop(_Frozen):
    mode: Literal["closed"] = "closed"
    think_time_min_s: float = 0.0
    think_time_max_s: float = 0.0


class OpenLoop(_Frozen):
    mode: Literal["open"] = "open"
    rate_per_s: float                      # total arrival rate across all users
    process: Literal["constant", "poisson"] = "poisson"
    max_inflight: int = 1000               # beyond this, arrivals queue client-side (and it shows)


class TraceReplay(_Frozen):
    """Recorded arrivals (loadgen/trace.py): each row is due at ``start_at + offset``. Rows are
    split over the load processes by index (row i to process i mod processes)."""

    mode: Literal["trace"] = "trace"
    start_at: float                        # epoch s of the trace's first row
    rows: list[tuple[float, int, int, str | None, str | None]]  # offset, in, out, class, prompt
    loop: bool = False
    period_s: float = 0.0                  # with loop: the trace starts again this much later
    max_inflight: int = 1000               # across all processes
    processes: int = 1


class LoadStage(_Frozen):
    """One stretch of the run with its own load (a step's, run/load_from_scenario.py), in epoch
    seconds: a closed loop's ``users``, or an open loop's total rate going linearly from
    ``rate_from`` to ``rate_to`` over [start, end), and ``spike`` (start, end, rate) within it."""

    start: float
    end: float
    users: int | None = None
    rate_from: float | None = None
    rate_to: float | None = None
    spike: tuple[float, float, float] | None = None


class LoadPlan(_Frozen):
    base_url: str                          # where requests go: the target, or the proxy before it
    protocol: Protocol
    model: str = "sim-1"
    path: str | None = None                # override the protocol's default request path
    headers: dict[str, str] = Field(default_factory=dict)  # values may hold ${ENV_VAR}
    verify_tls: bool = True
    timeout_s: float = 60.0                # per request, whole stream
    connect_timeout_s: float = 5.0
    stall_threshold_ms: float = 250.0
    users: int = 1
    spawn_rate: float = 1.0
    arrival: ClosedLoop | OpenLoop | TraceReplay = Field(default_factory=ClosedLoop,
                                                          discriminator="mode")
    classes: list[RequestClassPlan] = Field(default_factory=lambda: [RequestClassPlan()])
    samples_path: str                      # folder of scorecards and per-process records
    # The run's phases (name, start, end epoch s): each process scores its requests into them
    # (loadgen/scorecard.py). Empty: no scorecard (a bare Locust run; tests of the client).
    windows: list[tuple[str, float, float]] = Field(default_factory=list)
    raw_samples: bool = True               # also one JSON line per request (load.samples)
    # Where scorecards go (default: samples_path): the runner's own scratch folder, off the
    # --out disk, so a full report disk cannot cost the figures (launcher.py).
    scorecards_path: str = ""
    seed: int = 0
    end_at: float                          # epoch s: no request is sent after this
    retries: Literal["none", "standard"] = "none"   # loadgen/retry.py
    max_line_bytes: int = 1 << 20          # SSE parser limits (loadgen/sse_parser.py SSELimits)
    max_event_bytes: int = 4 << 20
    max_data_lines: int = 65_536
    # Back to back, in order (loadgen/stages.py): the load follows each from its start, and the
    # first one's from the load's start. Empty: the load above, constant all run.
    stages: list[LoadStage] = Field(default_factory=list)


# Headers whose whole value is a credential, besides any value that came from ${VAR}.
SECRET_HEADER = re.compile(r"auth|key|token|secret|cookie|signature|credential|password", re.I)
# Query parameters that carry credentials (Gemini's ``key=``, signed URLs, OAuth).
SECRET_PARAM = re.compile(
    r"(?i)((?:^|[?&;\s\"'])(?:key|api[_-]?key|access[_-]?token|token|sig|signature|secret|"
    r"password|auth)=)([^&#\s\"'<>]+)")


LIFTED_PREFIX = "STREAMQUAKE_LITERAL_SECRET_"


def lift_literal_secrets(plan: LoadPlan) -> tuple[LoadPlan, dict[str, str]]:
    """The plan with every credential written literally (a credential header's value with no
    ``${VAR}`` in it, e.g. the ``Basic`` header that ``user:KEY@`` in ``target.url`` becomes,
    or a ``key=`` parameter in the path) replaced by ``${STREAMQUAKE_LITERAL_SECRET_N}``, and
    those variables' values: the launcher gives them to the load processes through their
    environment (a master hands them to remote workers with the plan, as it always handed
    the literal), so the load plan on disk holds no secret."""
    env: dict[str, str] = {}

    def lift(value: str) -> str:
        var = f"{LIFTED_PREFIX}{len(env)}"
        env[var] = value
        return f"${{{var}}}"

    headers = {name: lift(value) if SECRET_HEADER.search(name) and value
               and not ENV_REF.search(value) else value
               for name, value in plan.headers.items()}
    path = plan.path
    if path:
        path = SECRET_PARAM.sub(
            lambda m: m.group(1) + (m.group(2) if "${" in m.group(2) else lift(m.group(2))),
            path)
    if not env:
        return plan, env
    return plan.model_copy(update={"headers": headers, "path": path}), env


def lifted_from(environ: Mapping[str, str]) -> dict[str, str]:
    """The lifted secrets in ``environ`` (see :func:`lift_literal_secrets`)."""
    return {k: v for k, v in environ.items() if k.startswith(LIFTED_PREFIX)}
