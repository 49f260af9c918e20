"""Scenario validation: every bad fixture gives its exact message, all problems at once."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from streamquake.errors import ScenarioError
from streamquake.located_yaml import MAX_FILE_BYTES, MAX_VALUES, parse_yaml
from streamquake.scenario import load_scenario, parse_scenario
from tests.conftest import REPO, run_cli
from tests.timing import cpu_s

BAD = Path("tests/scenarios/bad")

EXPECTED = {
    "unknown_field.yaml": [
        "6:3: load.userz: unknown field (hint: did you mean 'users'? allowed here: arrival, "
        "classes, limits, master_bind, remote_workers, retries, samples, saturation, seed, "
        "spawn_rate, stall_threshold, think_time, trace, users, workers)"
    ],
    "missing_phases.yaml": ["1:1: (top level): give 'phases' (e.g. {baseline: 30s, fault: 30s, "
                           "recovery: 30s}) or 'steps' (a list of named steps)"],
    "bad_duration.yaml": [
        "6:3: phases.baseline: expected a duration like '100ms' or '30s', got '10 sec'"
    ],
    "unknown_fault_type.yaml": [
        "7:5: faults.0.type: 'chaos_monkey' is not a type known here (hint: one of: cache_flush, "
        "gpu_clocks, netem, noisy_tenant, sse_proxy, tbf)"
    ],
    "percentile_missing.yaml": [
        "7:5: slos.0: 'ttft_ms' is a distribution: add 'percentile', e.g. 95"
    ],
    "two_targets.yaml": [
        "2:1: target: give exactly one of 'url' (a running endpoint) or 'embedded' (the "
        "simulated server, e.g. 'embedded: {}')"
    ],
    "not_yaml.yaml": ["3:1: not valid YAML: expected ',' or '}', but got '<scalar>'"],
    "proxy_drop_over_100.yaml": ["9:5: faults.0.drop: must be between 0% and 100%, got '150%'"],
    "merge_key_unknown_field.yaml": [
        # A merged key is located where it is written: in the anchored mapping.
        "5:26: load.classes.0.max_tokenz: unknown field (hint: did you mean 'max_tokens'? "
        "allowed here: body, cancel, conversation, dataset, max_tokens, name, priority, prompt, "
        "prompts, read, slos, weight)",
        "5:26: load.classes.1.max_tokenz: unknown field (hint: did you mean 'max_tokens'? "
        "allowed here: body, cancel, conversation, dataset, max_tokens, name, priority, prompt, "
        "prompts, read, slos, weight)",
    ],
    "merge_not_a_mapping.yaml": [
        "4:7: '<<' merges a mapping (or a list of mappings) into this one, but this is a list "
        "of other things"
    ],
    "undefined_alias.yaml": ["4:7: the alias '*bogus' names no anchor '&bogus' defined before it"],
    "recursive_alias.yaml": [
        "4:13: the alias '*me' is used inside the value it names (a recursive structure)"
    ],
    "alias_bomb.yaml": [
        "8:28: the alias '*d' stands for 7,381 values, which makes more than 50,000 in all "
        "(aliases multiply: is this an alias bomb?)"
    ],
    "too_deep.yaml": [
        "6:73: nested more than 64 levels deep (the limit; a scenario needs about 6)"
    ],
    "number_too_large.yaml": [
        "2:51: the number '1e400' is too large: numbers in a scenario must be finite and no "
        "larger than 2^63-1 (9.2e18)",
        "3:15: the number '99999999999999999999999999999' is too large: numbers in a scenario "
        "must be finite and no larger than 2^63-1 (9.2e18)",
        "4:20: the number '.inf' is infinite: numbers in a scenario must be finite and no larger "
        "than 2^63-1 (9.2e18)",
        "4:33: '.nan' is not a number: write a finite number",
    ],
    "not_utf8.yaml": [
        "1:10: not UTF-8: byte 0xe9 is an invalid continuation byte: save the file as UTF-8"
    ],
    "utf16.yaml": [
        " the file is UTF-16 or UTF-32 (it starts with a byte order mark): save it as UTF-8"
    ],
    "control_characters.yaml": [
        '1:8: the control character U+0000 (NUL) is not allowed in YAML (remove it, or write it '
        'as "\\x00" inside double quotes)',
        '3:19: the control character U+001B (ESC) is not allowed in YAML (remove it, or write it '
        'as "\\x1b" inside double quotes)',
        "4:52: the control character U+FFFE (a non-character) is not allowed in YAML (remove it)",
    ],
    "two_documents.yaml": [
        "4:1: a second YAML document starts here; a scenario file holds one (remove the '---' "
        "line)"
    ],
    "duplicate_key.yaml": [
        "7:3: duplicate key 'users' (first given on line 5): give each key once"
    ],
    "unsupported_tag.yaml": [
        "3:20: '5s' is not a valid int (it is tagged !!int)",
        "3:37: the tag !!binary is not supported in a scenario (remove it)",
        "3:62: the tag !custom is not supported in a scenario (remove it)",
        "4:7: the tag !!set is not supported in a scenario (remove it)",
    ],
    # The names come from the families that offer profiles (tc), through the catalog.
    "unknown_network_profile.yaml": [
        "5:3: network.profile: unknown network profile 'moon-link'; known profiles: "
        "cross-region, same-az",
    ],
    "many_problems.yaml": [
        "3:3: target.protocol: Input should be 'gemini', 'openai', 'anthropic', 'sse', "
        "'openai_responses' or 'llama_cpp' (hint: use one of the values listed)",
        "5:12: target.embedded.ttft.dist: 'gamma' is not a dist known here (hint: one of: fixed, "
        "normal, lognormal)",
        "7:3: load.users: Input should be greater than or equal to 1 (hint: use a bigger value)",
        "15:5: faults.0.drop: must be between 0% and 100%, got '150%'",
        "17:6: slos.0.metric: Input should be 'ttfb_ms', 'ttft_ms', 'itl_ms', 'e2e_ms', "
        "'output_tokens_per_s', 'queue_delay_ms', 'ttft_scheduled_ms', 'e2e_scheduled_ms', "
        "'send_ms', 'dns_ms', 'connect_ms', 'tls_ms', 'write_ms', 'ttfa_ms', 'error_rate', "
        "'stall_rate', 'chunk_loss', 'not_sent_rate', 'usage_deficit' or 'recovery_time_s' "
        "(hint: use one of the values listed)",
    ],
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_bad_fixture_gives_exact_messages(fixture: str) -> None:
    path = BAD / fixture
    with pytest.raises(ScenarioError) as info:
        load_scenario(REPO / path)
    got = [p.removeprefix(f"{REPO / path}:") for p in info.value.problems]
    assert got == EXPECTED[fixture]


@pytest.mark.timeout(10)
def test_every_bad_fixture_is_covered() -> None:
    assert {p.name for p in (REPO / BAD).glob("*.yaml")} == set(EXPECTED)


@pytest.mark.timeout(30)
def test_validate_cli_prints_file_line_and_exits_2() -> None:
    proc = run_cli("validate", str(BAD / "many_problems.yaml"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 5
    assert lines[0].startswith(f"Error: {BAD / 'many_problems.yaml'}:3:3: target.protocol:")
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "scenarios").glob("*.yaml")))
def test_shipped_scenarios_validate(path: str) -> None:
    proc = run_cli("validate", f"scenarios/{path}")
    assert proc.returncode == 0, proc.stderr
    assert ": OK: scenario" in proc.stdout


@pytest.mark.timeout(10)
def test_missing_file_is_a_scenario_error() -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario("/nonexistent/scenario.yaml")
    assert info.value.problems == [
        "/nonexistent/scenario.yaml: cannot read the scenario file: no such file"]


@pytest.mark.timeout(10)
def test_units_and_defaults() -> None:
    sc = parse_scenario(
        """
