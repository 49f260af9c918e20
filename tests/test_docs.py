"""The documentation site (mkdocs.yml, docs/, README.md): it builds with ``--strict`` (no broken
link or anchor), every scenario in it validates, every YAML fragment parses, and every shell
example that calls streamquake is run here or listed below with why it is not, so a new or
changed example that is wrong fails here.

The pages are read as the site shows them: docs/hooks/expand.py fills in what they include
(the README's "The two commands", CREATING_FAULTS.md, benchmarks/README.md, the references).
Quick tier: no real run, no fault, nothing beyond this machine's loopback; a run example is
planned with ``--dry-run`` instead (which starts and changes nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "docs" / "hooks" / "expand.py"

RUN = "run"            # safe and quick here: run as written, exit 0
DRY_RUN = "dry-run"    # a real run: planned with --dry-run instead (exit 0); the reason says why
NOT_RUN = "not run"    # checked against `--help` (the command, each --option) and, for inject,
                       # against `streamquake faults` (the type, each parameter); never run

# Every streamquake command the docs show, as written there (continuation lines joined, the
# comment left out, `.venv/bin/` and `python -m` left out): how this test treats it, and why.
EXAMPLES: dict[str, tuple[str, str]] = {
    # README, "An example" (the home page and Getting started show it too)
    "streamquake validate first-fault.yaml": (RUN, ""),
    "streamquake run first-fault.yaml --dry-run": (RUN, ""),
    "streamquake run first-fault.yaml --out out/first-fault":
        (DRY_RUN, "a real run of about a minute"),
    # README, "The two commands"
    "streamquake run scenarios/quickstart.yaml --out out/quickstart":
        (DRY_RUN, "a real run of about a minute (CI's main job; the suite's report tests run it)"),
    # Getting started
    "streamquake validate scenarios/quickstart.yaml": (RUN, ""),
    "streamquake run scenarios/quickstart.yaml --dry-run": (RUN, ""),
    "streamquake faults": (RUN, ""),
    "streamquake schema": (RUN, ""),
    # Scenarios: the reference chaos plan, inside User-Mode Linux
    "streamquake run scenarios/reference-chaos-plan.yaml --out out/reference":
        (DRY_RUN, "needs root, netem and User-Mode Linux, 78 s of steps "
                  "(tests/uml/test_reference_chaos_plan.py runs it in the UML gate)"),
    # Faults: the GPU scenario against the emulated NVML driver
    "streamquake run scenarios/gpu-downclock.yaml --out out/gpu":
        (DRY_RUN, "a real run of 33 s through the emulated NVML driver (tests/test_gpu_clocks.py)"),
    # README, "Engine faults: the KV cache flushed"
    "streamquake run scenarios/kv-cache-flush.yaml --out out/kv-cache-flush":
        (DRY_RUN, "a real run of 28 s (tests/test_engine_cache_flush.py runs its like)"),
    # README, "Engine faults: a noisy tenant"
    "streamquake run scenarios/noisy-tenant.yaml --out out/noisy-tenant":
        (DRY_RUN, "a real run of 20 s (tests/test_noisy_tenant.py runs its like)"),
    # README, "Faults in the meaning of a stream"
    "streamquake run scenarios/stream-error-event.yaml --out out/stream-error-event":
        (DRY_RUN, "a real run of 26 s (tests/test_stream_meaning_faults.py runs its like)"),
    # README, "Faults in a tool call's stream"
    "streamquake run scenarios/tool-call-chunks.yaml --out out/tool-call-chunks":
        (DRY_RUN, "a real run of 29 s (tests/test_tool_call_faults.py runs its like)"),
    # README, "Client cancellations"
    "streamquake run scenarios/client-cancellations.yaml --out out/client-cancellations "
    "--set target.embedded.send_log=out/sends.jsonl":
        (DRY_RUN, "a real run of 20 s (tests/test_cancellations.py runs its like)"),
    # README, "Conversations"
    "streamquake run scenarios/conversations.yaml --out out/conversations":
        (DRY_RUN, "a real run of 27 s (tests/test_conversations.py runs its like)"),
    # README, "Priorities"
    "streamquake run scenarios/priority-flood.yaml --out out/priority-flood":
        (DRY_RUN, "a real run of about 45 s (tests/test_priority_scheduler.py runs its like)"),
    "streamquake run scenarios/priority-flood.yaml --out out/priority-flood-fifo "
    "--set target.embedded.scheduler=null":
        (DRY_RUN, "a real run of about 45 s (tests/test_priority_scheduler.py runs its like)"),
    # Capacity under fault
    "streamquake capacity capacity.yaml --warmup 6s --probe 4s --precision 20% --no-watchdog":
        (NOT_RUN, "a search of several minutes, on a scenario of the suite's "
                  "(tests/test_capacity_search.py runs it)"),
    # Game days
    "streamquake agent --listen 10.0.0.5:7355 --tls-cert agent.pem --tls-key agent.key "
    "--allow-types gpu_clocks,netem,tbf --allow-gpus 0,1 --allow-interfaces eth0":
        (NOT_RUN, "an agent on another host's address, with its TLS files and GPUs"),
    "streamquake inject gpu_clocks gpus=[0] sm_clocks_mhz=[500,800] --for 10m --name slow-gpu "
    "--at https://10.0.0.5:7355 --ca-cert ca.pem":
        (NOT_RUN, "an agent on another host, with a GPU"),
    "streamquake status --at https://10.0.0.5:7355 --ca-cert ca.pem":
        (NOT_RUN, "an agent on another host"),
    "streamquake revert slow-gpu --at https://10.0.0.5:7355 --ca-cert ca.pem":
        (NOT_RUN, "an agent on another host"),
    "streamquake revert slow-gpu --force --at https://10.0.0.5:7355 --ca-cert ca.pem":
        (NOT_RUN, "an agent on another host"),
    "streamquake inject netem delay=100ms jitter=30ms --target 10.0.0.7:8000 --for 1m30s":
        (NOT_RUN, "root and netem, shaping the path to another host"),
    "streamquake inject tbf rate=1mbit --target 127.0.0.1:8000 --for 3s":
        (NOT_RUN, "root (a qdisc on this host), and the example kills its own shell"),
    "streamquake status --json":
        (NOT_RUN, "starts the local agent daemon, which stays 60 s "
                  "(tests/test_held_by_hand.py and the agent tests run it)"),
    "streamquake revert --all":
        (NOT_RUN, "starts the local agent daemon, which stays 60 s (the agent tests run it)"),
    "streamquake proxy --upstream http://10.0.0.7:8000 --listen 127.0.0.1:8081":
        (NOT_RUN, "a standing proxy in front of another host, in the foreground until Ctrl-C"),
    "streamquake inject sse_proxy drop=15% first_event_delay=400ms --for 2m --name lossy":
        (NOT_RUN, "needs the standing proxy above, and starts the local agent daemon"),
    "streamquake revert lossy": (NOT_RUN, "needs the fault above, held by the local agent"),
    "streamquake inject sse_proxy abort.status=503 --for 5m --proxy 10.0.0.9:8081 "
    "--at https://10.0.0.9:7355 --ca-cert ca.pem":
        (NOT_RUN, "a standing proxy and an agent on another host"),
    # More load than one machine
    "streamquake run nightly.yaml --remote-workers 2 --master-bind 0.0.0.0:5557":
        (NOT_RUN, "a scenario of the reader's, and workers on other hosts "
                  "(tests/test_remote_workers.py runs a master and workers on loopback)"),
    "streamquake worker --master controller.example:5557 [--processes auto]":
        (NOT_RUN, "a master on another host"),
}

# A scenario the docs show and then name by a file: the file, and the scenario's `name`.
SAVED_AS = {"first-fault.yaml": "first-fault"}


def _load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sq_docs_expand", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def pages() -> dict[str, str]:
    """Each page's Markdown as the site shows it, and the README as GitHub shows it."""
    hook = _load_hook()
    out = {"README.md": (REPO / "README.md").read_text(encoding="utf-8")}
    for path in sorted((REPO / "docs").rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        out[str(path.relative_to(REPO))] = hook.on_page_markdown(text)
    return out


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def blocks() -> Iterator[Block]:
    """Every fenced block of every page, dedented to its fence."""
    for page, text in pages().items():
        lines = text.split("\n")
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, fence, lang = m.groups()
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
                j += 1
            yield Block(page, i + 1, lang.lower(), "\n".join(body))
            i = j + 1


SHELL = {"sh", "bash", "shell", "console"}


def _logical_lines(text: str) -> Iterator[str]:
    """Lines with their backslash continuations joined."""
    pending = ""
    for line in text.split("\n"):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def invocations(line: str) -> Iterator[list[str]]:
    """The arguments of each streamquake command in one shell line (`a && b; c | d`)."""
    segment: list[str] = []
    for token in [*_tokens(line), ";"]:
        if token and set(token) <= set("();<>|&"):
            for k, word in enumerate(segment):
                if word == "streamquake" or word.endswith("/streamquake"):
                    yield segment[k + 1:]
                    break
                if word == "-m" and segment[k + 1:k + 2] == ["streamquake"]:
                    yield segment[k + 2:]
                    break
            segment = []
        else:
            segment.append(token)


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    args: tuple[str, ...]

    @property
    def key(self) -> str:
        return " ".join(["streamquake", *self.args])


def examples() -> list[Example]:
    """Every streamquake command in a shell block, or after a `$ ` prompt in another block."""
    out = []
    for b in blocks():
        for line in _logical_lines(b.text):
            if b.lang not in SHELL:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            out += [Example(b.page, b.line, tuple(args)) for args in invocations(line)]
    return out


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamquake", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})


def _yaml(text: str) -> object:
    return YAML(typ="safe", pure=True).load(text)


def _is_scenario(doc: object) -> bool:
    return isinstance(doc, dict) and "name" in doc and "target" in doc


# -- (a) the site builds, strictly ---------------------------------------------------------------


def test_the_site_builds_strictly_with_the_references_read_off_the_code(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    said = [line for line in (done.stdout + done.stderr).split("\n")
            if line.startswith(("WARNING", "ERROR", "Aborted", "Error", "mkdocs.exceptions"))]
    assert done.returncode == 0, "\n".join(said) or done.stderr[-3000:]
    reference = (site / "reference" / "faults" / "index.html").read_text(encoding="utf-8")
    faults = json.loads(_cli(["faults", "--json"], REPO).stdout)
    for fault in faults:
        assert f'id="{fault["type"]}"' in reference, fault["type"]
        for param in fault["params"]:
            assert f"<code>{param['name']}</code>" in reference, (fault["type"], param["name"])
    codes = (site / "reference" / "exit-codes" / "index.html").read_text(encoding="utf-8")
    assert "EXIT_NOT_JUDGED" in codes and "130/143" in codes
    # The README's "The two commands" is on the site as it is in the README, links made pages.
    start = (site / "getting-started" / "index.html").read_text(encoding="utf-8")
    assert "scripts/test --quick" in start and 'href="../reports/"' in start


def test_nothing_is_left_for_the_build_to_expand() -> None:
    for page, text in pages().items():
        assert "<!-- sq:" not in text, page


# -- (b) scenarios validate, fragments parse ----------------------------------------------------


def test_every_scenario_in_the_docs_validates_and_every_fragment_is_yaml(tmp_path: Path) -> None:
    problems, scenarios = [], 0
    for b in blocks():
        if b.lang not in ("yaml", "yml"):
            continue
        where = f"{b.page}:{b.line}"
        try:
            doc = _yaml(b.text)
        except YAMLError as exc:
            problems.append(f"{where}: not YAML: {exc}")
            continue
        if not _is_scenario(doc):
            continue
        scenarios += 1
        file = tmp_path / f"scenario-{scenarios}.yaml"
        file.write_text(b.text, encoding="utf-8")
        done = _cli(["validate", str(file)], tmp_path)
        if done.returncode != 0:     # 0 with warnings is valid; 2 is a problem
            problems.append(f"{where}: streamquake validate exited {done.returncode}: "
                            f"{done.stdout.strip()} {done.stderr.strip()}")
    assert not problems, "\n".join(problems)
    assert scenarios >= 2     # the README's example and the annotated quickstart, at least


# -- (c) every shell example is run, or listed with why not --------------------------------------


@cache
def _help(command: str) -> str:
    done = _cli([command, "--help"], REPO)
    assert done.returncode == 0, f"streamquake {command} --help: {done.stderr}"
    return done.stdout


@cache
def _fault_params() -> dict[str, set[str]]:
    faults = json.loads(_cli(["faults", "--json"], REPO).stdout)
    envelope = {"name", "phase", "at", "flap"}
    return {f["type"]: {p["name"] for p in f["params"]} | envelope for f in faults}


def _unknown(args: tuple[str, ...]) -> list[str]:
    """What `--help` and `streamquake faults` do not know of a command that is not run."""
    if not args or args[0].startswith("-"):
        return [] if not args or args[0] in ("--help", "--version") else [f"{args[0]}?"]
    text = _help(args[0])
    out = [f"{args[0]}: no option {word}" for word in args[1:]
           if re.fullmatch(r"\[?--[a-z][a-z0-9-]*\]?", word)
           and not re.search(rf"{re.escape(word.strip('[]'))}(?![\w-])", text)]
    if args[0] == "inject" and len(args) > 1:
        params = _fault_params()
        if args[1] not in params:
            out.append(f"inject: no fault type {args[1]!r} (`streamquake faults`)")
        else:
            keys = [w.split("=", 1)[0].split(".", 1)[0] for w in args[2:]
                    if "=" in w and not w.startswith("-")]
            out += [f"inject {args[1]}: no parameter {k!r}" for k in keys
                    if k not in params[args[1]]]
    return out


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Where the examples run: the repository's scenarios, and each saved scenario."""
    (tmp_path / "scenarios").symlink_to(REPO / "scenarios")
    for file, name in SAVED_AS.items():
        texts = [b.text for b in blocks() if b.lang == "yaml"
                 and _is_scenario(doc := _yaml(b.text)) and isinstance(doc, dict)
                 and doc["name"] == name]
        assert texts, f"no scenario named {name!r} in the docs, to save as {file}"
        (tmp_path / file).write_text(texts[0], encoding="utf-8")
    return tmp_path


def test_every_shell_example_is_run_or_listed_with_why_not(workdir: Path) -> None:
    found = examples()
    unlisted = sorted({f"{e.page}:{e.line}: {e.key}" for e in found if e.key not in EXAMPLES})
    assert not unlisted, ("examples neither run nor listed (add each to EXAMPLES in "
                          "tests/test_docs.py, with why it is not run):\n" + "\n".join(unlisted))
    stale = sorted(set(EXAMPLES) - {e.key for e in found})
    assert not stale, "listed in EXAMPLES, and no page shows them:\n" + "\n".join(stale)
    for key, (how, why) in EXAMPLES.items():
        assert how in (RUN, DRY_RUN, NOT_RUN) and (how == RUN or why), key

    problems = []
    for key in sorted({e.key for e in found}):
        how, _ = EXAMPLES[key]
        args = next(e.args for e in found if e.key == key)
        if how == NOT_RUN:
            problems += [f"{key}: {p}" for p in _unknown(args)]
            continue
        if how == DRY_RUN:
            assert args[0] == "run", f"{key}: only `run` has a --dry-run"
            args = (*args, "--dry-run")
        done = _cli(list(args), workdir)
        if done.returncode != 0:
            problems.append(f"{key}: exited {done.returncode}: "
                            f"{(done.stdout + done.stderr).strip()[-800:]}")
    assert not problems, "\n".join(problems)


def test_every_command_is_in_the_command_list() -> None:
    """`streamquake --help`'s commands and the synopsis on the Commands page are the same set."""
    listed = set(re.findall(r"^streamquake ([a-z]+)", pages()["docs/commands.md"], re.M))
    text = _cli(["--help"], REPO).stdout
    commands = set(re.findall(r"^│ ([a-z]+) ", text, re.M))
    assert commands and commands == listed, (sorted(commands - listed), sorted(listed - commands))
