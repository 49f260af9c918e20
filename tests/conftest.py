"""Shared test helpers: run the real CLI in a subprocess, with its own journal; adopt and reap
the orphans of a run a test stops, to see how each one ended."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamquake.procs import read_listening_line, spawn, stop
from tests.netns_fixtures import client_ns, serve, topo

__all__ = ["client_ns", "serve", "topo"]  # fixtures for the network tests

REPO = Path(__file__).resolve().parent.parent
_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private fault journal for every test, so no test sees (or leaves) a real one."""
    d = tmp_path / "state"
    monkeypatch.setenv("STREAMQUAKE_STATE_DIR", str(d))
    return d


def free_port() -> int:
    """A loopback port free a moment ago (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamquake", *args]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cli_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or REPO)


@pytest.fixture
def reaper() -> Iterator[None]:
    """This process adopts the orphans of what the test starts (PR_SET_CHILD_SUBREAPER): a
    stopped or killed run's children that outlive it become ours, and ``reap`` tells how each
    one ended."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, ctypes.get_errno()
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pids: set[int] | list[int], ended: dict[int, int]) -> bool:
    """Reap whichever of ``pids`` have ended as our (adopted) children, noting their wait
    status in ``ended``; True once each is reaped here or gone (reaped by its own parent). For
    polling (tests.timing.wait_until), with the ``reaper`` fixture."""
    for pid in set(pids) - set(ended):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:       # not ours (reaped by its parent) or not yet adopted
            continue
        if got == pid:
            ended[pid] = status
    return all(not Path(f"/proc/{p}").exists() for p in set(pids) - set(ended))


def how_ended(ended: dict[int, int]) -> dict[int, object]:
    """pid -> the signal that ended it, or "exit N"."""
    return {pid: (signal.Signals(os.WTERMSIG(st)) if os.WIFSIGNALED(st)
                  else f"exit {os.WEXITSTATUS(st)}") for pid, st in ended.items()}


def listening(cmd: list[str], what: str) -> Iterator[str]:
    """Start a test server that prints ``LISTENING <url>...`` once bound; yield what follows
    LISTENING, and stop the server after."""
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        yield read_listening_line(proc, 20, what)
    finally:
        stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def echo_server() -> Iterator[str]:
    """tests/hostile_server.py on 127.0.0.1 (its /echo-* paths echo credentials back)."""
    yield from listening([sys.executable, str(REPO / "tests" / "hostile_server.py")],
                         "hostile server")


# -- running in parallel (pytest-xdist, `scripts/test`: -n 5 --dist loadgroup) ------------------
#
# Most tests wait on subprocesses (a run is a target, a proxy, Locust and the runner), so five
# workers keep 2 cores busy. Tests go to workers one by one, except:
#
# * a module whose tests share a module-scoped fixture (one real run that several tests read)
#   stays on one worker, so the run is made once, not once per worker: its group is its module;
# * the groups below, whose members must not run beside each other, each on one worker.
#
# Nothing in the suite binds a fixed port on the host (all take port 0, or a fixed one inside
# a namespace of their own), namespaces and links are named with a fresh uuid by whoever makes
# them, and each test has its own state directory (``state_dir``); the builds that tests start
# are safe when two workers start them at once (each process compiles the NVML shim into a
# temporary directory of its own; scripts/uml-run writes its shim under a unique name and
# renames it into place; the engine tests only ever take llama-server's cache, never build it).
GROUPS: dict[str, tuple[str, ...]] = {
    # User-Mode Linux: each boot keeps a core busy for minutes, and the guest's own timing
    # checks (netem delays, preemption counts) want that core.
    "uml": ("test_netem_uml_gate.py", "test_uml_xstate.py"),
    # The six report runs (tests/report_runs.py) are made once per process: every module that
    # reads them on one worker makes them once.
    "report_runs": ("test_reports.py", "test_reports_html.py", "test_prometheus.py",
                    "test_compare.py", "test_history.py"),
    # The load process's own lateness is what these measure (hub holds, GC pauses, the
    # saturation guard's verdict on a process that keeps up): not beside one another.
    "client_timing": ("test_saturation.py", "test_hub_holds.py", "test_gc_pauses.py"),
}
_GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}

