"""What the proxy process and its clients agree on: where the control API lives in the URL space.

A module of constants only, below ``server``, ``injector``, ``resources`` and ``standing``, so
none of them imports another for them.
"""

from __future__ import annotations

# Everything under it is the control API; everything else is forwarded to the upstream.
CONTROL_PREFIX = "/_streamquake"

# A run's private proxy takes faults only from that run: every change to its faults carries this
# header with the key the run gave the proxy (in PROXY_KEY_ENV, never on its command line). A
# standing proxy (``streamquake proxy``) has no key and takes them from any agent.
KEY_HEADER = "Streamquake-Proxy-Key"
PROXY_KEY_ENV = "STREAMQUAKE_PROXY_KEY"
