"""``${VAR}`` in what a scenario sends (header values, the request path): the one pattern.

Any ``${...}`` is a reference; one whose inside is not a variable name is a mistake to report,
never text to send as it is."""

from __future__ import annotations

import re

ENV_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_env_name(name: str) -> bool:
    """``OPENAI_API_KEY`` yes; ``1KEY``, ``A-B``, ``""`` no."""
    return _ENV_NAME.fullmatch(name) is not None


def not_a_name(name: str) -> str:
    """The sentence for ``${name}`` whose ``name`` is not an environment variable name."""
    return f"'${{{name}}}' is not an environment variable name"