# The slow tier: left out by `scripts/test --quick` (-m "not slow"): the tests that took 8 s or
# more under -n 3 on a busy 2-core machine (benchmarks/README.md, "The suite's slowest tests").
# A module's name marks all its tests; "module.py::test_name" marks one (every parameter).
SLOW: tuple[str, ...] = (
    # Real runs through llama-server, gateways and the proxy (added after that measurement).
    "test_answer_parts.py", "test_engine_parts.py", "test_held_answers.py",
    # Real runs of 20-30 s, and one SIGKILLed while it flushes (issue 32).
    "test_engine_cache_flush.py::test_a_flush_raises_ttft_in_its_step_only_and_counts_its_erases",
    "test_cancellations.py::test_a_share_of_a_class_is_cancelled_after_n_tokens_or_ms_and_counted_apart",
    "test_engine_cache_flush.py::test_a_run_killed_while_flushing_leaves_nothing_flushing",
    "test_engine_cache_flush.py::test_on_llama_server_the_engines_own_timings_show_the_flush_in_"
    "its_step_only",
    "test_secrets_echoed.py", "test_probe.py",
    # Added this session: real runs of 20-40 s each.
    "test_otlp.py", "test_live_in_flight.py", "test_held_by_hand.py",
    "test_agent_netns.py", "test_fault_lifecycle.py", "test_fuzz_scenarios.py",
    "test_gateway_nginx.py", "test_hub_holds.py", "test_live_and_abort.py",
    "test_netem_uml_gate.py", "test_network_cli.py", "test_probe.py", "test_remote_workers.py",
    "test_run_e2e.py", "test_standing_proxy.py", "test_steps_reports.py", "test_survivorship.py",
    "test_target_sdks.py", "test_trace_replay.py",
    "test_agent.py::test_a_killed_local_agent_is_restarted_by_status_and_undoes_its_faults",
    "test_agent.py::test_agent_sigkilled_recovers_its_orphans_when_it_starts_again",
    "test_agent.py::test_agent_takes_a_token_over_plain_http_beyond_loopback_only_when_told",
    "test_agent.py::test_api_refuses_wrong_tokens_and_outside_the_allowlist_and_holds_leases",
    "test_agent.py::test_inject_deadline_holds_after_its_shell_is_sigkilled",
    "test_agent.py::test_only_a_faults_owner_renews_or_reverts_it_unless_forced",
    "test_agent.py::test_run_preflight_reports_every_agent_problem_at_once",
    "test_agent.py::test_sigterm_reverts_everything_and_an_idle_agent_exits",
    "test_agent.py::test_tls_and_mutual_tls",
    "test_arrivals.py::test_an_overloaded_open_loop_counts_every_arrival_and_breaks_the_not_sent_slo",
    "test_capacity_search.py::test_capacity_is_where_the_queue_becomes_unstable_and_a_doubled_service_time_halves_it",
    "test_cli.py::test_secrets_never_reach_output_or_reports",
    "test_cli.py::test_target_serve_streams_the_chosen_protocol_only",
    "test_cli.py::test_usage_errors_exit_2",
    "test_cli_habits.py::test_faults_lists_every_type_with_its_parameters",
    "test_cli_habits.py::test_inject_usage_errors_exit_2_and_start_no_agent",
    "test_cli_habits.py::test_run_json_prints_only_the_verdicts_on_stdout",
    "test_cli_habits.py::test_validate_json_set_overrides_and_warnings",
    "test_cli_words.py::test_a_scenario_file_that_cannot_be_read_writes_nothing",
    "test_cli_words.py::test_every_bad_flag_is_one_sentence_naming_it_exit_2",
    "test_cli_words.py::test_help_lists_every_exit_code_and_shows_flags_bare",
    "test_cli_words.py::test_live_lines_say_starting_and_never_reach_back_across_a_phase_edge",
    "test_client.py::test_timing_matches_the_targets_configured_delays",
    "test_compare.py::test_two_runs_of_the_same_scenario_are_the_same",
    "test_deploy.py::test_every_command_and_option_in_the_examples_exists",
    "test_exit_paths.py::test_a_path_that_is_not_utf8_is_echoed_escaped_not_a_traceback",
    "test_exit_paths.py::test_a_wrong_value_is_one_located_sentence_and_exit_2",
    "test_exit_paths.py::test_an_output_place_or_state_directory_under_a_file_is_one_sentence_and_exit_3",
    "test_fault_claims.py::test_a_killed_runs_gpu_claim_is_freed_by_recover",
    "test_fault_claims.py::test_a_run_whose_fault_is_refused_exits_3_and_says_why",
    "test_fault_claims.py::test_gpu_clock_locks_of_two_agent_leases_and_a_killed_agent",
    "test_fault_claims.py::test_gpu_power_limits_of_two_runs",
    "test_fault_claims.py::test_proxy_faults_of_two_runs_in_one_proxy",
    "test_fault_claims.py::test_tc_faults_of_two_runs_on_one_interface",
    "test_fault_family.py::test_a_live_runs_fault_is_left_alone_and_one_removed_under_it_is_reported",
    "test_fault_family.py::test_an_agent_takes_the_example_familys_allowlist_and_refuses_outside_it",
    "test_fault_family.py::test_example_family_is_found_and_validated",
    "test_fault_family.py::test_example_family_killed_then_recovered",
    "test_fault_family.py::test_example_family_runs_and_reverts",
    "test_flapping.py::test_a_flapping_fault_shows_its_pattern_per_second",
    "test_flapping.py::test_a_flapping_tbf_shows_its_pattern_and_leaves_nothing",
    "test_flapping.py::test_a_run_killed_while_flapping_on_is_recovered",
    "test_fuzz.py::test_loader_merges_and_aliases_as_yaml_says",
    "test_fuzz.py::test_loader_reads_json_documents_as_their_values",
    "test_gc_pauses.py::test_a_full_collection_is_recorded_by_the_guard_as_the_load_process_own",
    "test_history.py::test_options_that_would_mean_something_else_are_usage_errors",
    "test_hostile_targets.py::test_a_run_against_a_hostile_target_finishes_with_a_report",
    "test_hostile_targets.py::test_the_load_process_memory_stays_bounded",
    "test_kill_trials.py::test_a_kill_between_journal_and_change_is_recovered",
    "test_kill_trials.py::test_a_killed_run_leaves_nothing",
    "test_load_stages.py::test_a_run_sends_each_steps_load",
    "test_load_stages.py::test_a_trace_shorter_than_the_run_is_sent_once",
    "test_load_stages.py::test_closed_loop_concurrency_follows_the_stages_user_counts",
    "test_load_stages.py::test_open_loop_arrivals_per_second_follow_a_ramp_a_pause_and_a_spike",
    "test_locust_load.py::test_a_request_timeout_in_fractions_of_a_second_starts_locust",
    "test_locust_load.py::test_closed_loop_run_writes_samples_and_ends_at_end_at",
    "test_locust_load.py::test_master_and_workers_each_write_their_samples",
    "test_locust_load.py::test_max_inflight_queues_client_side_and_in_flight_streams_finish",
    "test_locust_load.py::test_missing_header_variable_fails_the_load_process_naming_it",
    "test_output_problems.py::test_a_disk_that_fills_up_loses_only_the_files_being_written",
    "test_output_problems.py::test_dry_run_prints_the_plan_and_changes_nothing",
    "test_proxy_upstream_close.py::test_a_run_through_the_proxy_has_no_errors_outside_the_fault",
    "test_proxy_upstream_close.py::test_an_upstream_closing_after_each_answer_meets_no_proxy_errors",
    "test_proxy_upstream_close.py::test_an_upstream_saying_close_is_not_pooled",
    "test_quantile_ci.py::test_independent_values_keep_their_coverage_and_about_a_third_of_their_worth",
    "test_quantile_ci.py::test_intervals_cover_the_true_quantile_at_least_as_often_as_claimed",
    "test_quantile_ci.py::test_intervals_hold_for_the_latencies_of_requests_that_queue",
    "test_real_engine.py::test_chunk_drop_through_the_proxy_shows_only_in_the_fault_phase",
    "test_real_engine.py::test_figures_agree_with_engine_timings_and_the_wire",
    "test_real_engine.py::test_the_engine_behind_nginx_measures_what_the_engine_sent_and_no_stream_is_flagged",
    "test_real_server_checks.py::test_a_run_with_an_unmeasurable_slo_exits_0_and_says_why_in_every_output",
    "test_recovery_evidence.py::test_one_slow_request_late_in_a_clean_run_is_neither_not_recovered_nor_late",
    "test_recovery_evidence.py::test_streams_of_the_fault_that_hang_past_the_revert_hold_the_time",
    "test_recovery_time.py::test_time_to_recovery_is_the_drain_time_of_the_queue_the_fault_built",
    "test_reference_plan_on_host.py::test_without_netem_it_refuses_before_touching_the_gpus",
    "test_retries.py::test_retried_attempts_are_counted_apart",
    "test_saturation.py::test_a_saturated_run_is_marked_so_and_an_unsaturated_one_not",
    "test_saturation.py::test_a_starved_load_generator_leaves_timings_not_judged_and_exits_6",
    "test_saturation.py::test_errors_still_break_a_run_whose_timings_are_not_judged",
    "test_saturation.py::test_verdicts_saturated_fail_makes_a_timing_not_judged_a_failure",
    "test_saturation.py::test_verdicts_saturated_warn_shows_them_and_does_not_gate",
    "test_scenario.py::test_cli_gives_one_sentence_and_exit_2_for_unreadable_paths",
    "test_scenario.py::test_each_limit_has_its_own_message",
    "test_scenario.py::test_target_serve_config_errors_are_located_with_exit_2",
    "test_scenario.py::test_target_serve_starts_with_a_good_config",
    "test_scenario.py::test_worst_inputs_at_the_size_limit_finish_in_bounded_time",
    "test_scorecard.py::test_cells_of_phases_over_are_frozen_and_thawed_without_loss",
    "test_scorecard.py::test_load_samples_none_scores_every_request_without_lines",
    "test_scorecard.py::test_merged_percentiles_are_the_raw_unions_nearest_rank",
    "test_scorecard.py::test_merged_scorecards_equal_one_scorecard_of_the_union",
    "test_secrets.py::test_no_artifact_of_a_run_holds_the_key",
    "test_slo.py::test_a_clean_run_near_capacity_is_not_failed_conclusively",
    "test_slow_consumer.py::test_a_slow_class_reads_at_its_rate_and_the_report_shows_each_class",
    "test_sse_proxy.py::test_injector_applies_and_reverts_through_a_real_proxy",
    "test_sse_proxy.py::test_upstream_failures_are_clear",
    "test_steps.py::test_a_fault_named_by_consecutive_steps_stays_applied_across_them",
    "test_steps.py::test_three_faults_in_one_run_each_seen_in_its_own_step_and_judged_before_and_after",
    "test_steps_outputs.py::test_compare_matches_steps_by_name_and_says_which_one_side_lacks",
    "test_steps_outputs.py::test_report_html_shows_every_step_every_fault_window_and_a_panel_per_fault",
    "test_stream_formats.py::test_a_run_against_transformers_serve_reads_every_stream_complete",
    "test_stream_formats.py::test_a_run_that_read_no_text_fails_as_a_protocol_mismatch",
    "test_stream_formats.py::test_a_run_whose_streams_all_succeed_without_text_fails_as_a_protocol_mismatch",
    "test_stream_formats.py::test_llama_server_native_legacy_and_responses_streams",
    "test_stream_formats.py::test_llama_server_streams_of_each_format_match_the_wire",
    "test_stream_formats.py::test_the_probe_says_which_format_was_expected_and_which_reads_the_events",
    "test_stream_formats.py::test_the_proxy_drops_responses_text_deltas_and_never_the_events_that_end_a_response",
    "test_stream_limits.py::test_the_soft_limit_is_raised_to_the_hard_one_and_every_stream_opens",
    "test_stream_meaning_faults.py::test_a_run_counts_the_injected_errors_in_the_fault_phase_only",
    "test_target.py::test_fixed_ttft_and_itl_are_reproduced",
    "test_target.py::test_seeded_responses_replay_and_match_the_plan",
    "test_target_stamps.py::test_stamps_are_invisible_to_an_sse_parser_and_absent_by_default",
    "test_target_stamps.py::test_the_openai_and_anthropic_sdks_skip_the_stamps",
    "test_tc_scaffold.py::test_a_fault_on_the_scaffold_changes_only_its_leaves",
    "test_tool_call_faults.py::test_a_run_counts_each_steps_spoilt_calls_in_that_step_only",
    "test_uml_xstate.py::test_fp_and_vector_registers_survive_context_switches_in_uml",
)

