"""The Locust side of streamquake: one SSE user class, loaded only by ``locust -f``.

Importing locust monkey-patches the standard library for gevent, so nothing in the CLI or the
runner imports this module; ``launcher.py`` starts it in its own process with the plan's path in
``$STREAMQUAKE_LOAD_PLAN``.

The user is a plain ``User`` driving :class:`StreamClient`, not a ``FastHttpUser``:
FastHttpUser's ``iter_lines()`` reads in blocks and handed the events of a stream over only at
its end, so every event got the same timestamp. Locust's request event is still fired per
request (and per TTFT) so that its summary means something; verdicts come from our samples.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import IO, Any

import gevent
from gevent.event import Event
from gevent.lock import BoundedSemaphore
from gevent.pool import Group
from locust import User, events, task
from locust.env import Environment
from locust.runners import (
    STATE_MISSING,
    STATE_RUNNING,
    STATE_SPAWNING,
    LocalRunner,
    MasterRunner,
    Runner,
    WorkerRunner,
)

from streamquake.errors import EXIT_SCENARIO, ScenarioError
from streamquake.loadgen import collector, holds, relay
from streamquake.loadgen.attribution import Window
from streamquake.loadgen.client import StreamClient
from streamquake.loadgen.conversation import Session, Turn, session_end
from streamquake.loadgen.plan import (
    LIFTED_PREFIX,
    PLAN_ENV,
    PLAN_FILE_WAIT_S,
    READY_PREFIX,
    Conversation,
    LoadPlan,
    OpenLoop,
    RequestClassPlan,
    TraceReplay,
    lifted_from,
)
from streamquake.loadgen.retry import retry_delay
from streamquake.loadgen.samples import RequestSample, UnsentArrival
from streamquake.loadgen.scorecard import CHECKPOINT_S, Scorecard, replace_text
from streamquake.loadgen.self_measure import start as start_saturation_guard
from streamquake.loadgen.sse_parser import SSELimits
from streamquake.loadgen.stages import arrival_times, users_at
from streamquake.loadgen.templates import check_templates
from streamquake.loadgen.trace import PromptSynth

_IDLE_S = 3600.0        # a user past end_at waits; Locust kills waiting users at once on stop
_WRITE_WAIT_S = 30.0    # how long the final save waits for a checkpoint's write in flight
_RAMP_SLACK_S = 1.0    # how late past its rate a user of the first ramp may still be spawned
# Records that wait to be scored together (Scorecard.defer): at 500 streams scoring held the
# hub 121-135 us a request in batches of 16, 91-124 in batches of 64 (truth.py's holds).
SCORE_BATCH = 64


class StreamFailure(Exception):
    """What Locust's summary shows for a failed request: ``kind: detail``."""


class _Process:
    """What the users of this one load process share."""

    plan: LoadPlan | None = None
    sinks: dict[str, IO[str]] = {}          # file prefix -> open JSONL file (or a relay sink)
    user_numbers = itertools.count()
    relay: relay.Relay | None = None        # a remote worker's outbox to the master
    joined: set[str] = set()                # on a master: every worker that ever connected
    stopped: set[str] = set()               # ... and those that said sq_stopped
    plan_ready = Event()
    card: Scorecard | None = None           # this process's requests, scored (scorecard.py)
    card_saved = (0, 0, False)              # (records, unsent, final) of the last one saved
    checkpointer: Any = None                # the greenlet that saves the card every CHECKPOINT_S
    scorer: Any = None                      # the greenlet scoring waiting records, while one runs
    writing: Any = None                     # ... its write in a native thread, while one runs
    first_spawn: float | None = None        # when this process's first user started


def _plan() -> LoadPlan:
    if _Process.plan is None:
        path = os.environ.get(PLAN_ENV)
        if path:
            _Process.plan = _read_plan(Path(path))
        elif relay.is_remote():
            # A worker on another host: the master sends the plan once asked (_on_init).
            if not _Process.plan_ready.wait(relay.PLAN_WAIT_S) or _Process.plan is None:
                raise RuntimeError(f"no load plan from the master within "
                                   f"{relay.PLAN_WAIT_S:g} s")
        else:
            raise RuntimeError(f"{PLAN_ENV} is not set: start this locustfile through "
                               "streamquake.run.launcher")
    assert _Process.plan is not None
    return _Process.plan


