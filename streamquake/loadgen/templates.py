"""Header and path templates (``${VAR}`` from the load process's environment) and the redaction
of the credentials they carry from what the load process writes.

No gevent here: the preflight, the probe and the run's session expand and redact with it too.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Iterable, Mapping

from streamquake.envref import ENV_REF, is_env_name, not_a_name
from streamquake.errors import ScenarioError
from streamquake.loadgen.plan import SECRET_HEADER, SECRET_PARAM, LoadPlan

# What a header may hold (RFC 9110 field names and values; no CR, LF or NUL).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_SECRET_MIN = 6         # shorter values would redact ordinary words
REDACTED = "[redacted]"


def expand_headers(headers: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Replace ``${VAR}`` in header values from ``environ``; name the variable if it is unset.

    Error messages name headers and variables, never a value.
    """
    missing: list[str] = []
    out: dict[str, str] = {}
    for name, value in headers.items():
        expanded = _expand(value, environ, f"header {name!r}", missing)
        if not _HEADER_NAME.fullmatch(name):
            missing.append(f"header name {name!r} is not a valid HTTP header name")
        elif not _HEADER_VALUE.fullmatch(expanded):
            refs = ", ".join(f"${{{v}}}" for v in ENV_REF.findall(value))
            source = f" (after expanding {refs})" if refs else ""
            missing.append(f"header {name!r} holds a line break or another control character"
                           f"{source}: an HTTP header cannot carry it")
        out[name] = expanded
    if missing:
        raise ScenarioError(missing)
    return out


def expand_path(path: str, environ: Mapping[str, str]) -> str:
    """``${VAR}`` in the request path (e.g. Gemini's ``?key=${GEMINI_API_KEY}``), so that a key
    given in the URL is never written to disk either."""
    missing: list[str] = []
    out = _expand(path, environ, "the request path", missing)
    if missing:
        raise ScenarioError(missing)
    return out


def check_templates(plan: LoadPlan, environ: Mapping[str, str]) -> None:
    """Raise ScenarioError if a header or the path names a variable ``environ`` lacks."""
    expand_headers(plan.headers, environ)
    if plan.path:
        expand_path(plan.path, environ)


def _expand(text: str, environ: Mapping[str, str], what: str, missing: list[str]) -> str:
    def repl(m: re.Match[str]) -> str:
        var = m.group(1)
        if not is_env_name(var):
            missing.append(f"{what}: {not_a_name(var)}")
            return ""
        if var not in environ:
            missing.append(f"{what} uses ${{{var}}}, but {var} is not set in the environment "
                           "of the load process: export it before the run")
            return ""
        return environ[var]
    return ENV_REF.sub(repl, text)


class Redactor:
    """Removes credentials from text the load process writes (error reasons, logs): every
    value that came from ``${VAR}``, whole values of credential headers (and their token after
    ``Bearer``, and the password a ``Basic`` token holds), and any ``key=``-style query
    parameter, even one the target made up.

    A target that quotes a key in part (OpenAI's 401 says ``Incorrect API key provided:
    sk-abc123def4********wxyz``) or transformed is caught too: any run of ``_SECRET_MIN`` or
    more characters of a secret, in any case, reversed, base64-encoded (at each of the three
    alignments) or percent-encoded, is redacted."""

    def __init__(self, secrets: Iterable[str], whole: Iterable[str] = ()) -> None:
        parts = {s for s in secrets if len(s) >= _SECRET_MIN}
        found = sorted(parts | {s for s in whole if len(s) >= _SECRET_MIN}, key=len,
                       reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, found))) if found else None
        # Every _SECRET_MIN-character window of every form of every secret, case-folded.
        self._grams = frozenset(
            form[i:i + _SECRET_MIN]
            for secret in parts for form in _secret_forms(secret)
            for i in range(len(form) - _SECRET_MIN + 1))

    @classmethod
    def for_request(cls, templates: Mapping[str, str], headers: Mapping[str, str],
                    path_template: str, path: str, environ: Mapping[str, str]) -> Redactor:
        secrets: list[str] = []
        whole: list[str] = []
        for name, template in templates.items():
            value = headers.get(name, "")
            if SECRET_HEADER.search(name) or ENV_REF.search(template):
                scheme, _, token = value.partition(" ")    # "Bearer sk-...", "Basic ..."
                token = token.strip()
                if token:
                    # The whole value exactly; its parts by the token alone ("Bearer" is a
                    # word, not a secret).
                    whole.append(value)
                    secrets += [token, *_basic_secrets(scheme, token)]
                else:
                    secrets.append(value)
        for text in (*templates.values(), path_template):
            secrets += [environ.get(var, "") for var in ENV_REF.findall(text)]
        secrets += [m.group(2) for m in SECRET_PARAM.finditer(path)]
        return cls(secrets, whole)

    def __call__(self, text: str) -> str:
        spans: list[tuple[int, int]] = []
        if self._pattern is not None:
            spans += [m.span() for m in self._pattern.finditer(text)]
        if self._grams and len(text) >= _SECRET_MIN:
            folded = _fold(text)
            n = _SECRET_MIN
            spans += [(i, i + n) for i in range(len(folded) - n + 1)
                      if folded[i:i + n] in self._grams]
        if spans:
            out: list[str] = []
            at = 0
            for start, end in _merged(spans):
                out += [text[at:start], REDACTED]
                at = end
            out.append(text[at:])
            text = "".join(out)
        # A key= parameter has its "=": a reason, an id or a model name without one (nearly
        # every text a request redacts) is spared the search.
        return SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text) if "=" in text else text


def _fold(text: str) -> str:
    """``text`` lower-cased character by character (same length, so indices still match)."""
    return "".join(low if len(low := ch.lower()) == 1 else ch for ch in text)


def _secret_forms(secret: str) -> set[str]:
    """How a target may echo ``secret``: as is, reversed, base64 (standard and URL-safe, from
    each of the three byte alignments, so that any part of it encodes to a run of one of
    these) and percent-encoded; all case-folded (upper- and lower-cased echoes match too)."""
    raw = secret.encode()
    forms = {secret, secret[::-1], urllib.parse.quote(secret, safe=""),
             urllib.parse.quote_plus(secret)}
    for skip in range(3):
        forms.add(base64.b64encode(raw[skip:]).decode().rstrip("="))
        forms.add(base64.urlsafe_b64encode(raw[skip:]).decode().rstrip("="))
    return {_fold(f) for f in forms}


def _basic_secrets(scheme: str, token: str) -> list[str]:
    """What a ``Basic`` token carries: ``user:password``, and the password."""
    if scheme.lower() != "basic":
        return []
    try:
        creds = base64.b64decode(token, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return []
    return [creds, creds.partition(":")[2]]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
