"""Running a scenario: preflight, parts, timeline, signals, fault ledger, scoring, verdicts and
outcome, each in its own module; ``runner.Runner`` walks them in order."""