def _read_plan(path: Path) -> LoadPlan:
    """The plan at ``path``; where it is not written yet (the runner sets the steps' times
    once every load process is up), say this one is up (``ready-<pid>`` beside it) and wait
    for it. Called first in the init event, so Locust starts no user before it is read."""
    if not path.exists():
        (path.parent / f"{READY_PREFIX}{os.getpid()}").touch()
        deadline = time.monotonic() + PLAN_FILE_WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no load plan at {path} within {PLAN_FILE_WAIT_S:g} s")
            gevent.sleep(0.01)
    return LoadPlan.model_validate_json(path.read_text())


def _write(record: RequestSample | UnsentArrival) -> None:
    """Score the record into this process's scorecard (with the next SCORE_BATCH-1 records,
    or at the next checkpoint, whichever comes first: Scorecard.defer); then, as lines,
    requests to samples-<pid>.jsonl (unless load.samples is none) and arrivals never sent to
    unsent-<pid>.jsonl (launcher.py)."""
    plan = _plan()
    hold = holds.Hold()
    if plan.windows:
        card = _Process.card
        if card is None:
            card = _Process.card = Scorecard([Window(*w) for w in plan.windows],
                                             seal_after_s=plan.timeout_s + 15.0,
                                             seconds_sink=_second_line)
            _Process.checkpointer = gevent.spawn(_checkpoints)
        card.defer(record)
        if card.pending >= SCORE_BATCH and _Process.scorer is None:
            _Process.scorer = gevent.spawn(_score, card)
    if not isinstance(record, RequestSample) or plan.raw_samples:
        _append("samples" if isinstance(record, RequestSample) else "unsent",
                record.to_json(), plan.samples_path)
    hold.done("samples")


def _score(card: Scorecard) -> None:
    """Score the records that wait (Scorecard.defer), in steps that give the hub back every
    half millisecond or so (holds.py)."""
    try:
        holds.sliced("scoring", card.score_steps())
    finally:
        _Process.scorer = None


def _second_line(line: str) -> None:
    """A sealed second of the timeline, off to seconds-<pid>.jsonl beside the scorecards (or
    to the master): written before the card that counts it."""
    plan = _plan()
    _append("seconds", line, plan.scorecards_path or plan.samples_path)


def _append(prefix: str, line: str, directory: str) -> None:
    """One line to <prefix>-<pid>.jsonl in ``directory``, or to the master (a remote worker),
    flushed at once: a killed process loses at most the line in flight. (A path, made a Path
    only to open the file: it is a line per request.)"""
    sink = _Process.sinks.get(prefix)
    if sink is None and _Process.relay is not None:
        sink = _Process.sinks[prefix] = relay.RelaySink(_Process.relay, prefix)  # type: ignore[assignment]
    if sink is None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        sink = _Process.sinks[prefix] = open(  # noqa: SIM115 - closed on quitting
            folder / f"{prefix}-{os.getpid()}.jsonl", "a", encoding="utf-8")
    sink.write(line + "\n")
    sink.flush()


def _save_card(final: bool = False) -> None:
    """This process's scorecard to the runner, at once: replaced atomically in
    scorecard-<pid>.json, or sent to the master (a remote worker), when anything was scored
    since the last time. The one saved once its users have stopped is marked final: the
    runner warns about a card that is not (a process killed, or one that could not save at
    the end). A checkpoint in progress (:func:`_checkpoints`) is given up first."""
    card = _Process.card
    if card is None:
        return
    if _Process.checkpointer is not None and _Process.checkpointer is not gevent.getcurrent():
        _Process.checkpointer.kill()
        _Process.checkpointer = None
    if _Process.writing is not None:
        # A checkpoint's write still in its thread would land after this card, and over it.
        _Process.writing.wait(_WRITE_WAIT_S)
    card.seal(time.time())
    final = final or _Process.card_saved[2]   # a stream ending after the final save: still final
    mark = _mark(card, final)
    if mark == _Process.card_saved:
        return
    _send_card(card.dumps(final), mark, threaded=False)


