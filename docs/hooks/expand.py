"""MkDocs hook (mkdocs.yml ``hooks:``): expands the ``<!-- sq:... -->`` lines of the pages at
build time, so the reference pages are read off the code and no text is kept in two places.

* ``<!-- sq:readme-intro N -->``, ``<!-- sq:readme-section NAME -->``: the README's first N
  paragraphs, or its ``## NAME`` section (CI's contract, "The two commands", lives
  there). Its links to its own headings become links to the pages those headings name.
* ``<!-- sq:include PATH [drop-title] -->``: a Markdown file of the repository
  (``CREATING_FAULTS.md``, ``benchmarks/README.md``), without its ``#`` title if asked.
* ``<!-- sq:faults -->``: every fault type and its parameters, from ``streamquake faults``.
* ``<!-- sq:exit-codes -->``: the exit codes, from ``streamquake.errors`` and the CLI's
  ``--help`` text.
* ``<!-- sq:metrics -->``: the metrics a scenario's SLOs and ``abort_when`` may name, from
  the scenario schema.

An unknown directive, a missing README section or a README link that leads nowhere in the
docs stops the build.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^<!-- sq:([a-z-]+)(?: (.*?))? -->[ \t]*$", re.MULTILINE)
HEADING = re.compile(r"^(#{1,6}) (.*)$")
LINK_HEADING = re.compile(r"^\[(.+)\]\(docs/([^)#]+\.md)\)$")


def _cell(text: object) -> str:
    """Text for a Markdown table cell: HTML-escaped, pipes escaped, on one line."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def _outside_fences(lines: list[str]) -> list[tuple[int, str]]:
    """(index, line) of every line that is not inside a fenced code block."""
    out, fence = [], ""
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = ""
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            continue
        out.append((i, line))
    return out


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)     # a link: its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _readme() -> list[str]:
    return (ROOT / "README.md").read_text(encoding="utf-8").split("\n")


def _readme_pages(lines: list[str]) -> dict[str, str]:
    """README anchor -> docs page, from the README's headings that link to a page."""
    pages = {}
    for _, line in _outside_fences(lines):
        m = HEADING.match(line)
        link = LINK_HEADING.match(m.group(2).strip()) if m else None
        if link:
            pages[github_slug(link.group(1))] = link.group(2)
    return pages


def _from_readme(text: str, pages: dict[str, str]) -> str:
    """README text as a docs page says it: `(#anchor)` -> the page, `(docs/x)` -> `(x)`."""
    def anchor(m: re.Match[str]) -> str:
        slug = m.group(1)
        if slug not in pages:
            raise PluginError(f"README.md links to #{slug}, and no README heading that "
                              f"links to a docs page has that anchor")
        return f"]({pages[slug]})"
    text = re.sub(r"\]\(#([^)]+)\)", anchor, text)
    return re.sub(r"\]\(docs/", "](", text)


def readme_intro(count: str) -> str:
    """The first ``count`` paragraphs after the README's title."""
    lines = _readme()
    first = next(i for i, line in _outside_fences(lines) if line.startswith("## "))
    paragraphs = "\n".join(lines[1:first]).strip().split("\n\n")
    if not count.isdigit() or not 0 < int(count) <= len(paragraphs):
        raise PluginError(f"sq:readme-intro {count}: say how many of the README's "
                          f"{len(paragraphs)} opening paragraphs")
    return _from_readme("\n\n".join(paragraphs[:int(count)]), _readme_pages(lines))


def readme_section(name: str) -> str:
    lines = _readme()
    heads = [(i, line) for i, line in _outside_fences(lines) if line.startswith("## ")]
    for k, (i, line) in enumerate(heads):
        if line[3:].strip() == name:
            end = heads[k + 1][0] if k + 1 < len(heads) else len(lines)
            return _from_readme("\n".join(lines[i + 1:end]).strip(), _readme_pages(lines))
    raise PluginError(f"README.md has no section '## {name}'")


