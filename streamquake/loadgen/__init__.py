"""Load generation: SSE parsing, wire formats, per-request samples, Locust users.

Nothing here imports locust or gevent at package import; only ``locustfile`` does, and it runs
in its own process.
"""