def _mark(card: Scorecard, final: bool) -> tuple[int, int, bool]:
    """What a saved card holds: records (those waiting for a checkpoint in progress too),
    arrivals never sent, and whether it is final."""
    return card.records + card.pending, card.unsent, final


def _send_card(text: str | list[str], mark: tuple[int, int, bool], threaded: bool) -> None:
    if _Process.relay is not None:
        hold = holds.Hold()
        _Process.relay.send_scorecard(text if isinstance(text, str) else "".join(text))
        hold.done("relay")
    else:
        plan = _plan()
        path = Path(plan.scorecards_path or plan.samples_path) / f"scorecard-{os.getpid()}.json"
        if threaded:
            # The write leaves the hub: a slow disk holds this greenlet only.
            # Left set if this greenlet is killed meanwhile: the final save waits for it.
            writing = _Process.writing = gevent.get_hub().threadpool.spawn(replace_text, path,
                                                                           text)
            writing.get()
            _Process.writing = None
        else:
            replace_text(path, text)
    _Process.card_saved = mark


def _checkpoints() -> None:
    """A process killed mid-run loses at most the last CHECKPOINT_S of its scoring. Each
    checkpoint runs in steps that give the hub back every millisecond or so (holds.py): only
    the cells changed since the last one are encoded, and the file is written off the hub."""
    freeze = holds.freeze_plan()
    if freeze is not None:
        gevent.spawn(holds.test_freezes, *freeze)
    while True:
        gevent.sleep(CHECKPOINT_S)
        card = _Process.card
        if card is None:
            continue
        try:
            holds.sliced("seconds", card.seal_steps(time.time()))
            final = _Process.card_saved[2]
            mark = _mark(card, final)
            if mark == _Process.card_saved:
                continue
            _send_card(holds.sliced("checkpoint", card.dump_steps(final)), mark, threaded=True)
        except OSError as exc:
            logging.getLogger(__name__).error("cannot save the scorecard: %s", exc)


def _fire(environment: Environment, sample: RequestSample) -> None:
    failure = None
    if sample.error is not None:
        failure = StreamFailure(f"{sample.error}: {sample.error_detail}")
    environment.events.request.fire(  # type: ignore[no-untyped-call]
        request_type="SSE", name=sample.cls, response_time=sample.e2e_ms or 0.0,
        response_length=sample.content_events, exception=failure, context={}, response=None,
        start_time=sample.sent, url=None,
    )
    if sample.ttft_ms is not None:
        environment.events.request.fire(  # type: ignore[no-untyped-call]
            request_type="TTFT", name=sample.cls, response_time=sample.ttft_ms,
            response_length=0, exception=None, context={}, response=None,
            start_time=sample.sent, url=None,
        )


def _quit_at_end(runner: Runner, plan: LoadPlan) -> None:
    """End the run at end_at instead of waiting out Locust's padded --run-time.

    This is what --run-time does too: the standalone process, or each worker on the master's
    quit message, stops gracefully, letting every user still in a task (a stream in flight, an
    open-loop user joining its arrivals) finish within --stop-timeout; idle users die at once.
    """
    gevent.sleep(max(0.0, plan.end_at - time.time()))
    if isinstance(runner, MasterRunner):
        # Stop first and wait for every worker to say its users stopped: a remote worker sends
        # its last records before that word (one connection, in order), so they are all on
        # disk before the master quits. Missing workers are not waited for.
        # Not Locust's stop: a worker handling it sleeps a whole stop timeout before reading
        # the next message, quit included. sq_stop makes each worker stop its users (each
        # stream in flight may finish), send its last records, say sq_stopped and quit; one
        # connection, in order, so when it has said so its records are on disk here.
        for client_id in _Process.joined:
            runner.send_message("sq_stop", None, client_id=client_id)
        deadline = time.time() + plan.timeout_s + 15.0
        while time.time() < deadline and any(
                cid not in _Process.stopped and cid in runner.clients
                and runner.clients[cid].state != STATE_MISSING for cid in _Process.joined):
            gevent.sleep(0.1)
    runner.quit()