name: units
target: {protocol: sse, url: "http://127.0.0.1:9/", headers: {X-Key: "${MY_KEY}"}, timeout: 1.5s}
load: {users: 3, arrival: {rate: 600/m}, stall_threshold: 0.5s}
phases: {baseline: 1m, fault: 500ms, recovery: 2}
slos: [{metric: chunk_loss, max: 2%}, {metric: e2e_ms, percentile: 99.9, max: 2s}]
"""
    )
    assert sc.target.url == "http://127.0.0.1:9"
    assert sc.target.timeout_s == 1.5
    assert sc.load.arrival is not None and sc.load.arrival.rate_per_s == 10.0
    assert sc.load.stall_threshold_ms == 500.0
    assert (sc.phases.baseline_s, sc.phases.fault_s, sc.phases.recovery_s) == (60.0, 0.5, 2.0)
    assert sc.slos[0].max == 0.02 and sc.slos[1].max == 2000.0
    assert sc.slos[0].phases == ["baseline", "fault", "recovery"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("snippet", "complaint"),
    [
        ('headers: {A: "${1BAD}"}', "is not an environment variable name"),
        ("url: ftp://x", "must start with http:// or https://"),
    ],
)
def test_target_field_checks(snippet: str, complaint: str) -> None:
    text = f"""
