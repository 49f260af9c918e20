"""The small helpers that used to be written more than once, now one copy each: the cases where
the copies disagreed, each settled the right way."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, model_validator

from streamquake.agentwire.ref import AgentRef
from streamquake.envref import ENV_REF, is_env_name
from streamquake.errors import ScenarioError, validation_sentences
from streamquake.faults.envelope import ENVELOPE, FaultSpec
from streamquake.faults.proxy.spec import SSEProxyFault, fault_from_params
from streamquake.loadgen.histogram import SparseHistogram
from streamquake.loadgen.templates import expand_headers, expand_path
from streamquake.loopback import is_loopback
from streamquake.procs import log_tail
from streamquake.scenario.schema import TargetSpec
from streamquake.stats import counts_percentile, nearest_rank, percentile

# --- nearest-rank percentiles (run/series, run/saturation, run/watch, loadgen/histogram,
# reports/compare) ---------------------------------------------------------------------------


def test_nearest_rank_is_not_pushed_up_a_rank_by_floating_point() -> None:
    # 7/100 * 100 is 7.000000000000001 in floating point: the sorted-list copies took rank 8.
    assert nearest_rank(7, 100) == 7 and nearest_rank(28, 25) == 7 and nearest_rank(14, 50) == 7
    assert percentile([float(v) for v in range(1, 101)], 7) == 7.0
    assert percentile([float(v) for v in range(1, 26)], 28) == 7.0


def test_nearest_rank_ends_and_nothing() -> None:
    assert percentile([], 50) is None and counts_percentile({}, 50) is None
    ranks = [nearest_rank(p, 10) for p in (0, 0.1, 10, 10.1, 50, 99.9, 100)]
    assert ranks == [1, 1, 1, 2, 5, 10, 10]


@pytest.mark.parametrize("n", [1, 3, 25, 100, 1000])
def test_sorted_values_counts_and_the_histogram_agree_at_every_percentile(n: int) -> None:
    rng = random.Random(n)
    values = sorted(rng.randint(1, 50) for _ in range(n))
    counts: dict[int, int] = {}
    hist = SparseHistogram()
    for v in values:
        counts[v] = counts.get(v, 0) + 1
        hist.record(v)
    for p in (*range(0, 101), 99.5, 99.9):
        want = percentile(values, p)
        assert counts_percentile(counts, p) == want and hist.percentile(p) == want, p


# --- the loopback rule (agent/server with ipaddress, run/parts by prefix, the standing proxy by
# a list of three) ------------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("LOCALHOST", True), ("127.0.0.1", True),
    ("127.0.0.2", True),                 # the standing proxy's list of three said no
    ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("127.example.com", False),          # run/parts's prefix said yes
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("", False), ("example.com", False),
])
def test_loopback_is_an_address_rule_not_a_prefix(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# --- ${VAR} (scenario/schema: any ${...}, bad names refused; loadgen/templates: valid names only,
# anything else sent as it was) -------------------------------------------------------------------


def test_every_dollar_brace_is_a_reference_and_a_bad_name_is_refused_everywhere() -> None:
    assert ENV_REF.findall("a ${OK} b ${1BAD} c ${A-B}") == ["OK", "1BAD", "A-B"]
    assert is_env_name("OPENAI_API_KEY") and not is_env_name("1KEY")
    assert not is_env_name("KEY\n")      # the old `^...$` patterns let a trailing newline in
    with pytest.raises(ScenarioError, match=r"A-B.*not an environment variable name"):
        expand_path("/v1/x?key=${A-B}", {"A-B": "secret"})   # the client sent it as written
    with pytest.raises(ScenarioError, match="not an environment variable name"):
        expand_headers({"Authorization": "Bearer ${1KEY}"}, {})
    assert expand_headers({"Authorization": "Bearer ${KEY}"}, {"KEY": "k"}) == {
        "Authorization": "Bearer k"}
    with pytest.raises(ValidationError, match="not an environment variable name"):
        TargetSpec.model_validate({"protocol": "openai", "path": "/x?key=${A-B}"})
    with pytest.raises(ValidationError, match="not an environment variable name"):
        TargetSpec.model_validate({"protocol": "openai", "headers": {"X": "${1KEY}"}})
    with pytest.raises(ValidationError, match="not an environment variable name"):
        AgentRef(name="a", url="http://127.0.0.1:1", token_env="TOKEN\n")


# --- validation errors as sentences (agent/holder, the proxy's control API, the scenario loader)


class _Pair(BaseModel):
    low: int
    high: int

    @model_validator(mode="after")
    def _ordered(self) -> _Pair:
        if self.low > self.high:
            raise ValueError("low must not exceed high")
        return self


def test_validation_sentences_name_the_field_and_drop_pydantics_prefix() -> None:
    with pytest.raises(ValidationError) as bad_field:
        _Pair.model_validate({"low": "x", "high": 1})
    assert validation_sentences(bad_field.value) == [
        "low: Input should be a valid integer, unable to parse string as an integer"]
    assert validation_sentences(bad_field.value, "pair")[0].startswith("pair.low: ")
    with pytest.raises(ValidationError) as whole:
        _Pair.model_validate({"low": 2, "high": 1})
    # The proxy's copy said "fault: Value error, ..."; the agent's said ": ..." without a prefix.
    assert validation_sentences(whole.value) == ["low must not exceed high"]
    assert validation_sentences(whole.value, "pair") == ["pair: low must not exceed high"]
    with pytest.raises(ValidationError) as proxy:
        fault_from_params({})
    [sentence] = validation_sentences(proxy.value)
    assert sentence.startswith("an sse_proxy fault needs at least one action: "), sentence


# --- the fault envelope's fields (reference, the proxy's spec, the proxy's injector) ------------


def test_the_envelope_is_what_faultspec_declares_and_never_reaches_the_proxy() -> None:
    assert tuple(FaultSpec.model_fields) == ENVELOPE and ENVELOPE[0] == "type"
    assert {"name", "phase", "at"} <= set(ENVELOPE)
    spec = SSEProxyFault.model_validate({"type": "sse_proxy", "name": "d", "at": "gpu-host",
                                         "delay": "100ms"})
    params = spec.proxy_params()
    assert params == {"delay_ms": 100.0, "delay_probability": 1.0}, params   # the old copy
    # of the envelope lacked `at`, and sent it to the proxy
    body = {**params, "at": "gpu-host", "name": "x", "phase": "fault"}
    assert fault_from_params(body) == fault_from_params(params)


# --- a log's last lines (embedded/process by descriptor, agent/local by path) ---------------------


def test_log_tail_by_path_and_by_descriptor(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"one\ntwo\nthree\xff\nfour")
    assert log_tail(log, 2) == ["three\ufffd", "four"] and log_tail(log, 0) == []
    fd = os.open(log, os.O_RDONLY)
    try:
        assert log_tail(fd, 10) == ["one", "two", "three\ufffd", "four"]
        assert os.fstat(fd)        # left open
    finally:
        os.close(fd)
    big = tmp_path / "big.log"
    big.write_text("".join(f"line {i:07d}\n" for i in range(200_000)))
    assert log_tail(big, 3) == [f"line {i:07d}" for i in (199_997, 199_998, 199_999)]
    assert all(line.startswith("line ") and len(line) == 12 for line in log_tail(big, 10_000))
    with pytest.raises(OSError):
        log_tail(tmp_path / "missing.log", 4)
