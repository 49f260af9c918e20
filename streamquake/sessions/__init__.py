"""A command's session end to end, between the CLI and the reports: read the scenario, run it
(run/), render and write its outputs (reports/), record history and exports. The CLI parses
flags and calls one function here; the reports only render a result."""