name: t
target: {{protocol: openai, {snippet if snippet.startswith('url') else 'embedded: {}, ' + snippet}}}
phases: {{baseline: 1s, fault: 0s, recovery: 0s}}
"""
    with pytest.raises(ScenarioError, match=complaint):
        parse_scenario(text)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("slo", "complaint"),
    [
        ("{metric: error_rate, max: 1}", "max: 1 is read as a fraction, 100% of requests, "
                                         "which never breaks: write 1% for 1 percent"),
        ("{metric: chunk_loss, max: 5}", "max: 5 is read as a fraction, 500%"),
        ("{metric: error_rate, max: 350 ms}", "'error_rate' is a rate: write a percentage"),
        ("{metric: ttft_ms, percentile: 95, max: 5%}", "'ttft_ms' is a time: write a duration"),
    ],
)
def test_a_threshold_in_the_wrong_unit_is_refused_with_the_fix(slo: str, complaint: str) -> None:
    """A rate's bare number is a fraction: ``max: 1`` was 100%, an SLO that could never
    break, and ``max: 350 ms`` on a rate or a percentage on a time passed unremarked."""
    problems = _problems(MINIMAL + f"slos:\n  - {slo}\n")
    assert any(complaint in p and p.startswith("f.yaml:5:") for p in problems), problems


@pytest.mark.timeout(10)
@pytest.mark.parametrize("limit", ["0.01", "1%", "100%", "0"])
def test_a_rate_threshold_as_a_fraction_or_a_percentage_is_read(limit: str) -> None:
    sc = parse_scenario(MINIMAL + f"slos:\n  - {{metric: error_rate, max: {limit}}}\n")
    assert sc.slos[0].max == {"0.01": 0.01, "1%": 0.01, "100%": 1.0, "0": 0.0}[limit]


@pytest.mark.timeout(10)
def test_fault_in_an_empty_phase_is_rejected() -> None:
    with pytest.raises(ScenarioError, match="lasts 0 s"):
        parse_scenario(
            """
