"""llama-server's slots API, as the cache flush uses it: ``GET /slots`` lists the slots (a JSON
list of objects with an ``id``), ``POST /slots/{id}?action=erase`` empties one slot's cache
(``{"id_slot": 0, "n_erased": 354}``: the tokens it dropped). Blocking ``urllib``, every call
with a timeout; every failure a sentence.

llama-server answers ``GET /slots`` unless started with ``--no-slots`` (501 then), and the
actions only when started with ``--slot-save-path`` (501 "This server does not support slots
action" otherwise). An erase of a slot that is generating waits until the slot is idle.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from streamquake.errors import InjectorError

NO_API = ("cache_flush needs llama-server's slots API (GET /slots, POST /slots/{id}?action=erase); "
          "vLLM, TGI and SGLang expose no per-slot erase")


class SlotsUnreachable(InjectorError):
    """No answer: refused, reset, timed out. ``reason`` is short, for a failure count."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Answer:
    status: int
    text: str

    def json(self) -> object:
        try:
            return json.loads(self.text)
        except ValueError:
            return None

    def message(self) -> str:
        """The server's own words: llama-server's ``{"error": {"message": ...}}``, else the
        start of the body."""
        body = self.json()
        error = body.get("error") if isinstance(body, dict) else None
        said = error.get("message") if isinstance(error, dict) else error
        text = said if isinstance(said, str) else self.text
        return " ".join(text.split())[:200] or "(empty body)"


def call(method: str, url: str, timeout_s: float) -> Answer:
    """One request; any HTTP status is an answer, no answer raises SlotsUnreachable."""
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Answer(resp.status, resp.read(1 << 20).decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        with exc:
            return Answer(exc.code, exc.read(1 << 16).decode(errors="replace"))
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise _timed_out(method, url, timeout_s) from exc
        reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
        raise SlotsUnreachable(f"cannot reach {url} ({reason})", reason) from exc
    except TimeoutError as exc:
        raise _timed_out(method, url, timeout_s) from exc
    except OSError as exc:      # reset mid-answer, and the like
        reason = exc.strerror or type(exc).__name__
        raise SlotsUnreachable(f"{method} {url} failed ({reason})", reason) from exc


def _timed_out(method: str, url: str, timeout_s: float) -> SlotsUnreachable:
    return SlotsUnreachable(f"{method} {url} got no answer within {timeout_s:g} s",
                            f"no answer within {timeout_s:g} s")


def slot_ids(base: str, timeout_s: float) -> list[int]:
    """The ids ``GET {base}/slots`` lists; InjectorError, a sentence, when it lists none."""
    url = f"{base}/slots"
    answer = call("GET", url, timeout_s)
    if answer.status in (404, 405, 501):
        raise InjectorError(f"the target at {base} exposes no slots API: GET /slots answered "
                            f"{answer.status} ({answer.message()}); {NO_API}")
    if answer.status != 200:
        raise InjectorError(f"GET {url} answered {answer.status} ({answer.message()})")
    body = answer.json()
    ids = [s.get("id") for s in body if isinstance(s, dict)] if isinstance(body, list) else []
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InjectorError(f"the target at {base} exposes no slots API: GET /slots answered "
                            f"200 but not a JSON list of slots with ids "
                            f"({' '.join(answer.text.split())[:120]!r}); {NO_API}")
    return [i for i in ids if isinstance(i, int)]


def erase_refusal(base: str, slot: int, timeout_s: float) -> str | None:
    """Why the server would refuse to erase, or None. Asks with a POST that names no action,
    which changes nothing: llama-server answers it 400 ("Invalid action") when it takes
    actions, and 501 when it was started without ``--slot-save-path``."""
    answer = call("POST", f"{base}/slots/{slot}", timeout_s)
    if answer.status in (404, 405, 501):
        hint = (" (llama-server: start it with --slot-save-path DIR)"
                if "slot-save-path" in answer.message() else "")
        return (f"the target at {base} lists its slots but will not erase them: POST "
                f"/slots/{slot} answered {answer.status} ({answer.message()}){hint}; {NO_API}")
    return None


class EraseFailed(Exception):
    """One erase did not happen; ``reason`` is short, for a failure count."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def erase(base: str, slot: int, timeout_s: float) -> int:
    """Erase one slot; the tokens it dropped (0 where the server does not say)."""
    try:
        answer = call("POST", f"{base}/slots/{slot}?action=erase", timeout_s)
    except SlotsUnreachable as exc:
        raise EraseFailed(exc.reason) from exc
    if answer.status != 200:
        raise EraseFailed(f"HTTP {answer.status}: {answer.message()}")
    body = answer.json()
    n = body.get("n_erased") if isinstance(body, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else 0
