"""Before any load: can this host hold the scenario's concurrent streams? Each open stream costs
one file descriptor in its load process and one in the embedded target, and one ephemeral port
towards the one address they all go to; the first of these to run out is named in one sentence,
with its fix, before anything starts.

The soft RLIMIT_NOFILE is raised to the hard one where the streams need it (as Go, nginx and
Locust's own launcher do): the target and the load processes started after this inherit it.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from pathlib import Path

from streamquake.scenario import Scenario

# Descriptors a process holds beyond one per stream: the interpreter, its imports, logs, the
# sample and scorecard files, pipes, the event loop's own (epoll, signal and wake-up fds).
FD_OVERHEAD = 64
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
NR_OPEN = Path("/proc/sys/fs/nr_open")


@dataclass(frozen=True)
class Limit:
    """One resource: how many streams it allows, and what to do when that is too few."""

    what: str
    streams: int     # the most concurrent streams it allows
    need: str        # what the scenario's streams need of it, in words
    fix: str


def concurrent_streams(scenario: Scenario) -> int:
    """The most streams the scenario keeps open at once, over all its load processes."""
    load = scenario.load
    if load.trace is not None:
        return load.trace.max_inflight
    if load.arrival is not None:
        return load.arrival.max_inflight
    # A closed loop: the most users any step runs (a step's own ``load.users``, else the
    # scenario's).
    return max([load.users, *(s.load.users for s in scenario.timeline
                              if s.load is not None and s.load.users is not None)])


def raise_nofile(need: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards the hard one if ``need`` is above it; the (soft,
    hard) limits after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need > soft and soft != hard:
        ceiling = hard
        if hard == resource.RLIM_INFINITY:
            try:
                ceiling = int(NR_OPEN.read_text())
            except (OSError, ValueError):
                ceiling = max(soft, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            soft = ceiling
        except (OSError, ValueError):
            pass    # not allowed here: the sentence below says what the streams need
    return soft, hard


def _port_range() -> tuple[int, int] | None:
    try:
        low, high = (int(x) for x in PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def limits(scenario: Scenario, streams: int) -> list[Limit]:
    processes = max(1, scenario.load.workers + scenario.load.remote_workers)
    per_process = math.ceil(streams / processes)
    soft, hard = raise_nofile(FD_OVERHEAD + max(per_process, streams if
                                                scenario.target.embedded is not None else 0))
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else f"{hard:,}"
    fds = max(0, soft - FD_OVERHEAD)
    fix_fds = (f"raise the open-files limit (`ulimit -n {FD_OVERHEAD + streams}` in the "
               f"shell that runs streamquake; the hard limit here is {hard_text}, so beyond it "
               "as root, or LimitNOFILE= in a systemd unit)")
    out = [Limit("file descriptors of each load process", fds * processes,
                 f"{per_process + FD_OVERHEAD:,} file descriptors in each load process "
                 f"(RLIMIT_NOFILE {soft:,})",
                 f"{fix_fds}, or spread the users over more load.workers")]
    if scenario.target.embedded is not None:
        out.append(Limit("file descriptors of the embedded target", fds,
                         f"{streams + FD_OVERHEAD:,} in the embedded target (RLIMIT_NOFILE "
                         f"{soft:,})", fix_fds))
    ports = _port_range()
    if ports is not None:
        low, high = ports
        out.append(Limit("ephemeral ports", high - low + 1,
                         f"{streams:,} local ports to one address ({high - low + 1:,} in "
                         f"net.ipv4.ip_local_port_range, {low}-{high})",
                         "widen net.ipv4.ip_local_port_range (`sysctl -w "
                         "net.ipv4.ip_local_port_range='1024 65535'`)"))
    return out


def stream_limits_check(scenario: Scenario) -> tuple[list[str], str]:
    """(problems, the sentence): what the scenario's concurrent streams need of this host, and
    what would run out first; a problem for each limit below the streams."""
    streams = concurrent_streams(scenario)
    found = limits(scenario, streams)
    first = min(found, key=lambda lim: lim.streams)
    needs = ", ".join(lim.need for lim in found[:-1]) + f" and {found[-1].need}" \
        if len(found) > 1 else found[0].need
    short = sorted((lim for lim in found if lim.streams < streams), key=lambda lim: lim.streams)
    problems = [
        f"{streams:,} concurrent streams will not fit: {lim.what} run out "
        f"{'also' if i else 'first'}, at about {lim.streams:,} streams: they need {lim.need}; "
        f"{lim.fix}"
        for i, lim in enumerate(short)]
    sentence = (f"{streams:,} concurrent streams need {needs}; the first to run out would be "
                f"{first.what}, at about {first.streams:,} streams")
    return problems, sentence