name: t
target: {protocol: openai, embedded: {}}
phases: {baseline: 1s, fault: 0s, recovery: 1s}
faults: [{type: sse_proxy, drop: 10%}]
"""
        )


MINIMAL = """\
name: t
target: {protocol: openai, embedded: {}}
phases: {baseline: 1s, fault: 0s, recovery: 0s}
"""


def _problems(text: str | bytes) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "f.yaml")
    return info.value.problems


@pytest.mark.timeout(10)
def test_merge_keys_follow_yaml_rules() -> None:
    # Explicit keys win over merged ones wherever they stand; an earlier merge wins a later one.
    doc = parse_yaml("a: &a {x: 1, y: 1}\nb: &b {y: 2, z: 2}\n"
                     "c: {x: 0, <<: [*a, *b]}\nd: {<<: *a, y: 3}\n", "f.yaml")
    assert doc.value["c"] == {"x": 0, "y": 1, "z": 2}
    assert doc.value["d"] == {"x": 1, "y": 3}
    # A quoted "<<" is an ordinary key.
    assert parse_yaml("'<<': 1\n", "f.yaml").value == {"<<": 1}


@pytest.mark.timeout(10)
def test_scalars_resolve_by_the_yaml_1_2_core_schema() -> None:
    doc = parse_yaml("a: 1_000\nb: 0x1F\nc: 1.5e3\nd: ~\ne: true\nf: yes\ng: 2001-12-14\n"
                     "h: '12'\ni: 0o17\nj: -.5\nk: 0x_\nl: !!float 3\nm: !!str 4\n", "f.yaml")
    assert doc.value == {"a": 1000, "b": 31, "c": 1500.0, "d": None, "e": True, "f": "yes",
                         "g": "2001-12-14", "h": "12", "i": 15, "j": -0.5, "k": "0x_",
                         "l": 3.0, "m": "4"}


@pytest.mark.timeout(30)
def test_each_limit_has_its_own_message(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(MINIMAL.encode() + b"#" * MAX_FILE_BYTES)
    many = "a: [" + "1, " * MAX_VALUES + "]\n"
    messages = {
        "size": load_exc(big)[0],
        "values": _problems(many)[0],
        "aliases": _problems((REPO / BAD / "alias_bomb.yaml").read_bytes())[0],
        "depth": _problems("a: " + "[" * 100)[0],
        "number": _problems("a: 1e999\n")[0],
    }
    assert "the limit is 1 MiB (1,048,576 bytes)" in messages["size"]
    assert messages["values"] == "f.yaml:1:149996: more than 50,000 values; a scenario needs " \
                                 "far fewer: is this the right file?"
    assert "alias bomb" in messages["aliases"]
    assert messages["depth"].startswith("f.yaml:1:67: nested more than 64 levels deep")
    assert messages["number"].startswith("f.yaml:1:4: the number '1e999' is too large")
    assert len({m.split(": ", 1)[1] for m in messages.values()}) == len(messages)


def load_exc(path: Path) -> list[str]:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return info.value.problems


@pytest.mark.timeout(10)
def test_non_regular_files_are_refused_before_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock.yaml"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        assert load_exc(sock_path) == [f"{sock_path}: is a socket, not a scenario file: give "
                                       "the path of a YAML file"]
    # Opening a FIFO for reading blocks until a writer comes: the loader must never try.
    assert load_exc(fifo) == [f"{fifo}: is a FIFO (named pipe), not a scenario file: give the "
                              "path of a YAML file"]
    assert load_exc(tmp_path) == [f"{tmp_path}: is a directory, not a scenario file"]
    assert load_exc(Path("/dev/zero")) == ["/dev/zero: is a character device, not a scenario "
                                           "file: give the path of a YAML file"]
    unreadable = tmp_path / "secret.yaml"
    unreadable.write_text(MINIMAL)
    unreadable.chmod(0)
    if os.geteuid() != 0:
        assert load_exc(unreadable) == [f"{unreadable}: cannot read the scenario file: "
                                        "Permission denied"]


@pytest.mark.timeout(60)
def test_cli_gives_one_sentence_and_exit_2_for_unreadable_paths(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    cases = {
        "fifo": (["validate", str(fifo)], f"Error: {fifo}: is a FIFO (named pipe), not a "
                                          "scenario file: give the path of a YAML file"),
        "dir": (["validate", str(tmp_path)], f"Error: {tmp_path}: is a directory, not a "
                                             "scenario file"),
        "missing": (["validate", str(tmp_path / "nope.yaml")],
                    f"Error: {tmp_path / 'nope.yaml'}: cannot read the scenario "
                    "file: no such file"),
        "run fifo": (["run", str(fifo), "--out", str(tmp_path / "out")],
                     f"Error: {fifo}: is a FIFO (named pipe), not a scenario file: give the "
                     "path of a YAML file"),
    }
    for name, (args, expected) in cases.items():
        proc = run_cli(*args, timeout=30)
        assert (proc.returncode, proc.stderr.strip()) == (2, expected), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fixture", ["alias_bomb.yaml", "too_deep.yaml", "not_utf8.yaml",
                                     "control_characters.yaml", "number_too_large.yaml"])
def test_cli_gives_located_errors_for_hostile_fixtures(fixture: str) -> None:
    proc = run_cli("validate", str(BAD / fixture), timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith(f"Error: {BAD / fixture}:") for line in lines)


WORST_CASES = {
    # Each is at the file size limit and among the slowest shapes for the YAML scanner.
    "comments": b"a: 1\n" + b"#\n" * (MAX_FILE_BYTES // 2 - 8),
    "flow list": b"a: [" + b"1," * (MAX_FILE_BYTES // 2 - 8) + b"]",
    "deep then wide": b"a: " + b"[" * 63 + b"1," * (MAX_FILE_BYTES // 2 - 40),
    "folded lines": b"a: " + b"x\n " * (MAX_FILE_BYTES // 3 - 8),
    "aliases": b"a: &a [1]\nb: [" + b"*a," * (MAX_FILE_BYTES // 3 - 8) + b"]",
    "bad tags": b"a: [" + b"!x 1," * (MAX_FILE_BYTES // 5 - 8) + b"]",
}


# A reference of known, linear cost at the same size: one plain value of 1 MiB (~0.25 s).
PLAIN_VALUE = b"a: " + b"x" * (MAX_FILE_BYTES - 8)
WORST_FACTOR = 20      # the worst shapes cost 1-6 times the reference; superlinear, far more


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(WORST_CASES))
def test_worst_inputs_at_the_size_limit_finish_in_bounded_time(name: str) -> None:
    data = WORST_CASES[name]
    assert len(data) <= MAX_FILE_BYTES
    # In CPU time (competing load does not count), against the reference measured right here
    # (a slower machine is slower at both).
    _, reference_s = cpu_s(lambda: _problems(PLAIN_VALUE))
    problems, took_s = cpu_s(lambda: _problems(data))
    assert took_s < WORST_FACTOR * reference_s, (took_s, reference_s)
    assert 1 <= len(problems) <= 51 and all(p.startswith("f.yaml:") for p in problems)


@pytest.mark.timeout(60)
def test_target_serve_config_errors_are_located_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "target.yaml"
    bad.write_text("ttft: {dist: gamma}\nitl: 5 parsecs\n")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    cases = {
        bad: [f"Error: {bad}:1:8: ttft.dist: 'gamma' is not a dist known here (hint: one of: "
              "fixed, normal, lognormal)",
              f"Error: {bad}:2:1: itl: expected a duration like '100ms' or '30s', got "
              "'5 parsecs'"],
        fifo: [f"Error: {fifo}: is a FIFO (named pipe), not a target configuration: give the "
               "path of a YAML file"],
        tmp_path: [f"Error: {tmp_path}: is a directory, not a target configuration"],
        tmp_path / "nope.yaml": [f"Error: {tmp_path / 'nope.yaml'}: cannot read "
                                 "the target configuration: no such file"],
    }
    for path, expected in cases.items():
        proc = run_cli("target", "serve", "--port", "0", "--config", str(path), timeout=30)
        assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, expected), path


@pytest.mark.timeout(60)
def test_target_serve_starts_with_a_good_config(tmp_path: Path) -> None:
    import subprocess

    from streamquake.procs import read_listening_line, spawn, stop
    from tests.conftest import cli_cmd

    good = tmp_path / "target.yaml"
    good.write_text("# an empty mapping is every default\n")
    proc = spawn(cli_cmd("target", "serve", "--port", "0", "--config", str(good)),
                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        assert read_listening_line(proc, 30, "target").startswith("http://127.0.0.1:")
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("short", "long"), [
    ("ttft_ms p95 < 350ms", {"metric": "ttft_ms", "percentile": 95.0, "max": 350.0}),
    ("ttft_ms: p(95)<350ms", {"metric": "ttft_ms", "percentile": 95.0, "max": 350.0}),
    ("itl_ms p99.9 <= 1s", {"metric": "itl_ms", "percentile": 99.9, "max": 1000.0}),
    ("error_rate < 1%", {"metric": "error_rate", "max": 0.01}),
    ("output_tokens_per_s p50 > 20", {"metric": "output_tokens_per_s", "percentile": 50.0,
                                      "min": 20.0}),
])
def test_a_k6_style_threshold_string_is_a_short_slo(short: str, long: dict[str, object]) -> None:
    """Issue 34: k6's `"p(95)<350ms"` style got "Input should be a valid dictionary"."""
    sc = parse_scenario(MINIMAL + f'slos:\n  - "{short}"\n')
    got = sc.slos[0].model_dump(include={"metric", "percentile", "max", "min"},
                                exclude_none=True)
    assert got == pytest.approx(long)   # "350ms" is 350.00000000000006 in the long form too


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("short", "complaint"), [
    ("fast please", "write an SLO as a mapping, e.g. {metric: ttft_ms, percentile: 95, max: "
                    "350ms}, or in short as \"ttft_ms p95 < 350ms\""),
    ("error_rate < 1", "'error_rate' is a rate: write a percentage"),
    ("ttft_ms < 350ms", "'ttft_ms' is a distribution: add 'percentile'"),
])
def test_a_short_slo_that_cannot_be_read_says_the_form(short: str, complaint: str) -> None:
    problems = _problems(MINIMAL + f'slos:\n  - "{short}"\n')
    assert any(complaint in p and p.startswith("f.yaml:5:") for p in problems), problems


@pytest.mark.timeout(10)
def test_set_names_a_list_item_by_its_name() -> None:
    """Issue 34: `--set faults.d.drop=...` could not address a fault by name, only by index."""
    from streamquake.located_yaml import parse_yaml
    from streamquake.scenario.overrides import apply_overrides

    text = MINIMAL.replace("fault: 0s", "fault: 1s") + (
        "faults:\n  - {type: sse_proxy, name: d, phase: fault, drop: 10%}\n"
        "  - {type: sse_proxy, phase: fault, delay: 5ms}\n")
    doc = apply_overrides(parse_yaml(text, "f.yaml"), ["faults.d.drop=20%",
                                                       "faults.sse_proxy.delay=9ms"])
    assert doc.value["faults"][0]["drop"] == "20%"            # type: ignore[index,call-overload]
    assert doc.value["faults"][1]["delay"] == "9ms"           # type: ignore[index,call-overload]
    with pytest.raises(ScenarioError, match=r"faults has no item named 'e' \(named: d, "
                                            r"sse_proxy\); write a name or an index from 0 to 1"):
        apply_overrides(parse_yaml(text, "f.yaml"), ["faults.e.drop=20%"])