def _follow_users(runner: LocalRunner | MasterRunner, plan: LoadPlan) -> None:
    """A closed loop with stages: from each stage's start, its user count (over the workers,
    if any). Users are added at the plan's spawn rate; a user taken away finishes the stream
    it is in (within the stop timeout). Locust starts the load with the first stage's count;
    this waits for that start, then follows the stages."""
    current = plan.users
    while (now := time.time()) < plan.end_at:
        started = runner.state in (STATE_SPAWNING, STATE_RUNNING)
        if started and (users := users_at(plan.stages, now, plan.users)) != current:
            runner.start(users, plan.spawn_rate)
            current = users
        edge = min((s.start for s in plan.stages if s.start > now), default=plan.end_at)
        gevent.sleep(max(0.0, edge - time.time()) if started else 0.1)  # start() may block


@events.init.add_listener  # type: ignore[untyped-decorator]
def _on_init(environment: Environment, runner: Runner | None = None, **_: Any) -> None:
    if isinstance(runner, WorkerRunner):
        runner.register_message("sq_stop", lambda *_, **__: _stop_worker(runner),
                                concurrent=True)
        if relay.is_remote():
            _init_remote_worker(runner)
            return
    # Fail the process at start, not every user at its first request.
    plan = _plan()
    try:
        check_templates(plan, os.environ)
    except ScenarioError as exc:
        logging.getLogger(__name__).error("%s", exc)
        sys.exit(EXIT_SCENARIO)
    if isinstance(runner, LocalRunner | MasterRunner):
        gevent.spawn(_quit_at_end, runner, plan)
        if any(stage.users is not None for stage in plan.stages):
            gevent.spawn(_follow_users, runner, plan)
    if isinstance(runner, MasterRunner):
        _init_master(runner, plan)
    start_saturation_guard(runner)     # CPU, hub lag, kernel-to-seen: saturation-<pid>.jsonl
    collector.start(runner)            # fewer young collections (collector.py)


def _stop_worker(runner: WorkerRunner) -> None:
    """The master's word that the run is over (see _quit_at_end)."""
    runner.stop()                 # users stop; streams in flight finish (within stop timeout)
    _save_card(final=True)        # the final scorecard, before the word that follows it
    if _Process.relay is not None:
        _Process.relay.flush()    # the last records, before the word that follows them
    # Then wait for the master's quit (it sends it once every worker has said this): quitting
    # from here, inside the runner's own greenlet group, could kill the loop that reads it and
    # leave the process up until Locust's 60 s heartbeat timeout.
    runner.send_message("sq_stopped", None)


def _init_master(runner: MasterRunner, plan: LoadPlan) -> None:
    """Serve the plan to workers that ask (remote ones), file their records, log membership."""
    run_dir = Path(os.environ[PLAN_ENV]).parent
    inbox = relay.Inbox(runner, Path(plan.samples_path), run_dir,
                        Path(plan.scorecards_path or plan.samples_path))
    plan_json = plan.model_dump_json()

    def on_plan_request(environment: Environment, msg: Any, **_: Any) -> None:
        data = msg.data if isinstance(msg.data, dict) else {}
        sent_at = data.get("time")
        skew = time.time() - sent_at if isinstance(sent_at, int | float) else None
        relay.note_worker(run_dir, runner, msg.node_id, skew)
        # The credentials the plan names as lifted (launcher.py) go with it, as the literal
        # values they were went before: a remote worker's environment cannot have them.
        runner.send_message("sq_plan", {"plan": plan_json, "lifted": lifted_from(os.environ)},
                            client_id=msg.node_id)

    runner.register_message("sq_plan_request", on_plan_request)
    runner.register_message("sq_stopped",
                            lambda environment, msg, **_: _Process.stopped.add(msg.node_id))
    environment = runner.environment
    environment.events.worker_connect.add_listener(  # type: ignore[no-untyped-call]
        lambda client_id, **_: _Process.joined.add(client_id))
    runner.register_message("sq_records", inbox.on_records)
    runner.register_message("sq_scorecard", inbox.on_scorecard)
    events.quitting.add_listener(lambda **_: inbox.close())  # type: ignore[no-untyped-call]
    gevent.spawn(relay.watch_workers, runner, run_dir, plan.end_at)