# The quiet tier: tests that compare a process's own timing with a fixed expectation (the
# load process keeping up, a tbf's on-state against its off-state, a client's gaps against the
# server's sleep, User-Mode Linux's own clock) and so want the cores to themselves. scripts/test
# runs them after the parallel tier on two workers (-m quiet -n 2): the UML group on one (it
# keeps one core busy), the others one at a time on the other, then on both once UML is done;
# beside two other workers each they failed on a busy 2-core machine.
QUIET: tuple[str, ...] = (
    "test_netem_uml_gate.py", "test_uml_xstate.py",
    "test_saturation.py", "test_hub_holds.py", "test_gc_pauses.py",
    "test_flapping.py", "test_gpu_clocks.py", "test_client.py", "test_locust_load.py",
    "test_steps.py", "test_recovery_time.py", "test_recovery_evidence.py", "test_target.py",
    "test_kernel_timestamps.py", "test_sse_proxy.py", "test_gateway_nginx.py",
    # Its client's gaps against the engine's span on the wire, within 5%, through a relay of
    # Python threads (tests/engines/tap.py) in the test's own process: beside two other workers
    # and llama-server on 2 cores they summed to 7.6 s against 26.6 s in CI (the same test
    # under scripts/test-stress --hogs 4, alone: 0.996 of the span).
    "test_real_engine.py::test_the_engine_behind_nginx_measures_what_the_engine_sent_and_no_"
    "stream_is_flagged",
    # The same relay, the client's gaps against the wire's span within 3% for each of
    # llama-server's formats: in the parallel tier of a fresh clone's CI (2026-12-04) its
    # /v1/responses streams summed to 1.044 of the span, the relay's threads late to forward.
    "test_stream_formats.py::test_llama_server_streams_of_each_format_match_the_wire",
    # llama-server's TTFT before, in and after the tenant's step, within one run: in the
    # parallel tier of a fresh clone (2026-12-05) the engine's whole answers took 150-450 ms
    # before and 400-800 ms after, the tenant gone (E2E, not only TTFT): the other workers'
    # load had changed, and the after step's TTFT p50 stayed 29 ms over the before's.
    "test_noisy_tenant.py::test_on_llama_server_the_tenants_long_prompts_take_its_slots_in_its_"
    "step_only",
    # The first request within 0.2 s of the first step's opening, a wall-clock bound: in the
    # parallel tier of a fresh clone's CI (2026-12-06, beside the capacity search) it came
    # 256 ms after.
    "test_run_e2e.py::test_the_first_step_opens_once_every_load_process_is_up",
)

