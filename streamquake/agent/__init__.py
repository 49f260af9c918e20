"""The fault agent: a process that holds faults under leases (``streamquake agent``).

A fault is applied through the fault contract and kept only while its lease is renewed; when the
renewals stop (the controller was killed, its shell closed, the network between them broke, which
a network fault can itself cause) the agent reverts it on its own within the lease. Locally it is
the watchdog behind ``streamquake inject``; on a serving host (GPU clocks on the GPU host, netem
on the server's interface) it is the remote agent a scenario names with ``at: NAME``.

Modules: ``ref`` (the scenario's ``agents:`` entries; light, ``validate`` imports it), ``api``
(the JSON bodies, typed), ``policy`` (what this agent may touch), ``holder`` (leases, the
watchdog, the journal), ``server`` (aiohttp, auth, TLS), ``client`` (blocking, for the runner and
the CLI), ``owner`` (the user's owner key, which alone renews or reverts their faults),
``local`` (the per-user daemon ``inject`` starts), ``params`` (``k=v`` fault parameters on the
command line).
"""
