"""``streamquake faults`` and ``schema``: what a scenario can say."""

from __future__ import annotations

from streamquake.cli.base import (
    JsonOption,
    app,
    console,
)


@app.command("faults")
def faults_cmd(as_json: JsonOption = False) -> None:
    """List the fault types and their parameters (every family the catalog finds)."""
    import json

    from rich.markup import escape
    from rich.table import Table

    from streamquake.faults.envelope import ENVELOPE
    from streamquake.reports.terminal import print_table
    from streamquake.scenario.docs import QUANTITIES, fault_docs

    docs = fault_docs()
    if as_json:
        print(json.dumps([d.to_json() for d in docs], indent=2))
        return
    console.print(f"Every fault also takes: {', '.join(ENVELOPE[1:])} (phase: warmup, "
                  "baseline, fault (default), recovery; at: local (default) or an agent's name)",
                  highlight=False, soft_wrap=True)
    for kind, how in QUANTITIES.items():
        console.print(f"{kind} parameters take {how}", markup=False, highlight=False,
                      soft_wrap=True)
    for doc in docs:
        table = Table(title=f"{doc.name} ({doc.family}): {doc.summary}", title_justify="left",
                      show_edge=False)
        for col in ("parameter", "type", "default", "notes"):
            table.add_column(col, overflow="fold")
        for p in doc.params:
            default = ("(required)" if p.required else "" if p.default is None
                       else p.default if isinstance(p.default, str) else json.dumps(p.default))
            table.add_row(*(escape(c) for c in (p.name, p.type, default, p.description)))
        print_table(table, console)


@app.command("schema")
def schema_cmd() -> None:
    """Print the scenario's JSON Schema, for editor completion (e.g. `# yaml-language-server:
    $schema=streamquake.schema.json`)."""
    import json

    from streamquake.scenario.docs import scenario_schema

    schema = scenario_schema()
    print(json.dumps(schema, indent=2))