# Groups whose shared fixture is a real run (or several): slow as a whole, since the fixture's
# time lands on whichever of their tests comes first.
SLOW_GROUPS: tuple[str, ...] = ("uml", "report_runs", "client_timing", "test_cli_words",
                                "test_steps_outputs", "test_stream_formats", "test_answer_parts",
                                "test_engine_parts", "test_held_answers", "test_secrets_echoed",
                                "test_conversations")

# What starts first (longest first, so no long test starts last and runs alone): modules or
# groups, in this order; everything else follows in collection order.
# The report runs come after the CPU-bound tests at the head of the list (fuzzing, quantile
# coverage, a run near capacity): four identical runs among them must see the same machine,
# and beside that burst (a fresh clone on 5 workers, 2026-12-05) the fourth read baseline ITL
# p95 16.1 ms against 11.9-12.3 and compare and history rightly called it worse.
FIRST: tuple[str, ...] = ("uml", "test_capacity_search.py", "test_fuzz_scenarios.py",
                          "test_quantile_ci.py", "test_fuzz.py", "test_slo.py",
                          "test_remote_workers.py", "test_kill_trials.py", "test_load_stages.py",
                          "client_timing", "test_steps_outputs.py", "test_real_engine.py",
                          "report_runs")


def _group(item: pytest.Item) -> str | None:
    module = item.path.name
    if module in _GROUP_OF:
        return _GROUP_OF[module]
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d and d[-1].scope == "module" for d in defs):
        return module.removesuffix(".py")
    return None