def _init_remote_worker(runner: WorkerRunner) -> None:
    """Ask the master for the plan; send every record back to it (loadgen/relay.py)."""
    outbox = _Process.relay = relay.Relay(runner)
    log = logging.getLogger(__name__)

    def on_plan(environment: Environment, msg: Any, **_: Any) -> None:
        plan = LoadPlan.model_validate_json(msg.data["plan"])
        lifted = msg.data.get("lifted")
        if isinstance(lifted, dict):
            os.environ.update({k: v for k, v in lifted.items() if isinstance(k, str)
                               and k.startswith(LIFTED_PREFIX) and isinstance(v, str)})
        try:
            check_templates(plan, os.environ)
        except ScenarioError as exc:
            log.error("%s", exc)
            outbox.close()
            os._exit(EXIT_SCENARIO)
        _Process.plan = plan
        _Process.plan_ready.set()
        log.info("load plan received from the master: %d users in all, until %s", plan.users,
                 time.strftime("%H:%M:%S", time.localtime(plan.end_at)))

    runner.register_message("sq_plan", on_plan)
    # Users stopped: the last records go now, before Locust tells the master "client_stopped".
    def on_test_stop(**_: Any) -> None:
        _save_card(final=True)
        outbox.flush()

    events.test_stop.add_listener(on_test_stop)  # type: ignore[no-untyped-call]
    events.quitting.add_listener(lambda **_: outbox.close())  # type: ignore[no-untyped-call]
    runner.send_message("sq_plan_request", {"time": time.time()})
    start_saturation_guard(runner, sink=relay.RelaySink(outbox, "saturation"))  # type: ignore[arg-type]
    collector.start(runner)


@events.quitting.add_listener  # type: ignore[untyped-decorator]
def _on_quitting(**_: Any) -> None:
    try:
        _save_card(final=True)
    except OSError as exc:   # the runner says so: this card's last checkpoint is not final
        logging.getLogger(__name__).error("cannot save the final scorecard: %s", exc)
    for sink in _Process.sinks.values():
        sink.close()
    _Process.sinks.clear()