def include(arg: str) -> str:
    path, _, option = arg.partition(" ")
    if option not in ("", "drop-title"):
        raise PluginError(f"sq:include {arg}: the only option is drop-title")
    file = ROOT / path
    if not file.is_file():
        raise PluginError(f"sq:include: no file {path} in the repository")
    lines = file.read_text(encoding="utf-8").split("\n")
    if option and lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip()


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "streamquake", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "1000", "NO_COLOR": "1"})
    if done.returncode != 0:
        raise PluginError(f"streamquake {' '.join(args)} exited {done.returncode}: "
                          f"{done.stderr.strip()}")
    return done.stdout


def _default(value: object, required: bool) -> str:
    if required:
        return "(required)"
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def faults(_: str) -> str:
    docs = json.loads(_cli("faults", "--json"))
    text = _cli("faults").split("\n")
    first = f"{docs[0]['type']} ("
    preamble = [line.strip() for line in text[:next(
        i for i, line in enumerate(text) if line.startswith(first))] if line.strip()]
    out = ["What `streamquake faults` prints (`--json` for tools):", ""]
    out += [f"* {_cell(line)}" for line in preamble]
    for doc in docs:
        out += ["", f"## `{doc['type']}`", "",
                f"Family `{doc['family']}`: {_cell(doc['summary'])}.", "",
                "| parameter | type | default | notes |", "|---|---|---|---|"]
        out += [f"| `{p['name']}` | {_cell(p['type'])} | "
                f"{_cell(_default(p['default'], p['required']))} | {_cell(p['description'])} |"
                for p in doc["params"]]
    return "\n".join(out)


def exit_codes(_: str) -> str:
    from streamquake import errors
    from streamquake.cli import CAPACITY_EXIT_CODES_HELP, EXIT_CODES_HELP

    codes = sorted((value, name) for name, value in vars(errors).items()
                   if name.startswith("EXIT_") and isinstance(value, int))
    tree = [c for c in vars(errors).values()
            if isinstance(c, type) and issubclass(c, errors.StreamquakeError)]
    out = ["`streamquake.errors` names each code; every error streamquake raises on purpose "
           "is one of its classes, and the CLI ends with that class's code:", "",
           "| code | name | errors that end with it |", "|---:|---|---|"]
    for value, name in codes:
        raised = "; ".join(
            f"`{c.__name__}`: {_cell((c.__doc__ or '').strip().split(chr(10))[0])}"
            for c in tree if c.exit_code == value)
        out.append(f"| {value} | `{name}` | {raised} |")
    out += ["", "What `streamquake --help` (and `run`, `validate` and `probe`) says:", "",
            "```text", EXIT_CODES_HELP.strip(), "```", "",
            "What `streamquake capacity --help` says:", "",
            "```text", CAPACITY_EXIT_CODES_HELP.strip(), "```"]
    return "\n".join(out)


def _metric_kind(name: str, histograms: tuple[str, ...], recovery: str) -> str:
    if name == recovery:
        return "per fault step, in its recovery step (seconds; no `percentile`)"
    if name in histograms:
        return "a distribution: the SLO names a `percentile`"
    return "a rate over the step (a share: `1%` or `0.01`)"


def metrics(_: str) -> str:
    from streamquake.scenario import schema

    histograms = schema.HISTOGRAM_METRICS
    abort = set(typing.get_args(schema.AbortMetric))
    out = ["| metric | what an SLO judges | better | in `abort_when` |",
           "|---|---|---|---|"]
    for name in typing.get_args(schema.Metric):
        better = "higher" if name in schema.HIGHER_IS_BETTER else "lower"
        kind = _metric_kind(name, histograms, schema.RECOVERY_TIME)
        out.append(f"| `{name}` | {kind} | {better} | {'yes' if name in abort else ''} |")
    return "\n".join(out)


DIRECTIVES: dict[str, Callable[[str], str]] = {
    "readme-intro": readme_intro,
    "readme-section": readme_section,
    "include": include,
    "faults": faults,
    "exit-codes": exit_codes,
    "metrics": metrics,
}


def on_page_markdown(markdown: str, **_: object) -> str:
    def expand(m: re.Match[str]) -> str:
        name, arg = m.group(1), m.group(2) or ""
        if name not in DIRECTIVES:
            raise PluginError(f"unknown directive <!-- sq:{name} -->; known: "
                              f"{', '.join(DIRECTIVES)}")
        return DIRECTIVES[name](arg)
    return DIRECTIVE.sub(expand, markdown)
