"""What crosses the wire between a controller and an agent, shared by the agent daemon
(``streamquake/agent``), the CLI and the run's remote controller (``run/remote.py``): the typed
API bodies (``api``), an agent as a scenario names it (``ref``), the HTTP client (``client``) and
the owner key (``owner``). Light and low: it imports only ``units``, ``errors`` and ``journal``.
"""