def _listed(item: pytest.Item, names: tuple[str, ...]) -> bool:
    """Whether ``names`` (modules, or module::test) holds ``item``."""
    name = f"{item.path.name}::{item.nodeid.split('::', 1)[-1]}"   # a parameter may hold a "/"
    return any(name == s or name.startswith(s + ("" if "::" in s else "::")) or
               name.startswith(s + "[") for s in names)


def _join_group(item: pytest.Item, group: str) -> None:
    """What xdist's --dist loadgroup does with an ``xdist_group`` mark, "nodeid@group", which
    its scheduler reads: pytest-xdist 3.8 sets ``item._nodeid``, which pytest 9.2 no longer
    reads (a node's id is ``item._id``), so there the groups would be silently ignored."""
    if not getattr(item.config.option, "loadgroup", False):    # not under -n, --dist loadgroup
        return
    joined = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id
        item._id = coerce_node_id(joined)
    else:
        item._nodeid = joined
    assert item.nodeid == joined, (item.nodeid, joined)


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _group(item)
        if _listed(item, SLOW) or group in SLOW_GROUPS:
            item.add_marker(pytest.mark.slow)
        if _listed(item, QUIET):
            item.add_marker(pytest.mark.quiet)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            _join_group(item, group)
    rank = {name: i for i, name in enumerate(FIRST)}

    def key(item: pytest.Item) -> int:
        return min(rank.get(item.path.name, len(rank)), rank.get(_group(item) or "", len(rank)))

    items.sort(key=key)     # stable: the same order on every worker
