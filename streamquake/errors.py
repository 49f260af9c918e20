"""One error tree for the whole tool; the CLI maps each branch to an exit code.

Library exceptions (pyroute2, pynvml, aiohttp, ruamel) are converted at the boundary with
``raise OurError("sentence a user can act on") from exc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails

EXIT_OK = 0
EXIT_SLO_BROKEN = 1
EXIT_SCENARIO = 2
EXIT_ENVIRONMENT = 3
EXIT_REVERT_FAILED = 4
EXIT_ABORTED = 5          # an abort condition held: faults reverted early, recovery measured
EXIT_NOT_JUDGED = 6       # nothing broke, but a gating timing check was not judged: the load
                          #   generator was saturated in its step (run/saturation.py)


class StreamquakeError(Exception):
    """Base of every error streamquake raises on purpose."""

    exit_code = EXIT_ENVIRONMENT


class ScenarioError(StreamquakeError):
    """The scenario file or the command line is wrong. Carries every problem found."""

    exit_code = EXIT_SCENARIO

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class PreflightError(StreamquakeError):
    """The environment cannot run this scenario (no capability, target unreachable...)."""

    exit_code = EXIT_ENVIRONMENT

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class TargetError(StreamquakeError):
    """The target (embedded or remote) could not be started or reached."""

    exit_code = EXIT_ENVIRONMENT


class InjectorError(StreamquakeError):
    """A fault could not be applied."""

    exit_code = EXIT_ENVIRONMENT


class LeaseLapsed(StreamquakeError):
    """This run's watchdog lease lapsed: nothing more may change on it, and the run aborts."""

    exit_code = EXIT_ABORTED


class RevertError(InjectorError):
    """A fault could not be reverted: the system may still be degraded."""

    exit_code = EXIT_REVERT_FAILED


def validation_message(err: ErrorDetails) -> str:
    """One pydantic error's message as a sentence (without pydantic's "Value error, ")."""
    return str(err["msg"]).removeprefix("Value error, ")


def validation_sentences(exc: ValidationError, prefix: str = "") -> list[str]:
    """One ``where: what`` sentence per problem, ``where`` dotted after ``prefix``
    (``fault.delay: ...``); a problem with the whole object is its message alone."""
    out = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        out.append(f"{loc}: {validation_message(err)}" if loc else validation_message(err))
    return out
