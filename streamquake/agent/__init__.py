"""The fault agent: a process that holds faults under leases (``streamquake agent``).

A fault is applied through the fault contract and kept only while its lease is renewed; when the
renewals stop (the controller was killed, its shell closed, the network between them broke, which
a network fault can itself cause) the agent reverts it on its own within the lease. Locally it is
the watchdog behind ``streamquake inject``; on a serving host (GPU clocks on the GPU host, netem
on the server's interface) it is the remote agent a scenario names with ``at: NAME``.

Modules: ``policy`` (what this agent may touch), ``holder`` (leases, the watchdog, the
journal), ``server`` (aiohttp, auth, TLS), ``local`` (the per-user daemon ``inject`` starts),
``commands`` (the CLI's agent commands), ``params`` (``k=v`` fault parameters on the command
line), ``runs`` (watching local runs). What crosses the wire (API bodies, agent references, the
HTTP client, the owner key) is in ``streamquake/agentwire``, which the run and the CLI share.
"""
