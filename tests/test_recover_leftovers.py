"""Issue 37.13: what a killed run leaves, `recover` repairs.

A claim whose journal entry is gone (its holder was SIGKILLed between undoing its fault and
freeing the claim) is removed by `recover`, not kept as "nothing to recover"; a journal nested
past the JSON parser's depth is moved aside like any torn journal, never a RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamquake.journal import Journal
from tests.conftest import free_port, run_cli


@pytest.mark.timeout(60)
def test_recover_removes_a_claim_no_entry_holds(state_dir: Path) -> None:
    journal = Journal(state_dir / "journal.json")
    thing = f"proxy:127.0.0.1:{free_port()}"
    held = journal.add("sse_proxy", "drop")
    held.claim({thing: "the SSE proxy"})
    kept = journal.add("sse_proxy", "still-held")     # a live owner's (this process): kept
    kept.claim({"proxy:127.0.0.1:1": "another SSE proxy"})
    # The holder's revert removed its entry; SIGKILL came before it freed the claim.
    journal.path.write_text(json.dumps([e for e in json.loads(journal.path.read_text())
                                        if e["id"] != held.entry_id]))
    claims = state_dir / "claims.json"
    assert thing in claims.read_text()

    done = run_cli("recover", env={"STREAMQUAKE_STATE_DIR": str(state_dir)}, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    assert "freed the claim on the SSE proxy" in done.stdout, done.stdout + done.stderr
    assert [c["thing"] for c in json.loads(claims.read_text())] == ["proxy:127.0.0.1:1"]
    # Nothing left to free: recover says so again.
    kept.done()
    again = run_cli("recover", env={"STREAMQUAKE_STATE_DIR": str(state_dir)}, timeout=60)
    assert again.returncode == 0 and "nothing to recover" in again.stdout, again.stdout
    assert json.loads(claims.read_text()) == []


@pytest.mark.timeout(60)
def test_a_journal_nested_past_the_parsers_depth_is_moved_aside(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    path = state_dir / "journal.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    done = run_cli("recover", env={"STREAMQUAKE_STATE_DIR": str(state_dir)}, timeout=60)
    text = done.stdout + done.stderr
    assert "Traceback" not in text and "RecursionError" not in text, text[-2000:]
    assert "was damaged and moved to" in text, text
    aside = [p for p in state_dir.iterdir() if p.name.startswith("journal.corrupt-")]
    assert len(aside) == 1 and aside[0].stat().st_size == 200_000
    assert json.loads(path.read_text()) == []