class StreamUser(User):
    """One simulated client: closed loop with think time, or its share of an open-loop rate."""

    def on_start(self) -> None:
        plan = _plan()
        number = next(_Process.user_numbers)
        worker = getattr(self.environment.runner, "worker_index", 0)
        self.rng = random.Random(f"{plan.seed}/{worker}/{number}")
        self.arrivals_rng = random.Random(f"{plan.seed}/{worker}/{number}/arrivals")
        # Which streams a class's ``cancel`` abandons: a draw of its own, so that a class
        # without one leaves every other draw (classes, prompts) as it was.
        self.cancel_rng = random.Random(f"{plan.seed}/{worker}/{number}/cancel")
        self.weights = [c.weight for c in plan.classes]
        self.number = number
        if isinstance(plan.arrival, OpenLoop):
            inflight = max(1, math.ceil(plan.arrival.max_inflight / plan.users))
        elif isinstance(plan.arrival, TraceReplay):
            inflight = max(1, math.ceil(plan.arrival.max_inflight / plan.arrival.processes))
        else:
            inflight = 1
        # As many pooled sockets as requests allowed in flight: the pool never queues on its own.
        limits = SSELimits(plan.max_line_bytes, plan.max_event_bytes, plan.max_data_lines)
        self.stream_client = StreamClient(plan, concurrency=inflight, limits=limits)
        self.slots = BoundedSemaphore(inflight)
        self.arrivals = Group()
        # Arrivals due and not yet sent, by number: what a stopped user still owes the record.
        self.waiting: dict[int, tuple[float, RequestClassPlan]] = {}
        self.arrival_numbers = itertools.count()
        self._hold_until_the_first_step(plan)

    @staticmethod
    def _hold_until_the_first_step(plan: LoadPlan) -> None:
        """No request before the first step opens (set once the load processes were up, half a
        second ahead: run/launcher.py start_load): what they sent before it no step would own,
        warming the connections the first step should have opened. The users of Locust's first
        ramp (spawned at its rate from the first one on) keep their spacing, the whole ramp
        shifted to the step's start, those spawned after it opened too; a user spawned later
        (a later step's users) or a ramp begun after the step opened (a remote worker that
        joined late) starts at once."""
        if not plan.windows:
            return
        now, opens = time.time(), plan.windows[0][1]
        if _Process.first_spawn is None:
            _Process.first_spawn = now
        shift = opens - _Process.first_spawn
        ramp_s = plan.users / plan.spawn_rate if plan.spawn_rate > 0 else 0.0
        if shift <= 0 or now - _Process.first_spawn > ramp_s + _RAMP_SLACK_S:
            return
        gevent.sleep(max(0.0, now + shift - time.time()))

    def on_stop(self) -> None:
        self.arrivals.kill()
        # Killed while waiting for a slot, or before their greenlet ever ran: never sent.
        now = time.time()
        for due, cls in self.waiting.values():
            _write(UnsentArrival(cls=cls.name, scheduled=due, given_up=now, reason="stopped"))
        self.waiting.clear()
        self.stream_client.close()

    def wait_time(self) -> float:
        plan = _plan()
        if time.time() >= plan.end_at:
            return _IDLE_S
        if isinstance(plan.arrival, OpenLoop | TraceReplay):
            return 0.0
        return self.rng.uniform(plan.arrival.think_time_min_s, plan.arrival.think_time_max_s)

    @task
    def stream(self) -> None:
        plan = _plan()
        if time.time() >= plan.end_at:
            return
        if isinstance(plan.arrival, OpenLoop):
            self._open_loop(plan, plan.arrival)
        elif isinstance(plan.arrival, TraceReplay):
            self._trace(plan, plan.arrival)
        else:
            self._send(plan, None)

    def _open_loop(self, plan: LoadPlan, arrival: OpenLoop) -> None:
        """Arrivals at this user's share of the rate, each in its own greenlet until end_at.

        An arrival is *due* once this loop reaches its time before end_at; from then on it is
        either sent (a sample, its wait for a slot in ``queue_delay_ms``) or recorded as never
        sent. Arrivals timed at or after end_at were never due. With stages, the rate is
        theirs at each moment (loadgen/stages.py)."""
        for due in arrival_times(time.time(), self.arrivals_rng, arrival.process == "poisson",
                                 arrival.rate_per_s, plan.users, plan.stages):
            if due >= plan.end_at:
                break
            gevent.sleep(max(0.0, due - time.time()))
            cls = self.rng.choices(plan.classes, weights=self.weights)[0]
            number = next(self.arrival_numbers)
            self.waiting[number] = (due, cls)
            self.arrivals.spawn(self._arrival, plan, number)
        # Not done before end_at: the task would run again and start a second schedule.
        gevent.sleep(max(0.0, plan.end_at - time.time()))
        self.arrivals.join()

    def _trace(self, plan: LoadPlan, trace: TraceReplay) -> None:
        """This process's rows of a recorded trace (row i if i mod processes is this worker's
        index), each due at its own time and from then on accounted for exactly as an open-loop
        arrival: sent (its wait in queue_delay_ms) or recorded as never sent. One user per
        process dispatches; any other user of the process idles."""
        worker = getattr(self.environment.runner, "worker_index", 0) % trace.processes
        mine = trace.rows[worker::trace.processes]
        if self.number != 0 or not mine:
            gevent.sleep(max(0.0, plan.end_at - time.time()))
            return
        by_name = {c.name: c for c in plan.classes}
        synth = PromptSynth(f"{plan.seed}/trace", max(r[1] for r in mine))
        start = trace.start_at
        while True:
            for offset, input_tokens, output_tokens, cls_name, prompt in mine:
                due = start + offset
                if due >= plan.end_at:
                    self.arrivals.join()
                    return
                gevent.sleep(max(0.0, due - time.time()))
                cls = by_name.get(cls_name or "") or \
                    self.rng.choices(plan.classes, weights=self.weights)[0]
                row_cls = cls.model_copy(update={
                    "prompts": [prompt or synth.prompt(input_tokens)],
                    "prompt_max_tokens": None, "max_tokens": output_tokens})
                number = next(self.arrival_numbers)
                self.waiting[number] = (due, row_cls)
                self.arrivals.spawn(self._arrival, plan, number)
            if not trace.loop:
                break
            start += trace.period_s
        # Not done before end_at: the task would run again and replay the trace from its start.
        gevent.sleep(max(0.0, plan.end_at - time.time()))
        self.arrivals.join()

    def _arrival(self, plan: LoadPlan, number: int) -> None:
        # Waiting here for a free slot is client-side queueing; it shows as sent - scheduled.
        with self.slots:
            due, cls = self.waiting.pop(number)
            if time.time() < plan.end_at:
                self._send(plan, due, cls)
                return
        _write(UnsentArrival(cls=cls.name, scheduled=due, given_up=time.time(),
                             reason="run_ended"))

    def _send(self, plan: LoadPlan, scheduled: float | None,
              cls: RequestClassPlan | None = None) -> None:
        if cls is None:
            cls = self.rng.choices(plan.classes, weights=self.weights)[0]
        if cls.conversation is not None:
            self._session(plan, scheduled, cls, cls.conversation)
            return
        self._request(plan, scheduled, cls)

    def _session(self, plan: LoadPlan, scheduled: float | None, cls: RequestClassPlan,
                 conversation: Conversation) -> None:
        """A conversation class's session: its turns one after another, each sending the
        history so far, a think time apart; the first due when ``scheduled`` (open loop) or
        now. It ends at its last turn, a failed one, or when the next would start at or after
        the run's end (loadgen/conversation.py): the last turn's sample says how. So a turn's
        sample is written when the next turn is sent or the session ends (after the think
        time), and written all the same if the user is stopped meanwhile."""
        session = Session(cls, conversation)
        for number in range(1, conversation.turns + 1):
            turn = session.turn(number)
            sample = self._request(plan, scheduled if number == 1 else None, cls, turn,
                                   hold=True)
            end = session_end(sample, number, conversation.turns)
            next_at = time.time() + session.think_s(self.rng)
            if end is None and next_at >= plan.end_at:
                end = "abandoned"
            try:
                if end is None:
                    gevent.sleep(max(0.0, next_at - time.time()))
                    if time.time() >= plan.end_at:
                        end = "abandoned"       # woken late, past the end: no next turn
            except BaseException:
                end = "abandoned"               # the user was stopped in its think time
                raise
            finally:
                sample.session = end
                _write(sample)
                _fire(self.environment, sample)
            if end is not None:
                return
            session.answered(turn)

    def _request(self, plan: LoadPlan, scheduled: float | None, cls: RequestClassPlan,
                 turn: Turn | None = None, hold: bool = False) -> RequestSample:
        """One request and its retries, each attempt's sample written; ``hold``: the final
        attempt's is returned unwritten (a session's turn: its caller writes it)."""
        attempt = 1
        cancel = cls.cancel is not None and self.cancel_rng.random() < cls.cancel.share
        while True:
            sample = self.stream_client.measure(cls, self.rng, scheduled=scheduled,
                                                cancel=cancel, turn=turn)
            sample.attempt = attempt
            delay = retry_delay(plan.retries, sample)
            # No retry that would start after the run's end: the attempt stands as it is.
            if delay is not None and time.time() + delay < plan.end_at:
                sample.retried = True
            elif hold:
                return sample
            _write(sample)
            _fire(self.environment, sample)
            if not sample.retried:
                return sample
            gevent.sleep(delay)
            attempt += 1
