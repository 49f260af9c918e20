"""What the proxy process and its clients agree on: where the control API lives in the URL space.

A module of constants only, below ``server``, ``injector``, ``resources`` and ``standing``, so
none of them imports another for them.
"""

from __future__ import annotations

# Everything under it is the control API; everything else is forwarded to the upstream.
CONTROL_PREFIX = "/_streamquake"
